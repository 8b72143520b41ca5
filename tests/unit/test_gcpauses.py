"""The control plane's garbage-collection policy (:mod:`llmgw.control.gcpauses`), in this process: real
collections of real objects, timed on this thread's CPU clock (load on the machine does not skew it)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Iterator

import pytest

from llmgw.control.gcpauses import NO_AUTOMATIC_FULL, GcPauses


@pytest.fixture
def clean_gc() -> Iterator[None]:
    """Collections start from an unfrozen heap and end unfrozen (the test's own objects reclaimable)."""
    gc.collect()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.collect()


def _state(n: int) -> list[object]:
    """``n`` small long-lived structures (~6 tracked objects each), like a node's rows and connection."""
    return [[{"node": i, "gpus": [i]}, {"labels": {"a": "b"}}, (i, [i]), {i}] for i in range(n)]


def _full_collection_cpu_s() -> float:
    t = time.thread_time()
    gc.collect(2)
    return time.thread_time() - t


def test_survivors_of_a_full_collection_are_frozen_and_the_next_walks_only_what_is_new(clean_gc: None) -> None:
    pauses = GcPauses(freeze=True)
    # ~120,000 tracked objects: 20 times the new ones below (the process's own heap is walked too)
    state = _state(20_000)
    baseline = _full_collection_cpu_s()  # without the policy: every full collection walks the state
    pauses.install()
    try:
        gc.collect(2)
        frozen = gc.get_freeze_count()
        assert frozen >= 100_000
        new = _state(1_000)
        after = _full_collection_cpu_s()
    finally:
        pauses.remove()
    print(f"full collection: {baseline * 1000:.1f} ms of CPU over the state, {after * 1000:.1f} ms once it is frozen")
    assert after < baseline / 5
    assert pauses.count[2] == 2
    assert pauses.longest_s[2] > 0
    del state, new


def test_the_interpreter_makes_no_full_collection_of_its_own_and_run_makes_one_each_period(clean_gc: None) -> None:
    # The interpreter starts a full collection once the objects promoted since the last pass a
    # quarter of what it left (clean_gc just made one over this process's whole heap, which in a
    # test worker holds every module imported so far): keep enough, ~6 tracked objects a _state.
    # Two of n: half the heap, plus 120,000 objects for the 70,000 allocations (700 x 10) that may
    # pass before the interpreter next considers a full collection (+50,000 made 600,000: 1.3 of
    # the file's 2.6 CPU-s alone, 2026-12-06).
    assert gc.get_threshold()[2] < NO_AUTOMATIC_FULL, "an earlier test left the full collections off"
    n = len(gc.get_objects()) // 4 // 6 + 10_000
    timing = GcPauses()  # without the policy: the interpreter's own full collections, counted
    timing.install()
    try:
        state = [_state(n) for _ in range(2)]
    finally:
        timing.remove()
    assert timing.count[2] >= 1
    del state
    gc.collect()

    pauses = GcPauses(freeze=True, full_every_s=0.05, unfreeze_s=3600)
    before = gc.get_threshold()
    pauses.install()
    try:
        # the same objects kept: many generation-0 and -1 collections, no full one (the interpreter
        # considers one every before[2] generation-1 collections: it would have, twice at least)
        state = [_state(n) for _ in range(2)]
        assert pauses.count[1] > 2 * before[2]
        assert pauses.count[2] == 0

        async def periods() -> None:
            stop, twice = asyncio.Event(), asyncio.Event()
            gc.callbacks.append(lambda phase, info: twice.set() if pauses.count[2] >= 2 else None)
            task = asyncio.create_task(pauses.run(stop))
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(twice.wait(), 20)
            finally:
                gc.callbacks.pop()
                stop.set()
                await task

        asyncio.run(periods())
        assert pauses.count[2] >= 2  # one a period
        assert gc.get_freeze_count() >= 12 * n  # the state survived and is frozen
    finally:
        pauses.remove()
    assert gc.get_threshold() == before  # removed: the interpreter's thresholds again
    del state


def test_garbage_made_among_frozen_objects_is_reclaimed_once_unfrozen(clean_gc: None) -> None:
    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the cyclic GC frees it

    pauses = GcPauses(freeze=True, full_every_s=0.05, unfreeze_s=0.12)
    pauses.install()
    try:
        nodes = [Node() for _ in range(1_000)]
        gc.collect(2)  # frozen now
        del nodes
        assert gc.collect(2) == 0  # frozen garbage: not reclaimed yet
        collected: list[int] = []
        freed = asyncio.Event()  # set once the cycles are freed (an Event binds to the loop that first waits)

        def count(phase: str, info: dict[str, int]) -> None:
            if phase == "stop":
                collected.append(info["collected"])
                if sum(collected) >= 1_000:
                    freed.set()

        gc.callbacks.append(count)

        async def periods() -> None:
            stop = asyncio.Event()
            task = asyncio.create_task(pauses.run(stop))
            with contextlib.suppress(TimeoutError):  # until the period's unfreeze, not a fixed 0.4 s
                await asyncio.wait_for(freed.wait(), 20)
            stop.set()
            await task

        try:
            asyncio.run(periods())
        finally:
            gc.callbacks.pop()
        assert sum(collected) >= 1_000  # the period's unfreeze: its full collection freed the cycles
    finally:
        pauses.remove()


def test_a_long_collection_is_logged_with_its_generation(clean_gc: None, caplog: pytest.LogCaptureFixture) -> None:
    pauses = GcPauses(log_over_s=0.0)
    with caplog.at_level(logging.INFO, logger="llmgw.control.gcpauses"):
        pauses.install()
        try:
            gc.collect(1)
        finally:
            pauses.remove()
    assert "gc: a generation 1 collection paused the control plane" in caplog.text
    assert gc.get_freeze_count() == 0  # without freeze nothing is frozen


@pytest.mark.parametrize("order", ["first installed first removed", "last installed first removed"])
def test_two_installed_at_once_give_the_interpreter_its_thresholds_back(clean_gc: None, order: str) -> None:
    # Two control planes served side by side in one process (the HA tests): the second must not save
    # the first's raised threshold as "the interpreter's" and put it back when removed last (it did:
    # the next test in that worker had no full collections of the interpreter's own).
    before = gc.get_threshold()
    a, b = GcPauses(freeze=True), GcPauses(freeze=True)
    a.install()
    b.install()
    assert gc.get_threshold()[2] == NO_AUTOMATIC_FULL
    first, last = (a, b) if order.startswith("first") else (b, a)
    first.remove()
    assert gc.get_threshold()[2] == NO_AUTOMATIC_FULL  # the other still schedules them
    last.remove()
    assert gc.get_threshold() == before
