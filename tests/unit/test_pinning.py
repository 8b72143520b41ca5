"""Core allocation per node and pinning a real process (``sleep``) to its cores."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import psutil
import pytest

from llmgw.agent.node.pinning import CoreAllocator, format_cpus, pin_process, shared_threads, usable_cpus
from llmgw.protocol import GroupRole, ReplicaSpec


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


def _spec(rid: str, cores: int = 0, **kw: object) -> ReplicaSpec:
    fields = {"id": rid, "model": rid, "version": "1", "profile": "cpu", "engine": "llamacpp",
              "source_url": "http://m/w.gguf", "file_name": "w.gguf", "key": "k", "cpu_cores": cores}
    return ReplicaSpec.model_validate(fields | kw)


def test_a_replica_reserving_no_cores_shares_what_the_others_leave() -> None:
    starter, judge = _spec("starter"), _spec("judge", 2)
    assert shared_threads(2, starter, [judge, starter]) == 1  # init on 2 cores: never below 1
    assert shared_threads(8, starter, [judge, starter]) == 6
    assert shared_threads(8, starter, [starter, _spec("other")]) == 4  # two share: half each
    assert shared_threads(8, starter, [starter, _spec("other"), _spec("third", 3)]) == 2
    assert shared_threads(4, starter, []) == 4  # alone (not yet in a desired list): the node
    assert shared_threads(8, judge, [judge, starter]) is None  # its own reservation rules
    assert shared_threads(8, _spec("gpu", gpu_indexes=[0]), [starter]) is None
    assert shared_threads(8, _spec("head", role=GroupRole.HEAD), [starter]) is None
