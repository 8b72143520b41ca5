"""What a judgment costs on this machine: gemma-3-270m as a ``prompted`` judge on a real llama-server.

Starts llama-server (``-np 1 --cache-ram 0 --swa-full --threads 2``, as init's judge profile plus
``--swa-full`` for a sliding-window model; ``--slot-save-path`` only so the slot can be erased for a
cold sample), then, for short prompts:

- **cold**: the slot erased before each judgment, so the whole judge prompt is prefilled;
- **warm**: judgment after judgment, so the fixed instruction comes from the slot's cache
  (``cache_prompt``: llama-server's per-slot prefix reuse);

each through :class:`llmgw.guard.judge.JudgeClient` (what the gateway calls). Reports p50/p95 of the
judge time, the engine's own time (llama-server's ``timings``: prompt + generation), the tokens
reused, and what judging adds beyond the engine's own time (target <= 10 ms), with a bare aiohttp
POST of the same body beside it to show how much of that is HTTP and llama-server's own request
handling rather than llmgw.

    python bench/judge.py [--n 20]

Prints its figures last, one ``name: value unit`` per line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

from llmgw.control.routing import Upstream
from llmgw.guard.config import Direction
from llmgw.guard.formats import PROMPTED
from llmgw.guard.judge import JudgeClient, JudgeRoute

CACHE = Path(os.environ.get("LLMGW_ASSETS", Path.home() / ".cache" / "llmgw"))
SERVER = Path(os.environ.get("LLAMA_SERVER") or CACHE / "llama-server-0.3.36" / "bin" / "llama-server")
MODEL = Path(os.environ.get("MODEL") or CACHE / "models" / "gemma-3-270m-q4_k_m.gguf")
KEY = "bench-key"
PROMPTS = [
    "What is the capital of France?", "How do I sort a list in Python?", "Write a haiku about rain.",
    "Explain TCP slow start briefly.", "What's a good name for a cat?", "How many legs does a spider have?",
    "Translate 'good morning' to German.", "Summarise the plot of Hamlet in one line.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * p))]


async def bench(port: int, n: int) -> dict[str, float]:
    up = Upstream("bench", f"127.0.0.1:{port}", KEY)
    client = JudgeClient({"j": JudgeRoute("j", "prompted", (up,))}.get)
    res: dict[str, list[float]] = {k: [] for k in (
        "cold_ms", "cold_engine_ms", "warm_ms", "warm_engine_ms", "warm_added_ms", "cold_added_ms",
        "bare_ms", "bare_engine_ms", "bare_added_ms", "warm_cached")}
    async with aiohttp.ClientSession() as bare:
        async def erase() -> None:
            async with bare.post(f"http://{up.endpoint}/slots/0?action=erase",
                                 headers={"Authorization": f"Bearer {KEY}"}) as r:
                r.raise_for_status()

        await client.judge(["j"], Direction.IN, "warm-up", budget_s=120)  # template check, first load
        for i in range(n):
            text = PROMPTS[i % len(PROMPTS)] + f" ({i})"
            await erase()
            j = await client.judge(["j"], Direction.IN, text, budget_s=120)
            res["cold_ms"].append(j.ms)
            res["cold_engine_ms"].append(j.engine_ms or 0)
            res["cold_added_ms"].append(j.ms - (j.engine_ms or 0))
        for i in range(n):
            text = PROMPTS[i % len(PROMPTS)] + f" [{i}]"
            j = await client.judge(["j"], Direction.IN, text, budget_s=120)
            res["warm_ms"].append(j.ms)
            res["warm_engine_ms"].append(j.engine_ms or 0)
            res["warm_added_ms"].append(j.ms - (j.engine_ms or 0))
            res["warm_cached"].append(j.cached_tokens)
            # The same body on a bare aiohttp POST: HTTP + llama-server's own handling, no llmgw.
            body = PROMPTED.request(Direction.IN, text + " bare")
            t0 = time.perf_counter()
            async with bare.post(f"http://{up.endpoint}/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {KEY}"}) as r:
                data = await r.json()
            ms = (time.perf_counter() - t0) * 1000
            t = data["timings"]
            eng = t["prompt_ms"] + t["predicted_ms"]
            res["bare_ms"].append(ms)
            res["bare_engine_ms"].append(eng)
            res["bare_added_ms"].append(ms - eng)
    await client.close()
    out: dict[str, float] = {}
    for k, xs in res.items():
        out[f"{k}_p50"] = statistics.median(xs)
        out[f"{k}_p95"] = pct(xs, 0.95)
    out["llmgw_added_over_bare_p50_ms"] = out["warm_added_ms_p50"] - out["bare_added_ms_p50"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20)
    args = ap.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as slots:
        proc = subprocess.Popen(
            [str(SERVER), "-m", str(MODEL), "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY,
             "-np", "1", "--ctx-size", "8192", "--cache-ram", "0", "--swa-full", "--threads", "2",
             "--no-webui", "--slot-save-path", slots],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("llama-server did not start")
                time.sleep(0.2)
            figures = asyncio.run(bench(port, args.n))
        finally:
            proc.terminate()
            proc.wait(10)
    print(f"judge: gemma-3-270m Q4_K_M as 'prompted', {args.n} judgments each, {os.cpu_count()} cores")
    for k, v in figures.items():
        unit = "tokens" if "cached" in k else "ms"
        print(f"{k}: {v:.1f} {unit}")


if __name__ == "__main__":
    main()
