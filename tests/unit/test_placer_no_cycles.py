"""A placer the leader drops is freed by reference count, not left for the cyclic collector.

The control plane makes full collections itself, rarely (:mod:`llmgw.control.gcpauses`), so garbage
that only the cyclic collector frees waits there: a placer whose usages called back into it was a
cycle through every node's ``Usage`` (33 placers' worth alive at 5,000 nodes while nodes were lost).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from llmgw.control.placement.checks import NodeInfo, Reservation
from llmgw.control.placement.placer import Placer
from llmgw.protocol import Inventory


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_a_dropped_placer_and_its_dry_run_leave_no_cyclic_garbage(no_automatic_gc: None) -> None:
    inv = Inventory(cores=4, memory_total_bytes=10**10, memory_available_bytes=10**10)
    nodes = [NodeInfo(f"n{i}", "ready", inv) for i in range(1_000)]
    placer = Placer(nodes, [Reservation("n1", "m", 1.0, 1, replica="r1")])
    dry = placer.without("m")
    placer.release([("n1", "r1")])
    placer.hold([Reservation("n2", "m", 1.0, 1, replica="r2")])
    assert placer.usage["n2"].cpu_cores == 1
    del placer, dry
    assert gc.collect() == 0  # 6,017 objects with the usages' callback into the placer
