"""The ``llmgw.control-plane`` label no node may give itself (control/api/nodelabels.py), over the real
agent API with real mTLS on 127.0.0.1, and where a control plane learns its own node.

A security tester's finding: a node whose credentials were taken claimed the label in a heartbeat
(with a large inventory) and the next replica of the starter and of a guard judge, which reads every
guarded prompt, was placed on it. Only a control plane's own node keeps it now."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw import tlsconf
from llmgw.control.api.agent import build_agent_app
from llmgw.control.api.nodelabels import own_node
from llmgw.control.reconcile.election import SoloElection
from llmgw.control.reconcile.membership import Membership
from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.control.store.rows import ControlPlaneRow
from llmgw.names import CONTROL_PLANE_LABEL
from llmgw.paths import Paths
from llmgw.protocol import Heartbeat, HeartbeatReply, Inventory, Pulse, state_digest
from llmgw.serverinit.files import agent_yaml

GB = 1_000_000_000
CLAIM = {CONTROL_PLANE_LABEL: "true", "zone": "a"}


@dataclass
class Api:
    url: str
    ca: tlsconf.CA
    dir: Path
    own: set[str]

    def client(self, node: str) -> ssl.SSLContext:
        cert, key = self.ca.issue_client(node).write(self.dir, f"agent-{node}")
        return tlsconf.client_context(self.dir / "ca.pem", cert, key)

    async def beat(self, node: str, body: Heartbeat | Pulse) -> HeartbeatReply:
        async with aiohttp.ClientSession() as s, s.post(
            self.url + "/agent/v1/heartbeat", data=body.model_dump_json(), ssl=self.client(node),
            headers={"Content-Type": "application/json"},
        ) as r:
            assert r.status == 200, await r.text()
            return HeartbeatReply.model_validate_json(await r.read())


@pytest.fixture
async def api(store: Store, tmp_path: Path) -> AsyncIterator[Api]:
    ca = tlsconf.CA.create()
    ca.write(tmp_path)
    cert, key = ca.issue_server(["127.0.0.1"]).write(tmp_path, "server")
    own = {"cp-box"}
    app = build_agent_app(store, clock=lambda: 1000.0, own_nodes=lambda: frozenset(own))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tlsconf.server_context(tmp_path / "ca.pem", cert, key))
    await site.start()
    try:
        yield Api(f"https://127.0.0.1:{runner.addresses[0][1]}", ca, tmp_path, own)
    finally:
        await runner.cleanup()


def claiming() -> Heartbeat:
    inv = Inventory(cores=64, memory_total_bytes=512 * GB, memory_available_bytes=512 * GB)
    return Heartbeat(inventory=inv, labels=CLAIM)


async def test_only_a_control_planes_own_node_keeps_the_label(
    api: Api, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    for node in ("cp-box", "intruder"):
        reply = await api.beat(node, claiming())
        assert reply.digest == state_digest(claiming())  # the digest of what the agent sent
    own, other = store.get_node("cp-box"), store.get_node("intruder")
    assert own is not None
    assert other is not None
    assert own.labels == CLAIM
    assert other.labels == {"zone": "a"}
    assert "node intruder: its agent claims the label llmgw.control-plane" in caplog.text
    # the agent's pulse names the digest of its own state (the label in it): current for the own node;
    # the other's was stored without the label, so it is asked its full state (judged again) each time
    assert not (await api.beat("cp-box", Pulse(digest=state_digest(claiming())))).send_full
    assert (await api.beat("intruder", Pulse(digest=state_digest(claiming())))).send_full


async def test_a_node_named_own_after_its_first_beat_gets_its_label_at_its_next_full_beat(
    api: Api, store: Store
) -> None:
    """init starts the control plane before it writes the node's agent.yaml: the node's first beats
    can come before any control plane's row names it (on another control plane, until that row is
    read). Its label is dropped then, and it is asked its full state again at its next pulse."""
    await api.beat("late-box", claiming())
    row = store.get_node("late-box")
    assert row is not None
    assert CONTROL_PLANE_LABEL not in row.labels
    api.own.add("late-box")  # its control plane's row read
    assert (await api.beat("late-box", Pulse(digest=state_digest(claiming())))).send_full
    await api.beat("late-box", claiming())
    row = store.get_node("late-box")
    assert row is not None
    assert row.labels == CLAIM
    assert not (await api.beat("late-box", Pulse(digest=state_digest(claiming())))).send_full


async def test_with_no_own_nodes_no_node_keeps_it(store: Store, tmp_path: Path) -> None:
    """``build_agent_app`` without ``own_nodes`` (a control plane with no node on its machine)."""
    ca = tlsconf.CA.create()
    ca.write(tmp_path)
    cert, key = ca.issue_server(["127.0.0.1"]).write(tmp_path, "server")
    runner = web.AppRunner(build_agent_app(store, clock=lambda: 1000.0))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tlsconf.server_context(tmp_path / "ca.pem", cert, key))
    await site.start()
    try:
        await Api(f"https://127.0.0.1:{runner.addresses[0][1]}", ca, tmp_path, set()).beat("cp-box", claiming())
    finally:
        await runner.cleanup()
    row = store.get_node("cp-box")
    assert row is not None
    assert row.labels == {"zone": "a"}


async def test_a_control_plane_publishes_its_machines_node_and_reads_the_others(store: Store, tmp_path: Path) -> None:
    """The node comes from this machine's agent.yaml (installs made before the rule keep their label),
    travels in the ``control_planes`` row (migration 14), and every member's is honoured."""
    paths = Paths(tmp_path)
    assert own_node(paths) == ""  # no agent.yaml: no node
    paths.agent_config.parent.mkdir(parents=True, exist_ok=True)
    paths.agent_config.write_text(agent_yaml(  # as server init writes it
        server="https://127.0.0.1:7443", node_id="box-a", etc=paths.etc, label_key=CONTROL_PLANE_LABEL,
        label_value="true", llama_server=None, servers=[], advertise="127.0.0.1",
    ))
    assert own_node(paths) == "box-a"
    store.upsert_control_plane(ControlPlaneRow("cp-b", "https://b:7443", 999.0, 990.0, "1", node="box-b"))
    db = OffLoop()
    try:
        election = SoloElection(store, "cp-a", db.run)
        members = Membership(store, db, election, name="cp-a", agent_url="https://a:7443", version="1",
                             node=own_node(paths), clock=lambda: 1000.0)
        await members.tick()
        assert members.own_nodes() == {"box-a", "box-b"}
        assert {r.name: r.node for r in store.list_control_planes()} == {"cp-a": "box-a", "cp-b": "box-b"}
    finally:
        db.close()


def test_an_agent_yaml_that_does_not_parse_gives_no_node(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    paths = Paths(tmp_path)
    paths.agent_config.parent.mkdir(parents=True, exist_ok=True)
    paths.agent_config.write_text(json.dumps({"node_id": "Not A Name"}))
    assert own_node(paths) == ""
    assert "no node of this machine carries the label llmgw.control-plane" in caplog.text


async def test_the_own_node_is_known_at_its_first_beat_not_at_the_next_write_of_the_row(
    store: Store, tmp_path: Path
) -> None:
    """init writes the agent.yaml after it started the control plane and starts the agent at once: its
    first beat must keep the label (it lost it until the next write of the row, ~2 s, and init printed
    "1 node without the label llmgw.control-plane=true" meanwhile: a new user's run)."""
    paths = Paths(tmp_path)
    db = OffLoop()
    try:
        members = Membership(store, db, SoloElection(store, "cp-a", db.run), name="cp-a",
                             agent_url="https://a:7443", version="1", find_node=lambda: own_node(paths))
        await members.tick()  # no agent.yaml yet
        assert members.own_nodes() == frozenset()
        paths.agent_config.parent.mkdir(parents=True, exist_ok=True)
        paths.agent_config.write_text(agent_yaml(
            server="https://127.0.0.1:7443", node_id="box-a", etc=paths.etc, label_key=CONTROL_PLANE_LABEL,
            label_value="true", llama_server=None, servers=[], advertise="127.0.0.1",
        ))
        assert members.own_nodes() == {"box-a"}  # no tick in between
    finally:
        db.close()
