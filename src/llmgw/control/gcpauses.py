"""How long Python's cyclic garbage collector stops the control plane's event loop.

A collection runs on the thread that allocated past the threshold and holds the GIL throughout: no
heartbeat, no gateway request is served meanwhile. A full (generation 2) collection walks every
tracked object not frozen at startup (``gc.freeze()`` in :mod:`llmgw.control.server`), and a large
cluster's state (nodes, replicas, connections) is made after startup, so these pauses grow with the
cluster. :class:`GcPauses` times each collection; one at or over :data:`LOG_OVER_S` is logged with
its generation, so a slow heartbeat can be matched to a pause in the log.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

LOG_OVER_S = 0.05
"""A collection at least this long (s) is logged (INFO): half the heartbeat p99 the control plane
is held to at 5,000 nodes (docs/operating.md)."""


class GcPauses:
    """Times every collection of the cyclic GC while installed (a ``gc.callbacks`` entry).

    ``longest_s`` and ``count`` are per generation (0, 1, 2): the longest pause in seconds and how
    many collections ran; ``total_s`` all pauses together. Use as a context manager
    (``with GcPauses():``) or call :meth:`install`/:meth:`remove`.
    """

    def __init__(self, log_over_s: float = LOG_OVER_S) -> None:
        self.log_over_s = log_over_s
        self.longest_s = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self.total_s = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        gen = int(info.get("generation", 2))
        self.count[gen] += 1
        self.total_s += took
        self.longest_s[gen] = max(self.longest_s[gen], took)
        if took >= self.log_over_s:
            log.info("gc: a generation %d collection paused the control plane %.0f ms (%d objects collected)",
                     gen, took * 1000, info.get("collected", 0))

    def install(self) -> None:
        """Start timing collections (idempotent)."""
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def remove(self) -> None:
        """Stop timing collections."""
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def __enter__(self) -> GcPauses:
        self.install()
        return self

    def __exit__(self, *_: object) -> None:
        self.remove()
