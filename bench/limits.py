"""A key limited to 600 requests per minute, driven at 2,000 per minute: how many are admitted per minute.

    .venv/bin/python bench/limits.py [--minutes 2] [--rpm 600] [--drive-rpm 2000] [--phases sqlite,postgresql]

Real parts: ``llmgw server run`` as its own process(es), a key made through the admin API
(``POST /api/v1/keys``), a model whose one replica is an instant upstream in this process (a node's
heartbeat over mTLS reports it ready), and a client sending at a fixed rate through the gateway.

Phases:

1. ``sqlite``: one control plane on SQLite, every request to its gateway;
2. ``postgresql``: two control planes on one PostgreSQL 15 (a throwaway cluster run as user
   ``postgres``, as the tests do), requests alternating between their gateways, so the limit has to
   hold cluster-wide through the store (``control/gateway/accounting.py``: each control plane writes
   its counts and reads the other's every 0.5 s).

Each phase waits for a minute to begin, drives ``--minutes`` whole calendar minutes (the limiter's
windows), and counts the 200s and 429s per minute. Target: admitted per minute within
``rpm`` ± 10 % on one control plane; with two, within ± 10 % plus one second of traffic. A missing
PostgreSQL is a failure, not a skip. Figures last, one ``name: value unit`` per line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.control import TOKEN, Install, heartbeat, make_install, start_server_run, wait_admin_health

from llmgw.protocol import HeartbeatReply, ReplicaState, ReplicaStatus

ANSWER = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _upstream() -> tuple[web.AppRunner, str]:
    async def chat(_: web.Request) -> web.Response:
        return web.json_response(ANSWER)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


async def _serve_model(s: aiohttp.ClientSession, inst: Install, endpoint: str) -> str:
    """Add model ``bench`` and report its replica ready at ``endpoint`` from a simulated node; its id."""
    ctx = inst.agent_ctx("bench-node")
    async with s.post(inst.agent_url + "/agent/v1/register", data=heartbeat(), ssl=ctx) as r:
        r.raise_for_status()
    model = {"name": "bench", "source": "http://m/bench.gguf", "profiles": [{"name": "cpu"}]}
    async with s.post(inst.admin + "/api/v1/models", json=model, headers=AUTH) as r:
        assert r.status == 201, await r.text()
    for _ in range(100):
        async with s.post(inst.agent_url + "/agent/v1/heartbeat", data=heartbeat(), ssl=ctx) as r:
            reply = HeartbeatReply.model_validate_json(await r.read())
        if reply.desired:
            break
        await asyncio.sleep(0.1)
    else:
        raise SystemExit("FAIL: the control plane placed no replica of 'bench' in 10 s")
    ready = ReplicaStatus(id=reply.desired[0].id, state=ReplicaState.READY, endpoint=endpoint)
    async with s.post(inst.agent_url + "/agent/v1/heartbeat", data=heartbeat(ready), ssl=ctx) as r:
        r.raise_for_status()
    return ready.id


async def _keep_beating(s: aiohttp.ClientSession, inst: Install, endpoint: str, replica: str) -> None:
    ctx = inst.agent_ctx("bench-node")
    ready = ReplicaStatus(id=replica, state=ReplicaState.READY, endpoint=endpoint)
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            async with s.post(inst.agent_url + "/agent/v1/heartbeat", data=heartbeat(ready), ssl=ctx) as r:
                await r.read()
        await asyncio.sleep(2)


async def _wait_routed(s: aiohttp.ClientSession, gateway: str, key: str) -> None:
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(100):
        async with s.post(gateway + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status in (200, 429):
                return
        await asyncio.sleep(0.1)
    raise SystemExit(f"FAIL: {gateway} does not route 'bench' with the new key within 10 s")


async def _drive(gateways: list[str], key: str, rpm: int, minutes: int) -> dict[int, Counter[int]]:
    """Send at ``rpm`` (spread evenly, alternating gateways) for ``minutes`` whole minutes; statuses per minute."""
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {key}"}
    per_minute: dict[int, Counter[int]] = {}
    start = (int(time.time()) // 60 + 1) * 60
    end = start + 60 * minutes
    gap = 60.0 / rpm
    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as s:

        async def one(url: str) -> None:
            sent = time.time()
            async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                per_minute.setdefault(int(sent // 60) * 60, Counter())[r.status] += 1

        await asyncio.sleep(max(0.0, start - time.time()))
        n = 0
        while (t := start + n * gap) < end:
            await asyncio.sleep(max(0.0, t - time.time()))
            task = asyncio.create_task(one(gateways[n % len(gateways)]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
        await asyncio.gather(*tasks)
    return {w: c for w, c in per_minute.items() if start <= w < end}


async def _phase(name: str, installs: list[Install], args: Any) -> dict[str, float]:
    upstream, endpoint = await _upstream()
    beat: asyncio.Task[None] | None = None
    try:
        async with aiohttp.ClientSession() as s:
            replica = await _serve_model(s, installs[0], endpoint)
            spec = {"name": "bench", "rpm": args.rpm}
            async with s.post(installs[0].admin + "/api/v1/keys", json=spec, headers=AUTH) as r:
                assert r.status == 201, await r.text()
                secret = (await r.json())["secret"]
            beat = asyncio.create_task(_keep_beating(s, installs[0], endpoint, replica))
            gateways = [f"http://127.0.0.1:{i.ports['gateway']}" for i in installs]
            for g in gateways:
                await _wait_routed(s, g, secret)
            print(f"[{name}] driving {args.drive_rpm} rpm through {len(gateways)} gateway(s) "
                  f"for {args.minutes} whole minute(s) ...", flush=True)
            per_minute = await _drive(gateways, secret, args.drive_rpm, args.minutes)
    finally:
        if beat is not None:
            beat.cancel()
        await upstream.cleanup()
    admitted = [c[200] for _, c in sorted(per_minute.items())]
    refused = [c[429] for _, c in sorted(per_minute.items())]
    other = [sum(v for k, v in c.items() if k not in (200, 429)) for _, c in sorted(per_minute.items())]
    for (w, _), a, r, o in zip(sorted(per_minute.items()), admitted, refused, other, strict=True):
        print(f"[{name}] minute {time.strftime('%H:%M', time.gmtime(w))}: {a} admitted, {r} refused (429), {o} other")
    if any(other):
        raise SystemExit(f"FAIL: [{name}] answers other than 200/429: {other}")
    return {
        f"{name}_admitted_min_per_minute": float(min(admitted)),
        f"{name}_admitted_max_per_minute": float(max(admitted)),
        f"{name}_refused_per_minute": sum(refused) / len(refused),
        f"{name}_control_planes": float(len(installs)),
    }


def _start(insts: list[Install]) -> list[subprocess.Popen[bytes]]:
    procs = [start_server_run(i, (i.root / "server.log").open("wb")) for i in insts]
    for i, p in zip(insts, procs, strict=True):
        wait_admin_health(i, p)
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=int, default=2)
    ap.add_argument("--rpm", type=int, default=600)
    ap.add_argument("--drive-rpm", type=int, default=2000)
    ap.add_argument("--phases", default="sqlite,postgresql")
    args = ap.parse_args()
    figures: dict[str, float] = {}
    phases = args.phases.split(",")
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-limits-") as tmp:
        if "sqlite" in phases:
            inst = make_install(Path(tmp) / "one")
            inst.write(gateway={"listen": f"127.0.0.1:{inst.ports['gateway']}", "allow_loopback_without_key": False})
            procs = _start([inst])
            try:
                figures |= asyncio.run(_phase("sqlite", [inst], args))
            finally:
                _stop(procs)
        if "postgresql" in phases:
            from tests.helpers.postgres import start_cluster  # noqa: PLC0415

            try:
                cluster = start_cluster()
            except Exception as e:
                print(f"FAIL: no PostgreSQL for the two-control-plane phase: {e}", file=sys.stderr)
                return 1
            try:
                url = cluster.new_database()
                insts = []
                for n in ("cp1", "cp2"):
                    i = make_install(Path(tmp) / n)
                    i.write(
                        gateway={"listen": f"127.0.0.1:{i.ports['gateway']}", "allow_loopback_without_key": False},
                        store={"url": url},
                        cluster={"name": n},
                    )
                    insts.append(i)
                procs = _start(insts)
                try:
                    figures |= asyncio.run(_phase("postgresql", insts, args))
                finally:
                    _stop(procs)
            finally:
                cluster.stop()
    low, high = args.rpm * 0.9, args.rpm * 1.1
    slack = args.drive_rpm / 60  # one second of traffic
    ok = True
    for phase in phases:
        lo, hi = figures[f"{phase}_admitted_min_per_minute"], figures[f"{phase}_admitted_max_per_minute"]
        extra = slack if figures[f"{phase}_control_planes"] > 1 else 0.0
        good = low - extra <= lo and hi <= high + extra
        ok &= good
        print(f"{'PASS' if good else 'FAIL'}: {phase}: admitted {lo:.0f}..{hi:.0f} per minute, target "
              f"{args.rpm} ± 10 %{' + 1 s of traffic' if extra else ''}")
    print(f"key_rpm_limit: {args.rpm} requests/min")
    print(f"driven_rpm: {args.drive_rpm} requests/min")
    for k, v in figures.items():
        print(f"{k}: {v:g} requests/min" if "control_planes" not in k else f"{k}: {v:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
