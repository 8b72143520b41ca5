"""The agent moves between two real control planes sharing one real PostgreSQL store.

Both control planes are llmgw's own ``serve`` (in-process, real mTLS agent API, real admin API) on
one PostgreSQL schema, the way an HA cluster shares its database; the agent is the real loop. The
control planes on this branch do not elect a leader yet (another part of issue 11), so both run the
reconcilers: harmless here, where the catalog is empty. Their replies carry term 0 and no members,
so this test covers the rotation only; terms and learned members are covered against stand-ins in
``test_agent_controlplanes.py``.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

import httpx
import pytest

from llmgw.agent.loop.controlplanes import rendezvous
from llmgw.agent.loop.loop import run_agent
from llmgw.config import AgentConfig
from llmgw.paths import Paths
from tests.helpers.control import TOKEN, Install, make_install, serving
from tests.helpers.net import free_port
from tests.helpers.nodes import declared_node
from tests.helpers.postgres import Cluster
from tests.helpers.waits import until


def standby_of(first: Install, root: Path) -> Install:
    """A second control plane install: the first one's CA, server certificate and admin token, its
    own ports (the certificate names 127.0.0.1, so it serves for both)."""
    paths = Paths(root)
    paths.etc.mkdir(parents=True)
    shutil.copytree(first.paths.pki, paths.pki, dirs_exist_ok=True)
    paths.admin_token.write_text(TOKEN + "\n")
    ports = {"admin": free_port(), "agent": free_port(), "gateway": free_port()}
    return Install(root, paths, paths.server_config, ports, first.ca)


async def node_seen_at(inst: Install, after: float) -> bool:
    """Whether ``inst``'s admin API shows node-1 with a heartbeat later than ``after`` (unix s)."""
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        r = await c.get(f"{inst.admin}/api/v1/nodes", timeout=5)
    r.raise_for_status()
    return any(n["id"] == "node-1" and (n["last_seen"] or 0) > after for n in r.json())


async def term_of(inst: Install) -> int:
    """The leadership term ``inst``'s control plane last read (``GET /api/v1/health``), 0 for none."""
    async with httpx.AsyncClient() as c:
        r = await c.get(f"{inst.admin}/api/v1/health", timeout=5)
    r.raise_for_status()
    return int(r.json().get("term") or 0)


async def test_the_agent_moves_to_the_other_control_plane_when_its_own_stops(
    tmp_path: Path, pg_cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    url = pg_cluster.new_schema()
    # each its own cluster.name: both were the machine's hostname, which the product logs as an error
    # (two control planes overwriting one row, one election holder's name)
    first = make_install(tmp_path / "cp1", store={"url": url}, cluster={"name": "cp-one"})
    second = standby_of(first, tmp_path / "cp2")
    second.write(store={"url": url}, cluster={"name": "cp-two"})
    if rendezvous("node-1", [first.agent_url, second.agent_url])[0] != first.agent_url:
        first, second = second, first  # the agent's home (rendezvous-ranked) is the one stopped below
    cert, key = first.ca.issue_client("node-1").write(tmp_path / "agent", "node-1")
    inv, fake = declared_node(tmp_path)
    cfg = AgentConfig.model_validate(
        {
            "server": first.agent_url,
            "servers": [second.agent_url],
            "node_id": "node-1",
            "tls": {"ca": first.paths.pki / "ca.pem", "cert": cert, "key": key},
            "discovery": {"inventory_file": str(inv)},
            "engines": {"llamacpp": {"binary": str(fake)}},
            "heartbeat_interval_s": 0.3,
        }
    )
    stop = asyncio.Event()
    async with serving(second):
        async with serving(first):
            agent = asyncio.create_task(run_agent(cfg, Paths(tmp_path / "node"), stop=stop))
            try:
                # Registered through the first; the second reads the same database and knows the node,
                # and the leader's term (read every second: a reply with an older one is refused by the
                # agent as from a stale database, a failed cycle; CI's load once delayed that read).
                await until("node-1 is registered", lambda: node_seen_at(second, 0), within_s=15)
                await until("the second knows the term", lambda: term_of(second), within_s=10)
            except BaseException:
                stop.set()
                raise
        stopped = time.time()
        try:
            await until("heartbeats reach the second", lambda: node_seen_at(second, stopped + 0.5), within_s=10)
            msgs = [r.getMessage() for r in caplog.records if r.name == "llmgw.agent"]
            switch = [m for m in msgs if m.startswith(f"control plane {first.agent_url} does not answer")]
            assert len(switch) == 1, msgs
            assert switch[0].endswith(f"using {second.agent_url}")
            assert not any("no control plane answers" in m for m in msgs)  # no cycle without an answer
            assert not any("registered with" in m and second.agent_url in m for m in msgs)  # no re-register
        finally:
            stop.set()
            await asyncio.wait_for(agent, 15)
