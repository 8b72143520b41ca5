"""Draining the gateway on SIGTERM, so a restart does not cut a stream mid-sentence without a word.

:class:`Drain` is a middleware on the gateway app and its ``on_response_prepare`` hook. The
control plane's shutdown (:func:`llmgw.control.server.serve`) then:

1. stops accepting connections (every listener closes; a request arriving on a kept-alive
   connection gets 503 ``shutting_down`` with ``Connection: close``);
2. :meth:`Drain.drain` lets the requests in flight finish, up to ``gateway.drain_s`` (20 s by
   default: most chat answers end well within it on a GPU; a long CPU answer may not);
3. at the deadline, each one still running is cancelled: its upstream connection is closed
   (which stops the engine generating) and the client gets, on a stream, an error event
   ``{"error": {"code": "shutting_down", …}}`` followed by ``data: [DONE]`` (the stream ends
   well-formed: the official ``openai`` client raises an ``APIError`` with the message); on a
   plain request, a 503 ``shutting_down``.

The unit's ``TimeoutStopSec=60s`` leaves room for the deadline (at most 50 s) and the rest of the
shutdown; a supervisor's SIGKILL never comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from llmgw.httperrors import openai_error_event, openai_error_json

log = logging.getLogger(__name__)

CUT_GRACE_S = 3.0
"""Seconds the cancelled requests have to write their last event and end, after the deadline."""

SHUTTING_DOWN = "shutting_down"
"""The error code a request cut (or refused) by a shutdown carries."""

_SSE: web.RequestKey[web.StreamResponse] = web.RequestKey("llmgw_drain_sse", web.StreamResponse)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _cut_event(message: str) -> bytes:
    # The blank line first: an event the cut interrupted between its lines is ended, not joined.
    return b"\n" + openai_error_event(503, SHUTTING_DOWN, message)


class Drain:
    """Tracks the gateway's requests in flight; see the module docstring.

    Use: ``app.middlewares.append(drain.middleware)`` and
    ``app.on_response_prepare.append(drain.on_prepare)`` before the app starts, then
    ``await drain.drain(deadline_s)`` once its listener is closed.
    """

    def __init__(self) -> None:
        self.closing = False
        self._inflight: dict[asyncio.Task[object], web.Request] = {}
        self._cut: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        """Requests being handled now."""
        return len(self._inflight)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Remember a prepared event stream, so a cut can write its last event to it."""
        if response.content_type == "text/event-stream":
            request[_SSE] = response

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Refuse new requests while closing; track the others; end a cut one well-formed."""
        if self.closing:
            out = openai_error_json(503, SHUTTING_DOWN, "the gateway is shutting down; retry in a few seconds")
            out.force_close()
            return out
        task = asyncio.current_task()
        if task is None:  # pragma: no cover  (aiohttp runs each request in a task)
            return await handler(request)
        self._inflight[task] = request
        self._idle.clear()
        try:
            return await handler(request)
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            task.uncancel()
            return await self._end_cut(request)
        finally:
            self._inflight.pop(task, None)
            self._cut.discard(task)
            if not self._inflight:
                self._idle.set()

    async def _end_cut(self, request: web.Request) -> web.StreamResponse:
        message = "the gateway is restarting and this request ran past its drain deadline; ask again"
        stream: web.StreamResponse | None = request.get(_SSE)
        if stream is None or not stream.prepared:
            out = openai_error_json(503, SHUTTING_DOWN, message)
            out.force_close()
            return out
        with contextlib.suppress(ConnectionError, RuntimeError):
            await stream.write(_cut_event(message))
            await stream.write_eof()
        return stream

    async def drain(self, deadline_s: float) -> tuple[int, int]:
        """Refuse new requests, wait up to ``deadline_s`` for those in flight, then cut the rest.

        Returns ``(finished, cut)``: how many requests in flight at the start ended by themselves,
        and how many were cut at the deadline.
        """
        self.closing = True
        started = len(self._inflight)
        if started:
            log.info("draining %d request(s) in flight, for up to %gs", started, deadline_s)
        t0 = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), deadline_s)
        cut = list(self._inflight)
        for task in cut:
            self._cut.add(task)
            task.cancel()
        if cut:
            log.warning("cut %d request(s) still running after %gs: they end with %s", len(cut),
                        time.monotonic() - t0, SHUTTING_DOWN)
            await asyncio.wait(cut, timeout=CUT_GRACE_S)
        return started - len(cut), len(cut)
