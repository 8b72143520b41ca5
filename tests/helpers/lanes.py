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

#: Each file of the ``timed`` and ``ha`` tests in CI: (wall seconds, CPU seconds), setup and teardown
#: included (``LLMGW_TEST_CPU``'s columns, tests/helpers/cputime.py: a cgroup per test, so a file's
#: CPU counts every process it started; 3 lanes, this machine otherwise idle: the dates below). A file
#: not named counts :data:`UNKNOWN`; a stale figure only unbalances the lanes.
FILE_S = {
    # The lanes part of scripts/test at 15:56 on 2026-12-06 (LLMGW_TEST_CPU; 136 s in all, the machine
    # slow then: bench/beat_store.py's read 865 µs).
    "tests/ha/test_failover.py": (100, 70),
    "tests/e2e/test_routing_e2e.py": (60, 44),
    "tests/ha/test_orphan.py": (50, 38),
    "tests/ha/test_frozen_lock.py": (41, 15),
    "tests/unit/test_autoscale_cluster.py": (37, 5.5),
    "tests/e2e/test_service_restart.py": (23, 17),
    "tests/unit/test_election.py": (14, 0.5),
    "tests/e2e/test_replicas_routing.py": (11, 10),
    "tests/e2e/test_adoption.py": (11, 5.4),
    "tests/ha/test_keys_cutoff.py": (6.3, 0.5),  # it waits on a cut-off's timers
    "tests/unit/test_key_set.py": (4.7, 2.2),
    "tests/unit/test_gateway_reload.py": (3.8, 0.2),
    "tests/unit/test_gateway_routing.py": (3.2, 0.1),
    "tests/e2e/test_processes.py": (3.1, 2.5),
    "tests/unit/test_judge_admission.py": (1.2, 0),
    "tests/unit/test_fair_queue.py": (0.2, 0),
    "tests/ha/test_checks.py": (0.1, 0),  # the checks' own logic, no cluster
}
UNKNOWN = (5, 5)
#: A file whose CPU is at least this share of its wall time keeps a core busy (the HA clusters under
#: load, three llama-servers generating): :func:`deal` runs no more of these at once than
#: :data:`HEAVY_LANES`. The others mostly wait on timers (a lease running out, a time-out). At 0.75
#: (tests/e2e/test_service_restart.py, 0.72, then ran beside two busy files) the lanes took 188 and
#: 212 s against 174-186 s: test_routing_e2e's bursts slowed by more than the split gained.
HEAVY = 0.5
#: How many heavy files may run at once: the cores of the machine CI runs on (2). With 3 lanes dealt
#: by wall time alone, the three heavy HA and routing files ran together at load 8-12, where the
#: timed bounds have no measured margin (2026-12-04).
HEAVY_LANES = 2
#: Tests that assert a wall-clock bound (a takeover within the lease, a key refused within a second, a
#: queue's order under a burst) which the parallel part's load on a 2-core machine can break (each
#: failed so in a 4-worker run at load 11-20). They get the ``timed`` marker (tests/conftest.py) and,
#: with the ``ha`` tests, run after the parallel part in three lanes (``scripts/test``): at most two
#: that keep a core busy at once (:func:`deal`), on a machine otherwise idle (load ~2-3, where they
#: were written to hold). A node id prefix: a file, or a file and a test.
TIMED = (
    "tests/e2e/test_adoption.py",
    "tests/e2e/test_processes.py",
    "tests/e2e/test_replicas_routing.py",
    "tests/e2e/test_routing_e2e.py",
    "tests/e2e/test_service_restart.py",
    "tests/unit/test_autoscale_cluster.py",
    "tests/unit/test_election.py",
    "tests/unit/test_gateway_reload.py",
    "tests/unit/test_fair_queue.py::test_one_key_with_500_waiting_does_not_delay_another_keys_request",
    "tests/unit/test_gateway_routing.py::test_requests_beyond_the_slots_wait_and_all_are_served",
    "tests/unit/test_judge_admission.py::test_without_a_queue_a_free_slot_is_never_refused",
    "tests/unit/test_key_set.py::test_ctl_key_set_changes_limits_on_the_gateway_within_a_second",
)


#: Where the ``ha`` tests live (``pytestmark = pytest.mark.ha``): tests/conftest.py refuses one elsewhere.
HA_DIR = "tests/ha/"
#: Set (to the lane count) by ``scripts/test`` for its second part: then :class:`LaneScheduling`
#: schedules the run.
ENV = "LLMGW_TIMED_LANES"


#: A file using fewer CPU seconds than this in all is never heavy, whatever its share: test_key_set's
#: 2 CPU-s in 3 s went onto a busy lane's end, after test_failover (149 s), not onto the light lane
#: that ends first (119 s).
HEAVY_MIN_CPU_S = 5


def heavy(name: str) -> bool:
    """Whether test file ``name`` keeps a core busy while it runs (:data:`HEAVY`, :data:`HEAVY_MIN_CPU_S`)."""
    wall, cpu = FILE_S.get(name, UNKNOWN)
    return cpu >= HEAVY * wall and cpu >= HEAVY_MIN_CPU_S


def deal(files: list[str], lanes: int, heavy_lanes: int = HEAVY_LANES) -> dict[str, int]:
    """``files`` (test file paths) dealt to ``lanes`` lanes; file -> lane (0-based). Longest first by
    :data:`FILE_S`'s wall time, each to the lane whose files add up to the least so far
    (longest-processing-time-first: within 4/3 of the best split), except that the :func:`heavy`
    files go only to the first ``heavy_lanes`` lanes, so that no more than that many run at once:
    the lanes beyond carry the files that mostly wait. ValueError: lanes or heavy_lanes < 1."""
    if lanes < 1 or heavy_lanes < 1:
        raise ValueError(f"lanes and heavy_lanes must be at least 1, got {lanes} and {heavy_lanes}")
    ends = [0.0] * lanes
    dealt: dict[str, int] = {}
    for name in sorted(files, key=lambda f: (-FILE_S.get(f, UNKNOWN)[0], f)):
        allowed = range(min(lanes, heavy_lanes)) if heavy(name) else range(lanes)
        lane = min(allowed, key=lambda i: ends[i])
        dealt[name] = lane
        ends[lane] += FILE_S.get(name, UNKNOWN)[0]
    return dealt


def files() -> list[str]:
    """What ``scripts/test``'s second part collects: :data:`HA_DIR` and the files of :data:`TIMED`
    (every worker collects what it is given: the whole suite cost each ~5 CPU-s and a few seconds)."""
    return [HA_DIR.rstrip("/"), *sorted({_file(prefix) for prefix in TIMED})]


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


if __name__ == "__main__":
    print(" ".join(files()))
