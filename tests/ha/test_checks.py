"""The split-brain checks of :class:`tests.ha.load.LeaderWatch` on recorded samples (no processes:
the HA test's own checker must catch a second leader, so it is tested on a made-up history)."""

from __future__ import annotations

import pytest

from tests.ha.load import Claim, LeaderWatch, Writer


def watch(*rounds: list[tuple[float, str, int, str]]) -> LeaderWatch:
    w = LeaderWatch(cluster=None)  # type: ignore[arg-type]  # never sampled: the samples are given
    w.samples = [[Claim(t, me, term, leader) for t, me, term, leader in r] for r in rounds]
    return w

def test_one_leader_and_followers_is_no_split_brain() -> None:
    w = watch(
        [(0.0, "cp1", 3, "cp1"), (0.0, "cp2", 3, "cp1"), (0.0, "cp3", 3, "cp1")],
        [(0.5, "cp2", 4, "cp2"), (0.5, "cp3", 4, "cp2")],
    )
    assert w.double_claims() == []
    assert w.overlap_s() == 0.0

def test_two_leaders_in_one_term_are_found() -> None:
    w = watch([(1.0, "cp1", 5, "cp1"), (1.0, "cp2", 5, "cp2"), (1.0, "cp3", 5, "cp1")])
    (found,) = w.double_claims()
    assert sorted(c.me for c in found) == ["cp1", "cp2"]

def test_a_stale_leader_in_a_lower_term_counts_as_overlap_only() -> None:
    w = watch(
        [(0.0, "cp1", 5, "cp1"), (0.0, "cp2", 5, "cp1")],
        [(1.0, "cp1", 5, "cp1"), (1.0, "cp2", 6, "cp2")],
        [(3.5, "cp1", 5, "cp1"), (3.5, "cp2", 6, "cp2")],
        [(4.0, "cp1", 6, "cp2"), (4.0, "cp2", 6, "cp2")],
    )
    assert w.double_claims() == []
    assert w.overlap_s() == 2.5


def test_the_longest_write_gap_is_measured_from_the_fault() -> None:
    w = Writer(rotation=None)  # type: ignore[arg-type]  # never run: the acknowledgements are given
    w.acked = {"a": (9.0, 9.5), "b": (10.0, 10.2), "c": (10.1, 31.0), "d": (31.0, 31.1)}
    assert w.longest_gap_s(10.0, 40.0) == pytest.approx(20.8)  # 10.2 -> 31.0
    assert w.longest_gap_s(31.05, 40.0) == pytest.approx(0.05)
