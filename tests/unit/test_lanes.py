"""How scripts/test deals the ``timed`` and ``ha`` files to its lanes (tests/helpers/lanes.py): pure
logic, the figures of :data:`tests.helpers.lanes.FILE_S`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.lanes import FILE_S, TIMED, UNKNOWN, deal, files, heavy


def _ends(dealt: dict[str, int], lanes: int) -> list[int]:
    return [sum(FILE_S.get(f, UNKNOWN)[0] for f, lane in dealt.items() if lane == i) for i in range(lanes)]


def test_two_lanes_end_within_the_last_file_dealt_of_each_other() -> None:
    """Longest-processing-time-first: a file goes to the lane that ends first, so no lane ends later
    than the other's end plus one file; the two longest files each start a lane."""
    dealt = deal(sorted(FILE_S), 2)
    ends = _ends(dealt, 2)
    assert max(ends) - min(ends) <= max(wall for wall, _cpu in FILE_S.values()), ends
    longest = sorted(FILE_S, key=lambda f: FILE_S[f][0], reverse=True)[:2]
    assert {dealt[f] for f in longest} == {0, 1}, dealt


def test_no_more_than_two_files_that_keep_a_core_busy_share_a_moment() -> None:
    """Three lanes: the heavy files (the HA clusters under load, three engines generating) all on
    lanes 0 and 1, the third carrying only files that mostly wait; and the split is shorter than
    with two lanes."""
    dealt = deal(sorted(FILE_S), 3)
    busy = {f for f in FILE_S if heavy(f)}
    assert {"tests/ha/test_failover.py", "tests/e2e/test_routing_e2e.py", "tests/ha/test_orphan.py"} <= busy
    assert "tests/unit/test_key_set.py" not in busy  # 2 CPU-s in 3 s: busy for a moment, not a lane's worth
    assert {dealt[f] for f in busy} == {0, 1}, dealt
    assert 2 in dealt.values()
    assert not any(heavy(f) for f, lane in dealt.items() if lane == 2)
    assert max(_ends(dealt, 3)) < max(_ends(deal(sorted(FILE_S), 2), 2))


def test_every_file_gets_one_lane_and_unknown_files_count_their_default() -> None:
    files = [*sorted(FILE_S), "tests/unit/test_new_and_unmeasured.py"]
    dealt = deal(files, 3)
    assert sorted(dealt) == sorted(files)
    assert set(dealt.values()) == {0, 1, 2}
    assert deal(files, 3) == dealt  # the same split every run: files sorted, ties by name


def test_one_lane_takes_everything_and_none_is_refused() -> None:
    assert set(deal(sorted(FILE_S), 1).values()) == {0}
    with pytest.raises(ValueError, match="lanes and heavy_lanes must be at least 1, got 0 and 2"):
        deal(["tests/unit/test_x.py"], 0)


def test_the_second_part_collects_every_timed_file_and_the_ha_directory() -> None:
    """scripts/test's second part collects only :func:`files`: each must exist, and every file named
    in TIMED or FILE_S is among them (a renamed file would otherwise run in neither part)."""
    collected = files()
    assert collected[0] == "tests/ha"
    assert all(Path(f).exists() for f in collected), collected
    named = {p.split("::", 1)[0] for p in TIMED} | {f for f in FILE_S if not f.startswith("tests/ha/")}
    assert named <= set(collected), named - set(collected)
