"""The gateway's load sources (:mod:`llmgw.control.gateway.load`): the counter around the relay and
the source combined from a balancer's per-replica loads and the queues (pure, no loop), and the
gateway's count of arrivals over real HTTP."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest

from llmgw.control.gateway.app import build_gateway_app
from llmgw.control.gateway.load import LoadCounter, ModelLoad, combined
from llmgw.routing import Route, StaticRouter, Upstream
from tests.helpers.gateway import ServerThread, fake_llama


def test_counter_counts_in_flight_and_refusals_once() -> None:
    c = LoadCounter()
    with c.holding("a"), c.holding("a"), c.holding("b"):
        c.missed("z")
        c.arrived("y")
        c.arrived("y")
        assert c() == {"a": ModelLoad(2), "b": ModelLoad(1), "y": ModelLoad(arrived=2), "z": ModelLoad(0, 1)}
        assert c() == {"a": ModelLoad(2), "b": ModelLoad(1)}  # a refusal, an arrival: reported once
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
    counter.arrived("a")
    counter.arrived("e")
    with counter.holding("a"):  # the counter's own in-flight is not added (the balancer's counts)
        got = combined(lambda: reps, lambda: queues, counter)()
    assert got == {
        "a": ModelLoad(in_flight=3, queued=4, replicas={"a-1": 2, "a-2": 1}, arrived=1),
        "e": ModelLoad(arrived=1),
        "c": ModelLoad(in_flight=0, queued=2),
        "d": ModelLoad(in_flight=0, queued=1),
    }


def test_the_gateway_counts_each_request_of_a_model_as_arrived() -> None:
    """Over real HTTP: a request answered by the replica is gone before any reading could see it in
    flight; the counter has it as arrived, once (the real gateway app and a llama-server stand-in)."""
    servers = ServerThread()
    try:
        port = servers.serve(fake_llama("r-1", "key-1"))
        counter = LoadCounter()
        route = Route("m", (Upstream("r-1", f"127.0.0.1:{port}", "key-1"),))
        app = build_gateway_app(StaticRouter(routes={"m": route}), keys={"sk-load"}, allow_loopback_without_key=False,
                                load=counter)
        gw = servers.serve(app)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(2):
            r = httpx.post(f"http://127.0.0.1:{gw}/v1/chat/completions", json=body,
                           headers={"Authorization": "Bearer sk-load"})
            assert r.status_code == 200, r.text
        assert counter() == {"m": ModelLoad(arrived=2)}
        assert counter() == {}
    finally:
        servers.close()
