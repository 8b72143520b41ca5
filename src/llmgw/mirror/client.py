"""A synchronous client of the mirror's management API (used by ``server init`` and the CLI).

Errors, translated here from httpx with the cause chained:

- :class:`~llmgw.errors.UnreachableError` — nothing answers at ``api_url`` (refused, timeout).
- :class:`~llmgw.errors.ApiError` — the mirror answered an error; ``status`` and ``code`` come from
  its ``{"error": {"code", "message"}}`` body (``status == 404`` from :meth:`MirrorClient.status`
  means the mirror has never been asked for that ``model/version``).

Who may call it: every route but ``/api/v1/health`` needs the management API's token
(``Authorization: Bearer``), which :func:`token_path` finds and :func:`read_token` reads. The
API answers loopback, so an address says nothing about who asks: before, any local user asked a
root-run mirror to import a root-only file (then served to anyone on the bytes port) or deleted a
served model's weights. The token is a file, 0600 and the ``llmgw`` user's, so exactly the mirror,
the control plane (both that user) and root's CLI (``server init``, ``mirror add|rm|ls``, ``ctl
model rm --delete-weights``) hold it:

- ``/etc/llmgw/mirror-token`` when the machine has one: ``llmgw mirror init`` writes it on a
  mirror's own machine, and the operator copies it to each control plane that uses that mirror;
- else ``/etc/llmgw/admin-token``: a mirror beside its control plane (``server init``) takes the
  admin token, which the same users already read and which every control plane of an HA cluster
  shares (a joined control plane uses the first one's mirror). Whoever may change the catalog may
  fetch and delete weights, and nobody else.

A token, not a unix socket with peer credentials: the API is also reached over the network (the
control planes of an HA cluster, a mirror on its own machine), where a socket has no peer to ask;
one mechanism covers both. Without a token (``token=None``) the client sends no header.

Example::

    with MirrorClient("http://127.0.0.1:8082", token=read_token(token_path(paths))) as m:
        m.health()
        st = m.fetch("hf:org/repo/model.gguf", "gemma-3-270m", "1")
        while m.status("gemma-3-270m", "1").state == "fetching":
            ...
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import httpx
from pydantic import TypeAdapter, ValidationError

from llmgw.errors import ApiError, ConfigError, UnreachableError, error_fields
from llmgw.mirror.models import FetchStatus
from llmgw.names import path_segment
from llmgw.paths import Paths

T = TypeVar("T")

_STATUS = TypeAdapter(FetchStatus)
_STATUS_LIST = TypeAdapter(list[FetchStatus])

CONNECT_TIMEOUT_S = 2.0
"""Seconds to open a connection: a mirror on another machine that is down costs this, not the whole
request timeout (``docs/ha.md`` §5: connect 2 s)."""


DEFAULT_API = "http://127.0.0.1:8082"
"""The management API a CLI asks when nothing names another: ``mirror serve``'s and ``server init``'s
default ``--api-listen``/``--mirror-api-listen``, on loopback."""


def local_api(paths: Paths) -> str:
    """The management API of this machine's mirror, for a command given no ``--api``: server.yaml's
    ``mirror.api`` when there is a server.yaml naming one (``server init`` writes it, with its
    ``--mirror-api-listen``), else :data:`DEFAULT_API` (a mirror's own machine, made by ``mirror
    init``, has no server.yaml). Before, the commands always asked :data:`DEFAULT_API`, and an
    install on another port answered ``does not answer`` until ``--api`` was given.

    Raises:
        ConfigError: server.yaml is there but does not load (naming the file and field).
    """
    if not paths.server_config.exists():
        return DEFAULT_API
    from llmgw.config import load_server_config  # noqa: PLC0415 (pydantic config: only when there is one)

    try:
        api = load_server_config(paths.server_config).mirror.api
    except ConfigError as e:
        raise ConfigError(f"{e} (or pass --api)") from e
    return api or DEFAULT_API


MIRROR_TOKEN = "mirror-token"  # noqa: S105 (a file name, not a secret)
"""The name of a mirror's own token file in ``/etc/llmgw`` (:func:`token_path`)."""


def token_path(paths: Paths) -> Path:
    """The management API's token file on this machine: ``/etc/llmgw/mirror-token`` when it exists,
    else the admin token (see the module docstring)."""
    own = paths.etc / MIRROR_TOKEN
    return own if own.exists() else paths.admin_token


def read_token(path: Path) -> str:
    """The token in ``path`` (its first line, stripped).

    Raises:
        ConfigError: it cannot be read (not root or ``llmgw``: the file is 0600) or is empty.
    """
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"the mirror's management API token {path} cannot be read ({e}); run this as root "
            "(sudo) or as the llmgw user"
        ) from e
    token = text.splitlines()[0].strip() if text else ""
    if not token:
        raise ConfigError(f"the mirror's management API token {path} is empty; run 'llmgw server init' again")
    return token


def local_token(paths: Paths) -> str | None:
    """The token a CLI on this machine sends (:func:`token_path`, :func:`read_token`); None when this
    machine has no token file at all (no llmgw install here: the mirror then answers 401 with
    what to do).

    Raises:
        ConfigError: the file exists but this user cannot read it (not root or ``llmgw``).
    """
    path = token_path(paths)
    return read_token(path) if path.exists() else None


class MirrorClient:
    """The mirror's management API at ``api_url`` (``http://127.0.0.1:8082``).

    The mirror may be on another machine and serve several control planes: each control plane's
    address must be among the mirror's ``--api-allow`` values (``llmgw mirror init
    --control-plane ADDR``, repeatable); another address is answered 403 ``forbidden``, raised as
    :class:`~llmgw.errors.ApiError` naming the flag.

    Args:
        api_url: the management API's base URL.
        token: the management API's token (:func:`read_token`); None sends none (only
            ``health`` then answers).
        timeout: seconds for each request (read, write, pool); connecting takes at most
            :data:`CONNECT_TIMEOUT_S` (or ``timeout`` when smaller).
        transport: an httpx transport to use instead of the network (tests, in-process apps).
    """

    def __init__(
        self,
        api_url: str,
        *,
        token: str | None = None,
        timeout: float = 15.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        limits = httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S))
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.api_url, timeout=limits, transport=transport, headers=headers)

    def __enter__(self) -> MirrorClient:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def health(self) -> None:
        """Return when the mirror answers ``{"status": "ok"}``.

        Raises:
            UnreachableError: it does not answer, or answers something else.
        """
        try:
            body = self._request("GET", "/api/v1/health")
        except ApiError as e:
            raise UnreachableError(f"the mirror at {self.api_url} is not healthy: {e}") from e
        if not isinstance(body, dict) or body.get("status") != "ok":
            raise UnreachableError(f"the mirror at {self.api_url} answered {body!r} to a health check")

    def status(self, model: str, version: str) -> FetchStatus:
        """The status of ``model/version``.

        Raises:
            ApiError: ``status == 404`` when the mirror does not know it.
            UnreachableError: the mirror does not answer.
        """
        return self._status(self._request("GET", f"/api/v1/status/{path_segment(model)}/{path_segment(version)}"))

    def fetch(self, source: str, model: str, version: str) -> FetchStatus:
        """Ask the mirror to fetch ``source`` as ``model/version`` (joins a fetch already running).

        Raises:
            ApiError: 400 for a bad source or name, 409 when ``model/version`` holds another source.
            UnreachableError: the mirror does not answer.
        """
        body = {"source": source, "model": model, "version": version}
        return self._status(self._request("POST", "/api/v1/fetch", json=body))

    def delete(self, model: str, version: str) -> FetchStatus:
        """Cancel the fetch of ``model/version`` if it runs and delete its bytes; its last status.

        Raises:
            ApiError: ``status == 404`` when the mirror does not know it.
            UnreachableError: the mirror does not answer.
        """
        return self._status(self._request("DELETE", f"/api/v1/files/{path_segment(model)}/{path_segment(version)}"))

    def files(self) -> list[FetchStatus]:
        """Every ``model/version`` the mirror knows."""
        return self._read(_STATUS_LIST, self._request("GET", "/api/v1/files"), "a file list")

    def _status(self, body: Any) -> FetchStatus:
        return self._read(_STATUS, body, "a status")

    def _read(self, shape: TypeAdapter[T], body: Any, what: str) -> T:
        """``body`` (a decoded answer) as ``shape``; one of another shape is an ApiError (status 200)
        naming ``what`` the mirror sent."""
        try:
            return shape.validate_python(body)
        except ValidationError as e:
            raise ApiError(f"the mirror at {self.api_url} sent {what} llmgw cannot read: {e}", status=200) from e

    def _request(self, method: str, path: str, json: Any = None) -> Any:
        try:
            resp = self._http.request(method, path, json=json)
        except httpx.TransportError as e:
            raise UnreachableError(
                f"the mirror at {self.api_url} does not answer ({type(e).__name__}: {e}); "
                "is 'llmgw mirror serve' running there?"
            ) from e
        if not resp.is_success:
            code, message = error_fields(resp.text, limit=200)
            raise ApiError(
                f"the mirror at {self.api_url} answered {resp.status_code} to {method} {path}: {message}",
                status=resp.status_code,
                code=code,
            )
        try:
            return resp.json()
        except ValueError:
            return None
