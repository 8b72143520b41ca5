"""The agent's side of the agent API's wire: posting a beat and reading the reply, the weights in
the node cache it reports, and the few words a failure is logged in."""

from __future__ import annotations

import contextlib
from pathlib import Path

import aiohttp
from pydantic import ValidationError

from llmgw.errors import ApiError, LlmgwError, UnreachableError, error_fields
from llmgw.protocol import Heartbeat, HeartbeatReply, Pulse

REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=5, sock_connect=2)
"""A heartbeat is small; a control plane that takes longer is treated as unreachable and the next
one is tried (docs/ha.md §5: request 5 s, connect 2 s)."""

STALE_TERM = "stale_term"
"""The :class:`~llmgw.errors.ApiError` code (status 200) of a reply whose term is below the highest
this agent has seen: the control plane is on a stale or orphaned database; its reply is not applied
and the agent rotates."""

NO_TERM_YET = "no_term_yet"
"""The :class:`~llmgw.errors.ApiError` code (status 200) of a reply with term 0 after the agent saw a
term: the control plane has not read the election since it started (its agent API answers from the
first moment, its view of the term follows within a second); not applied, as a stale term, but
logged at INFO: nothing is wrong with its database."""


def reason(e: LlmgwError) -> str:
    """A failure in a few words for a switch line: the text after the URL's "does not answer: "."""
    text = str(e)
    if " does not answer: " in text:
        return text.partition(" does not answer: ")[2]
    if " answered " in text:
        return "answered " + text.partition(" answered ")[2]
    return text


async def post_heartbeat(
    session: aiohttp.ClientSession, server: str, path: str, beat: Heartbeat | Pulse
) -> HeartbeatReply:
    """POST a heartbeat and parse the reply.

    Raises:
        UnreachableError: connection, TLS or timeout failure (names the URL).
        ApiError: a non-2xx answer (status and the ``{"error": {"code", "message"}}`` body), or a
            2xx body that is not a HeartbeatReply.
    """
    url = server.rstrip("/") + path
    try:
        async with session.post(
            url,
            data=beat.model_dump_json(),
            headers={"Content-Type": "application/json"},
            timeout=REQUEST_TIMEOUT,
        ) as resp:
            body = await resp.text()
            if resp.status >= 300:
                code, message = error_fields(body)
                raise ApiError(f"{url} answered {resp.status}: {message}", status=resp.status, code=code)
            try:
                return HeartbeatReply.model_validate_json(body)
            except ValidationError as e:
                raise ApiError(
                    f"{url} answered something that is not a heartbeat reply: {e}", status=resp.status
                ) from e
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        raise UnreachableError(f"control plane {url} does not answer: {type(e).__name__}: {e}") from e


def cached_weights(cache_root: Path) -> list[str]:
    """``model/version`` of every weights file in the node cache (``<root>/<model>/<version>/<file>``
    with its ``.<file>.sha256`` record, i.e. fully fetched and verified)."""
    out = set()
    with contextlib.suppress(OSError):
        for record in cache_root.glob("*/*/.*.sha256"):
            if (record.parent / record.name[1:].removesuffix(".sha256")).is_file():
                out.add(f"{record.parent.parent.name}/{record.parent.name}")
    return sorted(out)
