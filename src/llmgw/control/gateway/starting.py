"""Requests held while a model starts from zero replicas (``scaling.min: 0``).

A request for a model that autoscales from zero and has no ready replica is not refused: the
gateway holds it (:meth:`Starting.hold`) until the routing table shows a ready replica, then it goes
on as any request (through the balancer and the model's fair queue, so the held requests reach the
new replica no faster than its slots take them). While held it counts as queued in the load the
gateway reports (:meth:`Starting.held`), which is what makes the leader scale 0 → 1 at once (a
model with load and no ready replica is in panic: :mod:`llmgw.control.reconcile.autoscale`).

Bounds, per model: at most :data:`MAX_HELD` requests held (one more is answered 503
``model_starting`` with ``Retry-After`` at once), each for at most :data:`HOLD_S` (then the same
503). A held stream is told every :data:`KEEPALIVE_S` that it is still waiting (the caller's
``keepalive``: an SSE comment line), so clients and proxies with idle timeouts do not give up.

A model that cannot start is not held for nothing: once the routing table has said for
:data:`UNPLACEABLE_S` that the model's wanted replica could not be placed (``Route.unplaceable``,
the placement explanation's summary), its held requests are answered 503 ``model_unavailable``
with that reason, as a model with ``min`` ≥ 1 that cannot be placed is at once (before, a held
request waited the whole :data:`HOLD_S` and was told to retry).

One poller per model (not one per request) reads the routing table every :data:`POLL_S` while
anything is held: 1,000 held requests cost one in-memory lookup every 0.1 s, and each held request
is a parked coroutine (a few KB), nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from llmgw.errors import HttpError
from llmgw.httperrors import openai_error_event
from llmgw.routing import Route
from llmgw.words import counted, plural

#: Requests held per model at most (the issue: a burst of 1,000 at zero replicas; the bound holds).
MAX_HELD = 1000
#: The longest a request is held (s): an engine start from cached weights is a few seconds (the
#: issue's ``cold_start_s`` <= 5 s); a download of the weights can take longer, and the client is
#: then told to retry.
HOLD_S = 60.0
#: Seconds between two looks at the routing table while something is held.
POLL_S = 0.1
#: Seconds between two keepalives of a held stream (proxies commonly drop a connection silent for 30-60 s).
KEEPALIVE_S = 5.0
#: What a refused request is told to wait before retrying (s).
RETRY_AFTER_S = 5
#: How long (s) the routing table must keep saying the model cannot be placed, while requests are
#: held, before they are refused: the leader tries a from-zero model's first replica about a second
#: after its first held request (measured 1.00 s, docs/operating.md) and rewrites the explanation
#: then, so an explanation left from an earlier attempt is replaced well within it.
UNPLACEABLE_S = 3.0
#: The error code of a request refused because its model cannot start (as the gateway's for a model
#: with no ready replica).
MODEL_UNAVAILABLE = "model_unavailable"

#: The error code of a request refused while its model starts.
MODEL_STARTING = "model_starting"


@dataclass
class _Model:
    held: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    poller: asyncio.Task[None] | None = None
    blocked: str = ""  # why the model cannot start (the poller saw it for UNPLACEABLE_S): "" while it may


class Starting:
    """The held requests of every model (module docstring).

    Args:
        resolve: the routing table's lookup by catalog name (in memory); a route with upstreams
            means a replica is ready.
        holds: whether a model's requests are held (one that scales from zero); others are not.
        max_held: :data:`MAX_HELD`.
        hold_s: :data:`HOLD_S`.
        poll_s: :data:`POLL_S`.
        keepalive_s: :data:`KEEPALIVE_S`.
        unplaceable_s: :data:`UNPLACEABLE_S`.
        on_hold: called when a model's first request is held (none were): the load reporter's
            kick, so the leader hears of it at once (:data:`~llmgw.control.gateway.load.LOAD_KICK`).
    """

    def __init__(
        self,
        resolve: Callable[[str], Route | None],
        *,
        holds: Callable[[str], bool] = lambda _: True,
        max_held: int = MAX_HELD,
        hold_s: float = HOLD_S,
        poll_s: float = POLL_S,
        keepalive_s: float = KEEPALIVE_S,
        unplaceable_s: float = UNPLACEABLE_S,
        on_hold: Callable[[], None] = lambda: None,
    ) -> None:
        self.resolve, self.holds, self.max_held, self.hold_s = resolve, holds, max_held, hold_s
        self.poll_s, self.keepalive_s, self.on_hold = poll_s, keepalive_s, on_hold
        self.unplaceable_s = unplaceable_s
        self._models: dict[str, _Model] = {}

    def held(self) -> dict[str, int]:
        """Requests held now, by model (those with any)."""
        return {m: s.held for m, s in self._models.items() if s.held}

    async def hold(
        self, route: Route, keepalive: Callable[[], Awaitable[None]] | None = None
    ) -> Route:
        """Wait until ``route``'s model has a ready replica; return its route as then.

        ``keepalive`` is awaited every :attr:`keepalive_s` while waiting (a stream's SSE comment).

        Raises:
            HttpError: 503 ``model_starting`` with ``Retry-After`` when :attr:`max_held` requests of
                the model are held already (at once), or when none became ready within :attr:`hold_s`;
                503 ``model_unavailable`` with ``Retry-After`` when the model cannot be placed (see
                the module docstring).
        """
        name = route.model
        st = self._models.setdefault(name, _Model())
        if st.held >= self.max_held:
            waits = plural(st.held, "waits", "wait")
            raise self._refusal(name, f"{counted(st.held, 'request')} already {waits} for it")
        st.held += 1
        if st.held == 1:
            self.on_hold()
        if st.poller is None or st.poller.done():
            st.ready, st.blocked = asyncio.Event(), ""
            st.poller = asyncio.create_task(self._poll(name, st), name=f"llmgw-starting-{name}")
        deadline = time.monotonic() + self.hold_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._refusal(name, f"no replica was ready within {self.hold_s:g} s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(st.ready.wait(), min(left, self.keepalive_s))
                if st.ready.is_set():
                    got = self.resolve(name)
                    if got is not None and got.upstreams:
                        return got
                    if st.blocked:
                        raise unavailable_error(name, f"it cannot start: {st.blocked}", retry=False)
                    st.ready = asyncio.Event()  # gone again before this waiter looked: wait on
                elif keepalive is not None and deadline - time.monotonic() > 0:
                    await keepalive()
        finally:
            st.held -= 1
            if not st.held and st.poller is not None:
                st.poller.cancel()
                st.poller = None

    async def _poll(self, name: str, st: _Model) -> None:
        since: float | None = None  # when the table began saying the model cannot be placed
        while st.held:
            got = self.resolve(name)
            if got is not None and got.upstreams:
                st.ready.set()
            elif got is not None and got.unplaceable:
                now = time.monotonic()
                since = now if since is None else since
                if now - since >= self.unplaceable_s:
                    st.blocked = got.unavailable or "it cannot be placed on any node now"
                    st.ready.set()
            else:  # placeable again (a node came, a replica was placed): no longer refused
                since, st.blocked = None, ""
            await asyncio.sleep(self.poll_s)

    @staticmethod
    def _refusal(name: str, why: str) -> HttpError:
        return HttpError(
            503, MODEL_STARTING,
            f"model '{name}' is starting (it had no replica running): {why}; retry in {RETRY_AFTER_S} s",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


def unavailable_error(model: str, reason: str, *, retry: bool) -> HttpError:
    """503 ``model_unavailable``: ``model 'M' is not available: REASON``, with ``Retry-After``
    (:data:`RETRY_AFTER_S`) only when ``retry``: a replica is coming (a start, a restart, a node's
    return), not when placement says no node can run the model (retrying would not change that)."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else None
    return HttpError(503, MODEL_UNAVAILABLE, f"model '{model}' is not available: {reason}", headers=headers)


#: What a held stream is sent every :data:`KEEPALIVE_S` (an SSE comment: clients ignore it).
KEEPALIVE_LINE = b": waiting for a replica\n\n"

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Answered(Exception):
    """A held stream was refused after its 200 went out: the refusal was written to it as an error
    event; ``response`` is that stream, ``code`` the refusal's code."""

    def __init__(self, response: web.StreamResponse, code: str) -> None:
        super().__init__(code)
        self.response, self.code = response, code


async def hold_request(
    starting: Starting, request: web.Request, route: Route, *, stream: bool
) -> tuple[Route, web.StreamResponse | None]:
    """Hold a request of ``route``'s model until a replica is ready (:meth:`Starting.hold`); return
    the route then and, for a stream held past :attr:`Starting.keepalive_s`, its response already
    prepared (200, ``text/event-stream``, keepalive comments written): the relay writes on it.

    Raises:
        HttpError: 503 ``model_starting`` (a plain request, or a stream not yet answered).
        Answered: the same refusal written to a stream already prepared.
    """
    pre: web.StreamResponse | None = None

    async def keepalive() -> None:
        nonlocal pre
        if pre is None:
            pre = web.StreamResponse(headers=_SSE_HEADERS)
            await pre.prepare(request)
        await pre.write(KEEPALIVE_LINE)

    try:
        return await starting.hold(route, keepalive if stream else None), pre
    except HttpError as e:
        if pre is None:
            raise
        await answer_on_stream(pre, e)
        raise Answered(pre, e.code) from e


async def answer_on_stream(out: web.StreamResponse, e: HttpError) -> None:
    """Write ``e`` as the stream's last event (``data: {"error": …}``, then ``data: [DONE]``) and end it."""
    await out.write(openai_error_event(e.status, e.code, e.message))
    await out.write_eof()
