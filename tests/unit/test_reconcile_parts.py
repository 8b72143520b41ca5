"""The reconciler's parts on their own: the crash backoff (reconcile/restarts.py), the silent-node
probe (reconcile/probe.py) and placement's view of store rows (placement/inputs.py).

The leader's use of them is tested end to end in test_node_lifecycle.py and test_placement*.py;
these pin each rule at its seam. The engine in the probe test is a real aiohttp ``/health`` on
loopback.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from llmgw.catalog import Model, Profile
from llmgw.control.placement.inputs import reservations
from llmgw.control.reconcile import probe, restarts
from llmgw.control.store import NodeRow, ReplicaRow, Store
from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ProvisionState, ReplicaState

GB = 1_000_000_000


def replica(**kw: Any) -> ReplicaRow:
    return replace(ReplicaRow(id="m-1", model="m", node="a", profile="cpu", key="k"), **kw)


def node(state: str = "ready", last_seen: float = 100.0) -> NodeRow:
    inv = Inventory(cores=4, memory_total_bytes=8 * GB, memory_available_bytes=8 * GB)
    return NodeRow("a", 1, state, False, {}, inv, [], [], first_seen=0.0, last_seen=last_seen)


def test_backoff_doubles_from_10_s_and_stops_at_300() -> None:
    assert [restarts.backoff_s(n) for n in (0, 1, 2, 3, 4, 5, 30)] == [10, 20, 40, 80, 160, 300, 300]


def test_a_failure_after_long_service_counts_as_a_first_crash() -> None:
    short = replica(state=ReplicaState.FAILED.value, restarts=4, ready_at=100.0, updated_at=150.0)
    long = replace(short, updated_at=100.0 + 600)
    assert restarts.crashes(short, reset_s=600) == 4
    assert restarts.crashes(long, reset_s=600) == 0
    # Still ready: its count stands until forgiven.
    assert restarts.crashes(replace(long, state=ReplicaState.READY.value), reset_s=600) == 4


def test_a_failed_replica_is_due_when_its_backoff_has_passed() -> None:
    r = replica(state=ReplicaState.FAILED.value, restarts=2, updated_at=1000.0)
    assert not restarts.due(r, 1039.9, reset_s=600)
    assert restarts.due(r, 1040.0, reset_s=600)
    assert not restarts.due(replace(r, state=ReplicaState.READY.value), 9999.0, reset_s=600)


def test_forgive_resets_only_replicas_ready_long_enough(store: Store) -> None:
    store.upsert_node_heartbeat(
        "a",
        Heartbeat(
            inventory=Inventory(cores=4, memory_total_bytes=8 * GB, memory_available_bytes=8 * GB),
            engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED)],
        ),
        0.0,
    )
    old = store.add_replica(replica(id="m-old", state=ReplicaState.READY.value, ready_at=0.0, restarts=3))
    new = store.add_replica(replica(id="m-new", state=ReplicaState.READY.value, ready_at=500.0, restarts=2))
    out = restarts.forgive(store, [old, new], now=600.0, reset_s=600)
    assert {r.id: r.restarts for r in out} == {"m-old": 0, "m-new": 2}
    assert {r.id: r.restarts for r in store.list_replicas()} == {"m-old": 0, "m-new": 2}


def test_silence_counts_from_the_leaders_first_pass_at_the_earliest() -> None:
    n = node(last_seen=100.0)
    assert not probe.silent(n, 130.0, lost_after_s=30, since=50.0)
    assert probe.silent(n, 130.1, lost_after_s=30, since=50.0)
    # A leader that started at 120 heard nothing before: the node has until 150.
    assert not probe.silent(n, 140.0, lost_after_s=30, since=120.0)
    assert probe.silent(n, 150.1, lost_after_s=30, since=120.0)
    # Before the leader's first pass nothing is silent yet; a lost node stays silent.
    assert not probe.silent(n, 1e9, lost_after_s=30, since=None)
    assert probe.silent(node(state="lost"), 100.0, lost_after_s=30, since=None)


@pytest.fixture
async def health() -> AsyncIterator[str]:
    """A stand-in engine answering ``GET /health`` 200 on loopback; yields its ``host:port``."""

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_answering_keeps_only_the_engines_that_answer(health: str) -> None:
    up = replica(id="m-up", endpoint=health)
    down = replica(id="m-down", endpoint="127.0.0.1:9")
    async with aiohttp.ClientSession() as session:

        async def check(endpoint: str, key: str) -> bool:
            return await probe.probe_engine(session, endpoint, key, timeout_s=2)

        assert await probe.answering(check, [up, down]) == {"m-up"}
        assert await probe.answering(check, []) == set()


def test_an_unknown_profile_reserves_nothing() -> None:
    model = Model(name="m", source="file:/m.gguf", profiles=[Profile(name="cpu", min_memory_gb=2, cpu_cores=1)])
    known, unknown = reservations([replica(), replica(id="m-2", profile="gone")], {"m": model})
    assert (known.memory_gb, known.cpu_cores, known.replica) == (2, 1, "m-1")
    assert (unknown.memory_gb, unknown.cpu_cores, unknown.replica) == (0.0, 0, "m-2")
