"""The gateway's added latency, probed from a process of its own (bench/scale.py runs it).

    python bench/gwprobe.py DIRECT_URL GATEWAY_URL --body JSON [--n N] [--warmup 50]

Alternating POSTs, one straight to an upstream and one through the gateway to it, a steady
trickle (:data:`PAUSE_S` between pairs, not a load test), until standard input reaches its end
*and* at least ``--n`` pairs were measured after ``--warmup``; then one JSON line on standard
output: ``{"direct": [ms, ...], "gateway": [ms, ...], "at": [unix s, ...]}`` (``at``: when each
measured pair started, for a caller that splits the run into windows). Exits 1 naming the URL and status of an
answer other than 200.

Why a process of its own: in bench/scale.py the probe had shared the simulator's event loop with
5,000 simulated agents, whose beats, collections and stalls (up to ~90 ms in a burst) landed inside
the probe's own timings, on both sides but unevenly: the figure measured the simulator as much as
the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time

import aiohttp

PAUSE_S = 0.005
"""Seconds between two pairs (bench/scale.py's trickle)."""


async def probe(
    direct: str, gateway: str, body: bytes, n: int, warmup: int
) -> tuple[list[float], list[float], list[float]]:
    """Pairs until standard input ends and ``n`` were measured; (direct ms, gateway ms, unix s each
    pair started)."""
    loop = asyncio.get_running_loop()
    stdin_done = asyncio.Event()

    def wait_stdin() -> None:
        while os.read(0, 65536):  # returns at end of input: the caller's "stop" (unbuffered: a
            pass  # buffered read would hold stdin's lock, which a failing probe's shutdown then waits for)
        loop.call_soon_threadsafe(stdin_done.set)

    # A daemon thread, not the loop's executor: a probe that fails exits at once, not when its
    # caller closes standard input (asyncio.run would wait for the executor's thread).
    threading.Thread(target=wait_stdin, daemon=True).start()
    d_ms: list[float] = []
    g_ms: list[float] = []
    at: list[float] = []
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as sd, aiohttp.ClientSession() as sg:
        i = 0
        while not stdin_done.is_set() or len(g_ms) < n:
            started = time.time()
            for url, session, out in ((direct, sd, d_ms), (gateway, sg, g_ms)):
                t0 = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise SystemExit(f"{url} answered {r.status}: {(await r.text())[:300]}")
                if i >= warmup:
                    out.append((time.perf_counter() - t0) * 1000)
            if i >= warmup:
                at.append(started)
            i += 1
            await asyncio.sleep(PAUSE_S)
    return d_ms, g_ms, at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("direct")
    ap.add_argument("gateway")
    ap.add_argument("--n", type=int, default=300, help="pairs measured at least")
    ap.add_argument("--warmup", type=int, default=50, help="pairs not measured first")
    ap.add_argument("--body", required=True, help="the chat request both sides get (JSON)")
    args = ap.parse_args()
    d_ms, g_ms, at = asyncio.run(probe(args.direct, args.gateway, args.body.encode(), args.n, args.warmup))
    print(json.dumps({"direct": d_ms, "gateway": g_ms, "at": at}), flush=True)


if __name__ == "__main__":
    main()
