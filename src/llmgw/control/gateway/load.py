"""The gateway's load per model, for autoscaling: requests in flight and queued, read once a second.

:class:`ModelLoad` is what one control plane's gateway carries for one model at one moment;
a :data:`LoadSource` is any callable that returns them by model name. The control plane writes what
its source returns to the store every second (:class:`LoadReporter`),
and the leader sums the fresh rows of every control plane.

:func:`combined` is the gateway's source: in flight per replica from its balancer, queued from its
fair queues and the requests it holds while a model starts from zero (:mod:`.starting`), and the
requests a :class:`LoadCounter` saw refused for want of a ready replica (a model that does not scale
from zero), and the requests it saw arrive since the last reading (scale to zero's "no request").
:class:`LoadCounter` can also count in flight per model around a relay (``holding``), for a gateway
without a balancer.

Counting costs a dict lookup and an integer add per request on the event loop; no lock (one loop).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.control.store.rows import READING, GatewayLoadRow

log = logging.getLogger(__name__)

#: Seconds between two writes of a control plane's load (the issue: at least every second).
REPORT_EVERY_S = 1.0


@dataclass(frozen=True)
class ModelLoad:
    """One gateway's load for one model now.

    Attributes:
        in_flight: requests sent (or about to be sent) to a replica and not yet answered.
        queued: requests waiting at the gateway for a free slot (0 without a queue).
        replicas: in flight per replica id, where the source knows it (``{}`` otherwise).
        arrived: requests of the model that arrived since the previous reading: a request shorter
            than the time between two readings is never seen in flight, and scale to zero counts
            "no request" from the last one (a model asked every 8 s for 0.1 s went to zero 30 s
            after it scaled up: a new user's finding).
    """

    in_flight: int = 0
    queued: int = 0
    replicas: Mapping[str, int] = field(default_factory=dict)
    arrived: int = 0


#: What the autoscaler's reporter reads once a second: ``{model name: ModelLoad}`` (models without
#: load may be left out). Must return at once, on the event loop.
LoadSource = Callable[[], Mapping[str, ModelLoad]]


class LoadCounter:
    """Requests in flight per model, counted by the gateway's request handler (module docstring).

    Example::

        >>> c = LoadCounter()
        >>> with c.holding("chat"):
        ...     c()["chat"].in_flight
        1
        >>> c()
        {}
    """

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}
        self._missed: dict[str, int] = {}
        self._arrived: dict[str, int] = {}

    def arrived(self, model: str) -> None:
        """Count a request of ``model`` (:attr:`ModelLoad.arrived`, reported once, at the next read)."""
        self._arrived[model] = self._arrived.get(model, 0) + 1

    @contextmanager
    def holding(self, model: str) -> Iterator[None]:
        """Count one request of ``model`` in flight for the ``with`` block (left on any exit)."""
        self._in_flight[model] = self._in_flight.get(model, 0) + 1
        try:
            yield
        finally:
            left = self._in_flight[model] - 1
            if left:
                self._in_flight[model] = left
            else:
                del self._in_flight[model]

    def missed(self, model: str) -> None:
        """Count a request of ``model`` refused because no replica was ready (503): it is reported as
        queued once, at the next read, so that a model at zero replicas (``scaling.min: 0``) is
        scaled up by its first request until the gateway can hold such requests."""
        self._missed[model] = self._missed.get(model, 0) + 1

    def __call__(self) -> dict[str, ModelLoad]:
        """The :data:`LoadSource`: every model with a request in flight, or refused for want of a
        ready replica since the last call (as ``queued``), or asked since the last call (``arrived``)."""
        missed, self._missed = self._missed, {}
        arrived, self._arrived = self._arrived, {}
        return {
            m: ModelLoad(in_flight=self._in_flight.get(m, 0), queued=missed.get(m, 0), arrived=arrived.get(m, 0))
            for m in sorted({*self._in_flight, *missed, *arrived})
        }


class ReplicaInFlight(Protocol):
    """What :func:`combined` reads of a replica: its model and its requests in flight (the
    balancer's per-replica load has both)."""

    @property
    def model(self) -> str: ...

    @property
    def in_flight(self) -> int: ...


def combined(
    replicas: Callable[[], Mapping[str, ReplicaInFlight]],
    queued: Callable[[], Mapping[str, int]],
    counter: LoadCounter | None = None,
) -> LoadSource:
    """A :data:`LoadSource` from a balancer and queues: in flight per replica (``replicas()``:
    replica id -> its load) summed per model, ``queued()`` (model -> requests waiting), plus the
    requests ``counter`` saw refused for want of a ready replica, as queued, and those it saw
    arrive (its own in-flight count is not used: the balancer's is per replica)."""

    def read() -> dict[str, ModelLoad]:
        per: dict[str, dict[str, int]] = {}
        for rid, r in replicas().items():
            if r.in_flight:
                per.setdefault(r.model, {})[rid] = r.in_flight
        waiting = dict(queued())
        extra = counter() if counter is not None else {}
        out = {}
        for m in sorted({*per, *(k for k, v in waiting.items() if v), *extra}):
            mine = per.get(m, {})
            more = extra.get(m, ModelLoad())
            out[m] = ModelLoad(in_flight=sum(mine.values()), queued=waiting.get(m, 0) + more.queued, replicas=mine,
                               arrived=more.arrived)
        return out

    return read


#: The gateway app's :data:`LoadSource` (``app[LOAD]``), set by
#: :func:`~llmgw.control.gateway.app.build_gateway_app`: :func:`combined` over its balancer, its
#: queues and its held requests, and its :class:`LoadCounter` of refusals.
LOAD: web.AppKey[LoadSource] = web.AppKey("llmgw_load")


#: Set by the gateway when a request is held for a model with no ready replica (the first of its
#: held requests): the reporter writes at once instead of at its next second, so a start from zero
#: is decided ~0.5-1 s sooner (the leader reads every 0.5 s).
LOAD_KICK = web.AppKey("llmgw-load-kick", asyncio.Event)


class LoadReporter:
    """Writes this control plane's gateway load to the store every :data:`REPORT_EVERY_S`
    (on every control plane), off the event loop, and at once when ``kick`` is set.

    Args:
        store: the (unfenced) store.
        db: the pool with a deadline that store calls run on.
        name: ``cluster.name``.
        source: the gateway's :data:`~llmgw.control.gateway.load.LoadSource`.
        clock: unix seconds.
        kick: :data:`LOAD_KICK` (None: every second only).
        every_s: :data:`REPORT_EVERY_S`.
    """

    def __init__(self, store: Store, db: OffLoop, name: str, source: LoadSource,
                 clock: Callable[[], float] = time.time, kick: asyncio.Event | None = None,
                 every_s: float = REPORT_EVERY_S) -> None:
        self.store, self.db, self.name, self.source, self.clock = store, db, name, source, clock
        self.every_s = every_s
        self.kick = kick if kick is not None else asyncio.Event()
        self._failed = False

    def rows(self, now: float) -> list[GatewayLoadRow]:
        """What :meth:`tick` writes: one row per model with load, and this control plane's
        :data:`~llmgw.control.store.rows.READING` row, which says the reading was made even when
        nothing is in flight (a drain takes "no row" for "nothing in flight" only from a control
        plane whose reading is that recent: :func:`llmgw.control.reconcile.drainer.drained`). On the
        loop: memory only."""
        return [
            *(GatewayLoadRow(self.name, model, ml.in_flight, ml.queued, now, dict(ml.replicas), ml.arrived)
              for model, ml in sorted(self.source().items())),
            GatewayLoadRow(self.name, READING, 0, 0, now),
        ]

    async def tick(self) -> None:
        """One write; a failure is logged once until a write succeeds again."""
        now = self.clock()
        try:
            await self.db.run(self.store.write_gateway_load, self.name, self.rows(now), now=now)
        except Exception as e:
            if not self._failed:
                log.warning("control plane %s: its gateway load cannot be written: %s", self.name, e)
            self._failed = True
            return
        self._failed = False

    async def run(self, stop: asyncio.Event) -> None:
        """:meth:`tick` every :attr:`every_s`, or as soon as :attr:`kick` is set, until
        ``stop`` is set."""
        while not stop.is_set():
            self.kick.clear()
            await self.tick()
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.kick.wait())]
            try:
                await asyncio.wait(waits, timeout=self.every_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
