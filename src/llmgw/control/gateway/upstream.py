"""The gateway's side toward the engines: one pooled client, replica choice, and the two relays.

Mechanism, per chat request:

1. :meth:`UpstreamPool.send` picks the model's next replica round-robin and POSTs the body (the
   client's bytes, or what :mod:`llmgw.control.gateway.request` made of them) to
   ``http://{endpoint}/v1/chat/completions`` with that replica's key. When the connection is refused
   (or the connect times out), nothing was sent, so it tries the next replica once; past that the
   client gets 502. A replica is never retried after the request went out
   (generation is not idempotent and may be half done).
2. :func:`relay_plain` reads the whole answer, rewrites its ``model`` to the name the client used,
   and returns the replica's status. :func:`relay_stream` answers ``text/event-stream`` and writes
   every network chunk as it arrives (``iter_any``), never parsing the SSE's JSON; only the
   ``"model"`` field is swapped on bytes for the client's name (:class:`ModelRewriter`), since
   llama-server writes its model file's path there.
3. Replica errors (llama-server's are OpenAI-shaped) pass through with their status, scrubbed of the
   replica's address and key; a 500 that llama-server gives for the client's own mistake (a field of
   the wrong type, an image sent to a text-only model: :data:`_CLIENT_MISTAKES`) becomes the 400
   ``invalid_request_error`` it is. Two are the gateway's problem, not the client's, and become 502: a
   401/403 (the replica does not know the gateway's key: it was restarted with a new one) and a
   dead replica mid-request. Mid-stream, after the 200 went out, that 502 is a final
   ``data: {"error": ...}`` event.

Why aiohttp as the client: measured here reading SSE, aiohttp's client costs 36-70 µs of CPU per
event, httpx 160-270 µs; ``bench/gateway_overhead.py`` repeats it side by
side: aiohttp ``iter_any`` 91-105 µs vs httpx ``aiter_raw`` 206-228 µs per event, 2 busy cores.

Timeouts are LLM-sized: connect 5 s; a non-streamed answer may take
``upstream_timeout_s`` in all (long prefill plus long generation); a stream has no total limit,
only ``upstream_timeout_s`` of silence between chunks (which covers a long prefill).

Not guaranteed: that a stream broken mid-way tells the client more than the final error event; that
a request which the replica got before it died is not half-processed there.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from llmgw.control.gateway.inspect import Inspector, Refusal, StreamInspector, current_call
from llmgw.errors import HttpError
from llmgw.httperrors import openai_error_event, openai_error_json
from llmgw.routing import Route, Upstream

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
# cpp-httplib (llama-server's HTTP server) closes idle keep-alive connections after 5 s; dropping
# ours at 4 s avoids POSTing into a connection the engine is closing (aiohttp does not retry POSTs).
KEEPALIVE_S = 4.0
# Many concurrent streams are normal for an LLM gateway; the engine queues what its slots can't take.
MAX_CONNECTIONS = 1024



def refusal_response(refusal: Refusal) -> web.Response:
    """An inspector's :class:`Refusal` as an OpenAI error envelope, its ``extra`` fields included."""
    return openai_error_json(refusal.status, refusal.code, refusal.message, extra=refusal.extra)


@functools.lru_cache(maxsize=4096)
def _url(endpoint: str, path: str) -> URL:
    # yarl parsing costs more than the rest of the request setup; endpoints repeat.
    return URL(f"http://{endpoint}{path}")


# A stream's connection is not kept: llama-server (b0.3.36 here) drops a kept-alive connection
# after a streamed answer in a way the next request on it, or a new one opened meanwhile, fails
# ("Server disconnected", "Can not write request body"): measured, 10 of 20 sequential streams
# failed on one client, 3-6 of 20-30 through the gateway (502); with "Connection: close" 20 of 20
# passed. Plain answers keep their connections (20 of 20 on one connection).
_STREAM_HEADERS = {"Connection": "close"}


def _headers(up: Upstream, trace: Trace) -> dict[str, str]:
    return {"Authorization": "Bearer " + up.key, "Content-Type": "application/json", "x-request-id": trace.request_id}


@dataclass(slots=True)
class Trace:
    """What one proxied request measured: filled in by :class:`UpstreamPool` and the relays.

    ``upstream_ns`` is time waiting on the replica (connect, answer, body); ``setup_ns`` the
    gateway's own time from the handler's start to the first byte (streams) or to the response
    being ready (non-streamed), minus the upstream wait inside it. ``dropped``: the
    ``x-llmgw-dropped`` header's value, "" when no field was dropped. ``request_id`` is sent to the
    replica as ``x-request-id``; ``headers`` are added to the client's response (rate-limit headers);
    ``tally`` counts a stream's tokens; ``first_byte_ns`` is when the answer's first byte went out
    (``perf_counter_ns``), 0 before; ``error_code`` is the code of the error event that ended a
    stream after its 200 (a refusal, a broken replica), "" otherwise; ``path`` is the endpoint's path
    on the engine.
    """

    started_ns: int
    replica: str = ""
    upstream_ns: int = 0
    setup_ns: int = 0
    usage: dict[str, Any] | None = None
    dropped: str = ""
    request_id: str = ""
    headers: dict[str, str] | None = None
    tally: StreamTally | None = None
    first_byte_ns: int = 0
    error_code: str = ""
    path: str = "/v1/chat/completions"


class UpstreamPool:
    """One shared ``aiohttp.ClientSession`` (pooled keep-alive connections) and round-robin choice.

    Call :meth:`start` on app startup and :meth:`close` on cleanup. ``upstream_timeout_s``: see the
    module docstring.
    """

    def __init__(self, *, upstream_timeout_s: float) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._next: dict[str, int] = {}
        self.plain_timeout = aiohttp.ClientTimeout(total=upstream_timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        self.stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=upstream_timeout_s
        )
        self.upstream_timeout_s = upstream_timeout_s

    async def start(self) -> None:
        """Open the shared session (inside the running loop)."""
        connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=KEEPALIVE_S)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self.plain_timeout)

    async def close(self) -> None:
        """Close the session and its pooled connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(
        self, route: Route, body: bytes, trace: Trace, *, stream: bool
    ) -> tuple[Upstream, aiohttp.ClientResponse]:
        """POST ``body`` to the route's next replica; return it and its response once the headers arrived.

        Sets ``trace.replica`` and adds the wait to ``trace.upstream_ns``. The caller must release
        (or close) the response.

        Raises:
            HttpError: 502 ``upstream_unreachable`` when no replica tried accepted the connection;
                504 ``upstream_timeout`` / 502 ``upstream_failed`` when the chosen one did not answer.
        """
        assert self._session is not None, "UpstreamPool.start() was not awaited"  # noqa: S101
        ups = route.upstreams
        n = len(ups)
        first = self._next.get(route.model, 0)
        self._next[route.model] = first + 1
        timeout = self.stream_timeout if stream else self.plain_timeout
        t0 = time.perf_counter_ns()
        try:
            for attempt in range(min(2, n)):
                up = ups[(first + attempt) % n]
                trace.replica = up.replica_id
                try:
                    resp = await self._session.post(
                        _url(up.endpoint, trace.path),
                        data=body,
                        headers=_STREAM_HEADERS | _headers(up, trace) if stream else _headers(up, trace),
                        timeout=timeout,
                    )
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                    log.warning(
                        "replica %s of %s at %s: cannot connect: %s",
                        up.replica_id,
                        route.model,
                        up.endpoint,
                        e,
                    )
                except TimeoutError as e:
                    raise self.timeout_error(route) from e
                except aiohttp.ClientError as e:
                    log.warning(
                        "replica %s of %s at %s failed: %r", up.replica_id, route.model, up.endpoint, e
                    )
                    raise self.broken_error(route) from e
                else:
                    return up, resp
        finally:
            trace.upstream_ns += time.perf_counter_ns() - t0
        raise HttpError(
            502,
            "upstream_unreachable",
            f"no replica of model '{route.model}' accepts connections right now; retry shortly",
        )

    def timeout_error(self, route: Route) -> HttpError:
        """504 ``upstream_timeout``: the replica took longer than ``upstream_timeout_s``."""
        return HttpError(
            504, "upstream_timeout", f"model '{route.model}' did not answer within {self.upstream_timeout_s:g} s"
        )

    @staticmethod
    def broken_error(route: Route) -> HttpError:
        """502 ``upstream_failed``: the replica's connection broke after the request went out."""
        return HttpError(
            502,
            "upstream_failed",
            f"the replica of model '{route.model}' closed the connection before answering; retry",
        )


def _scrub(data: bytes, up: Upstream) -> bytes:
    """Remove the replica's address and key from an error body before a client sees it."""
    host = up.endpoint.rpartition(":")[0]
    for secret in (up.endpoint, up.key, host):
        if secret:
            data = data.replace(secret.encode(), b"<replica>")
    return data


#: Pieces of llama-server's 500 messages that are the request's fault, not the server's: its JSON
#: reader's type errors (``[json.exception.type_error.302] type must be string, but is number``, for a
#: field of the wrong type the gateway does not check) and media a text-only model cannot read.
_CLIENT_MISTAKES = ("[json.exception.", "image input is not supported", "audio input is not supported")


def _client_mistake(data: bytes) -> str:
    """The engine's message when a 500 body says the request was at fault (see :data:`_CLIENT_MISTAKES`),
    shortened and without llama-server's mmproj hint; "" for a real server error."""
    text = data.decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error")
        message = str(err.get("message", "")) if isinstance(err, dict) else text
    except (ValueError, AttributeError):
        message = text
    if not any(m in message for m in _CLIENT_MISTAKES):
        return ""
    if "input is not supported" in message:
        media = "images" if "image" in message else "audio"
        return f"it reads text only, not {media}: send 'text' content parts"
    return message.strip()[:300]


async def _replica_error(route: Route, up: Upstream, resp: aiohttp.ClientResponse) -> web.Response:
    """The response for a replica's 4xx/5xx: passed through (scrubbed), or a 502 when it is ours."""
    data = await resp.read()
    if resp.status in (401, 403):
        log.error("replica %s of %s rejected the gateway's key (%d)", up.replica_id, route.model, resp.status)
        return openai_error_json(
            502, "upstream_auth", f"the replica of model '{route.model}' refused the gateway; retry shortly"
        )
    data = _scrub(data, up)
    try:
        shaped = isinstance(json.loads(data).get("error"), dict)
    except (ValueError, AttributeError):
        shaped = False
    if resp.status == 500 and (mistake := _client_mistake(data)):
        log.info("replica %s of %s: a 500 for the client's request, sent as 400: %s", up.replica_id, route.model,
                 mistake)
        return openai_error_json(400, "invalid_request", f"model '{route.model}' cannot take this request: {mistake}")
    if shaped:
        return web.Response(body=data, status=resp.status, content_type="application/json")
    text = data.decode("utf-8", "replace").strip()[:300]
    return openai_error_json(
        resp.status, "upstream_error", f"model '{route.model}' answered {resp.status}: {text}"
    )


async def relay_plain(
    pool: UpstreamPool,
    route: Route,
    *,
    requested: str,
    body: bytes,
    request_json: dict[str, Any],
    trace: Trace,
    inspector: Inspector | None,
) -> web.Response:
    """Proxy a non-streamed request: the replica's answer with ``model`` set to ``requested``.

    Raises:
        HttpError: as :meth:`UpstreamPool.send`; 502 ``upstream_invalid`` when a 200 is not JSON.
    """
    up, resp = await pool.send(route, body, trace, stream=False)
    t0 = time.perf_counter_ns()
    try:
        if resp.status >= 400:
            return await _replica_error(route, up, resp)
        data = await resp.read()
    except TimeoutError as e:
        raise pool.timeout_error(route) from e
    except aiohttp.ClientError as e:
        raise pool.broken_error(route) from e
    finally:
        resp.release()
        trace.upstream_ns += time.perf_counter_ns() - t0
    try:
        answer = json.loads(data)
        answer["model"] = requested
    except (ValueError, TypeError) as e:
        raise HttpError(
            502, "upstream_invalid", f"the replica of model '{route.model}' sent an answer that is not JSON"
        ) from e
    usage = answer.get("usage")
    trace.usage = usage if isinstance(usage, dict) else None
    if inspector is not None:
        refusal = await inspector.answer(route, request_json, answer)
        if refusal is not None:
            return refusal_response(refusal)
    return web.Response(body=json.dumps(answer).encode(), status=resp.status, content_type="application/json")


async def relay_stream(
    request: web.Request,
    pool: UpstreamPool,
    route: Route,
    *,
    requested: str,
    body: bytes,
    request_json: dict[str, Any],
    trace: Trace,
    inspector: Inspector | None,
) -> web.StreamResponse:
    """Proxy a streamed request: ``text/event-stream``, each upstream network chunk written as it comes.

    Each chunk's complete lines go out with ``model`` set to ``requested`` (:class:`ModelRewriter`).

    Errors before the first byte raise :class:`HttpError` (as :meth:`UpstreamPool.send`) or return the
    replica's error; after it, a dead replica or a refusal ends the stream with an error event. A
    client that goes away closes the upstream connection, which makes llama-server stop generating.
    """
    up, resp = await pool.send(route, body, trace, stream=True)
    closed_cleanly = False
    try:
        if resp.status >= 400:
            return await _replica_error(route, up, resp)
        watcher = inspector.stream(route, request_json) if inspector is not None else None
        headers = {
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "x-llmgw-replica": trace.replica,
            "x-llmgw-overhead-ms": _ms(time.perf_counter_ns() - trace.started_ns - trace.upstream_ns),
        }
        if trace.dropped:
            headers["x-llmgw-dropped"] = trace.dropped
        if trace.headers:
            headers.update(trace.headers)
        if watcher is not None and (call := current_call.get()) is not None:
            headers.update(call.headers)
        out = web.StreamResponse(headers=headers)
        trace.setup_ns = time.perf_counter_ns() - trace.started_ns - trace.upstream_ns
        await out.prepare(request)
        t0 = trace.first_byte_ns = time.perf_counter_ns()
        try:
            refusal = await _pump(resp, out, watcher, ModelRewriter(requested), trace.tally)
            closed_cleanly = refusal is None
            if refusal is not None:
                trace.error_code = refusal.code
                await out.write(openai_error_event(refusal.status, refusal.code, refusal.message, extra=refusal.extra))
        except ConnectionResetError:  # the client went away; finally closes the upstream
            return out
        except (
            TimeoutError,
            aiohttp.ClientPayloadError,
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
        ) as e:
            err = pool.timeout_error(route) if isinstance(e, TimeoutError) else pool.broken_error(route)
            log.warning("stream of %s broke: %r", route.model, e)
            trace.error_code = err.code
            await out.write(openai_error_event(err.status, err.code, err.message))
        finally:
            trace.upstream_ns += time.perf_counter_ns() - t0
        await out.write_eof()
        return out
    finally:
        if closed_cleanly:
            resp.release()
        else:
            resp.close()


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
        return _MODEL_FIELD.sub(self._repl, chunk[:cut]) if cut else b""

    def tail(self) -> bytes:
        """What was held when the stream ended, rewritten."""
        rest, self._held = self._held, b""
        return _MODEL_FIELD.sub(self._repl, rest)


_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"(?:[^"\\]|\\.)*"')


async def _pump(
    resp: aiohttp.ClientResponse,
    out: web.StreamResponse,
    watcher: StreamInspector | None,
    rewriter: ModelRewriter,
    tally: StreamTally | None = None,
) -> Refusal | None:
    """Copy chunks (rewritten, counted by ``tally``) until the replica's end; a refusal stops it and
    is returned."""
    if watcher is None:
        async for chunk in resp.content.iter_any():
            data = rewriter.feed(chunk)
            if data and tally is not None:
                data = tally.feed(data)
            if data:
                await out.write(data)
        tail = rewriter.tail()
        if tail and tally is not None:
            tail = tally.feed(tail)
        if tail:
            await out.write(tail)
        return None
    async for chunk in resp.content.iter_any():
        data = rewriter.feed(chunk)
        if data and tally is not None:
            data = tally.feed(data)
        if not data:
            continue
        seen = await watcher.chunk(data)
        if isinstance(seen, Refusal):
            return seen
        if seen:
            await out.write(seen)
    last = rewriter.tail()
    if last and tally is not None:
        last = tally.feed(last)
    seen = await watcher.chunk(last) if last else b""
    if isinstance(seen, Refusal):
        return seen
    end = await watcher.end()
    if isinstance(end, Refusal):
        return end
    if seen + end:
        await out.write(seen + end)
    return None


class StreamTally:
    """Counts a relayed stream's tokens, for usage and limits, without parsing every event.

    Per line-aligned chunk it counts events (``data: {``: llama-server and vLLM send one token per
    content event) and looks for ``"usage"`` (a bytes search, ~0.1 µs per event); only the event that
    holds it is parsed. That event comes when the engine was asked for it
    (:func:`~llmgw.control.gateway.request.with_stream_usage`): it has ``"choices": []`` and the
    answer's ``usage``, and is removed from what the client gets when the client did not ask for it
    (``hide``). :meth:`usage` is the engine's ``usage`` when it came, else an estimate for a stream
    the client left early: completion tokens = content events relayed, prompt tokens = the
    messages' characters / 4 (OpenAI's rule of thumb for English text), marked ``"estimated": true``.
    """

    __slots__ = ("events", "hide", "prompt_chars", "seen")

    def __init__(self, *, hide: bool, prompt_chars: int) -> None:
        self.hide = hide
        self.prompt_chars = prompt_chars
        self.events = 0
        self.seen: dict[str, Any] | None = None

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
                    self.events -= 1
                    if self.hide and event.get("choices") == []:
                        drop_blank = True
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


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f}"
