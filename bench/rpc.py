"""gemma-3-270m on one node vs split over two llama.cpp RPC workers, through llmgw, on loopback.

A control plane (served in this process) and four real agents with declared inventories: ``solo``
(2 GB free) serves the model alone; ``head``, ``w1`` and ``w2`` (0.5 GB free each, label
``split=yes``) serve it as one group of three (``nodes: 3``): ``llama-server --rpc`` on the head
over two ``rpc-server`` workers, each isolated in its own network namespace and reached through the
agents' mTLS tunnel (llmgw.agent.groups.groupnet). Every process shares this machine's cores, so the split
figure is the cost of the RPC path (serialization, the tunnel, loopback TCP), not a speed-up: a
real split exists to hold a model no one node can.

Figures, last, one ``name: value unit`` per line:
- ``solo_ready_s`` / ``group_ready_s``: the model added to its first 200 through the gateway
  (placement, engine start; for the group: workers up, the head dialing them, layers sent over RPC).
- ``solo_tokens_per_s`` / ``split_tokens_per_s``: decode speed of a 64-token completion (llama-server's
  own ``timings.predicted_per_second``), the median of 3.
- ``split_vs_solo_ratio``.

    .venv/bin/python bench/rpc.py
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers.groupworld import World, group_world

CACHE = Path(os.environ.get("LLMGW_ASSETS", Path.home() / ".cache" / "llmgw"))
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER") or CACHE / "llama-cpp-0.3.36-rpc" / "bin" / "llama-server")
MODEL = Path(os.environ.get("MODEL") or CACHE / "models" / "gemma-3-270m-q4_k_m.gguf")
ROUNDS = 3
TOKENS = 64


async def complete(gateway: str, model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": "Once upon a time, in a small village by the sea,", "max_tokens": TOKENS,
            "temperature": 0}
    async with aiohttp.ClientSession() as s, s.post(
        gateway + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=300)
    ) as r:
        got = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{model}: {r.status} {got}")
        return dict(got)


async def ready_s(w: World, model: str, profile: dict[str, Any]) -> float:
    t0 = time.monotonic()
    await w.api("POST", "/api/v1/models", {"name": model, "source": f"{w.files}/gemma.gguf", "profiles": [profile]})
    while True:
        try:
            await complete(w.gateway, model)
            return time.monotonic() - t0
        except (RuntimeError, aiohttp.ClientError):
            if time.monotonic() - t0 > 300:
                raise
            await asyncio.sleep(0.2)


async def speed(gateway: str, model: str) -> float:
    rates = []
    for _ in range(ROUNDS):
        got = await complete(gateway, model)
        timings = got.get("timings") or {}
        if "predicted_per_second" in timings:
            rates.append(float(timings["predicted_per_second"]))
        else:
            raise RuntimeError(f"{model}: the answer has no timings: {got}")
    return statistics.median(rates)


async def main() -> None:
    for path in (LLAMA_SERVER, LLAMA_SERVER.parent / "rpc-server", MODEL):
        if not path.exists():
            sys.exit(f"bench/rpc.py: {path} is missing; run scripts/assets")
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        files = tmp / "files"
        files.mkdir()
        (files / "gemma.gguf").symlink_to(MODEL)
        async with group_world(tmp, files) as w:
            w.start_agent("solo", LLAMA_SERVER, 2.0, labels={"solo": "yes"})
            for node in ("head", "w1", "w2"):
                w.start_agent(node, LLAMA_SERVER, 0.5, labels={"split": "yes"})
            for _ in range(300):  # every node registered
                if len([n for n in await w.api("GET", "/api/v1/nodes") if n["state"] == "ready"]) == 4:
                    break
                await asyncio.sleep(0.2)
            args = ["--ctx-size", "512"]
            solo = await ready_s(w, "solo", {"name": "cpu", "min_memory_gb": 1.2, "args": args,
                                             "node_selector": {"solo": "yes"}})
            solo_rate = await speed(w.gateway, "solo")
            await w.api("DELETE", "/api/v1/models/solo")
            group = await ready_s(w, "split", {"name": "rpc", "nodes": 3, "min_memory_gb": 1.2, "args": args,
                                               "node_selector": {"split": "yes"}})
            split_rate = await speed(w.gateway, "split")
            placed = await w.api("GET", "/api/v1/replicas?model=split")
            members = next(r for r in placed if r["node"])["members"]
    print("group: " + ", ".join(f"{m['node']} rank {m['rank']} {m['memory_gb']:.3f} GB" for m in members))
    print(f"solo_ready_s: {solo:.1f} s")
    print(f"group_ready_s: {group:.1f} s")
    print(f"solo_tokens_per_s: {solo_rate:.1f} tokens/s")
    print(f"split_tokens_per_s: {split_rate:.1f} tokens/s")
    print(f"split_vs_solo_ratio: {split_rate / solo_rate:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
