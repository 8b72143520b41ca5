"""How long Python's cyclic garbage collector stops the control plane, and how it is kept short.

A collection runs on the thread that allocated past the threshold and holds the GIL throughout: no
heartbeat, no gateway request is served meanwhile. A full (generation 2) collection walks every
tracked object outside the permanent generation, and a large cluster's state (a held connection per
node: ~85 tracked objects each, counted at 2,000 nodes) is made after startup, so full collections
grow with the cluster: measured with bench/scale.py at 2,000 nodes, one every 10-15 s, 150-330 ms
each at load 4 and up to 1.6 s at load 13 (this machine: ~50 ms of CPU per 180,000 objects). They
were the heartbeat p99.

:class:`GcPauses` times every collection and logs one of :data:`LOG_OVER_S` or more (a slow
heartbeat can be matched to it in the log). With ``freeze`` (the control plane's setting) it also
moves what survived each full collection into the permanent generation (``gc.freeze()``), so the
next full collection walks only what was made since: long-lived state is walked once, not every
10 s. What becomes cyclic garbage while frozen is not reclaimed until :meth:`GcPauses.run`
unfreezes everything, every :data:`UNFREEZE_S`; the next full collection then walks (and frees)
all of it, one long pause per period. Measured at 2,000 nodes, collections found 25-650 cyclic
objects each (most objects die by reference count), so what waits for the period is small.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

LOG_OVER_S = 0.05
"""A collection at least this long (s) is logged (INFO): half the heartbeat p99 the control plane
is held to at 5,000 nodes (docs/operating.md)."""

UNFREEZE_S = 900.0
"""Every this many seconds everything frozen is unfrozen, so that the next full collection reclaims
the cyclic garbage made among frozen objects meanwhile (one long pause per period)."""


class GcPauses:
    """Times every collection of the cyclic GC while installed (a ``gc.callbacks`` entry) and, with
    ``freeze``, freezes the survivors of each full collection (see the module's docstring).

    ``longest_s`` and ``count`` are per generation (0, 1, 2): the longest pause in seconds and how
    many collections ran. :meth:`install`/:meth:`remove` add and
    take away the callback; :meth:`run` unfreezes every ``unfreeze_s`` until its event is set.
    """

    def __init__(self, log_over_s: float = LOG_OVER_S, *, freeze: bool = False, unfreeze_s: float = UNFREEZE_S) -> None:
        self.log_over_s = log_over_s
        self.freeze = freeze
        self.unfreeze_s = unfreeze_s
        self.longest_s = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._started = self._started_cpu = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started, self._started_cpu = time.perf_counter(), time.thread_time()
            return
        took = time.perf_counter() - self._started
        gen = int(info.get("generation", 2))
        self.count[gen] += 1
        self.longest_s[gen] = max(self.longest_s[gen], took)
        if took >= self.log_over_s:
            # The CPU time tells a long walk from a thread descheduled on a loaded machine.
            log.info("gc: a generation %d collection paused the control plane %.0f ms (%.1f ms of CPU; "
                     "%d objects collected)", gen, took * 1000, (time.thread_time() - self._started_cpu) * 1000,
                     info.get("collected", 0))
        if gen == 2 and self.freeze:
            # Every tracked object is in generation 2 now, and each has survived this collection.
            gc.freeze()

    def install(self) -> None:
        """Start timing collections (idempotent)."""
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def remove(self) -> None:
        """Stop timing collections; with ``freeze``, unfreeze everything (a control plane served inside
        another program, a test's, leaves its collections as they were)."""
        if self in gc.callbacks:
            gc.callbacks.remove(self)
            if self.freeze:
                gc.unfreeze()

    async def run(self, stop: asyncio.Event) -> None:
        """Every ``unfreeze_s`` seconds (with ``freeze``), ``gc.unfreeze()``, until ``stop`` is set."""
        if not self.freeze:
            return
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.unfreeze_s)
            if not stop.is_set():
                log.info("gc: unfreezing %d objects; the next full collection walks them all", gc.get_freeze_count())
                gc.unfreeze()
