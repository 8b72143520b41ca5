"""bench/scale.py's gateway figures: the probe (bench/gwprobe.py, a process of its own) started and
read back, the change between two samples with its bootstrap interval, and the ``ab`` phase (the
gateway with the beats flowing and held, in alternating windows). Apart from scale.py, which runs
the phases."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from scale_fleet import Fleet

HERE = Path(__file__).resolve().parent
GW_MODEL = "scale-gw"
"""The model whose two replicas the gateway is measured through (at the instant upstream)."""
GW_WARMUP = 50
"""Pairs the probe sends before it measures."""
BOOT_ROUNDS = 200
"""Resamples for the interval of the gateway's change during the run (:func:`added_change_ci`)."""
AB_WINDOWS = 12
"""Windows of the ``ab`` phase (``--ab-windows``), beats flowing and held in turn."""
AB_WINDOW_S = 4.0
"""Seconds of each ``ab`` window (``--ab-window-s``)."""
AB_SETTLE_S = 0.5
"""Seconds at the start of an ``ab`` window whose pairs are left out (the change of state settling)."""
GATEWAY_N = 2000
"""Requests measured on each side, at least (``--gateway-n``): the idle cluster's ~13 s of them. With
300 (before 2026-12-06) the idle median alone moved by ~2-4 % from run to run, as much as what was
being compared; the burst measures for as long as it lasts (~107 s, ~15,000 at N = 5,000)."""
#: The CPUs the probe runs on (``--pin-path``: the gateway's path on a CPU of its own), None: any.
PATH_CPUS: set[int] | None = None

BODY = json.dumps({"model": GW_MODEL, "messages": [{"role": "user", "content": "Say ok."}]}).encode()


async def gateway_probe(
    direct: str, gateway: str, stop: asyncio.Event, n: int
) -> tuple[list[float], list[float], list[float]]:
    """Alternating requests, direct then through the gateway, from a process of its own
    (bench/gwprobe.py: not from this one's event loop, which the simulated agents keep busy), until
    ``stop`` is set and at least ``n`` pairs were measured (after :data:`GW_WARMUP`); returns
    (direct ms, gateway ms, unix s each measured pair started). SystemExit when the probe fails (an
    answer other than 200, a refused connection): at once, not at ``stop``."""
    pin = ["taskset", "-c", ",".join(map(str, sorted(PATH_CPUS)))] if PATH_CPUS is not None else []
    proc = await asyncio.create_subprocess_exec(
        *pin, sys.executable, str(HERE / "gwprobe.py"), direct, gateway, "--n", str(n), "--warmup", str(GW_WARMUP),
        "--body", BODY.decode(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None
    # whichever comes first: the caller's stop, or the probe ending on its own (a failed answer)
    stopped, exited = asyncio.create_task(stop.wait()), asyncio.create_task(proc.wait())
    try:
        await asyncio.wait({stopped, exited}, return_when=asyncio.FIRST_COMPLETED)
        proc.stdin.close()
        out, _ = await proc.communicate()
    except BaseException:  # the bench failed or was cancelled meanwhile: no probe left sending
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    finally:
        stopped.cancel()
        exited.cancel()
    if proc.returncode != 0:
        raise SystemExit(f"the gateway probe (bench/gwprobe.py) failed with status {proc.returncode}")
    got = json.loads(out)
    return got["direct"], got["gateway"], got["at"]


class Burner:
    """A process that keeps ``cores`` of a CPU busy (1 ms spins, sleeps between) while :meth:`on`,
    stopped (SIGSTOP) while :meth:`off`: the ``ab`` phase's control, the same CPU load as the beats
    put on the machine without a beat (``--ab-burn-cores``). Confined to ``cpus`` when given."""

    SPIN = (
        "import sys, time\n"
        "duty = float(sys.argv[1]); spin = 0.001; rest = spin * (1 - duty) / duty\n"
        "while True:\n"
        "    end = time.perf_counter() + spin\n"
        "    while time.perf_counter() < end: pass\n"
        "    time.sleep(rest)\n"
    )

    def __init__(self, cores: float, cpus: set[int] | None = None) -> None:
        pin = ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []
        self.proc = subprocess.Popen([*pin, sys.executable, "-c", self.SPIN, str(cores)])
        self.off()

    def on(self) -> None:
        """Burn."""
        self.proc.send_signal(signal.SIGCONT)

    def off(self) -> None:
        """Stop burning."""
        self.proc.send_signal(signal.SIGSTOP)

    def close(self) -> None:
        """Kill it."""
        self.proc.kill()
        self.proc.wait()


async def ab_phase(
    fleet: Fleet, direct: str, gateway: str, windows: int, window_s: float,
    cpu: dict[str, Callable[[], float]] | None = None, burner: Burner | None = None,
) -> dict[str, float]:
    """The gateway with the control plane at work and idle, in alternating windows of ``window_s``
    seconds (``windows`` in all, beats flowing first): in a held window every agent holds its next
    beat (:attr:`scale_fleet.Fleet.flowing`), so the control plane, with the same N nodes and
    replicas, has no heartbeat to handle. The windows interleave because the gateway's added latency
    drifts by more than the effect over tens of seconds of one steady state (0.686 -> 0.605 ms in
    30 s, N = 5,000, 2026-12-06): an idle figure taken minutes earlier compares two moments as much
    as two loads. Pairs in the first :data:`AB_SETTLE_S` of a window are left out. A beat that falls
    due in a held window is dropped, so a flowing window carries the steady rate, no more
    (:attr:`scale_fleet.Fleet.flowing`). Returns ``ab_added_p50_flowing_ms``, ``..._held_ms``,
    ``ab_change_ms`` (flowing minus held) with its 95 % bootstrap interval, the pairs on each side,
    and the beats per second the control plane answered on each (``ab_beats_per_s_flowing``,
    ``..._held``) with the beats dropped and sent while held. ``cpu`` names CPU-second counters
    (``{"gateway_process": ...}``) whose rate over each side's windows (their first
    :data:`AB_SETTLE_S` left out) is given as ``ab_<name>_cores_flowing`` and ``..._held``: which
    process's work the beats add to. ``burner``: on in the held windows (the control: the CPU the
    beats take, without beats)."""
    stop = asyncio.Event()
    probe = asyncio.create_task(gateway_probe(direct, gateway, stop, 0))
    spans: list[tuple[float, float, bool]] = []
    beat_spans: list[tuple[float, float, bool]] = []  # monotonic, as the fleet's beats are timed
    dropped, sent_held = fleet.dropped, fleet.sent_held
    used = {name: {True: [0.0, 0.0], False: [0.0, 0.0]} for name in cpu or {}}  # [CPU s, wall s] per side
    try:
        await asyncio.sleep(GW_WARMUP * 0.01)  # the probe's warm-up pairs
        for k in range(windows):
            flowing = k % 2 == 0
            if flowing:
                fleet.flowing.set()
                if burner is not None:
                    burner.off()
            else:
                fleet.flowing.clear()
                if burner is not None:
                    burner.on()
            t0, m0 = time.time(), time.monotonic()
            await asyncio.sleep(AB_SETTLE_S)
            c0, m1 = {name: read() for name, read in (cpu or {}).items()}, time.monotonic()
            await asyncio.sleep(window_s - AB_SETTLE_S)
            for name, read in (cpu or {}).items():
                used[name][flowing][0] += read() - c0[name]
                used[name][flowing][1] += time.monotonic() - m1
            spans.append((t0 + AB_SETTLE_S, time.time(), flowing))
            beat_spans.append((m0, time.monotonic(), flowing))
    finally:
        fleet.flowing.set()
        if burner is not None:
            burner.off()
        stop.set()
    d_ms, g_ms, at = await probe
    sides: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
    for d, g, t in zip(d_ms, g_ms, at, strict=False):
        for start, end, flowing in spans:
            if start <= t < end:
                sides[flowing][0].append(d)
                sides[flowing][1].append(g)
    held, flowing_ = sides[False], sides[True]
    f = {"ab_added_p50_flowing_ms": added(*flowing_), "ab_added_p50_held_ms": added(*held)}
    f["ab_change_ms"] = f["ab_added_p50_flowing_ms"] - f["ab_added_p50_held_ms"]
    f["ab_change_ci_low_ms"], f["ab_change_ci_high_ms"] = added_change_ci(held, flowing_)
    f["ab_pairs_flowing"], f["ab_pairs_held"] = float(len(flowing_[1])), float(len(held[1]))
    beats = fleet.records.beats.get(fleet.records.phase, [])
    for side, name in ((True, "flowing"), (False, "held")):
        wall = sum(end - start for start, end, on in beat_spans if on is side)
        n = sum(1 for b in beats for start, end, on in beat_spans if on is side and start <= b.at < end)
        f[f"ab_beats_per_s_{name}"] = n / wall if wall else float("nan")
    for name, sides_used in used.items():
        for side, label in ((True, "flowing"), (False, "held")):
            spent, wall = sides_used[side]
            f[f"ab_{name}_cores_{label}"] = spent / wall if wall else float("nan")
    f["ab_beats_dropped"] = float(fleet.dropped - dropped)
    f["ab_beats_sent_held"] = float(fleet.sent_held - sent_held)
    return f


def added(d_ms: list[float], g_ms: list[float]) -> float:
    """What the gateway adds: its median minus the direct median (ms); NaN when a side is empty (a
    window too short for a pair: the figure is then printed as missing, not the run failed)."""
    if not d_ms or not g_ms:
        return float("nan")
    return statistics.median(g_ms) - statistics.median(d_ms)


def added_change_ci(idle: tuple[list[float], list[float]], run: tuple[list[float], list[float]],
                    rounds: int = BOOT_ROUNDS) -> tuple[float, float]:
    """The 95 % interval (ms) of ``added(run) - added(idle)``: each of the four samples (direct and
    gateway, idle and during the run) resampled with replacement ``rounds`` times (a percentile
    bootstrap, seeded: the same samples give the same interval). An interval reaching below 0 means
    this run cannot tell the gateway during the run from the idle one."""
    if not all((*idle, *run)):
        return float("nan"), float("nan")
    rng = random.Random(0)

    def again(xs: list[float]) -> list[float]:
        return rng.choices(xs, k=len(xs))

    diffs = sorted(
        added(again(run[0]), again(run[1])) - added(again(idle[0]), again(idle[1])) for _ in range(rounds)
    )
    return diffs[int(0.025 * rounds)], diffs[min(rounds - 1, int(0.975 * rounds))]
