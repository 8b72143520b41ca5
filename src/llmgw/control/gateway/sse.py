"""What the gateway does to a relayed stream's bytes: the ``model`` field swapped for the client's
name (:class:`ModelRewriter`) and the tokens counted (:class:`StreamTally`), both on line-aligned
bytes, never parsing every event; :func:`pump` copies the replica's chunks to the client through
them (:mod:`llmgw.control.gateway.upstream` relays with it)."""

from __future__ import annotations

import json
import re
import time
from typing import TYPE_CHECKING, Any, Protocol

from llmgw.control.gateway.inspect import Refusal
from llmgw.control.gateway.replicaclient import ReplicaBroken

if TYPE_CHECKING:
    from aiohttp import web

    from llmgw.control.gateway.inspect import StreamInspector
    from llmgw.control.gateway.replicaclient import ReplicaResponse


#: The longest line of a stream held back for the ``model`` swap; past it the stream is broken
#: (:class:`~llmgw.control.gateway.replicaclient.ReplicaBroken`). A llama-server or vLLM event is one
#: token: a few hundred bytes, a few KB with ``top_logprobs``. Unbounded before: a replica's line that
#: never ended was held whole, and joined again with every chunk (quadratic: the loop stalled).
MAX_LINE_BYTES = 2**20


class ModelRewriter:
    """Sets every SSE event's ``"model"`` to the name the client used, on bytes, line-aligned.

    llama-server (this build) puts its ``-m`` path in each chunk's ``model``, not the request's name:
    an internal path the client must not see, and not the name it asked for. A regex on bytes does
    the swap without parsing the JSON (~1 µs per event beside 90-140 µs of relaying). Output is cut at
    the last newline, holding back a partial line until the rest arrives, so a field split across
    network chunks is still replaced; a stream's events are whole lines, so nothing waits longer
    than its own line.
    """

    __slots__ = ("_held", "_repl")

    def __init__(self, requested: str) -> None:
        self._repl = (b'"model":' + json.dumps(requested).encode()).replace(b"\\", b"\\\\")
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines of what arrived so far, rewritten; a trailing partial line is held."""
        if self._held:
            chunk = self._held + chunk
        cut = chunk.rfind(b"\n") + 1
        self._held = chunk[cut:]
        if len(self._held) > MAX_LINE_BYTES:
            raise ReplicaBroken(f"the replica's stream has a line longer than {MAX_LINE_BYTES} bytes")
        return _MODEL_FIELD.sub(self._repl, chunk[:cut]) if cut else b""

    def tail(self) -> bytes:
        """What was held when the stream ended, rewritten."""
        rest, self._held = self._held, b""
        return _MODEL_FIELD.sub(self._repl, rest)


_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"(?:[^"\\]|\\.)*"')


class StreamTally:
    """Counts a relayed stream's tokens, for usage and limits, without parsing every event.

    Per line-aligned chunk it counts events (``data: {``: llama-server and vLLM send one token per
    content event) and looks for ``"usage"`` (a bytes search, ~0.1 µs per event); only the event that
    holds it is parsed. That event comes when the engine was asked for it
    (:func:`~llmgw.control.gateway.request.with_stream_usage`): it has ``"choices": []`` and the
    answer's ``usage``, and is removed from what the client gets when the client did not ask for it
    (``hide``); where it rides on a token's event (llama-server's ``/v1/completions``, whose last
    chunk always has it), that event's ``usage`` and ``timings`` are taken out instead.
    :meth:`usage` is the engine's ``usage`` when it came, else an estimate for a stream the client
    left early: completion tokens = content events relayed, prompt tokens = the
    messages' characters / 4 (OpenAI's rule of thumb for English text), marked ``"estimated": true``.
    """

    __slots__ = ("events", "hide", "prompt_chars", "seen", "timings")

    def __init__(self, *, hide: bool, prompt_chars: int) -> None:
        self.hide = hide
        self.prompt_chars = prompt_chars
        self.events = 0
        self.seen: dict[str, Any] | None = None
        #: llama-server's ``timings`` from the same event (its last), for the balancer's decode rate.
        self.timings: object = None

    def feed(self, data: bytes) -> bytes:
        """Count ``data`` (complete lines); return it, less the usage event when it is hidden."""
        self.events += data.count(b"data: {")
        if b'"usage"' not in data:
            return data
        kept: list[bytes] = []
        lines = data.split(b"\n")
        drop_blank = False
        for line in lines:
            if drop_blank and not line.strip():
                drop_blank = False
                continue
            drop_blank = False
            if line.startswith(b"data: {") and b'"usage"' in line:
                try:
                    event = json.loads(line[6:])
                except ValueError:
                    event = None
                if isinstance(event, dict) and isinstance(event.get("usage"), dict):
                    self.seen = event["usage"]
                    self.timings = event.get("timings")
                    self.events -= 1
                    if self.hide and event.get("choices") == []:
                        drop_blank = True
                        continue
                    if self.hide:  # on a token's event (a /v1/completions stream's last): the token stays
                        event.pop("usage", None)
                        event.pop("timings", None)
                        kept.append(b"data: " + json.dumps(event, separators=(",", ":")).encode())
                        continue
            kept.append(line)
        return b"\n".join(kept)

    def usage(self) -> dict[str, Any]:
        """The stream's ``usage``: the engine's, or the estimate (see the class docstring)."""
        if self.seen is not None:
            return self.seen
        completion = max(0, self.events - 1)  # the first event carries the role, not a token
        prompt = self.prompt_chars // 4
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "estimated": True,
        }


class Relayed(Protocol):
    """What :func:`pump` records on the request's trace (:class:`~llmgw.control.gateway.upstream.Trace`)."""

    tally: StreamTally | None
    first_byte_ns: int
    ended_ns: int


#: The event that ends an OpenAI stream; a client may close as soon as it has read it.
DONE_EVENT = b"data: [DONE]\n\n"


async def pump(
    resp: ReplicaResponse,
    out: web.StreamResponse,
    watcher: StreamInspector | None,
    rewriter: ModelRewriter,
    trace: Relayed,
) -> Refusal | None:
    """Copy chunks (rewritten, counted by ``trace.tally``) until the replica's end; a refusal stops it
    and is returned. ``trace.first_byte_ns`` is set at the first body bytes written: the time to the
    first token the client gets (llama-server sends its first event with the first token), which
    ``llmgw_gateway_ttft_seconds`` reports; it was the time the headers went out (~3-16 ms, while
    the first token came 0.2-1.6 s later: a new user's report, 2026-12-05). ``trace.ended_ns`` is set
    when the stream's last event (:data:`DONE_EVENT`) has been written: a client that closes from then
    on had the whole answer."""
    tally = trace.tally

    def counted(data: bytes) -> bytes:
        return tally.feed(data) if data and tally is not None else data

    async def write(data: bytes) -> None:
        if not trace.first_byte_ns:
            trace.first_byte_ns = time.perf_counter_ns()
        await out.write(data)
        if data.endswith(DONE_EVENT):
            trace.ended_ns = time.perf_counter_ns()

    async for chunk in resp.iter_any():
        data = counted(rewriter.feed(chunk))
        if not data:
            continue
        seen = data if watcher is None else await watcher.chunk(data)
        if isinstance(seen, Refusal):
            return seen
        if seen:
            await write(seen)
    last = counted(rewriter.tail())
    if watcher is None:
        if last:
            await write(last)
        return None
    seen = await watcher.chunk(last) if last else b""
    if isinstance(seen, Refusal):
        return seen
    end = await watcher.end()
    if isinstance(end, Refusal):
        return end
    if seen + end:
        await write(seen + end)
    return None
