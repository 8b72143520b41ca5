"""CPU pinning: tokens/s of two CPU replicas (1 core each) under concurrent load, pinned or not.

Two replicas of gemma-3-270m on the real llama-server, each with ``cpu_cores: 1`` (so
``--threads 1``), both generating at once (one client per replica, back to back, 64 tokens per
request) for ``SECONDS`` s. Three ways:

- ``unpinned``: the scheduler places the engines' threads (the agent with ``pin=False``);
- ``agent``: the agent pins every thread of each engine to its own core (``sched_setaffinity``,
  what the agent does);
- ``cpu-range``: llama-server's own ``--cpu-range N-N --cpu-strict 1`` (compute threads only).

Tokens/s = completion tokens / wall seconds per replica. The machine is shared with other work,
so figures move by a few percent between runs; the modes are interleaved over ``ROUNDS`` rounds
and the medians reported. Figures last, one ``name: value unit`` per line.

    .venv/bin/python bench/pinning.py
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.e2e.agent_world import GEMMA_SHA256
from tests.helpers.net import serve_files

from llmgw.agent.engines import llamacpp
from llmgw.agent.node.cache import NodeCache
from llmgw.agent.node.records import stop_all_engines
from llmgw.agent.replicas.runner import ReplicaRunner, RunnerEnv, new_key
from llmgw.config import AgentConfig
from llmgw.protocol import ReplicaSpec, ReplicaState

SECONDS = float(os.environ.get("PIN_SECONDS", "12"))
ROUNDS = int(os.environ.get("PIN_ROUNDS", "2"))
CACHE = Path(os.environ.get("LLMGW_ASSETS", Path.home() / ".cache" / "llmgw"))
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER") or CACHE / "llama-cpp-0.3.36-rpc" / "bin" / "llama-server")
MODEL = Path(os.environ.get("MODEL") or CACHE / "models" / "gemma-3-270m-q4_k_m.gguf")


async def load(session: aiohttp.ClientSession, endpoint: str, key: str, until: float) -> float:
    """Back-to-back 64-token completions until ``until``; returns tokens per second."""
    tokens, t0 = 0, time.monotonic()
    body = {
        "model": "gemma",
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": 64,
        "temperature": 0.8,
    }
    while time.monotonic() < until:
        async with session.post(
            f"http://{endpoint}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            data = await resp.json()
            tokens += int(data["usage"]["completion_tokens"])
    return tokens / (time.monotonic() - t0)


async def one_mode(env: RunnerEnv, files_url: str, mode: str) -> list[float]:
    env.pin = mode == "agent"
    runners = []
    for i in range(2):
        args = ["--ctx-size", "1024", "-np", "1"]
        if mode == "cpu-range":
            args += ["--cpu-range", f"{i}-{i}", "--cpu-strict", "1"]
        spec = ReplicaSpec(
            id=f"pin-{mode}-{i}",
            model="gemma",
            version="q4",
            profile="cpu",
            engine="llamacpp",
            source_url=f"{files_url}/gemma.gguf",
            sha256=GEMMA_SHA256,
            file_name="gemma.gguf",
            args=args,
            cpu_cores=1,
            key=new_key(),
        )
        r = ReplicaRunner(spec, env)
        r.start()
        runners.append(r)
    try:
        for r in runners:
            assert await r.wait_settled() == ReplicaState.READY, r.err
        for r in runners:
            assert r.pid is not None
            print(f"  {mode} {r.spec.id}: pid {r.pid} affinity {sorted(psutil.Process(r.pid).cpu_affinity())}")
        until = time.monotonic() + SECONDS
        return list(
            await asyncio.gather(*(load(env.session, r.status().endpoint, r.spec.key, until) for r in runners))
        )
    finally:
        for r in runners:
            await r.stop()


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        files = tmp / "files"
        files.mkdir()
        os.symlink(MODEL, files / "gemma.gguf")
        file_runner, files_url = await serve_files(files)
        state = tmp / "agent"
        cfg = AgentConfig.model_validate(
            {
                "server": "https://127.0.0.1:1",
                "node_id": "n",
                "tls": {"ca": "/x", "cert": "/x", "key": "/x"},
                "engines": {"llamacpp": {"binary": str(LLAMA_SERVER)}},
            }
        )
        _, server = llamacpp.probe(cfg, state)
        assert server is not None
        results: dict[str, list[float]] = {"unpinned": [], "agent": [], "cpu-range": []}
        try:
            async with aiohttp.ClientSession() as session:
                env = RunnerEnv(
                    agent_state=state,
                    advertise_address="127.0.0.1",
                    cores=psutil.cpu_count() or 1,
                    has_gpus=False,
                    cache=NodeCache(state / "cache"),
                    session=session,
                    engine=server,
                    stop_grace_s=5,
                )
                for rnd in range(ROUNDS):
                    for mode in results:
                        rates = await one_mode(env, files_url, mode)
                        print(f"round {rnd + 1} {mode}: " + ", ".join(f"{x:.1f}" for x in rates) + " tok/s")
                        results[mode] += rates
        finally:
            stop_all_engines(state, grace_s=5)
            await file_runner.cleanup()
        print(f"cores: {psutil.cpu_count()} count; load: {SECONDS:.0f} s x {ROUNDS} rounds per mode")
        for mode, rates in results.items():
            print(f"{mode}_per_replica_median: {statistics.median(rates):.1f} tok/s")
            print(f"{mode}_per_replica_min: {min(rates):.1f} tok/s")
            print(f"{mode}_total_median: {2 * statistics.median(rates):.1f} tok/s")


if __name__ == "__main__":
    asyncio.run(main())
