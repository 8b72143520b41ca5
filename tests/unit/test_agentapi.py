"""Agent API over real mTLS on 127.0.0.1: the CA gate, CN as node id, heartbeat -> desired replicas."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw import tlsconf
from llmgw.catalog import GuardModel, Model, Profile, Role
from llmgw.control.api.agent import build_agent_app
from llmgw.control.gateway.table import StoreRouter
from llmgw.control.reconcile.leader import Leader
from llmgw.control.store import ReplicaRow, Store
from llmgw.protocol import (
    EngineStatus,
    Heartbeat,
    HeartbeatReply,
    Inventory,
    ProvisionState,
    ReplicaState,
    ReplicaStatus,
)
from llmgw.views import ExplainView
from tests.helpers.waits import until

GB = 1_000_000_000


@dataclass
class Pki:
    ca: tlsconf.CA
    dir: Path

    def client(self, node: str, ca: tlsconf.CA | None = None) -> ssl.SSLContext:
        cert, key = (ca or self.ca).issue_client(node).write(self.dir, f"agent-{node}")
        return tlsconf.client_context(self.dir / "ca.pem", cert, key)


@dataclass
class Running:
    url: str
    store: Store
    pki: Pki
    beats: list[tuple[str, bool]]


@pytest.fixture
async def server(store: Store, tmp_path: Path) -> AsyncIterator[Running]:
    ca = tlsconf.CA.create()
    ca.write(tmp_path)
    cert, key = ca.issue_server(["127.0.0.1"]).write(tmp_path, "server")
    beats: list[tuple[str, bool]] = []
    app = build_agent_app(store, on_heartbeat=lambda n, c: beats.append((n, c)), clock=lambda: 1000.0)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(
        runner, "127.0.0.1", 0, ssl_context=tlsconf.server_context(tmp_path / "ca.pem", cert, key)
    )
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield Running(f"https://127.0.0.1:{port}", store, Pki(ca, tmp_path), beats)
    finally:
        await runner.cleanup()


def hb(*replicas: ReplicaStatus) -> Heartbeat:
    return Heartbeat(
        inventory=Inventory(cores=4, memory_total_bytes=8 * GB, memory_available_bytes=8 * GB),
        labels={"zone": "a"},
        engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")],
        replicas=list(replicas),
    )


async def post(
    url: str, ctx: ssl.SSLContext, body: Heartbeat, path: str = "/agent/v1/heartbeat"
) -> HeartbeatReply:
    async with aiohttp.ClientSession() as s, s.post(url + path, data=body.model_dump_json(), ssl=ctx) as r:
        assert r.status == 200, await r.text()
        return HeartbeatReply.model_validate_json(await r.read())


async def test_client_cert_from_another_ca_is_refused_at_handshake(server: Running) -> None:
    stranger = tlsconf.CA.create("someone else")
    ctx = server.pki.client("node-x", ca=stranger)
    with pytest.raises(aiohttp.ClientError):
        await post(server.url, ctx, hb())
    no_cert = tlsconf.client_context(server.pki.dir / "ca.pem")
    with pytest.raises(aiohttp.ClientError):
        await post(server.url, no_cert, hb())
    assert server.store.list_nodes() == []


async def test_cn_is_the_node_id_and_heartbeat_returns_desired_replicas(server: Running) -> None:
    ctx = server.pki.client("node-7")
    reply = await post(server.url, ctx, hb(), "/agent/v1/register")
    assert reply.node_id == "node-7"
    assert reply.desired == []
    (node,) = server.store.list_nodes()
    assert (node.id, node.state, node.labels) == ("node-7", "ready", {"zone": "a"})
    # on_heartbeat is called once the reply was sent (the agent never waits for the routing refresh).
    await until("on_heartbeat called", lambda: asyncio.sleep(0, server.beats == [("node-7", True)]))

    model = Model(
        name="chat",
        source="http://mirror:8081/chat/3/chat.gguf",
        version="3",
        sha256="ab" * 32,
        profiles=[Profile(name="cpu", cpu_cores=2, args=["--ctx-size", "4096"])],
    )
    server.store.add_model(model, now=1000.0)
    Leader(server.store, node_lost_after_s=30).reconcile_once(1000.0)

    reply = await post(server.url, ctx, hb())
    (spec,) = reply.desired
    (row,) = server.store.list_replicas()
    assert spec.id == row.id
    assert (spec.model, spec.version, spec.profile, spec.engine) == ("chat", "3", "cpu", "llamacpp")
    assert (spec.source_url, spec.sha256, spec.file_name) == (model.source, model.sha256, "chat.gguf")
    assert (spec.args, spec.cpu_cores, spec.key) == (["--ctx-size", "4096"], 2, row.key)

    # Another node's certificate gets nothing, and cannot report this node's replica.
    other = await post(
        server.url, server.pki.client("node-8"), hb(ReplicaStatus(id=row.id, state=ReplicaState.READY))
    )
    assert other.desired == []
    pending = server.store.get_replica(row.id)
    assert pending is not None
    assert pending.state == "pending"

    await post(
        server.url, ctx, hb(ReplicaStatus(id=row.id, state=ReplicaState.READY, endpoint="127.0.0.1:5001"))
    )
    ready = server.store.get_replica(row.id)
    assert ready is not None
    assert (ready.state, ready.endpoint, ready.ready_at) == ("ready", "127.0.0.1:5001", 1000.0)
    await until("on_heartbeat: changed", lambda: asyncio.sleep(0, server.beats[-1:] == [("node-7", True)]))

    router = StoreRouter(server.store)
    route = router.resolve("chat")
    assert route is not None
    assert [(u.endpoint, u.key) for u in route.upstreams] == [("127.0.0.1:5001", row.key)]


async def test_bad_body_is_400(server: Running) -> None:
    ctx = server.pki.client("node-7")
    async with (
        aiohttp.ClientSession() as s,
        s.post(server.url + "/agent/v1/heartbeat", data=b"{}", ssl=ctx) as r,
    ):
        assert r.status == 400
        body = await r.json()
    assert body["error"]["code"] == "invalid_heartbeat"
    assert body["error"]["message"].startswith("inventory")


async def test_impossible_inventories_are_refused_or_read_within_bounds(server: Running) -> None:
    """A security tester's node reported -4 cores, GPUs at index -1 with negative memory, and more
    memory available than in all: each was stored and shown. Negative counts are a 400 naming the
    field; available above the total is read as the total."""
    ctx = server.pki.client("node-7")
    good = hb().model_dump(mode="json")
    bad_gpu = {"index": -1, "name": "x", "klass": "x", "memory_total_bytes": -1}
    for field, value in (("cores", -4), ("memory_total_bytes", -1), ("gpus", [bad_gpu])):
        body = {**good, "inventory": {**good["inventory"], field: value}}
        async with aiohttp.ClientSession() as s, s.post(server.url + "/agent/v1/heartbeat", json=body, ssl=ctx) as r:
            assert r.status == 400, field
            assert (await r.json())["error"]["message"].startswith(f"inventory.{field}"), field
    body = {**good, "inventory": {**good["inventory"], "memory_available_bytes": 10**15}}
    async with aiohttp.ClientSession() as s, s.post(server.url + "/agent/v1/heartbeat", json=body, ssl=ctx) as r:
        assert r.status == 200, await r.text()
    row = server.store.get_node("node-7")
    assert row is not None
    assert row.inventory.memory_available_bytes == row.inventory.memory_total_bytes == 8 * GB


# --- the routing table the heartbeats feed ---


def test_store_router_caches_resolves_aliases_and_explains(store: Store) -> None:
    now = [0.0]
    router = StoreRouter(store, clock=lambda: now[0])
    chat = Model(name="chat", aliases=["default"], source="file:/c.gguf", profiles=[Profile(name="cpu")])
    judge = Model(
        name="judge",
        source="file:/j.gguf",
        role=Role.GUARD,
        guard=GuardModel(),
        profiles=[Profile(name="cpu")],
    )
    assert router.chat_models() == []  # builds the first snapshot at t=0
    store.add_model(chat, now=1.0)
    assert router.resolve("chat") is None  # snapshot built before the model existed is still fresh
    now[0] = 0.6
    route = router.resolve("default")
    assert route is not None
    assert route.model == "chat"
    assert route.upstreams == ()
    assert route.unavailable == "it has not been placed on a node yet"

    store.add_model(judge, now=1.0)
    store.set_explanation(
        ExplainView(model="chat", placed=False, summary="0/1 nodes can run it: 1 node lost"), now=1.0
    )
    store.add_replica(
        ReplicaRow(
            id="judge-1",
            model="judge",
            node="n",
            profile="cpu",
            key="k",
            state="ready",
            endpoint="10.0.0.5:7000",
        )
    )
    router.refresh()  # a heartbeat arrived: no waiting for the 0.5 s
    route = router.resolve("chat")
    assert route is not None
    assert route.unavailable == "0/1 nodes can run it: 1 node lost"
    assert router.resolve("judge") is None  # guard models are not offered to clients
    judge_route = router.resolve_any("judge")
    assert judge_route is not None
    assert [u.endpoint for u in judge_route.upstreams] == ["10.0.0.5:7000"]
    assert [r.model for r in router.chat_models()] == ["chat"]

    store.add_replica(
        ReplicaRow(
            id="chat-1",
            model="chat",
            node="n",
            profile="cpu",
            key="k",
            state="failed",
            # As the agent writes it: the cause first, then the engine's last lines.
            err="llama-server exited with code 1: error: cannot bind 10.0.0.5:7001; its last lines:\nloading",
        )
    )
    router.refresh()
    route = router.resolve("chat")
    assert route is not None
    assert route.unavailable == (
        "no replica is ready yet (failed (llama-server exited with code 1: error: cannot bind <internal>))"
    )


def test_a_model_whose_replicas_all_drain_says_they_are_being_stopped() -> None:
    """A new user's finding: right after 'ctl model scale gemma 0' the gateway said "no replica is
    ready yet (ready)" for about 2 s: the replica was still ready, and draining."""
    from llmgw.control.gateway.table import unavailable_reason  # noqa: PLC0415

    draining = ReplicaRow(id="chat-1", model="chat", node="n", profile="cpu", key="k", state="ready",
                          draining_since=5.0)
    assert unavailable_reason([draining], "") == "its replicas are being stopped (scaled down, or their node drained)"
    starting = ReplicaRow(id="chat-2", model="chat", node="n", profile="cpu", key="k", state="starting")
    assert unavailable_reason([draining, starting], "") == "no replica is ready yet (draining, starting)"
