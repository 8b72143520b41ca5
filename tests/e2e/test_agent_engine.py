"""A replica runner with the real llama-server and gemma-3-270m, weights from a local HTTP server.

Checks, on real processes: fetch into the node cache (sha256 verified) → starting → ready;
the engine answers ``POST /v1/chat/completions`` with the replica's key and 401 without; an agent
that goes away leaves the engine serving and the next one adopts it; after stop no process is
left; a truncated GGUF fails with llama-server's own error line in ``err``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil
import pytest
from aiohttp import web

from llmgw.agent.engines import llamacpp
from llmgw.agent.node.cache import NodeCache
from llmgw.agent.node.records import adoptable, load_records, stop_all_engines
from llmgw.agent.replicas.runner import ReplicaRunner, RunnerEnv, new_key
from llmgw.config import AgentConfig
from llmgw.protocol import ReplicaSpec, ReplicaState
from tests.conftest import Assets

pytestmark = pytest.mark.e2e

GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # scripts/assets pins it


@dataclass
class World:
    state: Path
    env: RunnerEnv
    files: str  # base URL of the file server
    files_dir: Path


@pytest.fixture
async def world(tmp_path: Path, assets: Assets) -> AsyncIterator[World]:
    files_dir = tmp_path / "files"
    files_dir.mkdir()
    os.symlink(assets.model, files_dir / "gemma.gguf")
    with (files_dir / "truncated.gguf").open("wb") as out, assets.model.open("rb") as src:
        out.write(src.read(1 << 20))
    app = web.Application()
    app.router.add_static("/", files_dir, follow_symlinks=True)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"

    state = tmp_path / "agent"
    cfg = AgentConfig.model_validate(
        {
            "server": "https://127.0.0.1:1",
            "node_id": "n",
            "tls": {"ca": "/x", "cert": "/x", "key": "/x"},
            "engines": {"llamacpp": {"binary": str(assets.llama_server)}},
        }
    )
    status, server = llamacpp.probe(cfg, state)
    assert server is not None, status.detail
    async with aiohttp.ClientSession() as session:
        env = RunnerEnv(
            agent_state=state,
            advertise_address="127.0.0.1",
            cores=psutil.cpu_count() or 1,
            has_gpus=False,
            cache=NodeCache(state / "cache"),
            session=session,
            engine=server,
            start_deadline_s=120,
            stop_grace_s=10,
        )
        try:
            yield World(state, env, base, files_dir)
        finally:
            stop_all_engines(state, grace_s=5)  # whatever a failing test left
            await runner.cleanup()


def gemma_spec(world: World, rid: str = "r-1", **kw: object) -> ReplicaSpec:
    fields: dict[str, object] = {
        "id": rid,
        "model": "gemma",
        "version": "q4",
        "profile": "cpu",
        "engine": "llamacpp",
        "source_url": f"{world.files}/gemma.gguf",
        "sha256": GEMMA_SHA256,
        "file_name": "gemma.gguf",
        "args": ["--ctx-size", "2048"],
        "cpu_cores": 1,
        "key": new_key(),
    }
    return ReplicaSpec.model_validate(fields | kw)


async def chat(
    session: aiohttp.ClientSession, endpoint: str, key: str | None
) -> tuple[int, dict[str, object]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "gemma", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    async with session.post(f"http://{endpoint}/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_ready_serves_with_key_and_stops_clean(world: World) -> None:
    spec = gemma_spec(world)
    runner = ReplicaRunner(spec, world.env)
    runner.start()
    assert await runner.wait_settled() == ReplicaState.READY, runner.err
    status = runner.status()
    assert status.endpoint.startswith("127.0.0.1:")
    assert status.pid is not None
    assert (world.state / "cache" / "gemma" / "q4" / "gemma.gguf").is_file()
    engine = psutil.Process(status.pid)
    assert spec.key not in engine.cmdline()  # the key goes by file, not argv
    assert engine.pid == os.getpgid(engine.pid)  # its own session and group

    code, body = await chat(world.env.session, status.endpoint, spec.key)
    assert code == 200, body
    assert body["choices"]
    code, _ = await chat(world.env.session, status.endpoint, None)
    assert code == 401
    code, _ = await chat(world.env.session, status.endpoint, "wrong")
    assert code == 401

    await runner.stop()
    assert runner.state == ReplicaState.STOPPED
    assert gone(status.pid)
    assert load_records(world.state) == []


async def test_engine_outlives_the_agent_and_is_adopted(world: World) -> None:
    spec = gemma_spec(world, "r-adopt")
    first = ReplicaRunner(spec, world.env)
    first.start()
    assert await first.wait_settled() == ReplicaState.READY, first.err
    pid = first.pid
    assert pid is not None
    await first.detach()  # the agent goes away
    assert not gone(pid)

    (record,) = adoptable(world.state)
    assert record.pid == pid
    second = ReplicaRunner.adopt(record, world.env)
    assert await second.wait_settled() == ReplicaState.READY, second.err
    code, _ = await chat(world.env.session, second.status().endpoint, spec.key)
    assert code == 200
    await second.stop()
    assert gone(pid)
    assert load_records(world.state) == []


async def test_truncated_gguf_fails_with_the_engines_own_error(world: World) -> None:
    spec = gemma_spec(
        world, "r-bad", source_url=f"{world.files}/truncated.gguf", sha256="", file_name="bad.gguf"
    )
    runner = ReplicaRunner(spec, world.env)
    runner.start()
    assert await runner.wait_settled() == ReplicaState.FAILED
    assert "llama-server exited with code 1 before it was ready: error loading model" in runner.err
    assert "failed to load model" in runner.err or "error loading model" in runner.err, runner.err
    assert runner.pid is not None
    assert gone(runner.pid)
    assert load_records(world.state) == []


async def test_engine_killed_while_serving_is_reported(world: World) -> None:
    runner = ReplicaRunner(gemma_spec(world, "r-kill"), world.env)
    runner.start()
    assert await runner.wait_settled() == ReplicaState.READY, runner.err
    assert runner.pid is not None
    os.kill(runner.pid, signal.SIGKILL)
    for _ in range(100):
        if runner.state == ReplicaState.FAILED:
            break
        await asyncio.sleep(0.1)
    assert runner.state == ReplicaState.FAILED
    assert "llama-server exited on signal SIGKILL (9)" in runner.err
    assert "while serving" in runner.err
    assert load_records(world.state) == []
    await runner.stop()


async def test_taken_port_is_retried_with_another(world: World) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks = iter([taken.getsockname()[1]])
        world.env.port_picker = lambda host: next(picks, None) or llamacpp.free_port(host)
        runner = ReplicaRunner(gemma_spec(world, "r-port"), world.env)
        runner.start()
        assert await runner.wait_settled() == ReplicaState.READY, runner.err
        assert runner.port != taken.getsockname()[1]
        await runner.stop()


async def test_a_stream_in_flight_ends_within_a_second_of_the_stop(world: World) -> None:
    """On SIGTERM llama-server stops generating but, with a stream open, never exits by itself: it
    held the connection silent until the agent's SIGKILL, 10 s later (a drained replica's stream, an
    operator's finding). llama.cpp's grace (LlamaCppEngine.stop_grace_s) is 1 s: the stream ends
    soon after the stop, however long the agent's grace (10 s here)."""
    spec = gemma_spec(world, "r-stream")
    runner = ReplicaRunner(spec, world.env)
    runner.start()
    assert await runner.wait_settled() == ReplicaState.READY, runner.err
    endpoint = runner.status().endpoint
    body = {"model": "gemma", "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 2000,
            "stream": True, "logit_bias": {"1": -100, "106": -100}}  # gemma's end tokens banned: it runs on
    first = asyncio.Event()
    ended = 0.0

    async def read() -> None:
        nonlocal ended
        async with world.env.session.post(f"http://{endpoint}/v1/chat/completions", json=body,
                                          headers={"Authorization": f"Bearer {spec.key}"}) as resp:
            with contextlib.suppress(aiohttp.ClientError):
                async for _ in resp.content:
                    first.set()
        ended = asyncio.get_running_loop().time()

    reader = asyncio.create_task(read())
    await asyncio.wait_for(first.wait(), 60)
    stopped = asyncio.get_running_loop().time()
    await runner.stop()
    await asyncio.wait_for(reader, 10)
    assert ended - stopped < 3.0, f"the stream ended {ended - stopped:.1f} s after the stop"
    assert runner.state == ReplicaState.STOPPED


async def test_an_engine_started_unpinned_is_pinned_once_its_cores_are_free(world: World) -> None:
    """A replica that starts while its cores are held (a profile change starts the new replica
    before the old one stops) runs unpinned; it stayed so for its whole life, spinning on cores the
    replicas placed after it were pinned to (an operator's finding). Once the cores are free, the
    agent's next beat pins it (pin_if_free): every thread of the engine, and its record."""
    from llmgw.agent.node.pinning import CoreAllocator  # noqa: PLC0415

    world.env.cpus = CoreAllocator([0, 1])
    old = ReplicaRunner(gemma_spec(world, "r-old", cpu_cores=2), world.env)
    old.start()
    assert await old.wait_settled() == ReplicaState.READY, old.err
    assert old.cpus == [0, 1]
    new = ReplicaRunner(gemma_spec(world, "r-new"), world.env)  # 1 core, none free
    new.start()
    assert await new.wait_settled() == ReplicaState.READY, new.err
    assert new.cpus == []
    assert new.pin_if_free() is False  # still none free
    await old.stop()
    assert new.pin_if_free() is True
    assert new.cpus == [0]
    assert new.pid is not None
    threads = psutil.Process(new.pid).threads()
    assert {tuple(os.sched_getaffinity(t.id)) for t in threads} == {(0,)}
    assert [r.cpus for r in load_records(world.state) if r.id == "r-new"] == [[0]]
    assert new.pin_if_free() is False  # pinned once
    code, _ = await chat(world.env.session, new.status().endpoint, new.spec.key)
    assert code == 200
    await new.stop()
