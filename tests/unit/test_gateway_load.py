"""The gateway's load sources (:mod:`llmgw.control.gateway.load`): the counter around the relay and
the source combined from a balancer's per-replica loads and the queues (pure, no loop)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from llmgw.control.gateway.load import LoadCounter, ModelLoad, combined


def test_counter_counts_in_flight_and_refusals_once() -> None:
    c = LoadCounter()
    with c.holding("a"), c.holding("a"), c.holding("b"):
        c.missed("z")
        assert c() == {"a": ModelLoad(2), "b": ModelLoad(1), "z": ModelLoad(0, 1)}
        assert c() == {"a": ModelLoad(2), "b": ModelLoad(1)}  # a refusal is reported once
    with pytest.raises(RuntimeError), c.holding("a"):
        raise RuntimeError  # left on an exception too
    assert c() == {}


@dataclass(frozen=True)
class _Rep:
    model: str
    in_flight: int


def test_combined_sums_replicas_and_adds_queues_and_refusals() -> None:
    reps = {"a-1": _Rep("a", 2), "a-2": _Rep("a", 1), "a-3": _Rep("a", 0), "b-1": _Rep("b", 0)}
    queues = {"a": 4, "b": 0, "c": 2}
    counter = LoadCounter()
    counter.missed("d")
    with counter.holding("a"):  # the counter's own in-flight is not added (the balancer's counts)
        got = combined(lambda: reps, lambda: queues, counter)()
    assert got == {
        "a": ModelLoad(in_flight=3, queued=4, replicas={"a-1": 2, "a-2": 1}),
        "c": ModelLoad(in_flight=0, queued=2),
        "d": ModelLoad(in_flight=0, queued=1),
    }
