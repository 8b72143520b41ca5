"""Engines survive the agent and the control plane (real agent process, real llama-server, gemma).

One node, two CPU replicas placed by the real leader, served by a real ``llmgw agent`` process:

- kill -9 the agent while a request streams: the request completes, more requests are answered;
- a new agent adopts both engines (same pids, same ids) and restarts neither; the control plane
  keeps the same replicas (no remove/replace), within 2 s of the agent's start;
- restart the control plane after an "outage" longer than ``node_lost_after_s``: its first leader
  pass loses no node, and no engine restarts;
- each engine is pinned to its own core with ``--threads 1``, and keeps it across adoption;
- stopping everything leaves no engine behind.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import psutil
import pytest

from llmgw.agent.node.records import load_records, stop_all_engines
from llmgw.proctime import SAME_START_S, since_boot
from tests.conftest import Assets
from tests.e2e.agent_world import AgentProcess, ControlPlane, make_cluster
from tests.helpers.net import serve_files

pytestmark = pytest.mark.e2e


async def stream(session: aiohttp.ClientSession, endpoint: str, key: str, tokens: int) -> str:
    """A streamed chat completion; returns the text. Raises on any HTTP or stream error."""
    body = {
        "model": "gemma",
        "messages": [{"role": "user", "content": "Count from one to fifty in words."}],
        "max_tokens": tokens,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    text = []
    async with session.post(f"http://{endpoint}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


@pytest.fixture
async def cluster(tmp_path: Path, assets: Assets) -> AsyncIterator[tuple[ControlPlane, AgentProcess]]:
    files = tmp_path / "files"
    files.mkdir()
    os.symlink(assets.model, files / "gemma.gguf")
    file_runner, files_url = await serve_files(files)
    cp, agent, model = make_cluster(tmp_path, llama_server=assets.llama_server, files_url=files_url)
    await cp.start()
    assert cp.store is not None
    cp.store.add_model(model, now=cp.clock())
    try:
        yield cp, agent
    finally:
        agent.term()
        stop_all_engines(agent.agent_state, grace_s=5)
        await cp.stop()
        await file_runner.cleanup()


def last_seen(cp: ControlPlane) -> float:
    node = cp.store.get_node("node-1") if cp.store else None
    return node.last_seen if node else 0.0


def ready_pids(cp: ControlPlane) -> dict[str, int | None]:
    return {r.id: r.pid for r in cp.reported() if r.state == "ready"}


async def test_kill9_agent_and_restart_control_plane_restart_no_engine(
    cluster: tuple[ControlPlane, AgentProcess],
) -> None:
    cp, agent = cluster
    agent.start()
    await cp.wait(lambda: len(ready_pids(cp)) == 2 and all(r.state == "ready" for r in cp.replicas()), 90, "2 ready")
    rows = {r.id: r for r in cp.replicas()}
    pids = ready_pids(cp)
    started = {rid: since_boot(psutil.Process(pid)) for rid, pid in pids.items() if pid}
    assert len(started) == 2
    # Pinned: one core each, not the same one, and --threads matches; the cores are recorded.
    engines = [psutil.Process(pid) for pid in pids.values() if pid]
    affinity = [set(p.cpu_affinity()) for p in engines]
    assert [len(a) for a in affinity] == [1, 1]
    assert not affinity[0] & affinity[1]
    for p in engines:
        argv = p.cmdline()
        assert argv[argv.index("--threads") + 1] == "1"
    assert sorted(c for r in load_records(agent.agent_state) for c in r.cpus) == sorted(
        c for a in affinity for c in a
    )

    async with aiohttp.ClientSession() as session:
        first, second = rows.values()
        # A request in flight while the agent dies and a new one starts.
        inflight = asyncio.create_task(stream(session, first.endpoint, first.key, 48))
        await asyncio.sleep(0.3)
        agent.kill9()
        assert await stream(session, second.endpoint, second.key, 4)  # still answered, agent dead
        seen = last_seen(cp)
        agent.start()
        # A fresh report from the new agent (not the dead one's last), with the same engines.
        took = await cp.wait(lambda: last_seen(cp) > seen and ready_pids(cp) == pids, 10, "adopted")
        # bench/adopt.py measures the 2 s target on a quiet machine (0.6 s); the bound here leaves
        # room for a machine busy with other tests (2.8 s seen); no restart is proven by the pids.
        assert took <= 4.0, f"adoption took {took:.2f} s"
        text = await inflight
        assert len(text) > 20, text

        # The control plane kept the same replicas and the node never went lost.
        assert {r.id: (r.key, r.endpoint) for r in cp.replicas()} == {
            rid: (r.key, r.endpoint) for rid, r in rows.items()
        }
        assert (cp.lost, cp.removed) == ([], [])
        for rid, pid in pids.items():
            assert pid is not None
            assert since_boot(psutil.Process(pid)) == pytest.approx(started[rid], abs=SAME_START_S)  # the same ones
        assert [set(p.cpu_affinity()) for p in engines] == affinity

        # Restart the control plane as if it had been down for 100 s (> node_lost_after_s).
        await cp.stop()
        cp.clock_offset_s = 100.0
        inflight = asyncio.create_task(stream(session, second.endpoint, second.key, 24))
        await cp.start()
        await cp.wait(
            lambda: ready_pids(cp) == pids and all(r.state == "ready" for r in cp.replicas()), 10, "re-reported"
        )
        await asyncio.sleep(1.5)  # a few more heartbeats and leader passes
        assert (cp.lost, cp.removed) == ([], [])
        assert ready_pids(cp) == pids
        assert [r.id for r in cp.replicas()] == sorted(rows)
        assert await inflight

    agent.term()
    # The restarted agent was never refused as a second one (the refusal's words; a bare "409" also
    # matched a random port in a URL of the log).
    assert "is in use by another agent" not in agent.log.read_text()
    for pid in pids.values():
        assert pid is not None
        assert psutil.pid_exists(pid)  # SIGTERM to the agent leaves engines
    assert sorted(r.id for r in load_records(agent.agent_state)) == sorted(rows)
    stopped = stop_all_engines(agent.agent_state, grace_s=5)
    assert sorted(stopped) == sorted(p for p in pids.values() if p)
    for pid in stopped:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
