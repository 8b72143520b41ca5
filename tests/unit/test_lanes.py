"""How scripts/test deals the ``timed`` and ``ha`` files to its lanes (tests/helpers/lanes.py): pure
logic, the figures of :data:`tests.helpers.lanes.FILE_S`."""

from __future__ import annotations

import pytest

from tests.helpers.lanes import FILE_S, UNKNOWN_S, deal


def _ends(dealt: dict[str, int], lanes: int) -> list[int]:
    return [sum(FILE_S.get(f, UNKNOWN_S) for f, lane in dealt.items() if lane == i) for i in range(lanes)]


@pytest.mark.parametrize("lanes", [2, 3])
def test_the_lanes_end_within_the_last_file_dealt_of_each_other(lanes: int) -> None:
    """Longest-processing-time-first: a file goes to the lane that ends first, so no lane ends later
    than the others' earliest end plus one file; the ``lanes`` longest files each start a lane."""
    dealt = deal(sorted(FILE_S), lanes)
    ends = _ends(dealt, lanes)
    assert max(ends) - min(ends) <= max(FILE_S.values()), ends
    longest = sorted(FILE_S, key=FILE_S.__getitem__, reverse=True)[:lanes]
    assert len({dealt[f] for f in longest}) == lanes, dealt  # the longest files each start a lane


def test_every_file_gets_one_lane_and_unknown_files_count_their_default() -> None:
    files = [*sorted(FILE_S), "tests/unit/test_new_and_unmeasured.py"]
    dealt = deal(files, 3)
    assert sorted(dealt) == sorted(files)
    assert set(dealt.values()) == {0, 1, 2}
    assert deal(files, 3) == dealt  # the same split every run: files sorted, ties by name


def test_one_lane_takes_everything_and_none_is_refused() -> None:
    assert set(deal(sorted(FILE_S), 1).values()) == {0}
    with pytest.raises(ValueError, match="lanes must be at least 1, got 0"):
        deal(["tests/unit/test_x.py"], 0)
