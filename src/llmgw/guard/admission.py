"""Admission for judgments: each judge gets at most as many judgments at once as it has slots, the
rest wait in the gateway in order of arrival, and one that could not be judged within what is left
of its budget is refused at once (``busy``) instead of timing out after it.

Why in the gateway: llama-server queues what it cannot start, out of sight; under load every
judgment then waited there until the budget ran out (most guarded requests got 503 after 5 s
on 2 cores), and abandoned non-streamed judgments kept the slot busy for a while after.
Here the queue is visible, so the wait can be estimated and refused early.

The estimate, for a judgment arriving now: ``ahead`` = judgments in flight + waiting; with ``slots``
judgments at once (the sum of the judge's ready replicas' ``total_slots`` from ``GET /props``, 1
when a replica does not say), it starts after ``rounds = (ahead - slots) // slots + 1`` judgment
times when ``ahead >= slots`` (0 otherwise), and takes one more. A judgment time is the smoothed
mean plus two mean deviations of the recent ones (RFC 6298's estimator: gains 1/8 and 1/4; before
the first judgment :data:`PRIOR_S`). A judgment is refused when ``rounds × mean + mean + 2 × dev``
is more than the seconds left in its budget; one that finds a free slot is never refused (it gets
its chance; the budget still bounds it). The refusal carries ``retry_after_s``: how much sooner the
queue would have to drain, at least 1 s. Each time a judgment ends the estimate is redone for those
still waiting, and one that can no longer finish within its budget is refused then (a burst
admitted on a running time that proved too short), rather than timing out at the end of it.

Not guaranteed: that an admitted judgment finishes within its budget (a judge slower than its
recent average still times out at the budget, as before), nor fairness between policies (one queue
per judge, first come first served).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from llmgw.errors import JudgeError
from llmgw.words import counted

#: Seconds a judgment is assumed to take before the judge's first one is measured (a warm
#: judgment with a 270M model on 2 cores was measured at ~1 s).
PRIOR_S = 1.0
#: RFC 6298's gains for the smoothed mean and the mean deviation.
MEAN_GAIN = 1 / 8
DEV_GAIN = 1 / 4
#: Deviations added to the mean for the judgment's own time.
DEVIATIONS = 2


@dataclass
class JudgeTime:
    """Smoothed judgment time of one judge (seconds): ``mean``, ``dev`` (mean deviation), ``n`` samples."""

    mean: float | None = None
    dev: float = 0.0
    n: int = 0

    def add(self, seconds: float) -> None:
        """Fold one judgment's time in (RFC 6298 §2: the first sets mean = s, dev = s/2)."""
        if self.mean is None:
            self.mean, self.dev = seconds, seconds / 2
        else:
            self.dev += DEV_GAIN * (abs(self.mean - seconds) - self.dev)
            self.mean += MEAN_GAIN * (seconds - self.mean)
        self.n += 1

    def expected(self) -> float:
        """Seconds one judgment is expected to take, with margin: ``mean + 2 × dev`` (or :data:`PRIOR_S`)."""
        return PRIOR_S if self.mean is None else self.mean + DEVIATIONS * self.dev


class JudgeQueue:
    """One judge's judgments: ``slots`` at once, the rest waiting here in order of arrival.

    Use :meth:`admit` around each judgment and :meth:`record` with its time.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.slots = 1
        self.in_flight = 0
        #: Waiting judgments in order of arrival: (granted when set, loop time by which it must be done).
        self.waiters: deque[tuple[asyncio.Future[None], float]] = deque()
        self.time = JudgeTime()
        #: Judgments refused at once since start.
        self.refused = 0

    def resize(self, slots: int) -> None:
        """Set how many judgments may run at once (at least 1); waiters start if there is room."""
        self.slots = max(1, slots)
        self._wake()

    def estimate(self) -> tuple[float, float]:
        """``(wait_s, judgment_s)`` for a judgment arriving now: its wait for a slot, and its own time."""
        ahead = self.in_flight + len(self.waiters)
        mean = PRIOR_S if self.time.mean is None else self.time.mean
        rounds = 0 if ahead < self.slots else (ahead - self.slots) // self.slots + 1
        return rounds * mean, self.time.expected()

    def snapshot(self) -> dict[str, float | int | None]:
        """For ``guard judge status``: slots, in flight, waiting, refused, mean/deviation (ms)."""
        return {
            "slots": self.slots, "in_flight": self.in_flight, "waiting": len(self.waiters), "refused": self.refused,
            "mean_ms": None if self.time.mean is None else self.time.mean * 1000, "dev_ms": self.time.dev * 1000,
        }

    def record(self, seconds: float) -> None:
        """One judgment took ``seconds`` at the judge (queue wait not included); waiters that the
        new estimate says cannot finish within their budget are refused now (see :meth:`_prune`)."""
        self.time.add(seconds)
        self._prune()

    def _prune(self) -> None:
        """Refuse (``busy``) each waiter whose estimated finish, from its place in the queue and the
        current running time, is past its deadline: a burst admitted on an estimate that proved
        too low is refused as soon as that is known, not after its whole budget."""
        if not self.waiters:
            return
        now = asyncio.get_running_loop().time()
        mean = PRIOR_S if self.time.mean is None else self.time.mean
        own = self.time.expected()
        kept: deque[tuple[asyncio.Future[None], float]] = deque()
        for fut, deadline in self.waiters:
            if fut.done():
                continue
            ahead = self.in_flight + len(kept)
            rounds = 0 if ahead < self.slots else (ahead - self.slots) // self.slots + 1
            finish = now + rounds * mean + own
            if finish > deadline:
                self.refused += 1
                fut.set_exception(JudgeError(
                    f"judge {self.name} is busy: {counted(ahead, 'judgment')} ahead on "
                    f"{counted(self.slots, 'slot')} would take past the budget",
                    kind="busy", retry_after_s=max(1.0, math.ceil(finish - deadline)),
                ))
            else:
                kept.append((fut, deadline))
        self.waiters = kept

    @asynccontextmanager
    async def admit(self, left_s: float) -> AsyncIterator[None]:
        """Hold one of the judge's slots for the body; wait for one in order of arrival.

        Raises:
            JudgeError: ``busy`` at once (nothing waits) when the estimated wait plus the judgment
                would not fit in ``left_s`` seconds; its ``retry_after_s`` says in how long to retry.
        """
        if self.in_flight >= self.slots or self.waiters:
            wait, own = self.estimate()
            if wait + own > left_s:
                self.refused += 1
                ahead = self.in_flight + len(self.waiters)
                retry = max(1.0, math.ceil(wait + own - left_s))
                raise JudgeError(
                    f"judge {self.name} is busy: {counted(ahead, 'judgment')} ahead on "
                    f"{counted(self.slots, 'slot')}, about "
                    f"{wait:.1f} s to wait and {own:.1f} s to judge, over the {left_s:.1f} s left of the budget",
                    kind="busy", retry_after_s=retry,
                )
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            entry = (fut, loop.time() + left_s)
            self.waiters.append(entry)
            try:
                await fut
            except JudgeError:  # refused while waiting (_prune): it holds no slot
                raise
            except BaseException:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self.in_flight -= 1  # granted a slot just as it was cancelled: hand the slot on
                    self._wake()
                elif entry in self.waiters:
                    self.waiters.remove(entry)
                raise
        else:
            self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self._wake()

    def _wake(self) -> None:
        while self.waiters and self.in_flight < self.slots:
            fut, _ = self.waiters.popleft()
            if not fut.done():
                self.in_flight += 1
                fut.set_result(None)
