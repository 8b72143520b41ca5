"""What the gateway adds to a request: direct vs through the gateway, side by side in one run.

    python bench/gateway_overhead.py [--n 5000] [--seconds 10] [--events 1000]

Starts two subprocesses on loopback: an *instant upstream* (an aiohttp app answering a fixed
``chat.completion`` JSON, or an SSE stream when the body asks ``"stream": true``) and the *gateway*
(``build_gateway_app`` with a StaticRouter pointing at it). Then, from this process:

1. latency: ``--n`` non-streamed requests to each, alternating direct/gateway, over one keep-alive
   aiohttp client each (after a warm-up); p50/p95 of both, the added median, and the gateway's own
   ``x-llmgw-overhead-ms`` median;
2. throughput: requests/s at concurrency 16 for ``--seconds`` each (the load generator is Python on
   the same cores, so both figures are bounded by it; compare them, don't quote them alone);
3. streams: CPU per SSE event of the gateway process relaying ``--events`` events (from
   ``/proc``-backed psutil counters), and, for the choice of upstream client, CPU per event of an
   aiohttp vs an httpx (async) client reading the same stream in this process.

Figures are printed last, one ``name: value unit`` per line. The target is <= 5 ms added at p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import psutil
from aiohttp import web

KEY = "sk-bench"
ANSWER = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
    }
).encode()
BODY = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "Say ok."}]}).encode()
EVENT = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}]}\n\n'
)


# -- the two servers (subprocesses) ----------------------------------------------------------------


async def _serve(app: web.Application, port_file: Path) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    await asyncio.to_thread(port_file.write_text, str(runner.addresses[0][1]))
    await asyncio.Event().wait()


def upstream_app(events: int) -> web.Application:
    """The instant upstream: a fixed answer, or ``events`` SSE events ~1 ms apart (one per network chunk)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b'"stream": true' not in body:
            return web.Response(body=ANSWER, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(events):
            await resp.write(EVENT)
            await asyncio.sleep(0.001)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def gateway_app(upstream_port: int) -> web.Application:
    """The gateway with one model, ``bench``, on the upstream."""
    from llmgw.control.gateway.app import build_gateway_app  # noqa: PLC0415 - only the gateway process needs it
    from llmgw.routing import Route, StaticRouter, Upstream  # noqa: PLC0415

    router = StaticRouter({"bench": Route("bench", (Upstream("r1", f"127.0.0.1:{upstream_port}", "k"),))})
    return build_gateway_app(router, keys={KEY}, allow_loopback_without_key=False)


def _spawn(args: list[str], port_file: Path) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([sys.executable, __file__, *args, "--port-file", str(port_file)])
    deadline = time.monotonic() + 20
    while not port_file.exists() or not port_file.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{args[1]} did not start")
        time.sleep(0.05)
    return proc, int(port_file.read_text())


# -- measurements ----------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def latency(direct: str, gateway: str, n: int) -> tuple[list[float], list[float], list[float]]:
    """Alternating sequential requests; returns (direct ms, gateway ms, gateway self-reported ms)."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    d_ms: list[float] = []
    g_ms: list[float] = []
    own: list[float] = []
    async with aiohttp.ClientSession() as sd, aiohttp.ClientSession() as sg:
        for i in range(n + 200):
            for url, session, out in ((direct, sd, d_ms), (gateway, sg, g_ms)):
                t0 = time.perf_counter()
                async with session.post(url, data=BODY, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
                took = (time.perf_counter() - t0) * 1000
                if i >= 200:  # warm-up
                    out.append(took)
                    if session is sg:
                        own.append(float(r.headers["x-llmgw-overhead-ms"]))
    return d_ms, g_ms, own


async def throughput(url: str, seconds: float, concurrency: int = 16) -> float:
    """Requests/s with ``concurrency`` workers on one keep-alive client for ``seconds``."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < end:
                async with session.post(url, data=BODY, headers=headers) as r:
                    await r.read()
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


STREAM_BODY = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "x"}], "stream": True},
    separators=(", ", ": "),
).encode()


async def relay_cpu(gateway: str, gateway_pid: int, events: int) -> float:
    """CPU µs the gateway process spends per SSE event it relays."""
    proc = psutil.Process(gateway_pid)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:
        before = sum(proc.cpu_times()[:2])
        async with s.post(gateway, data=STREAM_BODY, headers=headers) as r:
            async for _ in r.content.iter_any():
                pass
        after = sum(proc.cpu_times()[:2])
    return (after - before) / events * 1e6


async def client_cpu(url: str, events: int) -> tuple[float, float]:
    """CPU µs per event reading the upstream's SSE here: (aiohttp iter_any, httpx aiter_raw)."""
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:
        t0 = time.process_time()
        async with s.post(url, data=STREAM_BODY, headers=headers) as r:
            async for _ in r.content.iter_any():
                pass
        a = time.process_time() - t0
    async with httpx.AsyncClient() as c:
        t0 = time.process_time()
        async with c.stream("POST", url, content=STREAM_BODY, headers=headers) as resp:
            async for _ in resp.aiter_raw():
                pass
        h = time.process_time() - t0
    return a / events * 1e6, h / events * 1e6


def main() -> None:
    """Run the comparison (or, with ``--role``, be one of the two servers)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=5000, help="sequential requests to each side")
    ap.add_argument("--seconds", type=float, default=10.0, help="throughput run per side (s)")
    ap.add_argument("--events", type=int, default=1000, help="SSE events per stream")
    ap.add_argument("--role", choices=["upstream", "gateway"], help=argparse.SUPPRESS)
    ap.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "upstream":
        asyncio.run(_serve(upstream_app(args.events), args.port_file))
        return
    if args.role == "gateway":
        asyncio.run(_serve(gateway_app(args.upstream_port), args.port_file))
        return

    with tempfile.TemporaryDirectory() as tmp:
        up, up_port = _spawn(["--role", "upstream", "--events", str(args.events)], Path(tmp) / "up")
        gw, gw_port = _spawn(["--role", "gateway", "--upstream-port", str(up_port)], Path(tmp) / "gw")
        try:
            direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
            gateway = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
            print(f"cores: {os.cpu_count()}; {args.n} requests each side, alternating", flush=True)
            d_ms, g_ms, own = asyncio.run(latency(direct, gateway, args.n))
            print(f"throughput, concurrency 16, {args.seconds:g} s each", flush=True)
            d_rps = asyncio.run(throughput(direct, args.seconds))
            g_rps = asyncio.run(throughput(gateway, args.seconds))
            print(f"streams of {args.events} events", flush=True)
            relay_us = asyncio.run(relay_cpu(gateway, gw.pid, args.events))
            aio_us, httpx_us = asyncio.run(client_cpu(direct, args.events))
        finally:
            for p in (gw, up):
                p.terminate()
                p.wait(10)

    d50, g50 = statistics.median(d_ms), statistics.median(g_ms)
    figures = [
        ("direct_p50", d50, "ms"),
        ("direct_p95", _pct(d_ms, 0.95), "ms"),
        ("gateway_p50", g50, "ms"),
        ("gateway_p95", _pct(g_ms, 0.95), "ms"),
        ("overhead_p50", g50 - d50, "ms"),
        ("gateway_self_reported_overhead_p50", statistics.median(own), "ms"),
        ("direct_rps_c16", d_rps, "req/s"),
        ("gateway_rps_c16", g_rps, "req/s"),
        ("gateway_relay_cpu_per_event", relay_us, "us"),
        ("client_cpu_per_event_aiohttp", aio_us, "us"),
        ("client_cpu_per_event_httpx", httpx_us, "us"),
    ]
    for name, value, unit in figures:
        print(f"{name}: {value:.3f} {unit}" if unit == "ms" else f"{name}: {value:.0f} {unit}")


if __name__ == "__main__":
    main()
