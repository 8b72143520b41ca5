"""What the gateway adds to a request: direct, through llmgw's gateway, and through LiteLLM's proxy,
side by side in one run against the same instant upstream.

    python bench/gateway_overhead.py [--n 5000] [--rounds 5] [--pairs 3] [--seconds 10] [--events 1000] [--no-litellm]

Starts on loopback: an *instant upstream* (an aiohttp app answering a fixed ``chat.completion``
JSON, or an SSE stream when the body asks ``"stream": true``), the *gateway* as the control plane
builds it, with everything on (:func:`gateway_app_for_bench`: a stored key with limits looked up in
memory, the limiter, usage accounting synced to a SQLite store every 0.5 s, Prometheus metrics and the
access log written to a file), and *LiteLLM's proxy* (``litellm[proxy]`` ==:data:`LITELLM_VERSION` in its
own venv under ``~/.cache/llmgw/bench``, made on first use; one worker, a master key, the upstream as an
``openai/`` model). Then, from this process:

1. latency: ``--n`` non-streamed requests to each, alternating direct/gateway, over one keep-alive
   aiohttp client each (after a warm-up), in ``--rounds`` rounds; p50/p95 of both over all rounds, the
   added median (and each round's, with the load then: the spread), and the gateway's own
   ``x-llmgw-overhead-ms`` median; LiteLLM's added median from ``--n``/10 requests the same way;
2. throughput: requests/s at concurrency 16 for ``--seconds`` each, driven by ``wrk`` (a C load
   generator; ``apt-get install wrk`` when missing, a failure when that fails), ``-t2 -c16``: direct,
   gateway, LiteLLM; then ``--pairs`` - 1 more runs of gateway and LiteLLM back to back, and
   ``rps_vs_litellm_ratio``, the median of each pair's ratio (each printed, with the load);
3. streams: CPU per SSE event of the gateway process relaying ``--events`` events (from
   ``/proc``-backed psutil counters), and, for comparison with the gateway's own client to the
   replicas (control/gateway/replicaclient.py), CPU per event of an aiohttp vs an httpx (async)
   client reading the same stream in this process.

Targets: added p50 <= :data:`TARGET_ADDED_MS` and gateway requests/s >= :data:`TARGET_RATIO` x LiteLLM's;
each is printed as PASS/FAIL and a FAIL exits 1. Figures are printed last, one ``name: value unit`` per
line, with the load average at the start and the end (the machine is shared: the added milliseconds
grow with its load, the ratio much less, and ``gateway_cpu_per_request``, the gateway process's CPU
time per request during its ``wrk`` run, least).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx
import psutil
import yaml
from aiohttp import web

KEY = "sk-bench"
TARGET_ADDED_MS = 0.5
TARGET_RATIO = 40.0
LITELLM_VERSION = "1.108.7"  # what PyPI (as this machine reaches it) installs with [proxy]
LITELLM_KEY = "sk-bench-master"
CACHE = Path.home() / ".cache" / "llmgw" / "bench"
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


async def _serve(app: web.Application, port_file: Path, *, as_control_plane: bool = False) -> None:
    """Serve ``app`` on a free loopback port and write the port to ``port_file``. ``as_control_plane``:
    with the settings the control plane serves its gateway with (``llmgw.control.server``: a handler
    cancelled when its client goes away, idle connections kept 75 s), so the bench measures them."""
    runner = (
        web.AppRunner(app, access_log=None, handler_cancellation=True, keepalive_timeout=75.0)
        if as_control_plane
        else web.AppRunner(app, access_log=None)
    )
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

    async def props(_: web.Request) -> web.Response:
        # llama-server's slot count, which the gateway reads once: more slots than wrk's 16
        # connections, so throughput measures the gateway, not a wait for a slot.
        return web.json_response({"total_slots": 64})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/props", props)
    return app


def gateway_app_for_bench(upstream_port: int, state: Path) -> web.Application:
    """The gateway with one model, ``bench``, on the upstream, and what the control plane adds around it:
    :data:`KEY` as a stored key (``rpm``/``tpm`` limits set high enough never to refuse, so the limiter
    runs on every request), usage accounting synced to a SQLite store in ``state`` every 0.5 s, the
    Prometheus metrics (routing decisions and queue waits included), the access log (to ``state/access.log``),
    and the shutdown's drain (its middleware and ``on_response_prepare`` hook, as the control plane adds them)."""
    import logging  # noqa: PLC0415 - only the gateway process needs these

    from llmgw.apikeys import key_digest, key_prefix  # noqa: PLC0415
    from llmgw.control.api.metrics import ControlPlaneMetrics  # noqa: PLC0415
    from llmgw.control.gateway.accesslog import log_exchange  # noqa: PLC0415
    from llmgw.control.gateway.accounting import Accounting  # noqa: PLC0415
    from llmgw.control.gateway.app import build_gateway_app  # noqa: PLC0415
    from llmgw.control.gateway.callers import Callers  # noqa: PLC0415
    from llmgw.control.gateway.drain import Drain  # noqa: PLC0415
    from llmgw.control.gateway.inspect import Exchange  # noqa: PLC0415
    from llmgw.control.gateway.keys import GatewayKeys  # noqa: PLC0415
    from llmgw.control.gateway.limits import Limiter  # noqa: PLC0415
    from llmgw.control.store import open_store  # noqa: PLC0415
    from llmgw.control.store.offloop import OffLoop  # noqa: PLC0415
    from llmgw.control.store.rows import ApiKeyRow  # noqa: PLC0415
    from llmgw.routing import Route, StaticRouter, Upstream  # noqa: PLC0415

    logging.basicConfig(filename=state / "access.log", level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = open_store(f"sqlite:///{state / 'bench.db'}")
    store.add_key(ApiKeyRow("bench", key_prefix(KEY), key_digest(KEY), rpm=10**9, tpm=10**12, created_at=time.time()))
    callers, limiter = Callers(GatewayKeys(None)), Limiter()
    accounting = Accounting(store, OffLoop(), "bench", callers, limiter)
    metrics = ControlPlaneMetrics()
    observers = (accounting.observe, log_exchange, metrics.observe)

    def observe(ex: Exchange) -> None:
        for each in observers:
            each(ex)

    router = StaticRouter({"bench": Route("bench", (Upstream("r1", f"127.0.0.1:{upstream_port}", "k"),))})
    app = build_gateway_app(router, keys=(), allow_loopback_without_key=False, observe=observe,
                            callers=callers, limiter=limiter, routing_metrics=metrics)

    async def _accounting(_: web.Application) -> AsyncIterator[None]:
        await accounting.sync()
        stop = asyncio.Event()
        task = asyncio.create_task(accounting.run(stop))
        yield
        stop.set()
        await task

    app.cleanup_ctx.append(_accounting)
    drain = Drain()
    app.middlewares.append(drain.middleware)
    app.on_response_prepare.append(drain.on_prepare)
    return app


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


async def latency(
    direct: str, gateway: str, n: int, key: str = KEY
) -> tuple[list[float], list[float], list[float]]:
    """Alternating sequential requests; returns (direct ms, gateway ms, gateway self-reported ms)."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
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
                    if session is sg and "x-llmgw-overhead-ms" in r.headers:
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


def ensure_wrk() -> str:
    """The ``wrk`` binary; installed with apt-get when missing. Exits with a message when that fails."""
    found = shutil.which("wrk")
    if found:
        return found
    print("wrk is missing: apt-get install -y wrk", flush=True)
    r = subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], capture_output=True, text=True, check=False)
    found = shutil.which("wrk")
    if r.returncode or not found:
        raise SystemExit(f"FAIL: wrk (the load generator) cannot be installed: {r.stderr.strip()[-300:]}")
    return found


_WRK_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def wrk_run(
    wrk: str, url: str, key: str, seconds: float, tmp: Path, pid: int | None = None
) -> tuple[float, float, float]:
    """``wrk -t2 -c16`` POSTing :data:`BODY` to ``url`` with ``key``: (requests/s, p50 ms, CPU µs per request
    of process ``pid`` during the run, NaN without one: user + system time from psutil, which the machine's
    load skews much less than requests/s)."""
    script = tmp / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(BODY.decode())}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {key}"\n'
    )
    proc = psutil.Process(pid) if pid is not None else None
    cpu0 = sum(proc.cpu_times()[:2]) if proc is not None else 0.0
    out = subprocess.run(
        [wrk, "-t2", "-c16", f"-d{seconds:g}s", "--latency", "-s", str(script), url],
        capture_output=True, text=True, check=True,
    ).stdout
    cpu = sum(proc.cpu_times()[:2]) - cpu0 if proc is not None else float("nan")
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    done = re.search(r"(\d+) requests in", out)
    p50 = re.search(r"\s50%\s+([\d.]+)(us|ms|s)\b", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if rps is None or p50 is None or done is None:
        raise SystemExit(f"FAIL: cannot read wrk's output:\n{out}")
    if bad:
        raise SystemExit(f"FAIL: {url} answered {bad.group(1)} non-2xx responses under wrk:\n{out}")
    per_request = cpu / max(1, int(done.group(1))) * 1e6
    return float(rps.group(1)), float(p50.group(1)) * _WRK_UNITS[p50.group(2)], per_request


def base_python() -> Path:
    """The interpreter this bench runs on, a venv's base resolved (``/usr/bin/python3.11``, or a pyenv
    build): LiteLLM's venv is made from it, so that both sides run on one Python (a distribution's
    build with PGO/LTO ran pure-Python code ~19% faster here than pyenv's default build)."""
    return Path(getattr(sys, "_base_executable", sys.executable)).resolve()


def litellm_venv() -> Path:
    """LiteLLM's proxy in a venv of its own, made from :func:`base_python` once and kept in
    :data:`CACHE` (one per interpreter); its ``litellm`` binary."""
    py = base_python()
    tag = hashlib.sha256(str(py).encode()).hexdigest()[:8]
    venv = CACHE / f"litellm-{LITELLM_VERSION}-py{sys.version_info.major}{sys.version_info.minor}-{tag}"
    binary = venv / "bin" / "litellm"
    if binary.exists():
        return binary
    print(f"installing litellm[proxy]=={LITELLM_VERSION} into {venv} (once; a few minutes)", flush=True)
    subprocess.run([str(py), "-m", "venv", str(venv)], check=True)
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"litellm[proxy]=={LITELLM_VERSION}"],
                       capture_output=True, text=True, check=False)
    if r.returncode or not binary.exists():
        shutil.rmtree(venv, ignore_errors=True)
        raise SystemExit(f"FAIL: litellm[proxy]=={LITELLM_VERSION} cannot be installed: {r.stderr.strip()[-500:]}")
    return binary


def start_litellm(binary: Path, upstream_port: int, tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    """LiteLLM's proxy, one worker, model ``bench`` on the upstream, master key :data:`LITELLM_KEY`."""
    port = _free_port()
    config = tmp / "litellm.yaml"
    config.write_text(yaml.safe_dump({
        "model_list": [{"model_name": "bench", "litellm_params": {
            "model": "openai/bench", "api_base": f"http://127.0.0.1:{upstream_port}/v1", "api_key": "k"}}],
        "general_settings": {"master_key": LITELLM_KEY},
        "litellm_settings": {"telemetry": False},
    }))
    log = (tmp / "litellm.log").open("wb")
    proc = subprocess.Popen(
        [str(binary), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True"},  # offline: no fetch
    )
    deadline = time.monotonic() + 240
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/liveliness", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"FAIL: LiteLLM's proxy did not start; its log: {tmp / 'litellm.log'}")
        time.sleep(0.5)


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    ap.add_argument("--rounds", type=int, default=5, help="latency rounds (--n split over them; spread)")
    ap.add_argument("--pairs", type=int, default=3, help="wrk runs of gateway then LiteLLM (ratio: their median)")
    ap.add_argument("--seconds", type=float, default=10.0, help="throughput run per side (s)")
    ap.add_argument("--events", type=int, default=1000, help="SSE events per stream")
    ap.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM column (no ratio)")
    ap.add_argument("--role", choices=["upstream", "gateway"], help=argparse.SUPPRESS)
    ap.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "upstream":
        asyncio.run(_serve(upstream_app(args.events), args.port_file))
        return
    if args.role == "gateway":
        app = gateway_app_for_bench(args.upstream_port, args.port_file.parent)
        asyncio.run(_serve(app, args.port_file, as_control_plane=True))
        return

    wrk = ensure_wrk()
    litellm = None if args.no_litellm else litellm_venv()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        up, up_port = _spawn(["--role", "upstream", "--events", str(args.events)], tmp / "up")
        (tmp / "gw").mkdir()
        gw, gw_port = _spawn(["--role", "gateway", "--upstream-port", str(up_port)], tmp / "gw" / "port")
        procs = [gw, up]
        try:
            direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
            gateway = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
            load_start = os.getloadavg()
            print(f"cores: {os.cpu_count()}; load {_load(load_start)}; Python {platform.python_version()} "
                  f"({base_python()}, gateway and LiteLLM); {args.n} requests each side, alternating", flush=True)
            d_ms, g_ms, own, rounds = [], [], [], []
            for _ in range(args.rounds):  # pooled for the figures; each round's added median shows the spread
                d, g, o = asyncio.run(latency(direct, gateway, max(1, args.n // args.rounds)))
                d_ms += d
                g_ms += g
                own += o
                rounds.append((statistics.median(g) - statistics.median(d), os.getloadavg()[0]))
            print(f"throughput with wrk -t2 -c16, {args.seconds:g} s each", flush=True)
            d_rps, _, d_cpu = wrk_run(wrk, direct, KEY, args.seconds, tmp, up.pid)
            g_rps, _, g_cpu = wrk_run(wrk, gateway, KEY, args.seconds, tmp, gw.pid)
            l_rps = l_added = float("nan")
            pairs: list[tuple[float, float, float]] = []  # (gateway req/s, LiteLLM req/s, load) per wrk pair
            if litellm is not None:
                print("starting LiteLLM's proxy (one worker)", flush=True)
                lp, l_port = start_litellm(litellm, up_port, tmp)
                procs.append(lp)
                proxy = f"http://127.0.0.1:{l_port}/v1/chat/completions"
                ld_ms, l_ms, _ = asyncio.run(latency(direct, proxy, max(100, args.n // 10), key=LITELLM_KEY))
                l_added = statistics.median(l_ms) - statistics.median(ld_ms)
                l_rps, _, _ = wrk_run(wrk, proxy, LITELLM_KEY, args.seconds, tmp)
                pairs.append((g_rps, l_rps, os.getloadavg()[0]))
                for _ in range(args.pairs - 1):  # more pairs back to back: both sides see the same load
                    g_more, _, _ = wrk_run(wrk, gateway, KEY, args.seconds, tmp)
                    l_more, _, _ = wrk_run(wrk, proxy, LITELLM_KEY, args.seconds, tmp)
                    pairs.append((g_more, l_more, os.getloadavg()[0]))
            print(f"streams of {args.events} events", flush=True)
            relay_us = asyncio.run(relay_cpu(gateway, gw.pid, args.events))
            aio_us, httpx_us = asyncio.run(client_cpu(direct, args.events))
            usage_rows = _usage_rows(tmp / "gw" / "bench.db")
            load_end = os.getloadavg()
        finally:
            for p in procs:
                p.terminate()
                p.wait(15)

    d50, g50 = statistics.median(d_ms), statistics.median(g_ms)
    added = g50 - d50
    ratio = statistics.median(g / lite for g, lite, _ in pairs) if pairs else float("nan")
    figures = [
        ("direct_p50", d50, "ms"),
        ("direct_p95", _pct(d_ms, 0.95), "ms"),
        ("gateway_p50", g50, "ms"),
        ("gateway_p95", _pct(g_ms, 0.95), "ms"),
        ("added_p50_ms", added, "ms"),
        ("gateway_self_reported_overhead_p50", statistics.median(own), "ms"),
        ("litellm_added_p50_ms", l_added, "ms"),
        ("direct_rps_c16", d_rps, "req/s"),
        ("gateway_rps_c16", g_rps, "req/s"),
        ("litellm_rps_c16", l_rps, "req/s"),
        ("usage_requests_written", float(usage_rows), "requests"),
        ("upstream_cpu_per_request", d_cpu, "us"),
        ("gateway_cpu_per_request", g_cpu, "us"),
        ("gateway_relay_cpu_per_event", relay_us, "us"),
        ("client_cpu_per_event_aiohttp", aio_us, "us"),
        ("client_cpu_per_event_httpx", httpx_us, "us"),
    ]
    ok = added <= TARGET_ADDED_MS
    print(f"{'PASS' if ok else 'FAIL'}: added p50 {added:.3f} ms (target <= {TARGET_ADDED_MS:g} ms)")
    if litellm is not None:
        ok &= ratio >= TARGET_RATIO
        print(f"{'PASS' if ratio >= TARGET_RATIO else 'FAIL'}: gateway {ratio:.1f}x LiteLLM's req/s, the median of "
              f"{len(pairs)} pairs (first: {g_rps:.0f} vs {l_rps:.0f}; target >= {TARGET_RATIO:g}x)")
    for name, value, unit in figures:
        print(f"{name}: {value:.3f} {unit}" if unit == "ms" else f"{name}: {value:.0f} {unit}")
    print("added_p50_ms by round (load 1 m): " + ", ".join(f"{a:.3f} ({load:.1f})" for a, load in rounds))
    if pairs:
        print("rps_vs_litellm_ratio by pair (gateway/LiteLLM req/s, load 1 m): "
              + ", ".join(f"{g / lite:.1f} ({g:.0f}/{lite:.0f}, {load:.1f})" for g, lite, load in pairs))
    print(f"rps_vs_litellm_ratio: {ratio:.1f}")
    print(f"load_start: {_load(load_start)}")
    print(f"load_end: {_load(load_end)}")
    sys.exit(0 if ok else 1)


def _load(avg: tuple[float, float, float]) -> str:
    """``os.getloadavg()`` as ``1m/5m/15m`` (runnable processes; this machine's cores are ``os.cpu_count()``)."""
    return "/".join(f"{x:.2f}" for x in avg)


def _usage_rows(db: Path) -> int:
    """Requests the gateway's accounting wrote to its store (proof that usage was on)."""
    import sqlite3  # noqa: PLC0415

    with contextlib.closing(sqlite3.connect(db)) as conn:
        row = conn.execute("SELECT COALESCE(SUM(requests), 0) FROM usage_daily").fetchone()
    return int(row[0])


if __name__ == "__main__":
    main()
