"""Core allocation per node and pinning a real process (``sleep``) to its cores."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import psutil
import pytest

from llmgw.agent.node.pinning import CoreAllocator, format_cpus, pin_process, usable_cpus


def test_allocations_never_overlap_and_are_released() -> None:
    cores = CoreAllocator([0, 1, 2, 3])
    assert cores.allocate("a", 2) == [0, 1]
    assert cores.allocate("b", 1) == [2]
    assert cores.allocate("a", 2) == [0, 1]  # the same replica again (a port retry): same cores
    assert cores.allocate("c", 2) == []  # only core 3 is free: unpinned, never shared
    assert cores.free() == [3]
    cores.release("a")
    assert cores.allocate("c", 2) == [0, 1]
    assert cores.allocate("z", 0) == []
    assert cores.held() == {"b": [2], "c": [0, 1]}


def test_adopted_engines_claim_their_recorded_cores_first() -> None:
    cores = CoreAllocator([0, 1])
    assert cores.claim("old", [1]) == [1]
    assert cores.claim("other", [1, 5]) == []  # held by another, or not on this node
    assert cores.allocate("new", 1) == [0]


def test_format_cpus() -> None:
    assert format_cpus([5, 0, 1, 2]) == "0-2,5"
    assert format_cpus([]) == ""
    assert format_cpus([3]) == "3"


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "30"])
    yield proc
    proc.kill()
    proc.wait()


def test_pin_process_sets_every_threads_affinity(sleeper: subprocess.Popen[bytes]) -> None:
    first = usable_cpus()[0]
    assert pin_process(sleeper.pid, [first]) >= 1
    assert psutil.Process(sleeper.pid).cpu_affinity() == [first]


def test_pin_gone_process_raises() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(ProcessLookupError):
        pin_process(proc.pid, [0])
