"""Heartbeat latency while the catalog grows.

A real control plane (``python -m llmgw server run`` as its own process, SQLite store, its own CA)
and 200 simulated agents in this process, each with its own client certificate from the cluster
CA, beating over real mTLS at 80-100 % of the ``interval_s`` the server asks for (2 s, growing
with the cluster: ``max(2, nodes / 50)``), each on its own keep-alive connection like the real
agent. Like the real agent, each sends a pulse (its state's digest) while its state is the one the
control plane acknowledged, its full state otherwise or when asked (``send_full``), and the
digest of the desired list it applied. Every agent reports its desired replicas as ``ready`` on
its next heartbeat, so the burst also drives state changes (routing refreshes, leader passes).

Phases, each measured from the agents' side (request sent to reply read):

1. ``idle``: all 200 registered, beating, no models (``IDLE_S``);
2. ``burst``: 50 models (a CPU profile, ``scaling.min`` 2: 100 replicas) are added through the
   admin API one after the other as fast as it answers, then until every replica is reported
   ``ready`` (and at least ``SETTLE_S``);
3. ``after``: ``AFTER_S`` more seconds of plain heartbeats with 50 models and 100 replicas.

Besides latency: the control plane's CPU per heartbeat (``server_cpu_ms_per_beat_*``: its CPU
seconds over the beats answered in the phase; ``..._above_quiet_*``: less what it spends with no
agent at all, measured for ``QUIET_S`` first) and the share of pulses.

Target: ``heartbeat_p99_ms`` (the burst's p99) <= 100 ms. The figures measured before
the fix (store and reconcile work on the event loop) are in ``llmgw.control.store.offloop``'s docstring.
Figures last, one ``name: value unit`` per line, ``heartbeat_p99_ms`` the last one.

    .venv/bin/python bench/heartbeats.py [--agents 200] [--models 50] [--full] [--rate 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import psutil

from llmgw import tlsconf
from llmgw.paths import Paths
from llmgw.protocol import (
    EngineStatus,
    Heartbeat,
    HeartbeatReply,
    Inventory,
    ProvisionState,
    Pulse,
    ReplicaState,
    ReplicaStatus,
    state_digest,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers.control import TOKEN, make_install

GB = 1_000_000_000
RATE = [50.0]  # --rate: server.yaml's cluster.max_heartbeats_per_s
FULL = [False]  # --full: every beat a full heartbeat (as agents before pulses), for comparison
QUIET_S = 4.0
IDLE_S = 8.0
SETTLE_S = 6.0
AFTER_S = 10.0
BURST_TIMEOUT_S = 180.0


@dataclass
class Samples:
    """Latencies (ms) by phase, and errors seen."""

    phase: str = "warmup"
    ms: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    ready: set[str] = field(default_factory=set)
    lag: dict[str, list[float]] = field(default_factory=dict)
    pulses: dict[str, int] = field(default_factory=dict)
    interval_s: float = 0.0

    def add(self, ms: float, pulse: bool) -> None:
        self.ms.setdefault(self.phase, []).append(ms)
        if pulse:
            self.pulses[self.phase] = self.pulses.get(self.phase, 0) + 1


def install(root: Path, agents: int) -> tuple[Paths, dict[str, int], list[ssl.SSLContext]]:
    inst = make_install(root, cluster={"max_heartbeats_per_s": RATE[0]})
    certs = root / "agents"
    contexts = []
    for i in range(agents):
        cert, key = inst.ca.issue_client(f"node-{i:03d}").write(certs, f"node-{i:03d}")
        contexts.append(tlsconf.client_context(inst.paths.pki / "ca.pem", cert, key))
    return inst.paths, inst.ports, contexts


def heartbeat(i: int, desired: list[str], desired_dg: str) -> Heartbeat:
    return Heartbeat(
        inventory=Inventory(cores=8, memory_total_bytes=32 * GB, memory_available_bytes=30 * GB),
        labels={"zone": f"z{i % 4}"},
        engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")],
        replicas=[
            ReplicaStatus(id=r, state=ReplicaState.READY, endpoint=f"127.0.0.1:{20000 + n}")
            for n, r in enumerate(desired)
        ],
        instance=f"bench-{i:03d}",
        desired_digest=desired_dg,
    )


async def post(s: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, bytes]:
    async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.read()


async def agent(i: int, ctx: ssl.SSLContext, url: str, samples: Samples, stop: asyncio.Event) -> None:
    """One simulated agent: beat, record the latency, report what it was told to run as ready."""
    desired: list[str] = []
    desired_dg, acked = "", ""
    interval = 2.0
    await asyncio.sleep(random.uniform(0, interval))  # agents do not start in lockstep
    conn = aiohttp.TCPConnector(ssl=ctx, limit=1)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as s:
        while not stop.is_set():
            hb = heartbeat(i, desired, desired_dg)
            digest = state_digest(hb)
            full = hb.model_dump_json().encode()
            pulse = digest == acked and not FULL[0]
            small = Pulse(digest=digest, instance=hb.instance, desired_digest=desired_dg)
            body = small.model_dump_json().encode() if pulse else full
            t = time.perf_counter()
            try:
                status, text = await post(s, url, body)
                if status == 200 and pulse and HeartbeatReply.model_validate_json(text).send_full:
                    pulse = False
                    status, text = await post(s, url, full)
                ms = (time.perf_counter() - t) * 1000
                if status != 200:
                    samples.errors.append(f"node-{i:03d}: {status} {text[:200]!r}")
                else:
                    reply = HeartbeatReply.model_validate_json(text)
                    if not reply.desired_unchanged:
                        desired, desired_dg = [d.id for d in reply.desired], reply.desired_digest
                    acked = reply.digest
                    interval = samples.interval_s = reply.interval_s
                    samples.add(ms, pulse)
                    samples.ready.update(desired)
            except (aiohttp.ClientError, TimeoutError) as e:
                samples.errors.append(f"node-{i:03d}: {e!r}")
            left = interval * random.uniform(0.8, 1.0) - (time.perf_counter() - t)
            if left > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), left)


async def lag_probe(samples: Samples, stop: asyncio.Event) -> None:
    """This process's own event-loop lag (ms over a 10 ms sleep): what of a measured latency is the
    simulated agents' side, not the control plane's (the machine may be shared)."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.01)
        samples.lag.setdefault(samples.phase, []).append((time.perf_counter() - t - 0.01) * 1000)


def model_doc(n: int) -> dict[str, object]:
    return {
        "name": f"bench-{n:02d}",
        "source": f"http://mirror.invalid/bench-{n:02d}/1/model.gguf",
        "scaling": {"min": 2, "max": 2},
        "profiles": [{"name": "cpu", "min_memory_gb": 1, "cpu_cores": 1}],
    }


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


async def run(agents: int, models: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        _, ports, contexts = install(root, agents)
        print(f"pki: {agents} client certificates in {time.perf_counter() - t:.1f} s")
        log = (root / "server.log").open("wb")
        profile = os.environ.get("BENCH_PROFILE")  # a cProfile output path for the control plane
        prefix = ["-m", "cProfile", "-o", profile] if profile else []
        proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is measured
            [sys.executable, *prefix, "-m", "llmgw", "server", "run"],
            env={**os.environ, "LLMGW_ROOT": str(root)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        admin = f"http://127.0.0.1:{ports['admin']}"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        samples = Samples()
        stop = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        try:
            async with httpx.AsyncClient(base_url=admin, headers=auth, timeout=60) as client:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        if (await client.get("/api/v1/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if proc.poll() is not None or time.monotonic() > deadline:
                        print((root / "server.log").read_text()[-3000:])
                        raise SystemExit("the control plane did not start")
                    await asyncio.sleep(0.1)
                server = psutil.Process(proc.pid)
                cpu0 = sum(server.cpu_times()[:2])
                await asyncio.sleep(QUIET_S)  # no agent yet: what the control plane spends on its own
                quiet_cpu = (sum(server.cpu_times()[:2]) - cpu0) / QUIET_S
                url = f"https://127.0.0.1:{ports['agent']}/agent/v1/heartbeat"
                tasks = [asyncio.create_task(agent(i, c, url, samples, stop)) for i, c in enumerate(contexts)]
                tasks.append(asyncio.create_task(lag_probe(samples, stop)))
                await asyncio.sleep(4.0)  # every agent registered (staggered over one interval)
                samples.phase = "idle"
                cpu0 = sum(server.cpu_times()[:2])
                await asyncio.sleep(IDLE_S)
                idle_cpu = (sum(server.cpu_times()[:2]) - cpu0) / IDLE_S
                samples.phase = "burst"
                t0 = time.perf_counter()
                cpu0 = sum(server.cpu_times()[:2])
                add_ms = []
                for n in range(models):
                    t = time.perf_counter()
                    r = await client.post("/api/v1/models", json=model_doc(n))
                    add_ms.append((time.perf_counter() - t) * 1000)
                    if r.status_code != 201:
                        raise SystemExit(f"adding model {n}: {r.status_code} {r.text}")
                adds_s = time.perf_counter() - t0
                want = 2 * models
                while True:
                    reps = (await client.get("/api/v1/replicas")).json()
                    ready = sum(1 for x in reps if x.get("state") == "ready")
                    waited = time.perf_counter() - t0
                    if ready >= want and waited >= SETTLE_S:
                        break
                    if waited > BURST_TIMEOUT_S:
                        raise SystemExit(f"only {ready} of {want} replicas ready after {waited:.0f} s")
                    await asyncio.sleep(0.5)
                settled_s = time.perf_counter() - t0
                burst_cpu = (sum(server.cpu_times()[:2]) - cpu0) / settled_s
                samples.phase = "after"
                cpu0 = sum(server.cpu_times()[:2])
                await asyncio.sleep(AFTER_S)
                after_cpu = (sum(server.cpu_times()[:2]) - cpu0) / AFTER_S
                nodes = (await client.get("/api/v1/nodes")).json()
                lost = [nd["id"] for nd in nodes if nd["state"] != "ready"]
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
    for e in samples.errors[:5]:
        print("error:", e)
    idle, burst, after = (samples.ms.get(k, []) for k in ("idle", "burst", "after"))
    print(f"heartbeats measured: idle {len(idle)}, burst {len(burst)}, after {len(after)}")
    print(f"agents: {agents}")
    print(f"models_added: {models}")
    print(f"nodes_lost: {len(lost)}")
    print(f"heartbeat_errors: {len(samples.errors)}")
    print(f"model_add_p50_ms: {pct(add_ms, 50):.1f} ms")
    print(f"adds_s: {adds_s:.2f} s")
    print(f"all_ready_s: {settled_s:.2f} s")
    lag = samples.lag.get("burst", [])
    print(f"load_average_1m: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    print(f"server_cpu_quiet: {quiet_cpu:.2f} cores (no agents, no models)")
    print(f"server_cpu_idle: {idle_cpu:.2f} cores")
    print(f"server_cpu_burst: {burst_cpu:.2f} cores")
    print(f"server_cpu_after: {after_cpu:.2f} cores")
    print(f"interval_s_at_end: {samples.interval_s:.1f} s")
    phases = (("idle", idle_cpu, IDLE_S), ("burst", burst_cpu, settled_s), ("after", after_cpu, AFTER_S))
    for name, cores, secs in phases:
        beats = len(samples.ms.get(name, []))
        print(f"heartbeats_per_s_{name}: {beats / secs:.1f}")
        print(f"pulse_share_{name}: {samples.pulses.get(name, 0) / max(beats, 1):.2f}")
        print(f"server_cpu_ms_per_beat_{name}: {cores * secs * 1000 / max(beats, 1):.2f} ms")
        print(f"server_cpu_ms_per_beat_above_quiet_{name}: {(cores - quiet_cpu) * secs * 1000 / max(beats, 1):.2f} ms")
    print(f"agents_loop_lag_p50_ms: {pct(lag, 50):.1f} ms")
    print(f"agents_loop_lag_p99_ms: {pct(lag, 99):.1f} ms")
    print(f"heartbeat_idle_p50_ms: {pct(idle, 50):.1f} ms")
    print(f"heartbeat_idle_p99_ms: {pct(idle, 99):.1f} ms")
    print(f"heartbeat_after_p50_ms: {pct(after, 50):.1f} ms")
    print(f"heartbeat_after_p99_ms: {pct(after, 99):.1f} ms")
    print(f"heartbeat_max_ms: {max(burst):.1f} ms")
    print(f"heartbeat_p50_ms: {statistics.median(burst):.1f} ms")
    print(f"heartbeat_p99_ms: {pct(burst, 99):.1f} ms")
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--agents", type=int, default=200)
    ap.add_argument("--models", type=int, default=50)
    ap.add_argument("--rate", type=float, default=50.0, help="cluster.max_heartbeats_per_s (default 50)")
    ap.add_argument("--full", action="store_true", help="agents never send pulses (the full state every beat)")
    args = ap.parse_args()
    FULL[0], RATE[0] = args.full, args.rate
    sys.exit(asyncio.run(run(args.agents, args.models)))


if __name__ == "__main__":
    main()
