"""The gateway's request ids: the ``x-request-id`` every answer carries, the engine gets and the
access log names (the client's when it is plain, else one made here), and the
``on_response_prepare`` hook that sends it."""

from __future__ import annotations

import itertools
import re
import secrets

from aiohttp import web

from llmgw.control.gateway.prefix import mix64

_REQUEST_ID = web.RequestKey("llmgw_request_id", str)
#: A client's ``x-request-id`` is kept when it is 1-128 of these characters; else the gateway makes one.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


#: A made request id: this process's 8 random hex digits, then a counter passed through splitmix64's
#: finalizer (a bijection, so unique within the process for 2**64 requests, and not the count of
#: requests served). No system call per request: ``secrets.token_hex`` read the kernel's random
#: source for every one (``getrandom``, ~3 µs here under load).
_ID_PREFIX = secrets.token_hex(4)
_ID_COUNTER = itertools.count(int.from_bytes(secrets.token_bytes(8), "big"))


def new_request_id() -> str:
    """24 hex digits, unique in this process (see ``_ID_PREFIX``)."""
    return f"{_ID_PREFIX}{mix64(next(_ID_COUNTER) & 0xFFFFFFFFFFFFFFFF):016x}"


def request_id(request: web.Request) -> str:
    """The request's id: the client's ``x-request-id`` when it is plain (see ``_CLIENT_ID``), else 24 new
    hex digits (:func:`new_request_id`); kept on the request so every response to it carries the same one."""
    rid = request.get(_REQUEST_ID)
    if rid is None:
        sent = request.headers.get("x-request-id", "")
        rid = sent if sent and _CLIENT_ID.fullmatch(sent) else new_request_id()
        request[_REQUEST_ID] = rid
    return rid


async def send_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: every response carries ``x-request-id``."""
    response.headers.setdefault("x-request-id", request_id(request))
