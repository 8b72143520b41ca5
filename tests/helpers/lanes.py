"""The lanes of ``scripts/test``'s second part: the ``timed`` and ``ha`` tests, whole files dealt to
as many lanes as it starts xdist workers, by each file's time in CI.

xdist's own ``--dist loadfile`` sends a worker its next file while the current one still has two
tests to go (its prefetch heuristic), so in CI the 2.5-minute tests/ha/test_failover.py (one test)
took tests/ha/test_orphan.py with it onto one lane while the other emptied the queue: 329 s for
~550 s of tests in 2 lanes. Dealt here instead, once, longest first, each file to the lane that ends
first (longest-processing-time-first: within 4/3 of the best split); a lane is one xdist work unit.
(``--dist loadgroup`` would do it by marks, but with pytest 9 xdist 3.8 cannot rename the test ids
it groups by: its groups are ignored.)
"""

from __future__ import annotations

import os

import pytest
from xdist.scheduler import LoadScopeScheduling

#: Seconds each file of the ``timed`` and ``ha`` tests takes in CI, setup and teardown included (the
#: lanes' part of ``.ci/run``'s ``--durations`` on 2026-12-04 18:33, and ``LLMGW_TEST_CPU``'s wall
#: column, tests/helpers/cputime.py, of a run at 18:23). A file not named counts :data:`UNKNOWN_S`; a
#: stale figure only unbalances the lanes (the figures before these, from test_routing_e2e at 145 s,
#: left one lane ~250 s and the other ~210 s).
FILE_S = {
    "tests/ha/test_failover.py": 132,
    "tests/e2e/test_routing_e2e.py": 95,
    "tests/ha/test_orphan.py": 64,
    "tests/ha/test_frozen_lock.py": 40,
    "tests/e2e/test_service_restart.py": 38,
    "tests/unit/test_autoscale_cluster.py": 34,
    "tests/unit/test_election.py": 15,
    "tests/e2e/test_replicas_routing.py": 11,
    "tests/unit/test_gateway_routing.py": 7,
    "tests/unit/test_gateway_reload.py": 7,
    "tests/e2e/test_adoption.py": 7,
    "tests/unit/test_judge_admission.py": 6,
    "tests/unit/test_key_set.py": 5,
    "tests/e2e/test_processes.py": 4,
    "tests/unit/test_fair_queue.py": 1,
}
UNKNOWN_S = 5
#: Set (to the lane count) by ``scripts/test`` for its second part: then :class:`LaneScheduling`
#: schedules the run.
ENV = "LLMGW_TIMED_LANES"


def deal(files: list[str], lanes: int) -> dict[str, int]:
    """``files`` (test file paths) dealt to ``lanes`` lanes, longest first by :data:`FILE_S`, each to
    the lane whose files add up to the least so far; file -> lane (0-based). ValueError: lanes < 1."""
    if lanes < 1:
        raise ValueError(f"lanes must be at least 1, got {lanes}")
    ends = [0.0] * lanes
    dealt: dict[str, int] = {}
    for name in sorted(files, key=lambda f: (-FILE_S.get(f, UNKNOWN_S), f)):
        lane = min(range(lanes), key=lambda i: ends[i])
        dealt[name] = lane
        ends[lane] += FILE_S.get(name, UNKNOWN_S)
    return dealt


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class LaneScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with one scope per lane (:func:`deal` over the collected files, one
    lane per worker), so that each worker gets its lane whole at the start and nothing else."""

    def __init__(self, config: pytest.Config, log: object = None) -> None:
        super().__init__(config, log)  # type: ignore[arg-type]  # xdist's Producer, or None
        self._lanes: dict[str, int] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._lanes is None:
            assert self.collection is not None  # schedule() sets it before it splits
            self._lanes = deal(sorted({_file(n) for n in self.collection}), max(1, len(self.nodes)))
        return f"lane{self._lanes[_file(nodeid)]}"


def make_scheduler(config: pytest.Config, log: object) -> LaneScheduling | None:
    """:class:`LaneScheduling` when ``scripts/test`` asked for lanes (:data:`ENV`), else None (xdist's own)."""
    return LaneScheduling(config, log) if os.environ.get(ENV) else None
