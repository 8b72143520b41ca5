"""Usage and limit counts, written in batches off the request path, and the stored keys read back.

The gateway's hot path only touches memory: :meth:`Accounting.observe` (called once per request
with its :class:`~llmgw.control.gateway.inspect.Exchange`; 1.3 µs, timeit on this 2-core machine)
adds the request to this control plane's pending usage per (key, model, UTC day); the gateway itself
counts its tokens against the key's limits (:meth:`~llmgw.control.gateway.limits.Limiter.spend`).
:meth:`Accounting.run` wakes every ``SYNC_S`` and, in one store call on the store's thread pool
(:class:`~llmgw.control.store.offloop.OffLoop`):

1. writes what is pending in one transaction (:meth:`~llmgw.control.store.base.Store.record_accounting`:
   usage rows, this control plane's rate-window counts, each key's last use);
2. reads the other control planes' counts for this minute (:meth:`~llmgw.control.store.base.Store.rate_totals`),
   the tokens per key and day of this month (:meth:`~llmgw.control.store.base.Store.key_tokens_by_day`)
   and the keys (:meth:`~llmgw.control.store.base.Store.list_keys`), and hands them to the
   :class:`~llmgw.control.gateway.limits.Limiter` and :class:`~llmgw.control.gateway.callers.Callers`.

``SYNC_S`` = 0.5 s gives the issue's two bounds: a revoked key is refused on every control plane
within a second (on the one whose admin API revoked it, from the API's answer on:
:meth:`~llmgw.control.gateway.callers.Callers.put`), and a limit holds cluster-wide within about a
second of traffic. With the database down the writes are kept (and merged into the next try), limits
go on from what this control plane counts, the keys in memory stay in use for at most
``callers.KEYS_STALE_S`` (5 s) after their last successful read (then stored keys get 503 until a
read works again: a revocation made elsewhere is not missed for longer), and the failure is logged
once until it recovers. The keys are read in a call of their own before the write, so a write that
hangs does not hold them back. Rate windows older than ten minutes are deleted once a minute.

Usage counts ``requests``, ``prompt_tokens`` and ``completion_tokens`` (from the answer's ``usage``,
streams included), ``guard_blocks`` (the guard refused the prompt or the answer) and ``errors``
(a status >= 400 other than a guard block or a limit, or a stream that ended with an error event after
its 200; 499, the client leaving, is not an error).
Requests refused at the key check are not counted here (there is no key to count them for); the access
log and ``llmgw_gateway_refused_keys_total`` have them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field

from llmgw.control.gateway.callers import Callers
from llmgw.control.gateway.inspect import Exchange
from llmgw.control.gateway.limits import Limiter, day_of, period_start, window_of
from llmgw.control.store.base import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.control.store.rows import ApiKeyRow, RateDelta, UsageDelta

log = logging.getLogger(__name__)

#: Seconds between syncs: "a revoked key is refused within a second on every control plane".
SYNC_S = 0.5
#: Rate windows kept (s) before they are pruned.
KEEP_WINDOWS_S = 600
PRUNE_EVERY_S = 60.0

#: 429s that are not usage (counted by metrics): a key's limit, and a busy model refusing before any
#: replica was asked (a new user's flood made one key's usage read 1,063 requests and 1,046 errors
#: for 17 answered; the model's capacity, not the key's errors).
_LIMIT_CODES = frozenset({"rate_limit_exceeded", "insufficient_quota", "model_busy"})


@dataclass(frozen=True)
class _Read:
    keys: list[ApiKeyRow] | None
    others: dict[tuple[str, int], tuple[int, int]]
    day_tokens: dict[tuple[str, str], int]


@dataclass(eq=False, repr=False)
class Accounting:
    """This control plane's usage and limit counts, synced with the store (see the module docstring).

    Args:
        store: the store (its calls run on ``db``).
        db: the store's thread pool, with the store deadline.
        cp: this control plane's name (``cluster.name``): its rows in ``rate_windows``.
        callers: the key table to refresh from the store.
        limiter: the limiter to feed.
        sync_s: seconds between syncs.
        clock: wall-clock seconds (injected for tests).
    """

    store: Store
    db: OffLoop
    cp: str
    callers: Callers
    limiter: Limiter
    _: KW_ONLY
    sync_s: float = SYNC_S
    clock: Callable[[], float] = time.time
    syncs: int = field(default=0, init=False)
    _usage: dict[tuple[str, str, str], list[int]] = field(default_factory=dict, init=False)
    _last_used: dict[str, float] = field(default_factory=dict, init=False)
    _pruned: float = field(default=0.0, init=False)
    _failing: str = field(default="", init=False)

    # -- the request path ------------------------------------------------------------------------
    def observe(self, ex: Exchange) -> None:
        """Count one request (on the event loop; memory only)."""
        if not ex.key or ex.kind == "models":  # usage counts model calls; a listing is logged and metered only
            return
        now = self.clock()
        usage = ex.usage
        prompt = completion = 0
        if usage is not None:
            prompt = _int(usage.get("prompt_tokens"))
            completion = _int(usage.get("completion_tokens"))
        if ex.code in _LIMIT_CODES:  # refused by a limit or a busy model: counted by metrics, not as usage
            return
        counts = self._usage.get((ex.key, ex.model, day_of(now)))
        if counts is None:
            counts = self._usage[(ex.key, ex.model, day_of(now))] = [0, 0, 0, 0, 0]
        counts[0] += 1
        counts[1] += prompt
        counts[2] += completion
        if ex.blocked:
            counts[3] += 1
        elif (ex.status >= 400 and ex.status != 499) or (ex.stream and ex.status == 200 and ex.code):
            counts[4] += 1  # a stream that broke after its 200 too
        self._last_used[ex.key] = now

    # -- the loop ----------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Sync every ``sync_s`` until ``stop``; one last sync on the way out (what is pending is written)."""
        while not stop.is_set():
            await self.sync()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.sync_s)
        await self.sync()

    async def sync(self) -> bool:
        """One sync (see the module docstring); False when the store call failed (nothing is lost)."""
        usage, last_used = self._usage, self._last_used
        self._usage, self._last_used = {}, {}
        rates = self.limiter.take_deltas()
        now = self.clock()
        prune = now - self._pruned >= PRUNE_EVERY_S
        # The keys first, in a call of their own: a write that hangs (an orphaned primary waiting on
        # its standby) must not keep revocations out, nor make the keys stale (callers.KEYS_STALE_S).
        # Each read is handed over with the callers' write count from before it: one that an admin
        # write on this control plane overtook (Callers.put) is not used.
        keys_read = False
        since = self.callers.writes
        with contextlib.suppress(Exception):  # a failure is said below, by the write's
            self.callers.set_rows(await self.db.read(self.store.list_keys), since=since)
            keys_read = True
        since = self.callers.writes
        try:
            read = await self.db.run(self._write_read, usage, rates, last_used, now, prune, not keys_read)
        except Exception as e:  # any store failure: keep the counts, say it once
            self._give_back(usage, last_used)
            self.limiter.give_back(rates)
            if str(e) != self._failing:
                log.warning("usage and limits cannot be written to the store (%s); kept in memory, retrying", e)
                self._failing = str(e)
            return False
        if self._failing:
            log.info("usage and limits are written to the store again")
            self._failing = ""
        if prune:
            self._pruned = now
        if read.keys is not None:
            self.callers.set_rows(read.keys, since=since)
        self.limiter.set_others(read.others)
        self.limiter.set_budget_base(read.day_tokens)
        self.syncs += 1
        return True

    def _write_read(
        self,
        usage: Mapping[tuple[str, str, str], list[int]],
        rates: Sequence[tuple[str, int, int, int]],
        last_used: Mapping[str, float],
        now: float,
        prune: bool,
        read_keys: bool,
    ) -> _Read:
        """The store side of a sync (on the store's thread); the keys are read again only when
        ``read_keys`` (their own read before failed: a sync's keys are read once, ~1 ms of its ~4)."""
        if usage or rates or last_used:
            self.store.record_accounting(
                self.cp,
                [UsageDelta(k, m, d, *c) for (k, m, d), c in usage.items()],
                [RateDelta(k, w, r, t) for k, w, r, t in rates],
                last_used,
            )
        window = window_of(now)
        if prune:
            self.store.prune_rate_windows(before_window=window - KEEP_WINDOWS_S)
        return _Read(
            keys=self.store.list_keys() if read_keys else None,
            others=self.store.rate_totals(since_window=window, exclude_cp=self.cp),
            day_tokens=self.store.key_tokens_by_day(since_day=period_start("month", now)),
        )

    def _give_back(self, usage: dict[tuple[str, str, str], list[int]], last_used: dict[str, float]) -> None:
        for k, c in usage.items():
            mine = self._usage.setdefault(k, [0, 0, 0, 0, 0])
            for i, v in enumerate(c):
                mine[i] += v
        for name, t in last_used.items():
            self._last_used[name] = max(t, self._last_used.get(name, 0.0))


def _int(v: object) -> int:
    return v if isinstance(v, int) and v > 0 else 0
