"""The server side of llmgw's HTTP error edge: one error type, two wire shapes, one middleware.

Every llmgw listener refuses a request the same way: a handler raises
:class:`~llmgw.errors.HttpError` ``(status, code, message)``, or returns what :func:`error_json` /
:func:`openai_error_json` build from the same three values, in that order. Two wire shapes, each
fixed by the clients that read it:

- llmgw's own APIs (the admin API and its guard routes, the agent API, the mirror's management
  API): ``{"error": {"code", "message"}}`` (:func:`error_json`); llmgw's clients turn it into an
  :class:`~llmgw.errors.ApiError` carrying ``status`` and ``code``.
- the gateway: OpenAI's ``{"error": {"message", "type", "param": null, "code"}}``
  (:func:`openai_error_json`; :func:`openai_error_event` for a stream's last event), which the
  official ``openai`` clients parse.

:func:`error_middleware` answers, in the first shape, whatever a handler of an llmgw API raises:
an :class:`~llmgw.errors.HttpError` (:class:`~llmgw.errors.JsonBodyError` included), aiohttp's own
``HTTPException`` (a path or method no route takes), the errors its app maps in ``known`` (the
admin API: a store :class:`~llmgw.errors.Conflict` is a 409), and anything else as a logged 500
``internal`` that names no detail. The gateway does not use it: its chat handler answers its own
errors, because it records each answer's status and headers.

:func:`start_site` starts every listener of the control plane and the mirror: a port it cannot
bind is a :class:`~llmgw.errors.PortInUseError` naming the setting or flag and what to do.

The client side reads both shapes back with one function, :func:`llmgw.errors.error_fields`: the
gateway's client, the admin client, the mirror's client, the agent's heartbeat and the dashboard's
admin API client all turn an error answer into an :class:`~llmgw.errors.ApiError` through it. It
lives there, not here, so that a client that needs no aiohttp (the mirror's, the admin client's)
does not import it (~0.1 s of CPU) for a JSON reading.
"""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.typedefs import Handler, Middleware

from llmgw.errors import HttpError, PortInUseError

log = logging.getLogger(__name__)

_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_ROUTING_CODES = {404: "not_found", 405: "method_not_allowed"}


def error_json(status: int, code: str, message: str, *, headers: Mapping[str, str] | None = None) -> web.Response:
    """``{"error": {"code", "message"}}`` as a JSON response with ``status`` (llmgw's own APIs)."""
    return web.json_response({"error": {"code": code, "message": message}}, status=status, headers=headers)


def openai_error_body(
    status: int, code: str, message: str, *, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The OpenAI error envelope: ``{"error": {"message", "type", "param": null, "code", **extra}}``.

    ``type`` follows the status as OpenAI's API does: 401 ``authentication_error``, 403
    ``permission_error``, 429 ``rate_limit_error``, other 4xx ``invalid_request_error``, 5xx
    ``api_error``. ``extra`` adds fields to the ``error`` object (the guard's ``policy``,
    ``categories``); never an internal address.
    """
    kind = _OPENAI_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    error: dict[str, Any] = {"message": message, "type": kind, "param": None, "code": code}
    if extra:
        error.update(extra)
    return {"error": error}


def openai_error_json(
    status: int, code: str, message: str, *, extra: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """:func:`openai_error_body` as a JSON response with ``status``; a 401 also carries
    ``WWW-Authenticate: Bearer`` (RFC 6750), as OpenAI's API answers a missing key."""
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer", **(headers or {})}
    return web.json_response(openai_error_body(status, code, message, extra=extra), status=status, headers=headers)


def openai_error_event(status: int, code: str, message: str, *, extra: Mapping[str, Any] | None = None) -> bytes:
    """A stream's last words after its 200 went out: the OpenAI error envelope as an SSE event,
    then ``data: [DONE]``, so the stream ends well-formed (the ``openai`` client raises an
    ``APIError`` carrying the message)."""
    body = openai_error_body(status, code, message, extra=extra)
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


class _MalformedRequests(logging.Filter):
    """Turns aiohttp's report of a request it could not parse into one WARNING line.

    aiohttp answers such a request itself (400, text, connection closed) and logs
    ``logger.exception("Error handling request from %s", peer)``: ERROR with a traceback, whose
    message quotes the first 100 bytes of the offending line, which may be a secret (an over-long
    ``Authorization`` header). Here a record whose exception is an ``HttpProcessingError`` (the
    parser's: ``LineTooLong``, ``BadHttpMessage``, ``InvalidHeader``...) becomes
    ``malformed HTTP request from PEER refused with 400: LineTooLong (over 8190 bytes)``, without the
    traceback or the bytes; any other record passes unchanged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            what = type(exc).__name__
            if isinstance(exc, LineTooLong) and len(exc.args) > 1:
                what += f" (over {exc.args[1]} bytes)"  # LineTooLong(line, limit, actual_size)
            record.msg, record.args = "malformed HTTP request from %s refused with %d: %s", (
                peer, exc.code or 400, what)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


#: The logger llmgw's listeners give aiohttp's server (``web.AppRunner(app, logger=SERVER_LOG)``):
#: aiohttp's own errors, with a request it could not parse (an over-long header line, a bad
#: request line) reported in one WARNING line without a traceback (:class:`_MalformedRequests`).
SERVER_LOG = logging.getLogger("llmgw.http")
SERVER_LOG.addFilter(_MalformedRequests())


async def start_site(site: web.TCPSite, *, what: str, host: str, port: int, fix: str) -> None:
    """Start a listener's ``site`` (bound to ``host:port``), translating a failure to bind.

    Args:
        site: the site, its runner set up; the caller cleans the runner up when this raises.
        what: the setting or flag and the value it was given (``gateway_listen :8080``,
            ``--listen 127.0.0.1:8081``), which starts the message.
        host, port: where it binds.
        fix: the other way out, after "stop it" (``change gateway_listen in /etc/llmgw/server.yaml``).

    Raises:
        PortInUseError: the port is taken (``EADDRINUSE``): "``what``: port N is already in use by
            another program; stop it (e.g. 'ss -ltnp sport = :N') or ``fix``"; or it cannot be bound
            for another reason, which the message gives (the OS's ``strerror``: an address that is
            not this machine's).
    """
    try:
        await site.start()
    except OSError as e:
        raise bind_error(e, what=what, host=host, port=port, fix=fix) from e


def bind_error(e: OSError, *, what: str, host: str, port: int, fix: str) -> PortInUseError:
    """The :class:`PortInUseError` for failing to bind ``host:port`` with ``e`` (see :func:`start_site`)."""
    if e.errno == errno.EADDRINUSE:
        return PortInUseError(
            f"{what}: port {port} is already in use by another program; stop it "
            f"(e.g. 'ss -ltnp sport = :{port}') or {fix}"
        )
    return PortInUseError(f"{what}: cannot listen on {host}:{port}: {e.strerror or e}")


def routing_code(e: web.HTTPException) -> str:
    """The ``code`` for aiohttp's own refusal: ``not_found`` (no route), ``method_not_allowed``,
    else its reason phrase in ``snake_case`` (``request_entity_too_large``)."""
    return _ROUTING_CODES.get(e.status) or e.reason.lower().replace(" ", "_")


def error_middleware(
    *, service: str, known: Mapping[type[Exception], tuple[int, str]] | None = None
) -> Middleware:
    """An aiohttp middleware answering a handler's errors as ``{"error": {"code", "message"}}``.

    Put it first in the app's ``middlewares`` so it also answers what the others raise.

    Args:
        service: what the 500 answer and the log line call this listener (``the control plane``,
            ``the mirror``, ``the agent API``).
        known: more exception types and the ``(status, code)`` each is answered with, its message
            being ``str(error)``; the first type that matches wins, so name subclasses first.

    What it answers: :class:`~llmgw.errors.HttpError` with its own status, code, message and
    headers; an aiohttp ``HTTPException`` of status 400 or more with :func:`routing_code` and
    ``"<METHOD> <path>: <reason>"``, a 405 keeping its ``Allow`` header (the methods the path
    takes, RFC 9110) (a lower one, a redirect, passes through); a ``known`` type;
    anything else with 500 ``internal``, logged with its traceback (the client learns nothing
    internal).
    """
    table = tuple((known or {}).items())

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except HttpError as e:
            return error_json(e.status, e.code, e.message, headers=e.headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None  # a 405's methods
            return error_json(
                e.status, routing_code(e), f"{request.method} {request.path}: {e.reason}", headers=allow
            )
        except Exception as e:
            for kind, (status, code) in table:
                if isinstance(e, kind):
                    return error_json(status, code, str(e))
            log.exception("%s: %s %s failed", service, request.method, request.path)
            return error_json(500, "internal", f"{service} failed on this request; see its log")

    return errors
