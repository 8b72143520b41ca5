"""The gateway's queue: requests of one model wait here for a free slot, served in fair order.

Mechanism. The caller (the balancer) owns the slots; the queue only decides *who* gets the next
one. :meth:`FairQueue.acquire` is given ``take()``, which reserves a slot and returns what it
reserved (a replica), or None when the model has no free slot for this request.

1. Fast path: nobody waits and ``take()`` succeeds: its value is returned at once (one counter test
   and the call to ``take()``; no lock, no allocation: it runs on every request). Cost (timeit, this
   2-core machine): 0.69 µs per request with a trivial ``take()``, most of it the coroutine itself.
2. Otherwise the request is admitted to wait, or refused *at once* (below), and waits on a future.
3. :meth:`FairQueue.wake`, called by the balancer whenever a slot frees (a request ended) or the
   replicas changed, walks the waiters in fair order and calls the *head waiter's own* ``take()``
   while it succeeds, resolving that waiter's future with the value. It stops at the first None:
   a later waiter never jumps the head (``take()`` answers None only when no slot of the model
   fits that request, or when a free one is on a replica so slow that waiting for a faster one's
   finishes sooner: the balancer's shortest expected delay). A new arrival behind others also runs
   this walk, so a slot freed without a ``wake()`` is not left idle. An exception from a waiter's
   ``take()`` goes to that waiter's caller (it leaves the queue) and the walk goes on.

Fair order. Strict priority bands: a waiter of a higher ``priority`` (a key's 0–9) is always served
before any of a lower one (llm-d's flow control does the same); a lower band waits, bounded by
``wait_s``. Within a band, round-robin between keys (deficit round-robin with equal quanta of one
request), FIFO within a key. A key that starts waiting joins the end of the rotation. **Bound**: a
request of key K waits for at most one request of each other waiting key of its band (and for
every waiting request of higher bands, and K's own earlier ones) before it is served; so one key
with 500 waiting requests delays another key's single request by at most one freed slot, about
``service_s / slots``, at most one service time. Measured (``tests/unit/test_fair_queue.py``, 20 ms
service, 2 slots): a lone request arriving behind ~485 of a flooding key's waited 1.4-19.5 ms (7 runs,
this 2-core machine); in arrival order (FIFO) it would have waited 485 × 20 ms / 2 ≈ 4.9 s.

Bounds, per model: at most ``size`` waiting requests, and a request is admitted only when its
expected wait is within ``wait_s``. The expected wait counts the requests that fair order puts
ahead of it, ``ahead`` = the waiters of higher bands + K's own waiters + for each other key of its
band min(its waiters, K's waiters + 1), and is ``(ahead + 1) × service_s / slots``: all slots are
busy and one frees every ``service_s / slots`` seconds on average (``service_s``, the model's recent
median service time, and ``slots``, its slots now, come from the balancer's measurements; ``size``
and ``wait_s`` from the gateway's configuration: this module holds no numbers of its own). So a
flooding key is refused on its own backlog while another key's request is still admitted. A full
queue refuses the request that ranks last, not the newcomer: a request that finds ``size`` waiting
pushes out the newest waiter of the key holding the most places in the lowest band (429
``model_busy`` at once), when that band is below its own, or is its own and that key would still
hold more places than the newcomer's key (longest-queue drop, as fair-queueing routers drop from
the fattest flow); otherwise the newcomer is refused. Without it one key filling the queue locked
every other key out, priority 9 included (a new user's finding, 2026-12-05: 30 concurrent requests
of one key, ``size`` 8, and the other keys' first requests were refused at once).

Why refuse at once: a 429 ``model_busy`` with ``Retry-After`` tells the client now that it will not
be served within the bound, and when to come back (OpenAI's clients retry 429s after
``Retry-After``); waiting ``wait_s`` to say the same costs the client that time and holds a
connection. ``Retry-After`` is an estimate, whole seconds, at least 1: for a full queue, the time for
enough waiters to leave; for a long expected wait, the time for it to fall to ``wait_s``. A waiter
still waiting at ``wait_s`` (the estimate was wrong: slower answers, replicas lost) gets the same
429 then, its ``Retry-After`` its expected remaining wait.

A client that leaves (its task cancelled) leaves the queue when its task next runs, the next turn
of the event loop, before any slot could be handed to it: ``wake()`` skips a cancelled waiter
even in between. Slots never leak: ``take()`` is called only for a live waiter, and a waiter
cancelled after it was handed a value (the value was set, the task had not resumed) gives it to
``give_back`` (the balancer releases the slot, then the queue walks again), or without
``give_back`` hands it straight to the next waiter in fair order (dropped when none waits: pass
``give_back`` when slots are counted).

Not guaranteed: fairness across control planes (each holds its own queue per model); that
``Retry-After`` is met (it is an estimate from the measured service time).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from llmgw.errors import HttpError, WaitedOut
from llmgw.words import counted, plural

T = TypeVar("T")

#: Waiters :meth:`FairQueue.wake` offers a free slot to, in fair order, past those that defer.
SCAN = 16


@dataclass(frozen=True, slots=True)
class Defer:
    """What a waiter's ``take()`` returns to let a free slot go to a later waiter while it waits for
    one it prefers (the replica holding its conversation) until ``until`` (the queue's clock, s); the
    queue walks again then, and that ``take()`` should no longer defer."""

    until: float


@dataclass(slots=True, eq=False)
class _Waiter(Generic[T]):
    key: str
    priority: int
    take: Callable[[], T | Defer | None]
    future: asyncio.Future[T]
    service_s: float
    slots: int
    arrived: float
    timer: asyncio.TimerHandle | None = None
    queued: bool = True


@dataclass(slots=True)
class _Band(Generic[T]):
    """One priority's waiters: key → FIFO, in rotation order (the first key is served next)."""

    keys: OrderedDict[str, deque[_Waiter[T]]] = field(default_factory=OrderedDict)
    count: int = 0


class FairQueue(Generic[T]):
    """Requests of one model waiting for a slot, served in fair order (module docstring).

    Higher ``priority`` first; within a priority, round-robin between keys, FIFO within a key: a
    key's request waits for at most one request of each other waiting key of its priority. At most
    ``size`` requests wait; one whose expected wait, ``(ahead + 1) × service_s / slots``, exceeds
    ``wait_s`` is refused at once, and one still waiting after ``wait_s`` is refused then, both
    with 429 ``model_busy`` and ``Retry-After``.

    Args:
        model: the model's catalog name (in refusal messages).
        size: the most requests that may wait (≥ 0; 0 refuses every request that finds no slot).
        wait_s: the longest a request may wait, in seconds (> 0).
        clock: monotonic seconds, stamping arrivals (the wait named in a time-out's message).
        give_back: releases a value ``take()`` reserved, for a waiter cancelled after it was handed
            one; the queue then walks again. None: the value goes to the next waiter, or is dropped.

    Raises:
        ValueError: ``size`` below 0 or ``wait_s`` not above 0.

    Example::

        queue = FairQueue[Replica]("gemma", size=256, wait_s=30.0, give_back=balancer.release)
        replica = await queue.acquire(caller.name, caller.priority, balancer.take, service_s=2.0, slots=8)
        try: ...
        finally: balancer.release(replica); queue.wake()
    """

    def __init__(
        self,
        model: str,
        *,
        size: int,
        wait_s: float,
        clock: Callable[[], float] = time.monotonic,
        give_back: Callable[[T], None] | None = None,
    ) -> None:
        if size < 0:
            raise ValueError(f"FairQueue({model!r}): size {size} is below 0; give the most requests that may wait")
        if not wait_s > 0:
            raise ValueError(f"FairQueue({model!r}): wait_s {wait_s} is not above 0; give the longest wait in seconds")
        self.model, self.size, self.wait_s = model, size, wait_s
        self._clock = clock
        self._give_back = give_back
        self._bands: dict[int, _Band[T]] = {}
        self._order: list[int] = []  # priorities with waiters, highest first
        self._n = 0
        self._recheck: asyncio.TimerHandle | None = None  # the walk again when the first deferral ends
        self._recheck_at = math.inf

    def __len__(self) -> int:
        """Requests waiting now."""
        return self._n

    def queued(self) -> dict[str, int]:
        """Waiting requests by key name (keys with none left out)."""
        out: dict[str, int] = {}
        for band in self._bands.values():
            for key, waiters in band.keys.items():
                out[key] = out.get(key, 0) + len(waiters)
        return out

    async def acquire(
        self, key: str, priority: int, take: Callable[[], T | Defer | None], *, service_s: float, slots: int
    ) -> T:
        """Wait for a slot of the model in fair order and return what ``take()`` reserved.

        Args:
            key: the caller's key name (fairness is between these).
            priority: the key's priority; higher is served first (0–9 for stored keys).
            take: reserves a slot for this request and returns it (a replica), or None when none is
                free; called at once, and later from :meth:`wake` while this request heads the queue.
            service_s: the model's recent service time per request, seconds (> 0), for the estimate.
            slots: the model's slots now (a value below 1 counts as 1), for the estimate.

        Raises:
            HttpError: 429 ``model_busy`` with ``Retry-After``: at once when ``size`` requests
                already wait or the expected wait exceeds ``wait_s``; after ``wait_s`` of waiting.
            asyncio.CancelledError: the caller was cancelled; its place is freed, no slot kept.
        """
        if not self._n:
            got = take()
            if got is not None and not isinstance(got, Defer):
                return got
        slots = max(1, slots)
        own = len(self._keys(priority).get(key, ()))
        victim = None
        if self._n >= self.size:
            victim = self._victim(key, priority, own)
            if victim is None:
                # Room for one more once n - size + 1 waiters have left, one per service_s / slots.
                held = ("the gateway holds none waiting (queue.size 0)" if self.size == 0 else
                        f"{counted(self._n, 'request')} already {plural(self._n, 'waits', 'wait')}, the most "
                        "the gateway holds")  # "0 requests already wait, the most…" read oddly: a new user's finding
                self._refuse(held, (self._n - self.size + 1) * service_s / slots)
        ahead = self._ahead(key, priority, own)
        expected = (ahead + 1) * service_s / slots
        if expected > self.wait_s:
            self._refuse(f"{counted(ahead, 'request')} {plural(ahead, 'is', 'are')} ahead of this one for its "
                         f"{counted(slots, 'slot')}, about {expected:.1f} s "
                         f"of waiting, over the bound of {self.wait_s:g} s", expected - self.wait_s)
        if victim is not None:
            self._push_out(victim)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        waiter = _Waiter(key, priority, take, future, service_s, slots, self._clock())
        waiter.timer = loop.call_later(self.wait_s, self._expire, waiter)
        self._push(waiter)
        self._walk()
        try:
            return await future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def wake(self) -> None:
        """Hand free slots to waiters in fair order: call the head waiter's ``take()`` while it succeeds.

        Call it whenever a slot frees (a request ended, after releasing it) or the model's replicas
        changed. Costs one ``take()`` call when nobody can be served, nothing when nobody waits.
        """
        if self._n:
            self._walk()

    # -- internals ------------------------------------------------------------------------------

    def _victim(self, key: str, priority: int, own: int) -> _Waiter[T] | None:
        """When the queue is full: the waiter a new request of ``key`` at ``priority`` (holding ``own``
        waiters of its band) pushes out, or None (the new request is refused). The newest waiter of
        the key with the most waiters in the lowest band, when that band is below ``priority``, or is
        ``priority`` and that key would still hold more than ``key`` does with the new request."""
        if not self._order or self._order[-1] > priority:
            return None
        band = self._bands[self._order[-1]]
        fifo = max(band.keys.values(), key=len)
        if self._order[-1] == priority and len(fifo) <= own + 1:
            return None
        return fifo[-1]

    def _push_out(self, waiter: _Waiter[T]) -> None:
        """Refuse ``waiter`` (429 ``model_busy``) to make room for a request that ranks above it."""
        self._remove(waiter)
        if waiter.future.done():
            return
        mine = len(self._keys(waiter.priority).get(waiter.key, ())) + 1
        waiter.future.set_exception(self._busy(
            f"the queue is full and this key held {mine} of its {counted(self.size, 'place')}, so another key's "
            "request took this one's place", mine * waiter.service_s / waiter.slots, waited=True))

    def _keys(self, priority: int) -> OrderedDict[str, deque[_Waiter[T]]]:
        band = self._bands.get(priority)
        return band.keys if band is not None else OrderedDict()

    def _push(self, waiter: _Waiter[T]) -> None:
        band = self._bands.get(waiter.priority)
        if band is None:
            band = self._bands[waiter.priority] = _Band()
            self._order.append(waiter.priority)
            self._order.sort(reverse=True)
        fifo = band.keys.get(waiter.key)
        if fifo is None:
            fifo = band.keys[waiter.key] = deque()  # joins the end of the rotation
        fifo.append(waiter)
        band.count += 1
        self._n += 1

    def _remove(self, waiter: _Waiter[T]) -> None:
        """Take a waiter out of the queue (idempotent), dropping emptied keys and bands."""
        if not waiter.queued:
            return
        waiter.queued = False
        if waiter.timer is not None:
            waiter.timer.cancel()
        band = self._bands[waiter.priority]
        fifo = band.keys[waiter.key]
        if fifo[0] is waiter:
            fifo.popleft()
        else:
            fifo.remove(waiter)
        if not fifo:
            del band.keys[waiter.key]
        band.count -= 1
        self._n -= 1
        if not band.count:
            del self._bands[waiter.priority]
            self._order.remove(waiter.priority)

    def _head(self) -> _Waiter[T] | None:
        """The next waiter in fair order: the highest band's first key in rotation, its oldest request."""
        if not self._order:
            return None
        fifo = next(iter(self._bands[self._order[0]].keys.values()))
        return fifo[0]

    def _fair(self) -> Iterator[_Waiter[T]]:
        """The first :data:`SCAN` waiters in fair order (bands highest first; in a band, each key's
        first in rotation, then each key's second...). Stop iterating once the queue changed."""
        n = 0
        for p in self._order:
            fifos = list(self._bands[p].keys.values())
            depth = 0
            while row := [fifo[depth] for fifo in fifos if len(fifo) > depth]:
                for waiter in row:
                    yield waiter
                    n += 1
                    if n >= SCAN:
                        return
                depth += 1

    def _walk(self) -> None:
        while self._step():
            pass

    def _step(self) -> bool:
        """Offer the free slot to the waiters in fair order: the first whose ``take()`` does not
        :class:`Defer` decides (served, or None: nobody behind it is tried). True when one left."""
        until = math.inf
        for waiter in self._fair():
            if waiter.future.done():  # cancelled, its task not yet resumed: it leaves now
                self._remove(waiter)
                return True
            keys = self._bands[waiter.priority].keys
            try:
                got = waiter.take()
            except Exception as e:  # the error is that request's: it goes to its caller
                self._remove(waiter)
                waiter.future.set_exception(e)
                return True
            if isinstance(got, Defer):
                until = min(until, got.until)
                continue
            if got is None:
                break
            self._remove(waiter)
            if waiter.key in keys:
                keys.move_to_end(waiter.key)  # the key had its turn: to the end of the rotation
            waiter.future.set_result(got)
            return True
        if until < self._recheck_at:
            if self._recheck is not None:
                self._recheck.cancel()
            self._recheck_at = until
            self._recheck = asyncio.get_running_loop().call_later(max(0.0, until - self._clock()), self._rewalk)
        return False

    def _rewalk(self) -> None:
        self._recheck, self._recheck_at = None, math.inf
        self.wake()

    def _abandon(self, waiter: _Waiter[T]) -> None:
        """The waiter's task was cancelled: free its place, and re-offer a value it was handed."""
        self._remove(waiter)
        future = waiter.future
        if not future.done() or future.cancelled() or future.exception() is not None:
            return
        got = future.result()
        if self._give_back is not None:
            self._give_back(got)
            self.wake()
            return
        while (head := self._head()) is not None:
            self._remove(head)
            if not head.future.done():
                head.future.set_result(got)
                return

    def _expire(self, waiter: _Waiter[T]) -> None:
        if not waiter.queued or waiter.future.done():
            return
        keys = self._keys(waiter.priority)
        fifo = keys[waiter.key]
        ahead = self._ahead(waiter.key, waiter.priority, fifo.index(waiter))
        self._remove(waiter)
        waited = self._clock() - waiter.arrived
        # No slot came free for it; who is still ahead now (waiters that expired with it are gone:
        # "0 are still ahead" read as if it had been next all along) only when someone is.
        still = f" ({counted(ahead, 'request')} still ahead of it)" if ahead else ""
        waiter.future.set_exception(self._busy(
            f"this request waited {waited:.0f} s for a slot, the bound, and none came free for it{still}",
            (ahead + 1) * waiter.service_s / waiter.slots, waited=True))

    def _ahead(self, key: str, priority: int, own: int) -> int:
        """Requests fair order serves before the ``own + 1``-th of ``key`` at ``priority`` (docstring)."""
        ahead = own
        for p in self._order:
            if p > priority:
                ahead += self._bands[p].count
            elif p == priority:
                ahead += sum(min(len(fifo), own + 1) for other, fifo in self._bands[p].keys.items() if other != key)
        return ahead

    def _refuse(self, why: str, retry_s: float) -> None:
        raise self._busy(why, retry_s)

    def _busy(self, why: str, retry_s: float, *, waited: bool = False) -> HttpError:
        """429 ``model_busy`` saying ``why``, with ``Retry-After`` of ``retry_s`` (whole seconds, at
        least 1); a :class:`WaitedOut` when the request ``waited`` in the queue first."""
        retry = max(1, math.ceil(retry_s))
        return (WaitedOut if waited else HttpError)(
            429, "model_busy",
            f"model '{self.model}' is busy: {why}; retry after {retry} s, or ask the operator for more "
            "replicas of it",
            headers={"Retry-After": str(retry)},
        )
