"""The real agent loop against a real control plane (``serve`` in-process, SQLite, real mTLS):
pulses while nothing changes, the full state when it does, and what a control-plane restart and a
forgotten digest do.

The agent's engine is a stand-in script that answers ``--version`` (no model is served here: a
replica placed on the node fails to start, which is a state change the agent reports in full).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx
import pytest
import sqlalchemy as sa

from llmgw.agent.loop.loop import Agent
from llmgw.config import AgentConfig
from llmgw.control.store import SqlStore
from llmgw.control.store.schema import nodes_t
from llmgw.paths import Paths
from llmgw.protocol import desired_digest
from llmgw.tlsconf import client_context
from tests.helpers.control import TOKEN, Install, make_install, serving
from tests.helpers.nodes import declared_node
from tests.helpers.waits import until

INTERVAL_S = 0.1
"""The agent's heartbeat interval here (the test counts beats: each is this, jittered, plus the
agent's own 0.1 s between beats); the bound on a change reaching the agent is this plus the same
0.5 s of slack as at 0.3 s."""


@pytest.fixture
def install(tmp_path: Path) -> Install:
    return make_install(tmp_path / "cp", store={"url": f"sqlite:///{tmp_path / 'cp.db'}"})


def agent_config(inst: Install, tmp: Path) -> AgentConfig:
    cert, key = inst.ca.issue_client("node-1").write(tmp / "agent", "node-1")
    inv, fake = declared_node(tmp)
    return AgentConfig.model_validate({
        "server": inst.agent_url,
        "node_id": "node-1",
        "tls": {"ca": inst.paths.pki / "ca.pem", "cert": cert, "key": key},
        "discovery": {"inventory_file": str(inv)},
        "engines": {"llamacpp": {"binary": str(fake)}},
        "heartbeat_interval_s": INTERVAL_S,
    })


@pytest.fixture
async def sessions() -> AsyncIterator[list[aiohttp.ClientSession]]:
    held: list[aiohttp.ClientSession] = []
    yield held
    for s in held:
        await s.close()


async def start(
    cfg: AgentConfig, root: Path, held: list[aiohttp.ClientSession]
) -> tuple[Agent, asyncio.Task[None], asyncio.Event]:
    ctx = client_context(cfg.tls.ca, cfg.tls.cert, cfg.tls.key)
    api = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx))
    plain = aiohttp.ClientSession()
    held += [api, plain]
    agent = await asyncio.to_thread(Agent, cfg, Paths(root), api=api, plain=plain)
    stop = asyncio.Event()
    return agent, asyncio.create_task(agent.run(stop)), stop


def stored_digest(store: SqlStore) -> str:
    node = store.get_node("node-1")
    return node.digest if node is not None else ""


async def test_pulses_full_state_on_change_restart_and_forgotten_digest(
    install: Install, tmp_path: Path, sessions: list[aiohttp.ClientSession]
) -> None:
    cfg = agent_config(install, tmp_path)
    store = SqlStore.open(f"sqlite:///{tmp_path / 'cp.db'}")
    stop = asyncio.Event()
    task: asyncio.Task[None] | None = None
    try:
        async with serving(install):
            agent, task, stop = await start(cfg, tmp_path / "node", sessions)
            st = agent.state
            await until("five pulses", lambda: asyncio.sleep(0, st.pulses >= 5), within_s=15)
            assert st.fulls == 1  # the register; nothing changed since
            assert st.acked == stored_digest(store) != ""
            assert st.asked_full == 0
            assert st.interval_s == 2.0  # one node: the floor (and the agent keeps its own INTERVAL_S)

        # A control-plane restart on the same database: the digest is stored, pulses go on.
        fulls, asked = st.fulls, st.asked_full
        async with serving(install):
            pulses = st.pulses
            await until("pulses after the restart", lambda: asyncio.sleep(0, st.pulses >= pulses + 3), within_s=15)
            assert (st.fulls, st.asked_full) == (fulls, asked)

            # A digest the control plane no longer holds (a database restored, a migrated node):
            # the next pulse is answered send_full and the full state restores it.
            with store.engine.begin() as conn:
                conn.execute(sa.update(nodes_t).where(nodes_t.c.id == "node-1").values(digest=""))
            await until("asked for the full state", lambda: asyncio.sleep(0, st.asked_full == asked + 1))
            await until("the digest is back", lambda: asyncio.to_thread(lambda: stored_digest(store) == st.acked))

            # A desired change reaches the agent within one interval of the replica's placement.
            fulls = st.fulls
            async with httpx.AsyncClient(base_url=install.admin, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
                r = await c.post("/api/v1/models", json={
                    "name": "chat", "source": "http://127.0.0.1:9/chat/1/model.gguf",
                    "profiles": [{"name": "cpu", "cpu_cores": 1, "min_memory_gb": 1}],
                })
                assert r.status_code == 201, r.text
            placed: list[float] = []

            async def runner_seen() -> bool:
                rows = await asyncio.to_thread(store.list_replicas)
                if rows and not placed:
                    placed.append(time.time())
                return any(row.id in st.runners for row in rows)

            deadline = time.monotonic() + 15
            while not await runner_seen():
                assert time.monotonic() < deadline, "the replica never reached the agent"
                await asyncio.sleep(0.01)
            (row,) = store.list_replicas()
            reached_s = time.time() - row.created_at
            assert reached_s < INTERVAL_S + 0.5, reached_s  # one interval, plus the exchange and this poll
            assert st.desired_digest != desired_digest([])
            # The replica's state moved (it fails without a mirror): the agent sends its full state.
            await until("a full beat for the change", lambda: asyncio.sleep(0, st.fulls > fulls), within_s=10)
            stop.set()
            await asyncio.wait_for(task, 15)
            task = None
    finally:
        stop.set()
        if task is not None:
            await asyncio.wait_for(task, 15)
        store.close()
