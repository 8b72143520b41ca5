"""Asking the gateway from a terminal, as any OpenAI client would: the logic behind ``llmgw chat``.

Sync httpx (the CLI is sync; docs/architecture.md, "Rules the code keeps", says why servers use
aiohttp instead). Every
function takes an optional httpx ``transport`` so tests can point it anywhere without patching.

Where to ask (:func:`local_target`): this machine's ``server.yaml`` — ``gateway.listen`` becomes
``http://127.0.0.1:<port>`` when it listens on all interfaces, and the key is the first line of
``gateway.keys_file`` (else ``/etc/llmgw/client-keys``) when this user can read it; a single-machine
install may need no key at all (``gateway.allow_loopback_without_key``).

Errors, translated here with the cause chained:

- :class:`~llmgw.errors.UnreachableError`: the gateway does not answer, or broke off mid-answer; the
  message says what to run (``llmgw service status``).
- :class:`~llmgw.errors.ApiError`: the gateway answered 4xx/5xx (or a mid-stream error event); the
  message is the server's own, the status and ``code`` ride along.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from llmgw.config import load_server_config, parse_listen
from llmgw.errors import ApiError, ConfigError, UnreachableError, error_fields
from llmgw.paths import Paths

DEFAULT_GATEWAY = "http://127.0.0.1:8080"
# Connect fast; a local model may take minutes to prefill a long prompt or load after a restart.
TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=5.0)


@dataclass(frozen=True)
class Target:
    """A gateway to ask: ``base_url`` like ``http://127.0.0.1:8080`` (no ``/v1``), ``key`` or None."""

    base_url: str
    key: str | None


def normalize_url(url: str) -> str:
    """``host:port``, ``http://host:port/`` or ``.../v1`` → ``http://host:port`` (scheme kept if given)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url.removesuffix("/v1")


def _first_key(path: Any) -> str | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:  # missing, or 0600 and not ours: try without a key
        return None
    return next((s for line in lines if (s := line.strip()) and not s.startswith("#")), None)


def _may_read(path: Path) -> bool:
    """Whether this process may read ``path``."""
    return os.access(path, os.R_OK)


def local_target(paths: Paths) -> Target:
    """This machine's gateway, from ``server.yaml`` (see the module docstring).

    Without a ``server.yaml``: ``http://127.0.0.1:8080`` and no key.

    Raises:
        ConfigError: ``server.yaml`` exists but is invalid (the message names the field), or this
            user may not read it (root's, mode 0600: the message says to pass ``--server``).
    """
    if not paths.server_config.exists():
        return Target(DEFAULT_GATEWAY, None)
    if not _may_read(paths.server_config):
        raise ConfigError(
            f"{paths.server_config} cannot be read as uid {os.geteuid()} (it names this machine's gateway "
            "and its key): pass the gateway with --server URL and a key with --key (or LLMGW_SERVER, "
            "LLMGW_API_KEY), or run as root"
        )
    cfg = load_server_config(paths.server_config).gateway
    host, port = parse_listen(cfg.listen)
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return Target(f"http://{host}:{port}", _first_key(cfg.keys_file or paths.client_keys))


def resolve_target(paths: Paths, *, server: str | None, key: str | None) -> Target:
    """``--server``/``--key`` over this machine's config.

    This machine's key is only sent to this machine's gateway: with ``server`` set and no ``key``,
    the request goes without one.
    """
    if server:
        return Target(normalize_url(server), key)
    local = local_target(paths)
    return Target(local.base_url, key or local.key)


def _client(base_url: str, key: str | None, transport: httpx.BaseTransport | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=base_url, headers=headers, timeout=TIMEOUT, transport=transport)


def _unreachable(base_url: str, e: httpx.HTTPError) -> UnreachableError:
    if isinstance(e, httpx.ReadTimeout):
        what = f"stopped answering for {TIMEOUT.read:g} s"
    elif isinstance(e, httpx.RemoteProtocolError | httpx.ReadError):
        what = f"broke off the answer ({e})"
    else:
        what = f"does not answer ({e or type(e).__name__})"
    return UnreachableError(
        f"the gateway at {base_url} {what}; check it with 'llmgw service status' (or pass --server URL)"
    )


def _api_error(status: int, data: Any, base_url: str) -> ApiError:
    code, message = error_fields(data)
    if status == 401:
        message += f"; pass --key KEY (a line of the gateway's keys_file) for {base_url}"
    return ApiError(f"the gateway answered {status}: {message}", status=status, code=code)


def _blocked(guard: dict[str, Any], base_url: str) -> ApiError:
    """A streamed answer the guardrails held back: the gateway ends the stream with one
    ``content_filter`` chunk and its ``llmgw_guard`` (``direction``, ``categories``, ``policy``),
    nothing of the answer sent (llmgw.control.gateway.guard). Said as the plain answer's 400 says it."""
    cats = ", ".join(str(c) for c in guard.get("categories") or ())
    message = f"the answer was blocked by policy '{guard.get('policy', '?')}'" + (f" ({cats})" if cats else "")
    return _api_error(400, {"error": {"code": "content_blocked", "message": message}}, base_url)


def _raise_for(resp: httpx.Response, base_url: str) -> None:
    if resp.status_code < 400:
        return
    resp.read()
    try:
        data: Any = resp.json()
    except ValueError:
        data = resp.text
    raise _api_error(resp.status_code, data, base_url)


def list_models(base_url: str, key: str | None, *, transport: httpx.BaseTransport | None = None) -> list[str]:
    """The ids of ``GET /v1/models``, in the gateway's order (sorted by name).

    Raises:
        UnreachableError: the gateway does not answer.
        ApiError: it answered with an error (401 without a valid key).
    """
    base_url = normalize_url(base_url)
    try:
        with _client(base_url, key, transport) as client:
            resp = client.get("/v1/models")
            _raise_for(resp, base_url)
            return [str(m["id"]) for m in resp.json()["data"]]
    except httpx.HTTPError as e:
        raise _unreachable(base_url, e) from e


def default_model(base_url: str, key: str | None, *, transport: httpx.BaseTransport | None = None) -> str:
    """The first model of ``GET /v1/models``.

    Raises:
        ApiError: the gateway offers no model yet (404 ``model_not_found``), or as :func:`list_models`.
    """
    models = list_models(base_url, key, transport=transport)
    if not models:
        raise ApiError(
            f"the gateway at {normalize_url(base_url)} offers no chat model yet; see 'llmgw ctl models'",
            status=404,
            code="model_not_found",
        )
    return models[0]


def stream_chat(
    base_url: str,
    key: str | None,
    model: str,
    message: str,
    *,
    max_tokens: int | None = None,
    transport: httpx.BaseTransport | None = None,
) -> Iterator[str]:
    """Ask ``model`` one user ``message`` with ``stream: true``; yield the answer's text deltas as they come.

    ``max_tokens`` caps the answer (tokens); None leaves it to the model's ``max_output``.

    Raises (while iterating):
        UnreachableError: the gateway does not answer, or broke off mid-answer.
        ApiError: an error status, or an error event in the stream (the server's message), or an
            answer the guardrails blocked (400 ``content_blocked``: a ``content_filter`` ending).
    """
    base_url = normalize_url(base_url)
    body: dict[str, object] = {"model": model, "messages": [{"role": "user", "content": message}], "stream": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    try:
        with (
            _client(base_url, key, transport) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as resp,
        ):
            _raise_for(resp, base_url)
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, ": comments", "event:" lines
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                event = json.loads(payload)
                if "error" in event:
                    raise _api_error(502, event, base_url)
                for choice in event.get("choices") or ():
                    if choice.get("finish_reason") == "content_filter":
                        raise _blocked(event.get("llmgw_guard") or {}, base_url)
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        yield text
    except httpx.HTTPError as e:
        raise _unreachable(base_url, e) from e
