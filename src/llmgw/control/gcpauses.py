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
takes full collections out of the allocator's hands and freezes what survives each:

- The interpreter starts a full collection once the objects promoted since the last one reach a
  quarter of what that one left (CPython 3.11 ``gc_collect_generations``). Once the survivors are
  frozen that quarter is of a small figure, so at 5,000 nodes full collections came every ~8 s
  (121 of 50 ms or more in a 17-minute bench/scale.py run, the longest 254 ms: the heartbeat p99).
- What a full collection walks is what was promoted since the last and is still alive, and at 5,000
  nodes that stops growing within two minutes: the leader's view of every node, each row read
  again within a minute (:data:`llmgw.control.reconcile.view.ROLL_S`; ~100,000 objects: a ``NodeRow``,
  ``NodeInfo``, ``Usage``, ``Inventory``... per node), and each idle keep-alive connection's last
  request (aiohttp's ``RequestHandler.start`` keeps it in its locals until the next, ~45 objects,
  so it lives a beat interval). Both are freed by reference count, not by the collector: counted
  with ``gc.get_objects(2)`` at 5,000 nodes, 170,000 unfrozen objects a minute after a full
  collection, which then took 130-185 ms of CPU. A full collection every minute or every 15 costs
  about the same pause; every 15 it is a fifteenth as often.
- So :meth:`install` raises the third threshold (:data:`NO_AUTOMATIC_FULL`) and :meth:`run` makes
  the full collection itself every :data:`FULL_EVERY_S`, freezing its survivors (``gc.freeze()``).
  Generations 0 and 1 are collected as before (a few thousand objects each), so garbage cycles
  that die young are reclaimed at once; one among objects that lived into generation 2 waits for
  the next full collection (300-1,500 such objects a minute at 5,000 nodes).
- What becomes cyclic garbage while frozen is not reclaimed until :meth:`run` unfreezes everything,
  every :data:`UNFREEZE_S`; that period's full collection walks (and frees) all of it: the longest
  pause, once an hour (~1,100,000 objects at 5,000 nodes, about a second here).
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

FULL_EVERY_S = 900.0
"""Seconds between the full collections :meth:`GcPauses.run` makes (each walks what was promoted
since the last and is still alive: at 5,000 nodes ~200,000-400,000 objects, 0.2-0.4 s here)."""

UNFREEZE_S = 3600.0
"""Every this many seconds everything frozen is unfrozen before the full collection, so that it
reclaims the cyclic garbage made among frozen objects meanwhile (one long pause per period)."""

NO_AUTOMATIC_FULL = 1_000_000_000
"""The third ``gc.set_threshold`` value while :class:`GcPauses` schedules full collections: the
number of generation-1 collections before the interpreter starts a full one, out of reach."""


_scheduling: list[GcPauses] = []
"""The installed :class:`GcPauses` with ``freeze``: while any is, the third threshold is raised."""
_saved_thresholds: list[int] = []
"""The interpreter's thresholds from before the first of :data:`_scheduling` was installed."""


class GcPauses:
    """Times every collection of the cyclic GC while installed (a ``gc.callbacks`` entry) and, with
    ``freeze``, schedules the full collections and freezes their survivors (see the module's docstring).

    ``longest_s`` and ``count`` are per generation (0, 1, 2): the longest pause in seconds and how
    many collections ran. :meth:`install`/:meth:`remove` add and take away the callback (and, with
    ``freeze``, the raised threshold); :meth:`run` makes a full collection every ``full_every_s``
    seconds, unfreezing everything first every ``unfreeze_s``, until its event is set.
    """

    def __init__(
        self,
        log_over_s: float = LOG_OVER_S,
        *,
        freeze: bool = False,
        full_every_s: float = FULL_EVERY_S,
        unfreeze_s: float = UNFREEZE_S,
    ) -> None:
        self.log_over_s = log_over_s
        self.freeze = freeze
        self.full_every_s = full_every_s
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
        """Start timing collections and, with ``freeze``, stop the interpreter's own full collections
        (idempotent). Several installed at once (control planes served side by side in one test
        process) share the raised threshold: the interpreter's own comes back when the last is removed."""
        if self not in gc.callbacks:
            gc.callbacks.append(self)
            if self.freeze:
                if not _scheduling:
                    _saved_thresholds[:] = gc.get_threshold()
                _scheduling.append(self)
                first, second, _ = gc.get_threshold()
                gc.set_threshold(first, second, NO_AUTOMATIC_FULL)

    def remove(self) -> None:
        """Stop timing collections; with ``freeze``, and when no other is installed, the interpreter's
        thresholds again and everything unfrozen (a control plane served inside another program, a
        test's, leaves its collections as they were)."""
        if self in gc.callbacks:
            gc.callbacks.remove(self)
            if self in _scheduling:
                _scheduling.remove(self)
                if not _scheduling:
                    gc.set_threshold(*_saved_thresholds)
                    gc.unfreeze()

    async def run(self, stop: asyncio.Event) -> None:
        """With ``freeze``: a full collection every ``full_every_s`` seconds (its survivors frozen), the
        first after ``unfreeze_s`` or more since the last unfreeze preceded by ``gc.unfreeze()``;
        until ``stop`` is set. Without ``freeze``: returns at once (the interpreter collects)."""
        if not self.freeze:
            return
        unfrozen = time.monotonic()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.full_every_s)
            if stop.is_set():
                break
            if time.monotonic() - unfrozen >= self.unfreeze_s:
                log.info("gc: unfreezing %d objects; this full collection walks them all", gc.get_freeze_count())
                gc.unfreeze()
                unfrozen = time.monotonic()
            gc.collect(2)
