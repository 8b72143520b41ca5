"""One heartbeat, two store trips: one read transaction and one write transaction; a pulse (the
state's digest instead of the state) one trip (the heartbeats' batch reads and writes it on its
thread), the same two transactions, its write one ``UPDATE`` of ``last_seen``.

A real store (each backend of ``tests/conftest.py``'s ``store_url``) counts the transactions it
opens (``SqlStore._tx`` reads, ``SqlStore._wtx`` writes), and the agent API's off-loop pool counts
the calls it hands to its threads; the agent posts over real mTLS on 127.0.0.1. Only the heartbeat
is measured: the counters are reset before it and read once its reply arrived (the agent API here
has no routing table to refresh, so nothing else uses the store meanwhile; the store-mode log
broker uses a second store on the same database, which is not counted).

Before (main at 3be9a6f) a heartbeat made five trips to the pool (the revocation check, the node
read, the batched write, the replica reports, the reply's replicas) and six to seven transactions.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aiohttp
import pytest
import sqlalchemy as sa
from aiohttp import web
from sqlalchemy.engine import Connection

from llmgw import tlsconf
from llmgw.catalog import Model, Profile
from llmgw.control.api.agent import build_agent_app
from llmgw.control.api.logbroker import LogBroker
from llmgw.control.reconcile.leader import Leader
from llmgw.control.store import SqlStore
from llmgw.control.store.offloop import OffLoop
from llmgw.protocol import (
    EngineStatus,
    Heartbeat,
    HeartbeatReply,
    Inventory,
    LogReply,
    ProvisionState,
    Pulse,
    ReplicaState,
    ReplicaStatus,
    desired_digest,
    state_digest,
)
from tests.helpers.waits import until

GB = 1_000_000_000
T = TypeVar("T")


class CountingStore(SqlStore):
    """A real SqlStore that counts the transactions it opens."""

    reads = 0
    writes = 0

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        self.reads += 1
        with super()._tx() as conn:
            yield conn

    @contextmanager
    def _wtx(self) -> Iterator[Connection]:
        self.writes += 1
        with super()._wtx() as conn:
            yield conn


class CountingPool(OffLoop):
    """The off-loop pool, counting the calls handed to its threads (reads and writes alike)."""

    trips = 0

    async def _call(self, reading: bool, call: Callable[[], T]) -> T:
        self.trips += 1
        return await super()._call(reading, call)


@dataclass
class Agent:
    url: str
    store: CountingStore
    pool: CountingPool
    ctx: ssl.SSLContext
    beats: list[tuple[str, bool]]
    logs: LogBroker
    other: SqlStore

    def reset(self) -> None:
        self.store.reads = self.store.writes = self.pool.trips = 0

    def counts(self) -> tuple[int, int, int]:
        """(pool trips, read transactions, write transactions) since :meth:`reset`."""
        return self.pool.trips, self.store.reads, self.store.writes


@pytest.fixture
async def agent(store_url: str, tmp_path: Path) -> AsyncIterator[Agent]:
    ca = tlsconf.CA.create()
    ca.write(tmp_path)
    cert, key = ca.issue_server(["127.0.0.1"]).write(tmp_path, "server")
    store = CountingStore.open(store_url)
    assert isinstance(store, CountingStore)
    other = SqlStore.open(store_url)  # the log broker's, not counted
    pool, broker_pool = CountingPool(), OffLoop()
    beats: list[tuple[str, bool]] = []
    logs = LogBroker(store=other, db=broker_pool)
    app = build_agent_app(store, db=pool, logs=logs, on_heartbeat=lambda n, c: beats.append((n, c)))
    runner = web.AppRunner(app)
    await runner.setup()
    ssl_ctx = tlsconf.server_context(tmp_path / "ca.pem", cert, key)
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_ctx).start()
    client_cert, client_key = ca.issue_client("node-1").write(tmp_path, "agent-node-1")
    ctx = tlsconf.client_context(tmp_path / "ca.pem", client_cert, client_key)
    try:
        yield Agent(f"https://127.0.0.1:{runner.addresses[0][1]}", store, pool, ctx, beats, logs, other)
    finally:
        await runner.cleanup()
        await logs.idle()
        pool.close()
        broker_pool.close()
        other.close()
        store.close()


def hb(*replicas: ReplicaStatus) -> Heartbeat:
    return Heartbeat(
        inventory=Inventory(cores=4, memory_total_bytes=8 * GB, memory_available_bytes=8 * GB),
        engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")],
        replicas=list(replicas),
    )


async def beat(agent: Agent, body: Heartbeat) -> HeartbeatReply:
    async with (
        aiohttp.ClientSession() as s,
        s.post(agent.url + "/agent/v1/heartbeat", data=body.model_dump_json(), ssl=agent.ctx) as r,
    ):
        assert r.status == 200, await r.text()
        return HeartbeatReply.model_validate_json(await r.read())


async def test_a_heartbeat_is_one_read_and_one_write(agent: Agent) -> None:
    # The first heartbeat: the node registered and its certificate's serial remembered.
    agent.reset()
    reply = await beat(agent, hb())
    assert reply.desired == []
    assert agent.counts() == (2, 1, 1)
    assert agent.store.node_serials("node-1") != []
    await until("on_heartbeat called", lambda: asyncio.sleep(0, agent.beats == [("node-1", True)]))

    model = Model(name="chat", source="file:/m/chat.gguf", profiles=[Profile(name="cpu", cpu_cores=1)])
    agent.store.add_model(model, now=1.0)
    Leader(agent.store, node_lost_after_s=30).reconcile_once(2.0)
    (row,) = agent.store.list_replicas()

    # A heartbeat that receives its replica and reports it ready.
    agent.reset()
    reply = await beat(agent, hb(ReplicaStatus(id=row.id, state=ReplicaState.READY, endpoint="127.0.0.1:5001")))
    assert [spec.id for spec in reply.desired] == [row.id]
    assert agent.counts() == (2, 1, 1)
    ready = agent.store.get_replica(row.id)
    assert ready is not None
    assert (ready.state, ready.endpoint) == ("ready", "127.0.0.1:5001")
    await until("on_heartbeat: changed", lambda: asyncio.sleep(0, agent.beats[-1] == ("node-1", True)))

    # Nothing new: still one read and one write (the heartbeat itself is the write).
    agent.reset()
    reply = await beat(agent, hb(ReplicaStatus(id=row.id, state=ReplicaState.READY, endpoint="127.0.0.1:5001")))
    assert [spec.id for spec in reply.desired] == [row.id]
    assert agent.counts() == (2, 1, 1)


async def test_a_stored_log_request_rides_the_same_write(agent: Agent) -> None:
    await beat(agent, hb())
    asking = asyncio.ensure_future(agent.logs.read("node-1", "chat-1", lines=5, timeout_s=30))
    await until("the request stored", lambda: asyncio.to_thread(agent.other.log_request_nodes))

    agent.reset()
    reply = await beat(agent, hb())
    (request,) = reply.log_requests
    assert request.replica_id == "chat-1"
    assert agent.counts() == (2, 1, 1)

    answer = LogReply(id=request.id, replica_id="chat-1", text="hello\n", offset=6, found=True)
    async with (
        aiohttp.ClientSession() as s,
        s.post(agent.url + "/agent/v1/logs", data=answer.model_dump_json(), ssl=agent.ctx) as r,
    ):
        assert r.status == 200, await r.text()
    assert (await asyncio.wait_for(asking, 10)).text == "hello\n"
    assert (await beat(agent, hb())).log_requests == []  # handed out once


# --- pulses: liveness apart from state ---


@contextmanager
def statements(store: SqlStore) -> Iterator[list[str]]:
    """The SQL statements ``store`` sends while the block runs (first word and table, upper-cased)."""
    seen: list[str] = []

    def note(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        seen.append(" ".join(statement.split()).upper())

    sa.event.listen(store.engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", note)


async def post(agent: Agent, body: Heartbeat | Pulse | dict[str, object]) -> HeartbeatReply:
    data = json.dumps(body) if isinstance(body, dict) else body.model_dump_json()
    async with (
        aiohttp.ClientSession() as s,
        s.post(agent.url + "/agent/v1/heartbeat", data=data, ssl=agent.ctx) as r,
    ):
        assert r.status == 200, await r.text()
        return HeartbeatReply.model_validate_json(await r.read())


async def test_a_pulse_is_one_read_and_one_liveness_write(agent: Agent) -> None:
    first = await beat(agent, hb())
    assert first.digest == state_digest(hb())  # computed by the control plane from the full state
    assert not first.send_full
    before = agent.store.get_node("node-1")
    assert before is not None
    assert before.digest == first.digest

    agent.reset()
    with statements(agent.store) as sent:
        reply = await post(agent, Pulse(digest=first.digest, desired_digest=first.desired_digest))
    assert not reply.send_full
    assert reply.digest == first.digest
    assert (reply.desired, reply.desired_unchanged) == ([], True)
    assert agent.counts() == (1, 1, 1)  # one hand-off: read and written on the heartbeats' batch thread
    writes = [s for s in sent if s.startswith(("UPDATE", "INSERT", "DELETE"))]
    assert len(writes) == 1, writes  # the liveness write, nothing else
    assert writes[0].startswith("UPDATE NODES SET REVISION=(NODES.REVISION + "), writes
    assert "LAST_SEEN=" in writes[0]
    assert "INVENTORY" not in writes[0]
    after = agent.store.get_node("node-1")
    assert after is not None
    assert after.last_seen > before.last_seen
    assert after.revision == before.revision + 1
    assert (after.inventory, after.engines, after.digest) == (before.inventory, before.engines, before.digest)
    await until("on_heartbeat: unchanged", lambda: asyncio.sleep(0, agent.beats[-1] == ("node-1", False)))


async def test_a_lying_digest_is_asked_for_the_full_state_which_wins(agent: Agent) -> None:
    first = await beat(agent, hb())
    seen = agent.store.get_node("node-1")
    assert seen is not None

    agent.reset()
    reply = await post(agent, Pulse(digest="0" * 64))  # a digest of no state the control plane stored
    assert reply.send_full
    assert reply.digest == ""
    assert agent.counts()[2] == 0  # nothing written: the node is not seen alive on a lie
    unchanged = agent.store.get_node("node-1")
    assert unchanged is not None
    assert (unchanged.last_seen, unchanged.revision) == (seen.last_seen, seen.revision)

    # The full state is believed: more cores now, and the digest stored is the control plane's own.
    bigger = hb()
    bigger.inventory.cores = 16
    reply = await beat(agent, bigger)
    assert reply.digest == state_digest(bigger) != first.digest
    node = agent.store.get_node("node-1")
    assert node is not None
    assert (node.inventory.cores, node.digest) == (16, state_digest(bigger))
    # The old digest is a lost update now: asked for the full state again.
    assert (await post(agent, Pulse(digest=first.digest))).send_full
    assert not (await post(agent, Pulse(digest=state_digest(bigger)))).send_full


async def test_a_lost_node_or_a_node_without_digest_is_asked_for_the_full_state(agent: Agent) -> None:
    # A node the control plane never saw (a new node, another database).
    assert (await post(agent, Pulse(digest=state_digest(hb())))).send_full
    assert agent.store.get_node("node-1") is None
    first = await beat(agent, hb())
    node = agent.store.get_node("node-1")
    assert node is not None
    agent.store.update_node(node, state="lost")
    reply = await post(agent, Pulse(digest=first.digest))
    assert reply.send_full  # a pulse does not bring a lost node back: its full state does
    await beat(agent, hb())
    back = agent.store.get_node("node-1")
    assert back is not None
    assert back.state == "ready"
    await until("on_heartbeat: back", lambda: asyncio.sleep(0, agent.beats[-1] == ("node-1", True)))


async def test_desired_changes_reach_pulses_and_old_agents_get_the_whole_list(agent: Agent) -> None:
    first = await beat(agent, hb())
    assert first.desired == []
    model = Model(name="chat", source="file:/m/chat.gguf", profiles=[Profile(name="cpu", cpu_cores=1)])
    agent.store.add_model(model, now=1.0)
    Leader(agent.store, node_lost_after_s=30).reconcile_once(2.0)
    (row,) = agent.store.list_replicas()

    # The agent's desired digest is the empty list's: the new replica comes in the pulse's reply.
    reply = await post(agent, Pulse(digest=first.digest, desired_digest=first.desired_digest))
    assert (reply.desired_unchanged, [s.id for s in reply.desired]) == (False, [row.id])
    assert reply.desired_digest == desired_digest(reply.desired) != first.desired_digest
    # Applied: the next pulse says so, and the list is left out.
    again = await post(agent, Pulse(digest=first.digest, desired_digest=reply.desired_digest))
    assert (again.desired_unchanged, again.desired) == (True, [])

    # An older agent's beat (no desired_digest, no digest): the whole list, every time.
    old = json.loads(hb().model_dump_json())
    del old["desired_digest"]
    for _ in range(2):
        reply = await post(agent, old)
        assert (reply.desired_unchanged, [s.id for s in reply.desired]) == (False, [row.id])


async def _status(agent: Agent, body: Heartbeat | Pulse) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(
        agent.url + "/agent/v1/heartbeat", data=body.model_dump_json(), ssl=agent.ctx
    ) as r:
        return r.status, await r.text()


async def test_a_second_agents_pulse_is_refused_409(agent: Agent) -> None:
    """A pulse from another instance of the node's agent while the first holds the id: 409, as a full beat."""
    first = await beat(agent, hb().model_copy(update={"instance": "A"}))
    assert (await _status(agent, Pulse(digest=first.digest, instance="A")))[0] == 200
    status, text = await _status(agent, Pulse(digest=first.digest, instance="B"))
    assert status == 409, text
    assert "node_id_in_use" in text, text


async def test_one_pulses_failing_read_fails_it_alone_not_its_batch(agent: Agent) -> None:
    """A pulse is read inside the heartbeats' batch (beat_batch): a read that raises for one node (a
    bad row, a bug) answers that pulse 500 and no other beat of the batch (a reviewer's finding: a
    full beat batched with it got 500 too)."""
    first = await beat(agent, hb())
    real = agent.store.read_pulse
    calls: list[int] = []

    def flaky(*a: object, **k: object) -> object:
        calls.append(1)
        if len(calls) == 1:  # a slow batch, so that the next two beats make one batch together
            import time  # noqa: PLC0415

            time.sleep(0.4)
            return real(*a, **k)  # type: ignore[arg-type]
        raise RuntimeError("this node's row does not parse")

    agent.store.read_pulse = flaky  # type: ignore[method-assign]
    try:
        slow = asyncio.ensure_future(_status(agent, Pulse(digest=first.digest)))
        await asyncio.sleep(0.15)
        bad = asyncio.ensure_future(_status(agent, Pulse(digest=first.digest)))
        full = asyncio.ensure_future(_status(agent, hb()))
        got = await asyncio.gather(slow, bad, full)
    finally:
        agent.store.read_pulse = real  # type: ignore[method-assign]
    assert [g[0] for g in got] == [200, 500, 200], got
