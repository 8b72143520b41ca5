"""Node removal, certificate revocation and TLS failures, over real mTLS.

A real control plane (:func:`~llmgw.control.server.serve`: admin API, agent API with client
certificates from the cluster CA, leader) on loopback, and real agents (:func:`run_agent`) in this
process. The engine is a stand-in script (``--version`` answers; otherwise it sleeps like a loading
llama-server), so a replica stays ``starting``: removal needs a running engine, not a model.
``llmgw ctl node rm`` runs as the real CLI in a child process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import yaml
from cryptography import x509

from llmgw import tlsconf
from llmgw.agent.loop.loop import run_agent
from llmgw.agent.loop.tlsdiag import alert_name, certificate_problem
from llmgw.agent.node.records import load_records, stop_all_engines
from llmgw.config import AgentConfig
from llmgw.control.store import Store
from llmgw.control.store.rows import BeatWrite
from llmgw.errors import NodeRemoved, Revoked
from llmgw.paths import Paths
from llmgw.protocol import Heartbeat, Inventory
from tests.helpers.control import FAKE_ENGINE, TOKEN, make_install, serving
from tests.helpers.net import serve_files
from tests.helpers.waits import until

GB = 1_000_000_000
INVENTORY = {"cores": 4, "memory_total_bytes": 8 * GB, "memory_available_bytes": 8 * GB}


@dataclass
class World:
    root: Path
    ca: tlsconf.CA
    admin: str
    agent_url: str
    files: str
    engine: Path

    def issue(self, node: str, ca: tlsconf.CA | None = None, where: str = "") -> tuple[Path, Path]:
        return (ca or self.ca).issue_client(node).write(self.root / "nodes" / (where or node) / "etc", "agent")

    def config(self, node: str, cert: Path, key: Path, ca_pem: Path | None = None) -> AgentConfig:
        root = self.root / "nodes" / node
        inv = root / "inventory.yaml"
        inv.parent.mkdir(parents=True, exist_ok=True)
        inv.write_text(yaml.safe_dump(INVENTORY))
        return AgentConfig.model_validate(
            {
                "server": self.agent_url,
                "node_id": node,
                "tls": {"ca": ca_pem or Paths(self.root).pki / "ca.pem", "cert": cert, "key": key},
                "discovery": {"inventory_file": str(inv)},
                "engines": {"llamacpp": {"binary": str(self.engine)}},
                "heartbeat_interval_s": 0.2,
            }
        )

    async def api(self, method: str, path: str, body: Any = None) -> Any:
        async with (
            aiohttp.ClientSession() as s,
            s.request(method, self.admin + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as r,
        ):
            assert r.status < 300, await r.text()
            return await r.json() if r.content_length != 0 else None

    async def ctl(self, *args: str) -> tuple[int, str]:
        """``llmgw ctl ARGS`` as a child process; returns its exit code and stdout+stderr."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "llmgw", "ctl", *args, "--server", self.admin, "--token", TOKEN,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "LLMGW_ROOT": str(self.root), "COLUMNS": "200"},
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode()




@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    inst = make_install(tmp_path)
    engine = tmp_path / "llama-server"
    engine.write_text(FAKE_ENGINE)
    engine.chmod(engine.stat().st_mode | stat.S_IXUSR)
    files_dir = tmp_path / "files"
    files_dir.mkdir()
    (files_dir / "m.gguf").write_bytes(b"GGUF" + b"\0" * 1000)
    files_runner, files_url = await serve_files(files_dir)
    try:
        async with serving(inst):
            try:
                yield World(tmp_path, inst.ca, inst.admin, inst.agent_url, files_url, engine)
            finally:
                for node_dir in (tmp_path / "nodes").glob("*"):
                    stop_all_engines(Paths(node_dir).agent_state, grace_s=2)
    finally:
        await files_runner.cleanup()


def serial_of(cert: Path) -> str:
    return format(x509.load_pem_x509_certificate(cert.read_bytes()).serial_number, "X")


async def heartbeat_status(w: World, cert: Path, key: Path) -> tuple[int, dict[str, Any]]:
    ctx = tlsconf.client_context(Paths(w.root).pki / "ca.pem", cert, key)
    beat = Heartbeat(inventory=Inventory(**INVENTORY), instance="raw").model_dump_json()
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s,
        s.post(w.agent_url + "/agent/v1/heartbeat", data=beat, headers={"Content-Type": "application/json"}) as r,
    ):
        return r.status, await r.json()


async def test_node_rm_refused_while_busy_force_drains_revokes_and_the_agent_stops(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    w = world
    caplog.set_level(logging.INFO)
    cert, key = w.issue("node-1")
    agent = asyncio.create_task(run_agent(w.config("node-1", cert, key), Paths(w.root / "nodes" / "node-1")))
    try:
        await until("node-1 registered", lambda: w.api("GET", "/api/v1/nodes"))
        await w.api(
            "POST", "/api/v1/models",
            {"name": "m", "source": f"{w.files}/m.gguf", "profiles": [{"name": "cpu", "min_memory_gb": 1}]},
        )
        state = Paths(w.root / "nodes" / "node-1").agent_state

        async def engine_pid() -> int:
            recs = load_records(state)
            return recs[0].pid if recs else 0

        pid = await until("an engine runs on node-1", engine_pid)

        code, out = await w.ctl("node", "rm", "node-1")
        assert code == 1, out
        assert "409" in out
        assert "node 'node-1' has 1 replica(s) placed on it" in out
        assert "--force" in out
        assert [n["id"] for n in await w.api("GET", "/api/v1/nodes")] == ["node-1"]

        code, out = await w.ctl("node", "rm", "node-1", "--force")
        assert code == 0, out
        assert "node-1: drained 1 replica(s)" in out
        # as a drain does: the only node gone, its model has nowhere to go (rm said nothing: a new user's finding)
        assert "!! m: no other node can take the replicas drained from node-1 now" in out
        assert "'llmgw server add-node node-1' re-joins it" in out  # not 'uncordon': the node is gone
        assert f"certificate serial(s) {serial_of(cert)} revoked" in out
        assert "llmgw server add-node node-1" in out

        # The agent hears 403 certificate_revoked at its next heartbeat, stops its engine and ends.
        with pytest.raises(NodeRemoved) as removed:
            await asyncio.wait_for(agent, 20)
    finally:
        if not agent.done():
            agent.cancel()
    message = str(removed.value)
    assert "node 'node-1' was removed from the cluster" in message
    assert f"serial {serial_of(cert)}" in message
    assert "run 'llmgw server add-node node-1 --address ADDR --out DIR' on the control plane" in message
    assert any(message in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert load_records(state) == []

    # The old certificate stays refused (and writes nothing); a new one for the same node joins.
    status, body = await heartbeat_status(w, cert, key)
    assert (status, body["error"]["code"]) == (403, "certificate_revoked")
    assert await w.api("GET", "/api/v1/nodes") == []
    new_cert, new_key = w.issue("node-1", where="node-1-again")
    assert serial_of(new_cert) != serial_of(cert)
    status, body = await heartbeat_status(w, new_cert, new_key)
    assert status == 200, body
    assert [n["id"] for n in await w.api("GET", "/api/v1/nodes")] == ["node-1"]

    # Unknown node: 404, and the CLI says so.
    code, out = await w.ctl("node", "rm", "nope")
    assert code == 1
    assert "no node 'nope'" in out


async def warnings_of(w: World, cfg: AgentConfig, node: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Run the agent until it has logged a failure; return the agent's warnings."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_agent(cfg, Paths(w.root / "nodes" / node), stop=stop))

    async def logged() -> bool:
        return any(r.name == "llmgw.agent" and r.levelno == logging.WARNING for r in caplog.records)

    try:
        await until("the agent logs its failure", logged)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    return [r.getMessage() for r in caplog.records if r.name == "llmgw.agent" and r.levelno == logging.WARNING]


async def test_agent_with_a_certificate_from_another_ca_names_the_cause(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    w = world
    caplog.set_level(logging.INFO)
    stranger = tlsconf.CA.create("another cluster's CA")
    cert, key = w.issue("node-x", ca=stranger)
    (msg,) = await warnings_of(w, w.config("node-x", cert, key), "node-x", caplog)
    assert "does not answer" not in msg
    assert "Server disconnected" not in msg
    assert "the control plane rejected this agent's certificate (unknown CA): it was not issued by this " \
        "cluster's CA" in msg
    assert "another cluster" in msg  # the issuer it does have
    assert "run 'llmgw server add-node node-x --address ADDR --out DIR' on the control plane and copy the " \
        "new files" in msg
    assert await w.api("GET", "/api/v1/nodes") == []


async def test_agent_that_does_not_trust_the_server_certificate_says_what_to_copy(
    world: World, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    w = world
    caplog.set_level(logging.INFO)
    other = tlsconf.CA.create("an old CA")
    other.write(tmp_path / "old")
    cert, key = w.issue("node-y")
    (msg,) = await warnings_of(w, w.config("node-y", cert, key, ca_pem=tmp_path / "old" / "ca.pem"), "node-y", caplog)
    assert "this agent does not trust the control plane's certificate at " + w.agent_url in msg
    assert "certificate verify failed" in msg or "self-signed" in msg or "local issuer" in msg
    assert f"it is not signed by the CA in {tmp_path / 'old' / 'ca.pem'}" in msg
    assert "copy the cluster's CA (/etc/llmgw/pki/ca.pem on the control plane)" in msg


def test_alert_names_and_local_certificate_checks(tmp_path: Path) -> None:
    assert alert_name("TLSV1_ALERT_UNKNOWN_CA") == "unknown CA"
    assert alert_name("SSLV3_ALERT_CERTIFICATE_REVOKED") == "certificate revoked"
    assert alert_name("TLSV13_ALERT_CERTIFICATE_REQUIRED") == "certificate required"
    assert alert_name("CERTIFICATE_VERIFY_FAILED") == ""
    ca = tlsconf.CA.create()
    ca.write(tmp_path)
    cert, _ = ca.issue_client("n").write(tmp_path, "good")
    assert certificate_problem(cert, tmp_path / "ca.pem") == ("", "")
    server_cert, _ = ca.issue_server(["h"]).write(tmp_path, "server")
    assert certificate_problem(server_cert, tmp_path / "ca.pem")[0] == "unsupported certificate"


async def test_revoked_serial_refused_even_on_the_log_route(world: World) -> None:
    """A revoked agent cannot post log replies either (every agent route checks the deny-list)."""
    w = world
    cert, key = w.issue("node-z")
    status, _ = await heartbeat_status(w, cert, key)
    assert status == 200
    assert (await w.api("DELETE", "/api/v1/nodes/node-z"))["revoked"] == [serial_of(cert)]
    ctx = tlsconf.client_context(Paths(w.root).pki / "ca.pem", cert, key)
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s,
        s.post(w.agent_url + "/agent/v1/logs", data=b"{}") as r,
    ):
        assert r.status == 403
        assert (await r.json())["error"]["code"] == "certificate_revoked"


async def test_the_admin_api_says_whether_a_serial_is_revoked(world: World) -> None:
    """``server init`` asks this before keeping an agent certificate (a new user's report: after
    ``ctl node rm``, init kept the revoked one and waited 20 minutes for a node that had exited)."""
    w = world
    cert, key = w.issue("node-r")
    status, _ = await heartbeat_status(w, cert, key)
    assert status == 200
    serial = serial_of(cert)
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{w.admin}/api/v1/revocations/{serial}", headers={"Authorization": f"Bearer {TOKEN}"}) as r,
    ):
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "not_revoked"
    await w.api("DELETE", "/api/v1/nodes/node-r")
    got = await w.api("GET", f"/api/v1/revocations/{serial.lower()}")
    assert (got["serial"], got["node"]) == (serial, "node-r")
    assert got["revoked_at"] > 0


async def test_node_rm_refuses_a_second_bundle_issued_for_the_node_that_never_joined(world: World) -> None:
    """Two bundles for node-1 (``server add-node`` twice): the agent joins with the first, the node is
    removed, and the second, never presented, must not bring it back (it joined as ``ready``)."""
    w = world
    cert, key = w.issue("node-1")
    spare_cert, spare_key = w.issue("node-1", where="node-1-spare")
    assert serial_of(spare_cert) != serial_of(cert)
    agent = asyncio.create_task(run_agent(w.config("node-1", cert, key), Paths(w.root / "nodes" / "node-1")))
    try:
        await until("node-1 registered", lambda: w.api("GET", "/api/v1/nodes"))
        # Certificates carry their issue time to the second (notBefore): be a whole second past it.
        await asyncio.sleep(1.5)
        code, out = await w.ctl("node", "rm", "node-1")
        assert code == 0, out
        assert f"certificate serial(s) {serial_of(cert)} revoked" in out
        assert "every other certificate issued for it until now is refused" in out
        with pytest.raises(NodeRemoved):
            await asyncio.wait_for(agent, 20)
    finally:
        if not agent.done():
            agent.cancel()

    # The spare bundle: refused over real mTLS, as a raw heartbeat and as a real agent.
    status, body = await heartbeat_status(w, spare_cert, spare_key)
    assert status == 403, f"the spare bundle joined the removed node: {body}"
    assert body["error"]["code"] == "certificate_revoked"
    assert f"serial {serial_of(spare_cert)}" in body["error"]["message"]
    assert "every certificate issued for it until then" in body["error"]["message"]
    spare_cfg = w.config("node-1-spare", spare_cert, spare_key)
    with pytest.raises(NodeRemoved):
        await asyncio.wait_for(run_agent(spare_cfg, Paths(w.root / "nodes" / "node-1-spare")), 20)
    assert await w.api("GET", "/api/v1/nodes") == []
    # The admin API says so too when asked with the node and issue time (what init asks before it
    # keeps a certificate); by serial alone the spare was never revoked.
    issued = x509.load_pem_x509_certificate(spare_cert.read_bytes()).not_valid_before_utc.timestamp() + 300
    serial = serial_of(spare_cert)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
        async with s.get(f"{w.admin}/api/v1/revocations/{serial}?node=node-1&issued_at={issued:.0f}") as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["node"] == "node-1"
        async with s.get(f"{w.admin}/api/v1/revocations/{serial}") as r:
            assert r.status == 404

    # A bundle issued after the removal joins, and keeps joining (its serial is remembered as it comes).
    new_cert, new_key = w.issue("node-1", where="node-1-again")
    for _ in range(2):
        status, body = await heartbeat_status(w, new_cert, new_key)
        assert status == 200, body
    assert [n["id"] for n in await w.api("GET", "/api/v1/nodes")] == ["node-1"]


def test_a_heartbeat_admitted_before_the_removal_does_not_write_the_node_back(store: Store) -> None:
    """The race the agent API cannot see: a heartbeat whose certificate was checked before ``node
    rm`` and written after it. The write refuses a serial not remembered since the removal; one
    remembered after it (a bundle issued after the removal) is written. On SQLite and PostgreSQL."""
    beat = Heartbeat(inventory=Inventory(**INVENTORY), instance="i")
    store.note_cert("n1", "AA", 1.0)
    assert store.record_heartbeats([("n1", beat, 1.0, "AA")]) == [None]
    store.note_cert("n1", "BB", 2.0)  # a second bundle, checked just before the removal
    assert store.remove_node("n1", now=10.0) == ["AA", "BB"]
    (late,) = store.record_heartbeats([("n1", beat, 10.5, "CC")])
    assert isinstance(late, Revoked)
    assert (late.serial, late.node, late.revoked_at) == ("CC", "n1", 10.0)
    assert store.get_node("n1") is None
    assert store.refused_cert("n1", "CC", issued_at=5.0) == ("n1", 10.0)  # issued before the removal
    assert store.refused_cert("n1", "DD", issued_at=10.5) is None  # issued after it
    store.note_cert("n1", "DD", 11.0)
    assert store.record_heartbeats([("n1", beat, 11.0, "DD")]) == [None]
    assert store.get_node("n1") is not None


def test_the_heartbeat_write_checks_revocation_again(store: Store) -> None:
    """The same race through the agent API's own write (``Store.write_heartbeats``, which remembers
    a new serial in the transaction that records the heartbeat): a heartbeat read before ``node rm``
    and written after it is refused, with its serial remembered or not; a certificate issued after
    the removal is written, its serial remembered by that same write. On SQLite and PostgreSQL."""
    beat = Heartbeat(inventory=Inventory(**INVENTORY), instance="i")
    (first,) = store.write_heartbeats([BeatWrite("n1", beat, 1.0, "AA", issued_at=0.5, note=True)])
    assert first.refused is None
    assert store.node_serials("n1") == ["AA"]
    assert store.remove_node("n1", now=10.0) == ["AA"]
    for serial, issued_at, note in (("AA", 0.5, False), ("CC", 5.0, True), ("CC", None, True)):
        (late,) = store.write_heartbeats([BeatWrite("n1", beat, 10.5, serial, issued_at=issued_at, note=note)])
        assert isinstance(late.refused, Revoked), (serial, issued_at)
        assert (late.refused.serial, late.refused.node, late.refused.revoked_at) == (serial, "n1", 10.0)
        assert store.get_node("n1") is None
    assert store.node_serials("n1") == []  # a refused write remembers nothing
    (again,) = store.write_heartbeats([BeatWrite("n1", beat, 11.0, "DD", issued_at=10.5, note=True)])
    assert again.refused is None
    assert store.get_node("n1") is not None
    assert store.node_serials("n1") == ["DD"]
