"""What a judgment costs on this machine: gemma-3-270m as a ``prompted`` judge on a real llama-server.

Starts llama-server (``-np 1 --cache-ram 0 --swa-full --threads 2``, as init's judge profile plus
``--swa-full`` for a sliding-window model; ``--slot-save-path`` only so the slot can be erased for a
cold sample), then, for short prompts:

- **cold**: the slot erased before each judgment, so the whole judge prompt is prefilled;
- **warm**: judgment after judgment, so the fixed instruction comes from the slot's cache
  (``cache_prompt``: llama-server's per-slot prefix reuse);

each through :class:`llmgw.guard.judge.JudgeClient` (what the gateway calls: the answer streamed
and the connection closed once the verdict is known). Reports p50/p95 of the judge time, the
engine's own time (llama-server's ``timings``: prompt + generation, up to the verdict), the tokens
reused, and what judging adds beyond the engine's own time (target <= 10 ms), with a bare aiohttp
POST of the same body, read the same way, beside it to show how much of that is HTTP and
llama-server's own request handling rather than llmgw. Then a **burst**: ``--burst`` judgments at
once under a ``--budget`` (5 s, the default policy's): how many were judged, refused at once as
``busy`` (admission), or timed out, and how long a refusal took.

    python bench/judge.py [--n 20] [--burst 16] [--budget 5]

Prints its figures last, one ``name: value unit`` per line, ``judge_warm_p50_s`` (target <= 0.5 s on
2 cores) the very last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

from llmgw.errors import JudgeError
from llmgw.guard.config import Direction
from llmgw.guard.formats import PROMPTED
from llmgw.guard.judge import JudgeClient, JudgeRoute
from llmgw.routing import Upstream

CACHE = Path(os.environ.get("LLMGW_ASSETS", Path.home() / ".cache" / "llmgw"))
SERVER = Path(os.environ.get("LLAMA_SERVER") or CACHE / "llama-cpp-0.3.36-rpc" / "bin" / "llama-server")
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


async def bare_judgment(session: aiohttp.ClientSession, up: Upstream, body: dict[str, object]) -> float:
    """One streamed judgment with nothing of llmgw's client: the engine's ms up to the verdict."""
    text, eng = "", 0.0
    async with session.post(f"http://{up.endpoint}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {KEY}"}) as r:
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            t = event.get("timings") or {}
            eng = float(t.get("prompt_ms", 0)) + float(t.get("predicted_ms", 0)) or eng
            for ch in event.get("choices") or []:
                text += (ch.get("delta") or {}).get("content") or ""
            if PROMPTED.decided(PROMPTED.answer(text, PROMPTED.prefill), Direction.IN) is not None:
                r.close()
                break
    return eng


async def burst_judgments(client: JudgeClient, n: int, budget_s: float) -> dict[str, float]:
    """``n`` judgments at once under ``budget_s``: judged, refused busy, timed out; refusal time."""
    async def one(i: int) -> tuple[str, float]:
        t0 = time.perf_counter()
        try:
            await client.judge(["j"], Direction.IN, f"{PROMPTS[i % len(PROMPTS)]} <{i}>", budget_s=budget_s)
            kind = "judged"
        except JudgeError as e:
            kind = e.kind
        return kind, (time.perf_counter() - t0) * 1000

    results = await asyncio.gather(*(one(i) for i in range(n)))
    refused = [ms for kind, ms in results if kind == "busy"]
    judged = [ms for kind, ms in results if kind == "judged"]
    return {
        "burst_judged": sum(1 for k, _ in results if k == "judged"),
        "burst_refused_busy": len(refused),
        "burst_timed_out": sum(1 for k, _ in results if k == "timeout"),
        "burst_judged_max_ms": max(judged, default=0.0),
        "burst_refusal_max_ms": max(refused, default=0.0),
    }


async def bench(port: int, n: int, burst_n: int, budget_s: float) -> dict[str, float]:
    up = Upstream("bench", f"127.0.0.1:{port}", KEY)
    client = JudgeClient({"j": JudgeRoute("j", "prompted", (up,))}.get)
    res: dict[str, list[float]] = {k: [] for k in (
        "cold_ms", "cold_engine_ms", "warm_ms", "warm_engine_ms", "warm_added_ms", "cold_added_ms",
        "bare_ms", "bare_engine_ms", "bare_added_ms", "warm_cached")}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as bare:
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
            # The same body on a bare aiohttp POST, read until the verdict is known: HTTP + llama-server.
            body = PROMPTED.request(Direction.IN, text + " bare")
            t0 = time.perf_counter()
            eng = await bare_judgment(bare, up, body)
            ms = (time.perf_counter() - t0) * 1000
            res["bare_ms"].append(ms)
            res["bare_engine_ms"].append(eng)
            res["bare_added_ms"].append(ms - eng)
        burst = await burst_judgments(client, burst_n, budget_s)
    await client.close()
    out: dict[str, float] = {}
    for k, xs in res.items():
        out[f"{k}_p50"] = statistics.median(xs)
        out[f"{k}_p95"] = pct(xs, 0.95)
    out["llmgw_added_over_bare_p50_ms"] = out["warm_added_ms_p50"] - out["bare_added_ms_p50"]
    out |= burst
    out["judge_warm_p50_s"] = out["warm_ms_p50"] / 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--burst", type=int, default=16, help="judgments sent at once in the burst")
    ap.add_argument("--budget", type=float, default=5.0, help="the burst's budget per judgment (s)")
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
            figures = asyncio.run(bench(port, args.n, args.burst, args.budget))
        finally:
            proc.terminate()
            proc.wait(10)
    print(f"judge: gemma-3-270m Q4_K_M as 'prompted', {args.n} judgments each, {os.cpu_count()} cores")
    for k, v in figures.items():
        if k == "judge_warm_p50_s":
            print(f"{k}: {v:.3f} s")
        elif k.startswith("burst_") and not k.endswith("_ms"):
            print(f"{k}: {v:.0f} judgments")
        else:
            print(f"{k}: {v:.1f} {'tokens' if 'cached' in k else 'ms'}")


if __name__ == "__main__":
    main()
