"""Autoscaling on real processes: one traffic trace through the real gateway, from zero replicas and back.

    .venv/bin/python bench/autoscale.py [--max N] [--steady-s S] [--burst-s S]

A control plane (``llmgw server run``: gateway, admin API, leader with its autoscaler), one agent
(``llmgw agent``) and real llama-server replicas of gemma-3-270m (profile ``cpu``: 1 core,
``--ctx-size 1024 -np 2``, so ``scaling.target`` is 2 in flight per replica), all child processes
on loopback (the install of tests/helpers/control.py); the weights are served to the agent by a
file server in this process, as the mirror would. The node declares 4 cores and 8 GB
(``discovery.inventory_file``) so that ``--max`` 3 replicas of 1 core fit on this 2-core machine:
they share the two cores, in the autoscaled run and in the static one alike.

The catalog's windows are short so that a run fits in ~5 minutes: ``stable_window_s`` 10 (Knative:
60), ``panic_window_s`` 2 (6), ``scale_down_after_s`` 8 (300), ``scale_to_zero_after_s`` 10 (600).
The agent's heartbeat is its default, 2 s (a new replica reaches the node at its next heartbeat).

Before the trace: one request at zero replicas downloads the weights into the node's cache (its
time is ``cold_start_uncached_s``, not a target), then the model goes back to zero by itself. The
trace, all streamed chats (a ~30-token question, ``max_tokens`` 24), each client sending its next
request as soon as the last one ended:

1. **idle** ``IDLE_S`` (zero replicas);
2. **step**: ``STEADY`` clients for ``--steady-s``; the first request meets zero replicas, is held by
   the gateway (SSE comments) while one starts;
3. **burst**: ``BURST`` clients more for ``--burst-s``;
4. **idle** until the model is back at zero replicas (or ``TAIL_MAX_S``).

Then the **static** deployment: the same model held at ``--max`` replicas (``scaling.min = max``),
and the steady part's clients for ``STATIC_S``.

Figures (printed last, ``name: value``):

* ``failed_requests``: requests not answered 200 with a complete stream (``data: [DONE]``, no error
  event), whole trace and static run; target 0. Nothing is retried.
* ``cold_start_s``: the step's first request (zero replicas, weights cached) to its first token;
  target <= 5.
* ``scale_up_reaction_s``: a load step to the autoscaler's decision (its recorded ``at``), the larger
  of the step from zero (``0 → 1``) and the burst (to more than one); both in panic; target <= 2.
* ``replica_seconds_ratio``: replicas that exist (any state: placed, starting, ready, draining),
  integrated over the trace (sampled every 0.25 s), over ``max`` x the trace's length; target <= 0.5.
* ``ttft_p95_s`` and ``static_ttft_p95_s``: time to the first content token, p95, of the steady
  part's requests sent after the cold-start request's first token (those before were held), and of
  the static run's; ``ttft_p95_ratio`` their quotient, target <= 1.5.
* ``load_avg_1m``: ``os.getloadavg()`` at the end (the machine is shared; figures move with it).

Exits 1 when a figure misses its target. About 4.5 minutes here (warm-up ~40 s, trace ~120 s, the
static run ~60 s with its start); figures and their reading in docs/install.md ("Autoscaling").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers.control import TOKEN, Install, make_install, start_server_run, wait_admin_health
from tests.helpers.net import serve_files

from llmgw.agent.node.records import stop_all_engines
from llmgw.paths import Paths

CACHE = Path(os.environ.get("LLMGW_ASSETS", Path.home() / ".cache" / "llmgw"))
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER") or CACHE / "llama-cpp-0.3.36-rpc" / "bin" / "llama-server")
MODEL = Path(os.environ.get("MODEL") or CACHE / "models" / "gemma-3-270m-q4_k_m.gguf")

NAME = "gemma"
SLOTS = 2  # -np: scaling.target defaults to it
STEADY = 2  # clients in the steady part: one replica's slots
BURST = 4  # clients added by the burst: 6 in flight, 3 replicas' slots
IDLE_S = 30.0  # before the step: a quiet night, compressed
TAIL_MAX_S = 90.0
STATIC_S = 30.0
SCALING = {"min": 0, "stable_window_s": 10.0, "panic_window_s": 2.0, "scale_down_after_s": 8.0,
           "scale_to_zero_after_s": 10.0}
QUESTION = "In two sentences, why do rivers bend into meanders over time?"
MAX_TOKENS = 24


@dataclass
class Answer:
    """One request: ``sent`` (monotonic s), status (0: the connection failed), ttft and total (s)."""

    sent: float
    status: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    error: str = ""


@dataclass
class Run:
    """What the trace saw: answers, the replica count over time, the phases' start times."""

    answers: list[Answer] = field(default_factory=list)
    counts: list[tuple[float, int]] = field(default_factory=list)  # (monotonic s, replicas existing)


class Admin:
    """The admin API over aiohttp (bearer token)."""

    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.s, self.base = session, base

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        async with self.s.request(method, self.base + path, json=body,
                                  headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            text = await r.text()
            if r.status >= 300:
                raise SystemExit(f"FAIL: {method} {path}: HTTP {r.status}: {text[:300]}")
            return json.loads(text) if text else None

    async def replicas(self) -> list[dict[str, Any]]:
        return [r for r in await self.call("GET", f"/api/v1/replicas?model={NAME}") if r["node"]]

    async def ready(self) -> int:
        return len([r for r in await self.replicas() if r["state"] == "ready" and r["draining_since"] is None])

    async def until(self, what: str, pred: Any, within_s: float) -> float:
        t0 = time.monotonic()
        while not await pred():
            if time.monotonic() - t0 > within_s:
                raise SystemExit(f"FAIL: not within {within_s:g} s: {what}; replicas {await self.replicas()}")
            await asyncio.sleep(0.2)
        return time.monotonic() - t0


async def ask(s: aiohttp.ClientSession, url: str) -> Answer:
    """One streamed chat; never raises: the :class:`Answer` says what came back."""
    body = {"model": NAME, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    a = Answer(sent=time.monotonic())
    try:
        async with s.post(url, json=body) as r:
            a.status = r.status
            if r.status != 200:
                a.error = (await r.text())[:300]
            else:
                done = False
                async for line in r.content:
                    if line.startswith(b"data: [DONE]"):
                        done = True
                    elif line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            a.status, a.error = 502, json.dumps(event)[:300]
                        for c in event.get("choices") or []:
                            if (c.get("delta") or {}).get("content") and a.ttft_s is None:
                                a.ttft_s = time.monotonic() - a.sent
                if not done and a.status == 200:
                    a.status, a.error = 599, "the stream ended without data: [DONE]"
    except (aiohttp.ClientError, TimeoutError) as e:
        a.status, a.error = 0, repr(e)
    a.total_s = time.monotonic() - a.sent
    return a


async def clients(s: aiohttp.ClientSession, url: str, n: int, until: float, out: list[Answer]) -> None:
    """``n`` clients, each sending its next request when the last one ended, until ``until`` (monotonic)."""

    async def one() -> None:
        while time.monotonic() < until:
            out.append(await ask(s, url))

    await asyncio.gather(*(one() for _ in range(n)))


async def sample(admin: Admin, run: Run, stop: asyncio.Event) -> None:
    """Replicas existing (placed on a node, any state), every 0.25 s, until ``stop``."""
    while not stop.is_set():
        with contextlib.suppress(aiohttp.ClientError):
            run.counts.append((time.monotonic(), len(await admin.replicas())))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


def replica_seconds(counts: list[tuple[float, int]], t0: float, t1: float) -> float:
    """The step function ``counts`` integrated over [t0, t1]."""
    total = 0.0
    for (at, n), (nxt, _) in zip(counts, [*counts[1:], (t1, 0)], strict=True):
        lo, hi = max(at, t0), min(nxt, t1)
        if hi > lo:
            total += n * (hi - lo)
    return total


def p95(xs: list[float]) -> float:
    """Nearest-rank p95."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.95 * len(s)))]


async def decision_at(admin: Admin, after: float, pred: Any, within_s: float = 30) -> dict[str, Any]:
    """The first decision recorded at or after ``after`` (unix s) that ``pred`` accepts."""
    found: dict[str, Any] = {}

    async def seen() -> bool:
        view = await admin.call("GET", f"/api/v1/models/{NAME}/autoscale")
        for d in reversed(view["decisions"]):  # newest first in the view
            if d["at"] >= after and pred(d):
                found.update(d)
                return True
        return False

    await admin.until("the autoscaler's decision", seen, within_s)
    return found


def write_agent(inst: Install, tmp: Path) -> tuple[Path, Path]:
    """agent.yaml for ``node-1`` (its certificate from the install's CA, a declared inventory of 4
    cores and 8 GB); returns (its LLMGW_ROOT, agent.yaml)."""
    root = tmp / "node"
    etc = root / "etc"
    etc.mkdir(parents=True)
    cert, key = inst.ca.issue_client("node-1").write(etc, "agent")
    inv = etc / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"cores": 4, "memory_total_bytes": 8 * 10**9, "memory_available_bytes": 8 * 10**9}))
    cfg = etc / "agent.yaml"
    cfg.write_text(yaml.safe_dump({
        "server": inst.agent_url, "node_id": "node-1",
        "tls": {"ca": str(inst.paths.pki / "ca.pem"), "cert": str(cert), "key": str(key)},
        "discovery": {"inventory_file": str(inv)},
        "engines": {"llamacpp": {"binary": str(LLAMA_SERVER)}},
    }))
    return root, cfg


def start_agent(cfg: Path, root: Path, out: Any) -> subprocess.Popen[bytes]:
    """``llmgw agent --config cfg`` under ``LLMGW_ROOT=root``, its output to ``out``."""
    return subprocess.Popen([sys.executable, "-m", "llmgw", "agent", "--config", str(cfg)],
                            env={**os.environ, "LLMGW_ROOT": str(root)}, stdout=out, stderr=subprocess.STDOUT)


def keep_logs(tmp: Path, to: Path) -> None:
    """Copy the control plane's and the agent's logs from ``tmp`` to ``to``."""
    to.mkdir(parents=True, exist_ok=True)
    for name in ("cp.log", "agent.log"):
        (to / name).write_bytes((tmp / name).read_bytes())


async def trace(admin: Admin, s: aiohttp.ClientSession, url: str, args: argparse.Namespace) -> dict[str, float]:
    """The traced part (module docstring) once the model is at zero with its weights cached."""
    run = Run()
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(admin, run, stop))
    t0 = time.monotonic()
    print(f"trace: idle {IDLE_S:g} s", flush=True)
    await asyncio.sleep(IDLE_S)
    step_wall, step = time.time(), time.monotonic()
    print(f"trace: step to {STEADY} clients for {args.steady_s:g} s", flush=True)
    steady: list[Answer] = []
    steady_task = asyncio.create_task(clients(s, url, STEADY, step + args.steady_s + args.burst_s, steady))
    up0 = await decision_at(admin, step_wall - 0.01, lambda d: d["from_n"] == 0 and d["to_n"] >= 1)

    async def one_ready() -> bool:
        return await admin.ready() >= 1

    await admin.until("the first replica ready", one_ready, 120)
    first_rep = min((r for r in await admin.replicas() if r["ready_at"]), key=lambda r: r["ready_at"])
    await asyncio.sleep(max(0.0, step + args.steady_s - time.monotonic()))
    burst_wall, burst_at = time.time(), time.monotonic()
    print(f"trace: burst, {BURST} clients more for {args.burst_s:g} s", flush=True)
    burst: list[Answer] = []
    burst_task = asyncio.create_task(clients(s, url, BURST, burst_at + args.burst_s, burst))
    up1 = await decision_at(admin, burst_wall - 0.01, lambda d: d["to_n"] > max(d["from_n"], 1))
    await asyncio.gather(steady_task, burst_task)
    print("trace: idle until zero replicas", flush=True)
    tail = time.monotonic()

    async def zero() -> bool:
        return not await admin.replicas()

    with contextlib.suppress(SystemExit):
        await admin.until("back to zero replicas", zero, TAIL_MAX_S)
    t1 = time.monotonic()
    stop.set()
    await sampler
    run.answers = steady + burst
    for a in run.answers:
        if a.status != 200:
            print(f"  failed: HTTP {a.status} {a.error}")
    first = min(steady, key=lambda a: a.sent)
    cold = first.ttft_s if first.ttft_s is not None else float("inf")
    warm = [a.ttft_s for a in steady if a.ttft_s is not None and a.sent >= first.sent + cold and a.sent < burst_at]
    used = replica_seconds(run.counts, t0, t1)
    print(f"  cold start: decided +{up0['at'] - step_wall:.2f} s, placed +{first_rep['created_at'] - step_wall:.2f} s, "
          f"engine ready +{first_rep['ready_at'] - step_wall:.2f} s, first token +{cold:.2f} s")
    print(f"  decisions: {up0['reason']} (at +{up0['at'] - step_wall:.2f} s); {up1['reason']} "
          f"(at +{up1['at'] - burst_wall:.2f} s)")
    print(f"  steady requests {len(steady)}, burst requests {len(burst)}, tail to zero {t1 - tail:.1f} s, "
          f"trace {t1 - t0:.1f} s, peak replicas {max(n for _, n in run.counts)}")
    print(f"  replica-seconds {used:.1f}: idle and steady {replica_seconds(run.counts, t0, burst_at):.1f}, "
          f"burst {replica_seconds(run.counts, burst_at, tail):.1f}, tail {replica_seconds(run.counts, tail, t1):.1f}")
    return {
        "failed": float(sum(1 for a in run.answers if a.status != 200)),
        "requests": float(len(run.answers)),
        "cold_start_s": cold,
        "zero_reaction_s": up0["at"] - step_wall,
        "burst_reaction_s": up1["at"] - burst_wall,
        "replica_seconds_ratio": used / (args.max * (t1 - t0)),
        "ttft_p95_s": p95(warm) if warm else float("inf"),
        "ttft_requests": float(len(warm)),
        "back_to_zero": float(t1 - tail < TAIL_MAX_S),
    }


async def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-autoscale-") as tmp_s:
        tmp = Path(tmp_s)
        files = tmp / "files"
        files.mkdir()
        (files / "gemma.gguf").symlink_to(MODEL)
        file_runner, files_url = await serve_files(files)
        inst = make_install(tmp / "cp", node_lost_after_s=10)
        node_root, agent_cfg = write_agent(inst, tmp)
        cp_log, agent_log = (tmp / "cp.log").open("wb"), (tmp / "agent.log").open("wb")
        cp = start_server_run(inst, cp_log)
        agent = None
        try:
            await asyncio.to_thread(wait_admin_health, inst, cp)
            agent = start_agent(agent_cfg, node_root, agent_log)
            return await measure(inst, files_url, args)
        finally:
            if agent is not None:
                agent.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.wait(15)
                if agent.poll() is None:
                    agent.kill()
            stop_all_engines(Paths(node_root).agent_state, grace_s=5)
            cp.terminate()
            try:
                cp.wait(20)
            except subprocess.TimeoutExpired:
                cp.kill()
            await file_runner.cleanup()
            if args.keep_logs:
                keep_logs(tmp, Path(args.keep_logs))


async def measure(inst: Install, files_url: str, args: argparse.Namespace) -> int:
    """Warm the node's cache, run the trace and the static deployment, print the figures."""
    gateway = yaml.safe_load(inst.config.read_text())["gateway"]["listen"]
    url = f"http://{gateway}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        admin = Admin(s, inst.admin)

        async def node_ready() -> bool:
            return any(n["state"] == "ready" for n in await admin.call("GET", "/api/v1/nodes"))

        await admin.until("the node ready", node_ready, 60)
        profile = {"name": "cpu", "cpu_cores": 1, "min_memory_gb": 1,
                   "args": ["--ctx-size", "1024", "-np", str(SLOTS)]}
        await admin.call("POST", "/api/v1/models", {"name": NAME, "source": f"{files_url}/gemma.gguf",
                                                   "scaling": {**SCALING, "max": args.max}, "profiles": [profile]})
        print("warm-up: one request at zero replicas fetches the weights into the node's cache", flush=True)
        warm = await ask(s, url)
        if warm.status != 200:
            raise SystemExit(f"FAIL: the warm-up request: HTTP {warm.status}: {warm.error}")

        async def zero() -> bool:
            return not await admin.replicas()

        back = await admin.until("back to zero after the warm-up", zero, TAIL_MAX_S)
        print(f"  cold_start_uncached_s {warm.ttft_s:.2f}; back to zero {back:.1f} s later", flush=True)
        got = await trace(admin, s, url, args)

        print(f"static: {args.max} replicas held, {STEADY} clients for {STATIC_S:g} s", flush=True)
        await admin.call("PATCH", f"/api/v1/models/{NAME}", {"scaling": {**SCALING, "min": args.max, "max": args.max}})

        async def all_ready() -> bool:
            return await admin.ready() == args.max

        await admin.until(f"{args.max} replicas ready", all_ready, 120)
        static: list[Answer] = []
        await clients(s, url, STEADY, time.monotonic() + STATIC_S, static)
    static_ttft = p95([a.ttft_s for a in static if a.ttft_s is not None])
    failed = int(got["failed"]) + sum(1 for a in static if a.status != 200)
    for a in static:
        if a.status != 200:
            print("  failed (static):", a.status, a.error)
    load = os.getloadavg()
    ratio = got["ttft_p95_s"] / static_ttft
    figures = [
        ("requests", f"{int(got['requests']) + len(static)}", None),
        ("failed_requests", f"{failed}", failed == 0),
        ("cold_start_s", f"{got['cold_start_s']:.2f}", got["cold_start_s"] <= 5),
        ("scale_up_reaction_s", f"{max(got['zero_reaction_s'], got['burst_reaction_s']):.2f}",
         max(got["zero_reaction_s"], got["burst_reaction_s"]) <= 2),
        ("scale_up_reaction_from_zero_s", f"{got['zero_reaction_s']:.2f}", None),
        ("scale_up_reaction_burst_s", f"{got['burst_reaction_s']:.2f}", None),
        ("replica_seconds_ratio", f"{got['replica_seconds_ratio']:.2f}", got["replica_seconds_ratio"] <= 0.5),
        ("back_to_zero", "yes" if got["back_to_zero"] else "no", bool(got["back_to_zero"])),
        ("ttft_p95_s", f"{got['ttft_p95_s']:.2f} ({int(got['ttft_requests'])} requests)", None),
        ("static_ttft_p95_s", f"{static_ttft:.2f} ({len(static)} requests)", None),
        ("ttft_p95_ratio", f"{ratio:.2f}", ratio <= 1.5),
        ("load_avg_1m", f"{load[0]:.1f}", None),
    ]
    for name, value, ok in figures:
        print(f"{name}: {value}" + ("" if ok is None else "  PASS" if ok else "  FAIL"))
    return 0 if all(ok is not False for _, _, ok in figures) else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max", type=int, default=3, help="scaling.max, and the static deployment's replicas")
    p.add_argument("--steady-s", type=float, default=45.0, help="seconds of the steady part")
    p.add_argument("--burst-s", type=float, default=20.0, help="seconds of the burst")
    p.add_argument("--keep-logs", default="", help="copy the control plane's and agent's logs to this folder")
    sys.exit(asyncio.run(main(p.parse_args())))
