"""The leader and silent nodes, and the crash backoff.

- A replica of a node that stopped heartbeating stays (and stays routable) while its engine answers
  the control plane's health probe, over real HTTP (an aiohttp stand-in for the engine's
  ``/health``: the real llama-server case is tests/e2e/test_lost_agent.py); when the probe fails
  too, it is replaced.
- A replica ready for ``backoff_reset_s`` has its crash count reset; an operator's restart is not
  a crash.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.catalog import Model, Profile, Scaling
from llmgw.control.api.admin import build_admin_app
from llmgw.control.gateway.table import StoreRouter
from llmgw.control.reconcile.leader import Leader
from llmgw.control.reconcile.probe import probe_engine
from llmgw.control.reconcile.restarts import backoff_s
from llmgw.control.store import ReplicaRow, Store
from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ProvisionState, ReplicaState, ReplicaStatus

GB = 1_000_000_000
KEY_HEADER = "Authorization"


def beat() -> Heartbeat:
    inv = Inventory(cores=8, memory_total_bytes=8 * GB, memory_available_bytes=8 * GB)
    return Heartbeat(
        inventory=inv, engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED)], instance="i1"
    )


def chat_model(n: int = 1) -> Model:
    return Model(
        name="m",
        source="file:/m.gguf",
        profiles=[Profile(name="cpu", min_memory_gb=1, cpu_cores=1)],
        scaling=Scaling(min=n, max=n),
    )


def report(store: Store, node: str, r: ReplicaRow, state: ReplicaState, now: float, endpoint: str = "") -> ReplicaRow:
    store.apply_reports(node, [ReplicaStatus(id=r.id, state=state, endpoint=endpoint, err="boom")], now)
    got = store.get_replica(r.id)
    assert got is not None
    return got


@pytest.fixture
async def engine() -> AsyncIterator[tuple[web.AppRunner, str, list[str]]]:
    """A stand-in engine's ``/health`` on loopback; records the Authorization headers it got."""
    seen: list[str] = []

    async def health(request: web.Request) -> web.Response:
        seen.append(request.headers.get(KEY_HEADER, ""))
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield runner, f"127.0.0.1:{runner.addresses[0][1]}", seen
    await runner.cleanup()


async def test_silent_node_replica_stays_routable_while_its_engine_answers(
    store: Store, engine: tuple[web.AppRunner, str, list[str]]
) -> None:
    runner, endpoint, seen = engine
    store.upsert_node_heartbeat("a", beat(), 100.0)
    store.add_model(chat_model(), now=100.0)
    async with aiohttp.ClientSession() as session:
        leader = Leader(
            store, node_lost_after_s=30, probe=lambda ep, key: probe_engine(session, ep, key, timeout_s=2)
        )
        await leader.pass_once(100.0)
        (r,) = store.list_replicas()
        r = report(store, "a", r, ReplicaState.READY, 101.0, endpoint)
        router = StoreRouter(store, max_age_s=0)

        # The agent goes silent for longer than node_lost_after_s: the node is lost, but the engine
        # answers its probe (with the replica's key), so the replica stays, routable.
        res = await leader.pass_once(140.0)
        assert (res.lost, res.removed, res.kept) == (["a"], [], [r.id])
        assert seen == [f"Bearer {r.key}"]
        route = router.resolve("m")
        assert route is not None
        assert [u.endpoint for u in route.upstreams] == [endpoint]
        res = await leader.pass_once(142.0)
        assert (res.removed, res.created, res.kept) == ([], [], [r.id])

        # The agent reports again: the very same replica (id, key) is what it is told to run.
        store.upsert_node_heartbeat("a", beat(), 143.0)
        res = await leader.pass_once(143.0)
        assert (res.removed, res.kept) == ([], [])
        assert [(x.id, x.key, x.state) for x in store.list_replicas()] == [(r.id, r.key, "ready")]

        # Silent again, and now the engine is gone too: the replica is lost and replaced.
        await runner.cleanup()
        res = await leader.pass_once(180.0)
        assert res.lost == ["a"]
        assert res.removed == [r.id]
        assert res.kept == []
        route = router.resolve("m")
        assert route is not None
        assert route.upstreams == ()


async def test_probe_engine_is_false_for_a_port_where_nothing_listens() -> None:
    async with aiohttp.ClientSession() as session:
        assert await probe_engine(session, "127.0.0.1:9", "k", timeout_s=1) is False


def test_crash_count_resets_after_ready_for_a_while(store: Store) -> None:
    store.upsert_node_heartbeat("a", beat(), 100.0)
    store.add_model(chat_model(), now=100.0)
    leader = Leader(store, node_lost_after_s=10_000, backoff_reset_s=600)
    leader.reconcile_once(100.0)
    # Three crashes in a row: the backoff grows (10, 20, 40 s).
    now = 100.0
    for crashes in range(3):
        (r,) = store.list_replicas()
        assert r.restarts == crashes
        report(store, "a", r, ReplicaState.FAILED, now)
        now += backoff_s(crashes)
        assert leader.reconcile_once(now - 1).removed == []
        assert leader.reconcile_once(now).removed == [r.id]
    (r,) = store.list_replicas()
    assert r.restarts == 3
    r = report(store, "a", r, ReplicaState.READY, now, "127.0.0.1:1")
    leader.reconcile_once(now + 599)
    assert store.list_replicas()[0].restarts == 3
    leader.reconcile_once(now + 600)  # ready for 10 minutes: forgiven
    (r,) = store.list_replicas()
    assert r.restarts == 0
    # The next crash waits 10 s again, not 80.
    report(store, "a", r, ReplicaState.FAILED, now + 700)
    assert leader.reconcile_once(now + 710).removed == [r.id]
    assert store.list_replicas()[0].restarts == 1


def test_a_replica_that_failed_after_long_service_is_replaced_as_after_a_first_crash(store: Store) -> None:
    store.upsert_node_heartbeat("a", beat(), 100.0)
    store.add_model(chat_model(), now=100.0)
    leader = Leader(store, node_lost_after_s=10_000, backoff_reset_s=60)
    leader.reconcile_once(100.0)
    (r,) = store.list_replicas()
    store.update_replica(replace(r, restarts=5))  # a history of crashes, long ago
    r = report(store, "a", store.list_replicas()[0], ReplicaState.READY, 100.0, "127.0.0.1:1")
    # No pass ran while it served; it fails after 100 s of service (> backoff_reset_s = 60).
    report(store, "a", r, ReplicaState.FAILED, 200.0)
    assert leader.reconcile_once(210.0).removed == [r.id]  # 10 s, not 300
    assert store.list_replicas()[0].restarts == 1


@pytest.fixture
async def admin(store: Store) -> AsyncIterator[TestClient[Any, Any]]:
    app = build_admin_app(store, token="t", clock=lambda: 1000.0)
    async with TestClient(TestServer(app)) as c:
        yield c


async def test_an_operator_restart_is_not_a_crash(store: Store, admin: TestClient[Any, Any]) -> None:
    store.upsert_node_heartbeat("a", beat(), 990.0)
    store.add_model(chat_model(), now=990.0)
    leader = Leader(store, node_lost_after_s=10_000)
    leader.reconcile_once(990.0)
    (r,) = store.list_replicas()
    store.update_replica(replace(r, restarts=2))
    for _ in range(3):
        (r,) = store.list_replicas()
        resp = await admin.post(f"/api/v1/replicas/{r.id}/restart", headers={"Authorization": "Bearer t"})
        assert resp.status == 202, await resp.text()
        assert (await resp.json())["restarts"] == 2
    (r,) = store.list_replicas()
    assert r.restarts == 2
    report(store, "a", r, ReplicaState.FAILED, 1000.0)
    assert leader.reconcile_once(1000.0 + backoff_s(2) - 1).removed == []
    assert leader.reconcile_once(1000.0 + backoff_s(2)).removed == [r.id]


async def test_the_routing_refresh_tells_watchers_which_models_replicas_changed(store: Store) -> None:
    """``StoreRouter.refresh_in`` (the control plane's routing refresh) tells the gateway's queues
    the models whose routed replicas changed, and nothing when none did: a replica that turns ready
    is offered to the requests already waiting (test_gateway_routing's waiter test)."""
    store.upsert_node_heartbeat("a", beat(), 100.0)
    store.add_model(chat_model(2), now=100.0)
    router = StoreRouter(store)
    told: list[frozenset[str]] = []
    router.watch(told.append)

    async def run(fn: Callable[[], frozenset[str]]) -> frozenset[str]:
        return fn()

    await router.refresh_in(run)
    assert told == [frozenset({"m"})]  # the first table: every model is new
    await router.refresh_in(run)
    assert told == [frozenset({"m"})]  # nothing changed: nobody is woken
    one = store.add_replica(ReplicaRow("m-1", "m", "a", "cpu", "k1"))
    await router.refresh_in(run)
    assert len(told) == 1  # a pending replica is not routed: no change
    report(store, "a", one, ReplicaState.READY, 101.0, "127.0.0.1:1")
    await router.refresh_in(run)
    assert told[1:] == [frozenset({"m"})]
    route = router.resolve("m")
    assert route is not None
    assert [u.replica_id for u in route.upstreams] == ["m-1"]
