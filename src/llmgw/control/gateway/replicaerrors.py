"""A replica's error answer as the client gets it (:func:`replica_error`): passed through scrubbed of the
replica's address and key (:func:`scrub`), a 500 that is the client's own mistake made the 400 it is
(:func:`client_mistake`), a prompt past the model's context a 400 ``context_length_exceeded`` (OpenAI's
code for it, which clients test for), an error whose ``code`` is a number (llama-server's HTTP status)
given a string code, and a 401/403 (the replica does not know the gateway's key) made a 502.
Used by both relays of :mod:`llmgw.control.gateway.upstream`."""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from llmgw.control.gateway.replicaclient import ReplicaResponse
from llmgw.httperrors import openai_error_json
from llmgw.routing import Route, Upstream

log = logging.getLogger("llmgw.control.gateway.upstream")  # the relays' logger, as before this split


def scrub(data: bytes, up: Upstream) -> bytes:
    """Remove the replica's address and key from an error body before a client sees it."""
    host = up.endpoint.rpartition(":")[0]
    for secret in (up.endpoint, up.key, host):
        if secret:
            data = data.replace(secret.encode(), b"<replica>")
    return data


#: Pieces of llama-server's 500 messages that are the request's fault, not the server's: its JSON
#: reader's type errors (``[json.exception.type_error.302] type must be string, but is number``, for a
#: field of the wrong type the gateway does not check) and media a text-only model cannot read.
CLIENT_MISTAKES = ("[json.exception.", "image input is not supported", "audio input is not supported")


def client_mistake(data: bytes) -> str:
    """The engine's message when a 500 body says the request was at fault (see :data:`CLIENT_MISTAKES`),
    shortened and without llama-server's mmproj hint; "" for a real server error."""
    text = data.decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error")
        message = str(err.get("message", "")) if isinstance(err, dict) else text
    except (ValueError, AttributeError):
        message = text
    if not any(m in message for m in CLIENT_MISTAKES):
        return ""
    if "input is not supported" in message:
        media = "images" if "image" in message else "audio"
        return f"it reads text only, not {media}: send 'text' content parts"
    return message.strip()[:300]


async def replica_error(route: Route, up: Upstream, resp: ReplicaResponse) -> web.Response:
    """The response for a replica's 4xx/5xx: passed through (scrubbed), or a 502 when it is ours."""
    data = await resp.read()
    if resp.status in (401, 403):
        log.error("replica %s of %s rejected the gateway's key (%d)", up.replica_id, route.model, resp.status)
        return openai_error_json(
            502, "upstream_auth", f"the replica of model '{route.model}' refused the gateway; retry shortly"
        )
    data = scrub(data, up)
    try:
        err = json.loads(data).get("error")
    except (ValueError, AttributeError):
        err = None
    shaped = isinstance(err, dict)
    if isinstance(err, dict) and (too_long := _context_error(route, resp.status, err)) is not None:
        return too_long
    if resp.status == 500 and (mistake := client_mistake(data)):
        log.info("replica %s of %s: a 500 for the client's request, sent as 400: %s", up.replica_id, route.model,
                 mistake)
        return openai_error_json(400, "invalid_request", f"model '{route.model}' cannot take this request: {mistake}")
    if isinstance(err, dict) and not isinstance(err.get("code"), str | None):
        # llama-server puts the HTTP status in ``code`` (a number); OpenAI's is a string or null
        kind = err.get("type")
        code = kind if isinstance(kind, str) and kind else "upstream_error"
        return openai_error_json(resp.status, code, str(err.get("message", ""))[:1000])
    if shaped:
        return web.Response(body=data, status=resp.status, content_type="application/json")
    text = data.decode("utf-8", "replace").strip()[:300]
    return openai_error_json(
        resp.status, "upstream_error", f"model '{route.model}' answered {resp.status}: {text}"
    )


def _context_error(route: Route, status: int, err: dict[str, Any]) -> web.Response | None:
    """The 400 ``context_length_exceeded`` for an engine's answer that the input was too long: a
    prompt past the context (llama-server's own 400), or an embedding input past the micro-batch (its
    500, "increase the physical batch size", no advice for a client: a new user's finding); None
    for any other error."""
    message = str(err.get("message", ""))
    if err.get("type") == "exceed_context_size_error":
        said = message.split(", try increasing it", maxsplit=1)[0][:200]
        return openai_error_json(
            400, "context_length_exceeded",
            f"model '{route.model}': {said}; shorten the messages or ask for fewer max_tokens",
        )
    if status == 500 and (said := _too_large(message)):
        return openai_error_json(400, "context_length_exceeded", f"model '{route.model}': {said}; send a shorter input")
    return None


def _too_large(message: str) -> str:
    """llama-server's 500 for an embedding input longer than it can take in one micro-batch
    (``input (602 tokens) is too large to process. increase the physical batch size …``) as
    ``input (602 tokens) is too large to process``; "" for any other message."""
    head = message.split(". increase the physical batch size", 1)[0]
    return head[:200] if head != message and "is too large to process" in head else ""
