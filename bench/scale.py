"""A cluster of N nodes, simulated: what one control plane costs and how fast it sees a dead node.

    .venv/bin/python bench/scale.py --agents 500 [--agents 2000 ...] [--models 200] [--kill 100]
        [--rate 50] [--ramp-per-s 100] [--outage-s 15]

A real control plane (``python -m llmgw server run`` as its own process, SQLite store, its own CA,
``cluster.max_heartbeats_per_s`` = ``--rate``; with ``--ha`` three of them on one PostgreSQL, the
agents spread over them by their rendezvous homes, the busiest one's CPU reported, the restart
fault on the first one), an *instant upstream* (bench/gateway_overhead.py's,
its own process) and N simulated agents in this one asyncio process (bench/scale_fleet.py: each its
own certificate from the cluster CA, the real agent's wire, pulses, interval and jittered backoff;
engines simulated by their reports). For each N, in order:

1. ``quiet``: the control plane alone (its CPU with no agent);
2. ``gateway idle``: two agents only, and a model ``scale-gw`` (2 replicas) on them, reported ready
   at the upstream; the gateway's added latency (gateway minus direct, alternating requests, the way
   bench/gateway_overhead.py measures it, from a process of its own: bench/gwprobe.py) on this idle
   cluster;
3. ``ramp``: the other agents start, ``--ramp-per-s`` a second, each registering at once; a run
   whose agents do not all register says how far it got and prints no figure for N;
4. ``steady``: ``--settle-s`` (10) then ``--steady-s`` (20) of beats: ``cp_cpu_cores``, the beats per second;
5. ``burst``: ``--models`` models (2 replicas each) added through the admin API one after the
   other, until every replica is reported ready; ``heartbeat_p99_ms`` over the beats sent meanwhile
   (and ``heartbeat_p99_burst_vs_steady``, its ratio to the p99 of ``--steady-gw-s`` (10) more
   seconds of steady beats with the same gateway trickle on: both under the same load from other
   work and the same gateway traffic, over which ``added_p50_steady_ms`` is the gateway's added latency
   among N beating nodes; ``heartbeat_burst_pulse_p99_ms`` and ``..._full_p99_ms``
   the p99 of the digest-only beats and of the full states apart),
   and the gateway's added latency measured meanwhile (``added_p50_ms`` vs ``gateway_added_idle_p50_ms``;
   ``added_p50_change_ms`` the difference, ``..._ci_low_ms``/``..._ci_high_ms`` its 95 % bootstrap
   interval: :func:`scale_gateway.added_change_ci`);
   then ``ab`` (``--ab-windows`` 12 of ``--ab-window-s`` 4 s): the gateway probed while the beats
   flow and while every agent drops the beat that falls due (no two in a row), in alternating windows
   (:func:`scale_gateway.ab_phase`; ``ab_beats_per_s_flowing`` and ``..._held`` the beats answered):
   ``ab_change_ms`` is what the control plane's heartbeat work adds to the gateway, with the drift
   of minutes between the idle figure and the burst's taken out; ``ab_gateway_process_cores_*`` and
   ``ab_agent_api_process_cores_*`` the CPU of the control plane's own process (the gateway's) and
   of its agent API process on each side (``--agent-api``: ``process``, the default, runs the agent
   API in a process of its own, ``cluster.agent_api_process``; ``inline`` in the gateway's);
6. ``kill``: ``--kill`` agents that host bench replicas stop at once; ``lost_detect_s`` (the worst,
   from each node's last answered beat to the admin API showing it ``lost``) against the bound
   docs/operating.md states (``lost_shown_within_s_documented``:
   :func:`llmgw.control.api.cadence.lost_after_for` plus one leader interval and one pass,
   :data:`PASS_S`) plus the bench's own poll (:data:`LOST_POLL_S` and the poll's longest answer)
   and ``--lost-slack-s``; ``lost_marked_max_s`` is the leader's own figure (from its log: the
   silence it saw when it marked each one), then their replicas re-placed on live nodes and ready
   (``replaced_ready_s``, from the last one seen lost), ``replicas_placed_twice``;
7. ``remove``: every bench model deleted at once; the heartbeat p99 meanwhile;
8. ``restart`` (the fault): the control plane is stopped (SIGTERM), kept down ``--outage-s``, and
   started again on the same store; every agent reconnects with the real agent's backoff (full
   jitter). ``reconnect_peak_per_s`` (the most first answers after the restart in one second),
   ``reconnect_p99_ms`` (latency of each agent's first exchange after, a new TLS connection) and
   ``reconnect_all_s`` (from the control plane answering again until every agent has an answer;
   with ``--ha`` the agents fail over first, so see ``reconnect_all_since_stop_s``);
   ``--no-backoff-jitter`` makes the agents back off as before full jitter, for comparison.

``cp_rss_mib`` is the control plane's largest resident memory over phases 1-7 (sampled each second;
``cp_rss_mib_<phase>`` the largest in each);
``sim_cpu_cores`` this process's own CPU over the steady phase (it must not starve the control plane
on a 2-core machine), ``sim_loop_lag_*_p99_ms`` its own event loop's lag in the steady phase and
the burst (what of a heartbeat's latency is the simulator's own wait, not the control plane's;
``..._max_ms`` the longest), ``sim_gc_pause_max_ms_*`` its longest garbage collection there (its full
collections are off once the fleet is up: :class:`scale_fleet.SimGc`). With ``--logs DIR``, each
control plane's log and every burst beat (``burst-beats-N.tsv``: wall time sent, ms, pulse or not).
With several ``--agents``, ``cp_cpu_cores_per_1000_nodes`` at each N and a
straight line through them (least squares, ``cores = a + b × N``) read at 20,000 nodes.
Figures last, one ``name: value`` per line, each run's labelled with its N.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import scale_cp  # noqa: E402
import scale_gateway  # noqa: E402
from gateway_overhead import _spawn  # noqa: E402
from scale_cp import ControlPlane, installs  # noqa: E402
from scale_fleet import Fleet, SimAgent, SimGc, issue_certs, loop_lag  # noqa: E402
from scale_gateway import (  # noqa: E402
    AB_SETTLE_S,
    AB_WINDOW_S,
    AB_WINDOWS,
    GATEWAY_N,
    GW_MODEL,
    Burner,
    ab_phase,
    added,
    added_change_ci,
    gateway_probe,
)
from tests.helpers.control import TOKEN  # noqa: E402

from llmgw.control.api.cadence import interval_for, lost_after_for  # noqa: E402
from llmgw.control.reconcile.leader import DEFAULT_INTERVAL_S  # noqa: E402
from llmgw.protocol import KEEPALIVE_S  # noqa: E402

QUIET_S = 3.0
SETTLE_S = 10.0
STEADY_S = 20.0
STEADY_GW_S = 10.0
POLL_S = 2.0
"""How often the admin API is polled for nodes and replicas (s)."""
LOST_POLL_S = 0.5
"""How often the admin API is polled for nodes while the killed ones are expected lost (s): the
bench's own term of the lost-detection bound, with the poll's answer time."""
PASS_S = 1.0
"""The time a leader pass takes to reach its mark of silent nodes, allowed in the lost-detection
bound (s), as docs/operating.md states it: a whole dirty pass at 500 nodes takes a tenth of that
on a quiet machine (bench/leader_pass.py), a loaded 2-core one stretches it."""
LOST_LOG = re.compile(r"node (\S+) lost: no heartbeat for ([\d.]+) s")
GC_LOG = re.compile(r"gc: a generation (\d) collection paused the control plane (\d+) ms \(([\d.]+) ms of CPU")


@dataclass
class Run:
    """One N's measured figures (``figures``, in print order) and whether N was reached."""

    n: int
    figures: dict[str, float] = field(default_factory=dict)
    reached: int = 0
    failures: list[str] = field(default_factory=list)


def enter(phase: str, fleet: Fleet, cps: list[ControlPlane]) -> None:
    """Heartbeats and each control plane's resident memory are recorded under ``phase`` from now."""
    fleet.records.phase = phase
    for c in cps:
        c.phase = phase


def say(n: int, phase: str) -> None:
    """A progress line: the phase starting, the time and the load."""
    print(f"N = {n}: {phase} at {time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.1f}", flush=True)


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile of ``xs`` (nearest rank); NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def model_doc(name: str) -> dict[str, object]:
    return {
        "name": name,
        "source": f"http://mirror.invalid/{name}/1/model.gguf",
        "scaling": {"min": 2, "max": 2},
        "profiles": [{"name": "cpu", "min_memory_gb": 1, "cpu_cores": 1}],
    }


async def until(done: Callable[[], Awaitable[bool]], within_s: float, every_s: float) -> bool:
    """Poll ``done`` every ``every_s`` until it is true (True) or ``within_s`` passed (False)."""
    deadline = time.monotonic() + within_s
    while True:
        if await done():
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(every_s)


async def replicas(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    r = await client.get("/api/v1/replicas")
    r.raise_for_status()
    out: list[dict[str, Any]] = r.json()
    return out


async def wait_ready(client: httpx.AsyncClient, models: set[str], want: int, within_s: float) -> float | None:
    """Seconds until ``want`` replicas of ``models`` are ready; None past ``within_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        reps = await replicas(client)
        ready = [x for x in reps if x["model"] in models and x["state"] == "ready"]
        if len(ready) >= want:
            return time.monotonic() - t0
        await asyncio.sleep(POLL_S)
    return None


async def ramp(fleet: Fleet, agents: list[SimAgent], per_s: float, within_s: float) -> int:
    """Start ``agents`` at ``per_s`` a second; returns how many registered within ``within_s``."""
    t0 = time.monotonic()
    for k, a in enumerate(agents):
        fleet.start(a)
        ahead = t0 + (k + 1) / per_s - time.monotonic()
        if ahead > 0:
            await asyncio.sleep(ahead)
        if k % 500 == 499:
            print(f"  {sum(a.registered for a in agents)} of {k + 1} started registered after "
                  f"{time.monotonic() - t0:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)

    async def registered() -> bool:
        return all(a.registered for a in agents)

    await until(registered, within_s - (time.monotonic() - t0), 0.5)
    return sum(a.registered for a in agents)


def gc_pauses(f: dict[str, float], logs: list[Path]) -> None:
    """``cp_gc_pauses_logged`` (the control planes' collections of 50 ms or more, from their logs:
    :mod:`llmgw.control.gcpauses`), ``cp_gc_pause_max_ms``, the longest, and ``cp_gc_cpu_max_ms``, the
    most CPU one took (a pause much longer than its CPU is the thread descheduled on a busy machine)."""
    got = [m for path in logs if path.exists() for m in GC_LOG.finditer(path.read_text(errors="replace"))]
    f["cp_gc_pauses_logged"] = len(got)
    f["cp_gc_pause_max_ms"] = max((float(m[2]) for m in got), default=0.0)
    f["cp_gc_cpu_max_ms"] = max((float(m[3]) for m in got), default=0.0)


async def kill_phase(client: httpx.AsyncClient, fleet: Fleet, run: Run, kill: int, lost_after: float,
                     interval: float, slack_s: float, logs: list[Path]) -> None:
    """Kill ``kill`` agents hosting bench replicas; measure detection and re-placement (see the module
    docstring). ``logs``: the control planes' logs, where the leader says after how long a silence
    it marked each node lost (``lost_marked_max_s``: detection without the bench's poll)."""
    f = run.figures
    reps = await replicas(client)
    hosts = {x["node"] for x in reps if x["model"] != GW_MODEL}
    gw_hosts = {x["node"] for x in reps if x["model"] == GW_MODEL}
    by_name = {a.name: a for a in fleet.agents}
    pick = [by_name[h] for h in sorted(hosts) if h in by_name and h not in gw_hosts]
    pick += [a for a in fleet.agents if a.name not in hosts and a.name not in gw_hosts]
    wanted = {x["model"] for x in reps if x["model"] != GW_MODEL}
    # Only agents between beats, killed with no await in between: one killed with a beat in flight
    # may have that beat recorded, and its silence would count from before it (up to an interval).
    victims = [a for a in pick if not a.sending][:kill]
    names = {a.name for a in victims}
    for a in victims:
        fleet.kill(a)
    last_ok = {a.name: a.last_ok for a in victims}
    await asyncio.sleep(max(0.0, min(last_ok.values()) + lost_after - 2 * POLL_S - time.monotonic()))
    seen: dict[str, float] = {}
    on_nodes: dict[str, set[str]] = {}
    deadline = time.monotonic() + lost_after + 90
    polls: list[float] = []
    poll_errors = 0
    while len(seen) < len(names) and time.monotonic() < deadline:
        asked = time.monotonic()
        r = await client.get("/api/v1/nodes")
        now = time.monotonic()  # the state may have moved while the request was answered: count its end
        polls.append(now - asked)
        if r.status_code != 200:  # e.g. 503 when the store is slow under load: ask again, count it
            poll_errors += 1
            await asyncio.sleep(LOST_POLL_S)
            continue
        for nd in r.json():
            if nd["id"] in names and nd["state"] == "lost":
                seen.setdefault(nd["id"], now)
        await asyncio.sleep(LOST_POLL_S)
    detect = [seen[n] - last_ok[n] for n in seen]
    # docs/operating.md's bound (silence, then at most one leader interval and one pass) and the
    # bench's own poll: a node lost just after one poll read it is shown by the next, LOST_POLL_S
    # after that one ended, when answered (each answer at most the longest measured).
    documented = lost_after + DEFAULT_INTERVAL_S + PASS_S
    bound = documented + LOST_POLL_S + 2 * max(polls, default=0.0) + slack_s
    marked = [float(m[2]) for path in logs if path.exists()
              for m in LOST_LOG.finditer(path.read_text(errors="replace")) if m[1] in names]
    f["nodes_killed"] = len(victims)
    f["nodes_poll_errors"] = poll_errors
    f["replicas_on_killed"] = sum(1 for x in reps if x["node"] in names)
    f["nodes_seen_lost"] = len(seen)
    f["lost_after_s_documented"] = lost_after
    f["lost_shown_within_s_documented"] = documented
    f["lost_marked_max_s"] = max(marked) if marked else float("nan")  # the leader's own, from its log
    f["lost_detect_bound_s"] = bound
    f["lost_detect_p50_s"] = pct(detect, 50)
    f["lost_detect_s"] = max(detect) if detect else float("nan")
    f["nodes_poll_p50_s"] = pct(polls, 50)  # what of lost_detect_s is the admin API's own answer time
    if len(seen) < len(names):
        run.failures.append(f"only {len(seen)} of {len(names)} killed nodes seen lost")
    elif max(detect) > bound:
        run.failures.append(f"lost_detect_s {max(detect):.1f} above the bound {bound:.1f}")
    # Re-placed: every bench model back to its 2 replicas, ready, on live nodes; none twice.
    t0 = time.monotonic()
    twice = 0
    ready_s = None
    while time.monotonic() - t0 < 1.5 * interval + 60:
        reps = await replicas(client)
        live = [x for x in reps if x["model"] in wanted and x["node"] not in names]
        for x in reps:
            on_nodes.setdefault(x["id"], set()).add(x["node"])
        per_model: dict[str, int] = {}
        for x in live:
            per_model[x["model"]] = per_model.get(x["model"], 0) + 1
        twice = max(twice, sum(max(0, c - 2) for c in per_model.values()))
        if sum(1 for x in live if x["state"] == "ready") >= 2 * len(wanted):
            ready_s = time.monotonic() - t0
            break
        await asyncio.sleep(POLL_S)
    twice += sum(1 for nodes in on_nodes.values() if len({n for n in nodes if n}) > 1)
    f["replaced_ready_s"] = float("nan") if ready_s is None else ready_s
    f["replicas_placed_twice"] = twice
    if ready_s is None:
        run.failures.append("the killed nodes' replicas were not all ready elsewhere in time")


async def restart_phase(fleet: Fleet, cp: ControlPlane, run: Run, outage_s: float, interval: float) -> None:
    """Stop the control plane, keep it down ``outage_s``, start it; measure the agents' return."""
    rec = fleet.records
    rec.phase = "restart"
    say(len(fleet.agents), "restart")
    rec.restarted_at = time.monotonic()
    await cp.stop()
    stopped = time.monotonic()
    await asyncio.sleep(max(0.0, stopped + outage_s - time.monotonic()))
    starting = time.monotonic()
    await cp.start()
    up = time.monotonic()
    run.figures["cp_stop_s"] = stopped - rec.restarted_at
    run.figures["cp_start_s"] = up - starting
    live = [a for a in fleet.agents if a.alive]
    backing_off = sum(1 for a in live if a.failed)

    async def back() -> bool:
        return len(rec.reconnects) >= len(live)

    await until(back, 1.2 * interval + 30, 0.5)
    answers = sorted(b.at + b.ms / 1000 - up for b in rec.reconnects.values())
    bins: dict[int, int] = {}
    for t in answers:
        bins[int(t)] = bins.get(int(t), 0) + 1
    tried = [t - rec.restarted_at for t in rec.attempts if t < up]
    f = run.figures
    f["restart_outage_s"] = up - rec.restarted_at  # stop + --outage-s + start
    f["agents_backing_off_at_restart"] = backing_off
    f["attempts_during_outage_per_s"] = len(tried) / max(up - rec.restarted_at, 1e-9)
    f["reconnected"] = len(rec.reconnects)
    f["reconnect_all_s"] = answers[-1] if answers else float("nan")  # from the control plane back up
    f["reconnect_all_since_stop_s"] = answers[-1] + up - rec.restarted_at if answers else float("nan")
    f["reconnect_peak_per_s"] = max(bins.values()) if bins else 0
    f["reconnect_p50_ms"] = pct([b.ms for b in rec.reconnects.values()], 50)
    f["reconnect_p99_ms"] = pct([b.ms for b in rec.reconnects.values()], 99)
    if len(rec.reconnects) < len(live):
        run.failures.append(f"only {len(rec.reconnects)} of {len(live)} agents reconnected in time")


async def admin(client: httpx.AsyncClient, run: Run, method: str, url: str, **kw: Any) -> httpx.Response:
    """An admin call retried on 503 (as an operator would; each counted in ``admin_503``), up to 5 times."""
    for _ in range(4):
        r = await client.request(method, url, **kw)
        if r.status_code != 503:
            return r
        run.figures["admin_503"] = run.figures.get("admin_503", 0) + 1
        await asyncio.sleep(1.0)
    return await client.request(method, url, **kw)


async def run_n(run: Run, args: argparse.Namespace) -> None:
    """Run every phase for ``run.n`` agents, filling ``run`` as it goes (what was measured stays
    when a phase raises)."""
    n = run.n
    f = run.figures
    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    insts, pg = installs(root, ha=args.ha, rate=args.rate, lost_after_s=args.lost_after_s,
                         agent_api_process=args.agent_api == "process")
    inst = insts[0]
    t = time.perf_counter()
    names = [f"sim-{i:05d}" for i in range(n)]
    certs = issue_certs(inst.ca, names, root / "agents")
    f["pki_s"] = time.perf_counter() - t
    up, up_port = _spawn(["--role", "upstream", "--events", "1"], root / "upstream-port")
    if scale_gateway.PATH_CPUS is not None:  # --pin-path: the upstream on the gateway's path's CPU
        for thread in psutil.Process(up.pid).threads():
            os.sched_setaffinity(thread.id, scale_gateway.PATH_CPUS)
    cps = [ControlPlane(i) for i in insts]

    def cpu() -> list[float]:
        return [c.cpu() for c in cps]

    def cores(before: list[float], wall: float) -> tuple[float, float]:
        """The busiest control plane's cores since ``before``, and all of them together."""
        each = [(b - a) / wall for a, b in zip(before, cpu(), strict=True)]
        return max(each), sum(each)

    me = psutil.Process()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    tasks: list[asyncio.Task[Any]] = []
    fleet = Fleet([i.agent_url for i in insts], inst.paths.pki / "ca.pem", f"127.0.0.1:{up_port}", GW_MODEL)
    fleet.jitter = not args.no_backoff_jitter
    fleet.keepalive_s = args.keepalive_s
    sim_gc = SimGc(fleet)
    try:
        async with httpx.AsyncClient(base_url=inst.admin, headers=auth, timeout=120) as client:
            await asyncio.gather(*(c.start() for c in cps))
            tasks += [asyncio.create_task(c.sample_rss()) for c in cps]
            lags: dict[str, list[float]] = {}
            tasks.append(asyncio.create_task(loop_lag(fleet, lags)))
            c0 = cpu()
            await asyncio.sleep(QUIET_S)
            f["cp_cpu_cores_quiet"] = cores(c0, QUIET_S)[0]
            t = time.perf_counter()
            for name, (cert, key) in zip(names, certs, strict=True):
                fleet.add(name, cert, key)
            f["tls_contexts_s"] = time.perf_counter() - t
            # The gateway on an idle cluster: two agents, one model.
            for a in fleet.agents[:2]:
                fleet.start(a)

            async def registered() -> bool:
                return all(a.registered for a in fleet.agents[:2])

            if not await until(registered, 60, 0.1):
                raise SystemExit("the first two agents did not register in 60 s")
            (await client.post("/api/v1/models", json=model_doc(GW_MODEL))).raise_for_status()
            if await wait_ready(client, {GW_MODEL}, 2, 60) is None:
                raise SystemExit(f"{GW_MODEL}'s replicas were not ready in 60 s")
            direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
            gateway = f"http://127.0.0.1:{inst.ports['gateway']}/v1/chat/completions"
            stop_gw = asyncio.Event()
            stop_gw.set()
            d_idle, g_idle, _ = await gateway_probe(direct, gateway, stop_gw, args.gateway_n)
            # Ramp.
            enter("ramp", fleet, cps)
            t, c0, s0 = time.monotonic(), cpu(), sum(me.cpu_times()[:2])
            run.reached = 2 + await ramp(fleet, fleet.agents[2:], args.ramp_per_s, n / args.ramp_per_s + 60)
            f["ramp_s"] = time.monotonic() - t
            f["cp_cpu_cores_ramp"] = cores(c0, f["ramp_s"])[0]
            f["sim_cpu_cores_ramp"] = (sum(me.cpu_times()[:2]) - s0) / f["ramp_s"]
            print(f"N = {n}: {run.reached} registered in {f['ramp_s']:.1f} s, control plane "
                  f"{f['cp_cpu_cores_ramp']:.2f} cores meanwhile, this process {f['sim_cpu_cores_ramp']:.2f}, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            if run.reached < n:
                for ph, kept in fleet.records.errors.items():
                    count = fleet.records.error_count[ph]
                    print(f"N = {n}, {ph}: {count} failed exchanges, e.g.", *kept[:3], sep="\n  ")
                return
            nodes = (await client.get("/api/v1/nodes")).json()
            ready_nodes = sum(1 for nd in nodes if nd["state"] == "ready")
            if ready_nodes < n:
                run.reached = ready_nodes
                return
            # Steady.
            sim_gc.quiet()  # the simulator's own full collections off from here (SimGc)
            await asyncio.sleep(args.settle_s)
            enter("steady", fleet, cps)
            say(n, "steady")
            c0, s0, t = cpu(), sum(me.cpu_times()[:2]), time.monotonic()
            await asyncio.sleep(args.steady_s)
            wall = time.monotonic() - t
            f["cp_cpu_cores"], total = cores(c0, wall)
            if len(cps) > 1:
                f["cp_cpu_cores_all"] = total
                answered = sum(fleet.used.values())
                for k, c in enumerate(cps):
                    f[f"beats_share_cp{k}"] = fleet.used.get(c.inst.agent_url, 0) / max(answered, 1)
            f["sim_cpu_cores"] = (sum(me.cpu_times()[:2]) - s0) / wall
            f["heartbeats_per_s_steady"] = len(fleet.records.beats.get("steady", [])) / wall
            steady = [b.ms for b in fleet.records.beats.get("steady", [])]
            f["heartbeat_steady_p50_ms"] = pct(steady, 50)
            f["heartbeat_steady_p99_ms"] = pct(steady, 99)
            f["sim_loop_lag_steady_p99_ms"] = pct(lags.get("steady", []), 99)
            f["sim_loop_lag_steady_max_ms"] = max(lags.get("steady", [0.0]))
            f["sim_gc_pause_max_ms_steady"] = sim_gc.longest_ms("steady")
            f["load_average_1m_steady"] = os.getloadavg()[0]
            f["cp_cpu_cores_per_1000_nodes"] = f["cp_cpu_cores"] / n * 1000
            f["interval_s"] = fleet.records.interval_s
            # The same beats with the gateway trickle the burst measures too (it shares the loop).
            enter("steady_gw", fleet, cps)
            stop_gw = asyncio.Event()
            gw = asyncio.create_task(gateway_probe(direct, gateway, stop_gw, 0))
            await asyncio.sleep(args.steady_gw_s)
            stop_gw.set()
            d_steady, g_steady, _ = await gw
            f["added_p50_steady_ms"] = added(d_steady, g_steady)
            steady_gw = [b.ms for b in fleet.records.beats.get("steady_gw", [])]
            f["heartbeat_steady_gw_p50_ms"] = pct(steady_gw, 50)
            f["heartbeat_steady_gw_p99_ms"] = pct(steady_gw, 99)
            f["load_average_1m_steady_gw"] = os.getloadavg()[0]
            # Burst of model adds, the gateway measured meanwhile.
            interval = interval_for(n, args.rate)
            enter("burst", fleet, cps)
            say(n, "burst")
            stop_gw = asyncio.Event()
            gw = asyncio.create_task(gateway_probe(direct, gateway, stop_gw, args.gateway_n))
            c0, t = cpu(), time.monotonic()
            bench_models = {f"bench-{k:03d}" for k in range(args.models)}
            for name in sorted(bench_models):
                r = await admin(client, run, "POST", "/api/v1/models", json=model_doc(name))
                if r.status_code != 201:
                    raise SystemExit(f"adding model {name}: {r.status_code} {r.text}")
            f["adds_s"] = time.monotonic() - t
            ready_s = await wait_ready(client, bench_models, 2 * args.models, 1.5 * interval + 60)
            f["burst_all_ready_s"] = float("nan") if ready_s is None else time.monotonic() - t
            f["cp_cpu_cores_burst"] = cores(c0, time.monotonic() - t)[0]
            stop_gw.set()
            d_run, g_run, _ = await gw
            if ready_s is None:
                run.failures.append("the burst's replicas were not all ready in time")
            burst = [b.ms for b in fleet.records.beats.get("burst", [])]
            if args.logs is not None:  # each burst beat: wall time sent, ms, pulse (to line up with the logs)
                args.logs.mkdir(parents=True, exist_ok=True)
                off = time.time() - time.monotonic()
                (args.logs / f"burst-beats-{n}.tsv").write_text("".join(
                    f"{b.at + off:.3f}\t{b.ms:.1f}\t{int(b.pulse)}\n" for b in fleet.records.beats.get("burst", [])))
            f["heartbeats_in_burst"] = len(burst)
            f["heartbeat_burst_p50_ms"] = pct(burst, 50)
            f["heartbeat_p99_ms"] = pct(burst, 99)
            f["heartbeat_p99_burst_vs_steady"] = f["heartbeat_p99_ms"] / max(f["heartbeat_steady_gw_p99_ms"], 1e-9)
            # Which beats make the tail: pulses (a digest only) or full states (new replicas reported).
            pulses = [b.ms for b in fleet.records.beats.get("burst", []) if b.pulse]
            fulls = [b.ms for b in fleet.records.beats.get("burst", []) if not b.pulse]
            f["heartbeats_in_burst_full"] = len(fulls)
            f["heartbeat_burst_pulse_p99_ms"] = pct(pulses, 99)
            f["heartbeat_burst_full_p99_ms"] = pct(fulls, 99)
            f["sim_loop_lag_burst_p99_ms"] = pct(lags.get("burst", []), 99)
            f["sim_loop_lag_burst_max_ms"] = max(lags.get("burst", [0.0]))
            f["sim_gc_pause_max_ms_burst"] = sim_gc.longest_ms("burst")
            f["load_average_1m_burst"] = os.getloadavg()[0]
            if args.logs is not None:  # each gateway probe pair: direct ms, gateway ms (idle, then the burst)
                for phase, (ds, gs) in (("idle", (d_idle, g_idle)), ("steady", (d_steady, g_steady)),
                                        ("burst", (d_run, g_run))):
                    (args.logs / f"gateway-{phase}-{n}.tsv").write_text(
                        "".join(f"{d:.3f}\t{g:.3f}\n" for d, g in zip(ds, gs, strict=False)))
            f["gateway_added_idle_p50_ms"] = added(d_idle, g_idle)
            f["added_p50_ms"] = added(d_run, g_run)
            f["gateway_requests_idle"], f["gateway_requests_burst"] = len(g_idle), len(g_run)
            f["added_p50_change_ms"] = f["added_p50_ms"] - f["gateway_added_idle_p50_ms"]
            f["added_p50_change_ci_low_ms"], f["added_p50_change_ci_high_ms"] = added_change_ci(
                (d_idle, g_idle), (d_run, g_run))
            if args.ab_windows:  # the gateway with the beats flowing and held, interleaved
                enter("ab", fleet, cps)
                say(n, "ab")
                cpu = {"gateway_process": cps[0].own_cpu, "agent_api_process": cps[0].children_cpu,
                       "simulator": lambda: sum(me.cpu_times()[:2])}
                burner = Burner(args.ab_burn_cores, scale_cp.AGENT_API_CPUS) if args.ab_burn_cores else None
                if burner is not None:
                    cpu["burner"] = lambda: sum(psutil.Process(burner.proc.pid).cpu_times()[:2])
                try:
                    f.update(await ab_phase(fleet, direct, gateway, args.ab_windows, args.ab_window_s, cpu, burner))
                finally:
                    if burner is not None:
                        burner.close()
            if args.stop_after == "burst":
                return
            # Kill a batch.
            enter("kill", fleet, cps)
            say(n, "kill")
            lost_after = lost_after_for(interval, args.lost_after_s)
            await kill_phase(client, fleet, run, args.kill, lost_after, interval, args.lost_slack_s,
                             [c.inst.root / "server.log" for c in cps])
            # Remove the models in a burst.
            enter("remove", fleet, cps)
            say(n, "remove")
            t = time.monotonic()
            for name in sorted(bench_models):
                (await admin(client, run, "DELETE", f"/api/v1/models/{name}")).raise_for_status()

            async def gone() -> bool:
                return not any(x["model"] in bench_models for x in await replicas(client))

            if not await until(gone, 60, POLL_S):
                run.failures.append("replicas of the removed models still listed after 60 s (see server.log)")
            f["remove_s"] = time.monotonic() - t
            f["heartbeat_remove_p99_ms"] = pct([b.ms for b in fleet.records.beats.get("remove", [])], 99)
            f["cp_rss_mib"] = max(c.rss_max for c in cps) / 2**20
            for ph in ("ramp", "steady", "steady_gw", "burst", "kill", "remove"):  # where the largest was
                f[f"cp_rss_mib_{ph}"] = max(c.rss_phase_max.get(ph, 0) for c in cps) / 2**20
            gc_pauses(f, [c.inst.root / "server.log" for c in cps])
            f["sim_rss_mib"] = me.memory_info().rss / 2**20
            # The fault: a restart.
            await restart_phase(fleet, cps[0], run, args.outage_s, interval)
            errs = fleet.records.error_count
            f["heartbeat_errors_outside_restart"] = sum(c for ph, c in errs.items() if ph != "restart")
            for ph, kept in fleet.records.errors.items():
                if ph != "restart":
                    print(f"N = {n}, {ph}: {errs[ph]} failed exchanges, e.g. {kept[0]}")
            f["load_average_1m"] = os.getloadavg()[0]
    finally:
        sim_gc.close()
        for task in tasks:
            task.cancel()
        await fleet.close()
        for c in cps:
            await c.stop()
        if pg is not None:
            pg.stop()
        up.terminate()
        up.wait(15)
        if args.logs is not None:  # the control planes' logs outlive the run's directory
            args.logs.mkdir(parents=True, exist_ok=True)
            for k, c in enumerate(cps):
                with contextlib.suppress(OSError):
                    shutil.copy(c.inst.root / "server.log", args.logs / f"server-{n}-cp{k}.log")
        tmp.cleanup()


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``cores = a + b × nodes`` through ``points``; (a, b)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--agents", type=int, action="append", help="N simulated nodes (repeatable; default 500)")
    ap.add_argument("--models", type=int, default=200, help="models added in the burst (2 replicas each)")
    ap.add_argument("--kill", type=int, default=100, help="nodes killed in the batch")
    ap.add_argument("--rate", type=float, default=50.0, help="cluster.max_heartbeats_per_s (default 50)")
    ap.add_argument("--ramp-per-s", type=float, default=100.0, help="agents started per second")
    ap.add_argument("--outage-s", type=float, default=15.0, help="how long the control plane stays down")
    ap.add_argument("--lost-after-s", type=float, default=30.0, help="server.yaml node_lost_after_s")
    ap.add_argument("--settle-s", type=float, default=SETTLE_S, help="after the ramp, before the steady window")
    ap.add_argument("--steady-s", type=float, default=STEADY_S, help="the steady window (cp_cpu_cores)")
    ap.add_argument("--steady-gw-s", type=float, default=STEADY_GW_S,
                    help="steady beats with the gateway trickle on (the burst's baseline)")
    ap.add_argument("--lost-slack-s", type=float, default=0.0, help="seconds added to the lost-detection bound")
    ap.add_argument("--no-backoff-jitter", action="store_true",
                    help="agents back off exactly 1, 2, 5, 10 s (before full jitter), for comparison")
    ap.add_argument("--keepalive-s", type=float, default=KEEPALIVE_S,
                    help=f"agents' idle connection lifetime (default {KEEPALIVE_S:g} s, the real agent's)")
    ap.add_argument("--ha", action="store_true", help="three control planes on one PostgreSQL")
    ap.add_argument("--gateway-n", type=int, default=GATEWAY_N,
                    help=f"gateway requests measured per side, at least (default {GATEWAY_N})")
    ap.add_argument("--ab-windows", type=int, default=AB_WINDOWS,
                    help=f"after the burst, windows of beats flowing and held for the gateway's A/B "
                    f"(default {AB_WINDOWS}; 0: none)")
    ap.add_argument("--ab-window-s", type=float, default=AB_WINDOW_S,
                    help=f"each A/B window (default {AB_WINDOW_S:g} s)")
    ap.add_argument("--ab-burn-cores", type=float, default=0.0,
                    help="the ab phase's control: a process keeping this many cores busy in the held "
                    "windows (on the agent API's CPUs with --pin-path), the CPU the beats take without a "
                    "beat; ab_change then compares the beats with that load alone (default 0: none)")
    ap.add_argument("--stop-after", choices=["burst"], help="end the run after this phase (a quick look)")
    ap.add_argument("--pin", action="store_true",
                    help="the control plane on the first CPU alone, this process and its other children "
                    "(the simulated agents, the upstream, the gateway probe) and the control plane's agent "
                    "API process (--agent-api process) on the others: what the control plane's own work "
                    "costs the gateway, apart from what simulating the fleet on the same machine takes from "
                    "it (as a control plane host with more cores than this machine's two would schedule it)")
    ap.add_argument("--pin-path", action="store_true",
                    help="the gateway's path on the first CPU (the control plane's own process, the "
                    "upstream, the gateway probe), everything else on the others (this process: the "
                    "simulated agents; the agent API process): whether the beats touch the gateway's "
                    "path other than by taking CPU from it, as on a host whose cores are not all busy")
    ap.add_argument("--agent-api", choices=["process", "inline"], default="process",
                    help="cluster.agent_api_process: the agent API in a process of the control plane's own "
                    "(default, as docs/operating.md advises at this scale) or on the gateway's event loop "
                    "('inline', for comparison); the control plane's CPU and memory count both processes")
    ap.add_argument("--logs", type=Path, help="copy each control plane's server.log into this directory")
    args = ap.parse_args()
    sizes = args.agents or [500]
    for name, v in (("--agents", min(sizes)), ("--models", args.models), ("--kill", args.kill)):
        if v < 1:
            ap.error(f"{name} must be at least 1, not {v}")
    if args.ab_windows and (args.ab_windows < 2 or args.ab_window_s <= AB_SETTLE_S):
        ap.error(f"--ab-windows must be 0 or at least 2 (a flowing and a held window), and --ab-window-s "
                 f"more than the {AB_SETTLE_S:g} s left out of each, not {args.ab_windows} and {args.ab_window_s:g}")
    if args.kill > min(sizes) - 2:
        ap.error(f"--kill {args.kill} must leave the 2 gateway nodes: at most --agents minus 2")
    if args.pin and args.pin_path:
        ap.error("--pin and --pin-path: one or the other")
    if args.pin_path:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            ap.error(f"--pin-path needs at least 2 CPUs, this process may use {len(cpus)}")
        scale_cp.CP_CPUS = scale_gateway.PATH_CPUS = {cpus[0]}
        scale_cp.AGENT_API_CPUS = set(cpus[1:])
        os.sched_setaffinity(0, set(cpus[1:]))
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            ap.error(f"--pin needs at least 2 CPUs, this process may use {len(cpus)}")
        scale_cp.CP_CPUS = {cpus[0]}
        scale_cp.AGENT_API_CPUS = set(cpus[1:])
        os.sched_setaffinity(0, set(cpus[1:]))
    runs = []
    for n in sizes:
        print(f"N = {n}: {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}", flush=True)
        run = Run(n)
        runs.append(run)
        try:
            asyncio.run(run_n(run, args))
        except Exception as e:
            run.failures.append(f"{type(e).__name__}: {e}")
    failed = False
    for run in runs:
        if run.reached < run.n:
            print(f"N = {run.n} NOT REACHED on this machine: {run.reached} of {run.n} agents registered; "
                  "no figure for this N")
            print(f"nodes_reached_{run.n}: {run.reached}")
            for why in run.failures:
                print(f"FAIL at N = {run.n}: {why}")
            failed = True
            continue
        for why in run.failures:
            print(f"FAIL at N = {run.n}: {why}")
            failed = True
        for name, value in run.figures.items():
            print(f"{name}_{run.n}: {value:.3f}" if isinstance(value, float) else f"{name}_{run.n}: {value}")
    points = [(r.n, r.figures["cp_cpu_cores"]) for r in runs if r.reached == r.n and "cp_cpu_cores" in r.figures]
    if len(points) >= 2:
        a, b = fit(points)
        print(f"cp_cpu_cores_fit: {a:.3f} + {b * 1000:.4f} per 1000 nodes")
        print(f"cp_cpu_cores_at_20000_est: {a + b * 20000:.2f}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
