"""An agent that goes silent does not take its healthy engine down.

Real processes: the control plane (:func:`~llmgw.control.server.serve`: agent API over mTLS,
leader, gateway) in this process, ``llmgw agent`` as a child process, and the real llama-server
with gemma-3-270m that the agent launches. ``node_lost_after_s`` is 2 s here (30 s by default).

The agent is frozen with SIGSTOP for well past ``node_lost_after_s``: the node goes ``lost``, but
its engine still answers the control plane's health probe, so its replica stays and every request
through the gateway meanwhile is answered. After SIGCONT the agent reports again and keeps the
very same engine (same pid and start time, same replica id and key): nothing was killed or
replaced. Then the agent is killed and a new one starts only once the node is lost: it adopts the
same engine. (Before the fix the replica was deleted as soon as the node was lost: the gateway
answered 503 until a new engine had loaded, and the returning agent stopped the old one.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import yaml

from llmgw.agent.node.records import load_records, stop_all_engines
from llmgw.proctime import SAME_START_S, since_boot
from tests.conftest import Assets
from tests.e2e.agent_world import GEMMA_SHA256, AgentProcess
from tests.helpers.control import TOKEN, make_install, serving
from tests.helpers.net import serve_files
from tests.helpers.waits import until

pytestmark = pytest.mark.e2e

GB = 1_000_000_000
LOST_AFTER_S = 2.0
FROZEN_S = 9.0  # > 4 x node_lost_after_s: the node is surely lost, and several leader passes run


@dataclass
class World:
    admin: str
    gateway: str
    agent: AgentProcess

    async def api(self, path: str) -> Any:
        async with (
            aiohttp.ClientSession() as s,
            s.get(self.admin + path, headers={"Authorization": f"Bearer {TOKEN}"}) as r,
        ):
            assert r.status == 200, await r.text()
            return await r.json()

    async def ask(self, session: aiohttp.ClientSession) -> tuple[int, str]:
        body = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
        async with session.post(
            self.gateway + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)
        ) as r:
            return r.status, await r.text()


async def lost(w: World) -> bool:
    return bool((await w.api("/api/v1/nodes"))[0]["state"] == "lost")




@pytest.fixture
async def world(tmp_path: Path, assets: Assets) -> AsyncIterator[World]:
    inst = make_install(tmp_path, node_lost_after_s=LOST_AFTER_S)
    paths, ca, ports = inst.paths, inst.ca, inst.ports
    files_dir = tmp_path / "files"
    files_dir.mkdir()
    os.symlink(assets.model, files_dir / "gemma.gguf")
    files_runner, files_url = await serve_files(files_dir)

    node_root = tmp_path / "node"
    cert, key = ca.issue_client("node-1").write(node_root / "etc", "agent")
    inv = node_root / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"cores": 2, "memory_total_bytes": 8 * GB, "memory_available_bytes": 8 * GB}))
    config = node_root / "etc" / "agent.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": f"https://127.0.0.1:{ports['agent']}",
                "node_id": "node-1",
                "tls": {"ca": str(paths.pki / "ca.pem"), "cert": str(cert), "key": str(key)},
                "discovery": {"inventory_file": str(inv)},
                "engines": {"llamacpp": {"binary": str(assets.llama_server)}},
                "heartbeat_interval_s": 0.5,
            }
        )
    )
    agent = AgentProcess(node_root, config, tmp_path / "agent.log")

    async with serving(inst):
        w = World(inst.admin, f"http://127.0.0.1:{ports['gateway']}", agent)
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                w.admin + "/api/v1/models",
                headers={"Authorization": f"Bearer {TOKEN}"},
                json={
                    "name": "m",
                    "source": f"{files_url}/gemma.gguf",
                    "sha256": GEMMA_SHA256,
                    "profiles": [
                        {"name": "cpu", "min_memory_gb": 1, "cpu_cores": 1, "args": ["--ctx-size", "512", "-np", "1"]}
                    ],
                },
            ) as r,
        ):
            assert r.status == 201, await r.text()
        try:
            yield w
        finally:
            if agent.proc is not None and agent.proc.poll() is None:
                agent.proc.send_signal(signal.SIGCONT)
            agent.term()
            stop_all_engines(agent.agent_state, grace_s=5)
    await files_runner.cleanup()


async def test_frozen_agent_keeps_its_engine_serving_and_adopts_it_back(world: World) -> None:
    w = world
    w.agent.start()
    assert w.agent.proc is not None

    async def ready() -> list[dict[str, Any]]:
        reps = [r for r in await w.api("/api/v1/replicas?model=m") if r["state"] == "ready"]
        return reps if reps and load_records(w.agent.agent_state) else []

    (replica,) = await until("the replica is ready", ready, 180)
    (record,) = load_records(w.agent.agent_state)
    pid, started = record.pid, since_boot(psutil.Process(record.pid))

    async with aiohttp.ClientSession() as session:
        status, text = await w.ask(session)
        assert status == 200, text

        w.agent.proc.send_signal(signal.SIGSTOP)  # a paused agent (a debugger, a VM pause, a frozen cgroup)
        frozen_at = time.monotonic()
        answers: list[tuple[int, str]] = []
        states: set[str] = set()
        while time.monotonic() - frozen_at < FROZEN_S:
            answers.append(await w.ask(session))
            states.add((await w.api("/api/v1/nodes"))[0]["state"])
            await asyncio.sleep(0.3)
        # The node was lost meanwhile (so the scenario happened), yet every request was answered.
        assert "lost" in states, states
        assert [s for s, _ in answers if s != 200] == [], [t for s, t in answers if s != 200][:2]
        assert len(answers) >= 3
        reps = await w.api("/api/v1/replicas?model=m")
        assert [(r["id"], r["state"]) for r in reps] == [(replica["id"], "ready")]

        w.agent.proc.send_signal(signal.SIGCONT)

        async def back() -> bool:
            return bool((await w.api("/api/v1/nodes"))[0]["state"] == "ready")

        await until("the node reports again", back, 30)
        await asyncio.sleep(2.0)  # a few heartbeats and leader passes after its return
        status, text = await w.ask(session)
        assert status == 200, text

        reps = await w.api("/api/v1/replicas?model=m")
        assert [(r["id"], r["state"], r["restarts"]) for r in reps] == [(replica["id"], "ready", 0)]
        (after,) = load_records(w.agent.agent_state)
        assert (after.id, after.pid) == (replica["id"], pid)
        assert since_boot(psutil.Process(pid)) == pytest.approx(started, abs=SAME_START_S)  # the very same engine

        # The agent dies and a new one starts only after the node was lost: it adopts the engine.
        w.agent.kill9()
        await until("the node is lost", lambda: lost(w), 30)
        status, text = await w.ask(session)
        assert status == 200, text
        w.agent.start()
        await until("the node reports again", back, 30)
        await asyncio.sleep(2.0)
        status, text = await w.ask(session)
        assert status == 200, text

    reps = await w.api("/api/v1/replicas?model=m")
    assert [(r["id"], r["state"], r["restarts"]) for r in reps] == [(replica["id"], "ready", 0)]
    (after,) = load_records(w.agent.agent_state)
    assert (after.id, after.pid) == (replica["id"], pid)
    assert since_boot(psutil.Process(pid)) == pytest.approx(started, abs=SAME_START_S)
    log = w.agent.log.read_text()
    assert f"replica {replica['id']}: adopting llama-server pid {pid}" in log
    assert "stopping" not in log
