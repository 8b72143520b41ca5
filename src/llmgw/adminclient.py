"""A sync client of the control plane's admin API (used by ``server init`` and ``llmgw ctl``).

Errors: a connection failure is :class:`~llmgw.errors.UnreachableError` (with what to run);
an error answer is :class:`~llmgw.errors.ApiError` carrying the status and the body's code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from llmgw.config import load_server_config, parse_listen
from llmgw.errors import ApiError, UnreachableError
from llmgw.paths import Paths


def _connect_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


@dataclass
class AdminClient:
    """The admin API at ``base_url`` with the bearer ``token``; ``transport`` is a seam for tests."""

    base_url: str
    token: str
    timeout_s: float = 15.0
    transport: httpx.BaseTransport | None = None

    @classmethod
    def from_paths(cls, paths: Paths, *, server: str | None = None, token: str | None = None) -> AdminClient:
        """The client for this machine's control plane: ``admin_listen`` and the token file of server.yaml.

        Raises:
            ConfigError: server.yaml or the token file cannot be read (and no override was given).
        """
        if server and token:
            return cls(server.rstrip("/"), token)
        cfg = load_server_config(paths.server_config)
        host, port = parse_listen(cfg.admin_listen)
        base = server or f"http://{_connect_host(host)}:{port}"
        if token is None:
            token = cfg.read_admin_token(paths.server_config)
        return cls(base.rstrip("/"), token)

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            with httpx.Client(timeout=self.timeout_s, transport=self.transport) as c:
                r = c.request(
                    method, self.base_url + path, json=body,
                    headers={"Authorization": f"Bearer {self.token}"},
                )
        except httpx.HTTPError as e:
            raise UnreachableError(
                f"the control plane's admin API at {self.base_url} does not answer ({e.__class__.__name__}: {e}); "
                "check it with 'llmgw service status'"
            ) from e
        if r.status_code >= 400:
            code, message = "", r.text.strip()
            try:
                err = r.json().get("error", {})
                code, message = str(err.get("code", "")), str(err.get("message", message))
            except (ValueError, AttributeError):
                pass
            raise ApiError(f"{method} {path}: {r.status_code} {message}", status=r.status_code, code=code)
        return r.json() if r.content else None

    def get(self, path: str) -> Any:
        """GET ``path`` (``/api/v1/...``) and return the decoded JSON."""
        return self._request("GET", path)

    def post(self, path: str, body: Any) -> Any:
        """POST JSON ``body`` to ``path`` and return the decoded JSON."""
        return self._request("POST", path, body)

    def patch(self, path: str, body: Any) -> Any:
        """PATCH ``path`` with the JSON merge patch ``body`` and return the decoded JSON."""
        return self._request("PATCH", path, body)

    def put(self, path: str, body: Any) -> Any:
        """PUT JSON ``body`` to ``path`` and return the decoded JSON."""
        return self._request("PUT", path, body)

    def delete(self, path: str) -> Any:
        """DELETE ``path`` and return the decoded JSON (None when empty)."""
        return self._request("DELETE", path)

    def health_pid(self) -> int | None:
        """The control plane's pid from ``GET /api/v1/health``; None when nothing (or no llmgw) answers."""
        try:
            with httpx.Client(timeout=2.0, transport=self.transport) as c:
                r = c.get(self.base_url + "/api/v1/health")
                pid = r.json().get("pid") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return pid if isinstance(pid, int) and not isinstance(pid, bool) else None

    def health(self) -> bool:
        """True when ``GET /api/v1/health`` answers 200 (no token needed)."""
        try:
            with httpx.Client(timeout=2.0, transport=self.transport) as c:
                return c.get(self.base_url + "/api/v1/health").status_code == 200
        except httpx.HTTPError:
            return False


def read_token(path: Path) -> str:
    """The first line of a token file."""
    return path.read_text().strip().splitlines()[0] if path.exists() else ""
