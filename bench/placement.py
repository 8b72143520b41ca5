"""Placement speed, pure (no processes, no store), against its targets, and checked against
placement's definition (:class:`~llmgw.control.placement.reference.ReferencePlacer`).

1. ``place_1000_on_500_s``: 1,000 replicas (100 models x 10, a GPU profile and a CPU profile each)
   onto 500 nodes (400 CPU nodes of 32 cores / 128 GB in 4 zones, 100 GPU nodes with 8 x
   h100-80gb), one :class:`~llmgw.control.placement.placer.Placer` as the leader's pass uses it,
   the Placer built inside the timing. Target <= 0.2 s (0.77-0.85 s before the indexes).
2. ``place_1000_on_5000_s``: the node mix x 10 (4,000 CPU nodes in 4 zones and 2 pools, 1,000 GPU
   nodes in 2 pools, 200 CPU nodes holding one model's weights), 1,000 replicas of 100 models:
   the even ones as above (GPU, else CPU), the odd ones CPU only with a zone selector (labels,
   cached weights and spread all decide). Target <= 0.5 s.
3. ``explain_500`` / ``explain_5000`` (ms): one explanation of a model that fits nowhere (every
   node rejected, the summary and the would-fit-if list), full, Placer included; beside them the
   reference's time for the same (one round).

Correctness, loudly (exit 1 and the first difference):

* every round's placements (model, node, profile, cards, in order) equal the ones
  ``ReferencePlacer`` makes on the same inputs, saved in ``bench/placement_expected.json``
  (``--write-expected`` runs the reference again and rewrites it: minutes at 5,000 nodes);
* on 500 nodes the reference also runs live once: every decision's summary, and the full verdict
  lists of every 97th decision and each model's last, must be equal;
* each explanation (summary, rejections, would-fit-if) equals the reference's, at both sizes.

Each figure is the median of ``ROUNDS`` runs, its spread (min-max) beside it; the load average is
printed with them (the machine is shared). Figures last, one ``name: value unit`` per line.

    .venv/bin/python bench/placement.py [--write-expected]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from llmgw.catalog import Model, Profile, Scaling
from llmgw.control.placement import checks
from llmgw.control.placement import placer as pl
from llmgw.control.placement.explain import explain_view
from llmgw.control.placement.reference import ReferencePlacer
from llmgw.protocol import GPU, EngineStatus, Inventory, ProvisionState
from llmgw.views import ExplainView

ROUNDS = 7
GB = 1_000_000_000
LLAMA = {"llamacpp": EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")}
EXPECTED = Path(__file__).with_name("placement_expected.json")

Placed = list[str]  # "model node profile cards", one per replica, in placement order


def nodes(scale: int = 1) -> list[checks.NodeInfo]:
    """400 x ``scale`` CPU nodes and 100 x ``scale`` GPU nodes; at ``scale`` above 1 also pools
    and cached weights (200 CPU nodes hold m001's)."""
    out = []
    for i in range(400 * scale):
        inv = Inventory(cores=32, memory_total_bytes=128 * GB, memory_available_bytes=120 * GB)
        labels = {"zone": f"z{i % 4}"} | ({"pool": f"p{i % 2}"} if scale > 1 else {})
        cached = frozenset({"m001/1"}) if scale > 1 and i % 20 == 1 else frozenset()
        out.append(checks.NodeInfo(f"cpu-{i:04d}", "ready", inv, labels=labels, engines=LLAMA, cached=cached))
    for i in range(100 * scale):
        gpus = [GPU(index=g, name="NVIDIA H100 80GB HBM3", klass="h100-80gb", memory_total_bytes=80 * GB)
                for g in range(8)]  # fmt: skip
        inv = Inventory(cores=96, memory_total_bytes=1000 * GB, memory_available_bytes=990 * GB, gpus=gpus)
        labels = {"pool": f"g{i % 2}"} if scale > 1 else {}
        out.append(checks.NodeInfo(f"gpu-{i:04d}", "ready", inv, labels=labels, engines=LLAMA))
    return out


def models(mixed: bool = False) -> list[Model]:
    """100 models x 10 replicas; ``mixed``: the odd ones CPU only, in one zone."""
    gpu = Profile(name="gpu", gpu_class="h100-80gb", priority=200, min_memory_gb=40)
    cpu = Profile(name="cpu", priority=100, min_memory_gb=4, cpu_cores=4)
    out = []
    for i in range(100):
        profiles = [gpu, cpu]
        if mixed and i % 2:
            profiles = [Profile(name="cpu", min_memory_gb=6, cpu_cores=4, node_selector={"zone": f"z{i % 4}"})]
        out.append(Model(name=f"m{i:03d}", source=f"http://mirror/m{i}/1/m.gguf", scaling=Scaling(min=10, max=10),
                         profiles=profiles))  # fmt: skip
    return out


def place_all(ns: list[checks.NodeInfo], ms: list[Model], make: Callable[..., pl.Placer]) -> tuple[float, Placed]:
    """Seconds to place every model's ``scaling.min`` replicas with one placer (built inside)."""
    t = time.perf_counter()
    placer = make(ns, [])
    decisions = []
    for m in ms:
        for i in range(m.scaling.min):
            d = placer.place(m)
            if d.placed:
                placer.reserve(m, d, f"{m.name}-{i}")
            decisions.append((m.name, d))
    took = time.perf_counter() - t
    return took, [f"{m} {d.node} {d.profile.name if d.profile else '-'} {list(d.gpu_indexes)}" for m, d in decisions]


def same_as_reference_live(ns: list[checks.NodeInfo], ms: list[Model]) -> None:
    """Both placers side by side: summaries of all decisions, full verdicts of every 97th and each
    model's last."""
    fast, ref = pl.Placer(ns, []), ReferencePlacer(ns, [])
    k = 0
    for m in ms:
        for i in range(m.scaling.min):
            a, b = fast.place(m), ref.place(m)
            if (a.node, a.profile, a.gpu_indexes, a.summary) != (b.node, b.profile, b.gpu_indexes, b.summary):
                fail(f"decision {k} ({m.name}): placer says {a.summary!r}, the reference {b.summary!r}")
            if (k % 97 == 0 or i == m.scaling.min - 1) and a.verdicts != b.verdicts:
                fail(f"decision {k} ({m.name}): verdicts differ from the reference's")
            if a.placed:
                fast.reserve(m, a, f"{m.name}-{i}")
                ref.reserve(m, b, f"{m.name}-{i}")
            k += 1


def huge() -> Model:
    return Model(
        name="huge",
        source="http://mirror/huge/1/h.gguf",
        profiles=[
            Profile(name="gpu", gpu_class="b200-180gb", priority=200, min_memory_gb=150),
            Profile(name="cpu", min_memory_gb=2000, cpu_cores=8, node_selector={"zone": "z1"}),
        ],
    )


def explain_once(ns: list[checks.NodeInfo], make: Callable[..., pl.Placer]) -> tuple[float, ExplainView]:
    m = huge()
    t = time.perf_counter()
    placer = make(ns, [])
    d = placer.place(m)
    view = explain_view(m, decision=d, placer=placer, replicas=[], now=0.0)
    return time.perf_counter() - t, view


def fail(why: str) -> None:
    print(f"FAIL: {why}", file=sys.stderr)
    sys.exit(1)


def check_placed(case: str, got: Placed, expected: dict[str, Placed]) -> None:
    want = expected.get(case)
    if want is None:
        fail(f"{EXPECTED} has no {case}; run bench/placement.py --write-expected (it runs ReferencePlacer)")
    for k, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            fail(f"{case}: placement {k} is {a!r}, the reference placed {b!r}")
    if len(got) != len(want):
        fail(f"{case}: {len(got)} placements, the reference made {len(want)}")


def spread(xs: list[float], unit: str, scale: float = 1.0, digits: int = 3) -> str:
    """``median unit (N rounds min-max)``."""
    lo, mid, hi = (f"{x * scale:.{digits}f}" for x in (min(xs), statistics.median(xs), max(xs)))
    return f"{mid} {unit} ({len(xs)} rounds {lo}-{hi})"


def main() -> None:
    cases = {"place_1000_on_500": (nodes(1), models()), "place_1000_on_5000": (nodes(10), models(mixed=True))}
    if "--write-expected" in sys.argv:
        out = {}
        for case, (ns, ms) in cases.items():
            took, out[case] = place_all(ns, ms, ReferencePlacer)
            print(f"{case}: the reference took {took:.1f} s")
        EXPECTED.write_text(json.dumps(out, indent=0) + "\n")
        print(f"wrote {EXPECTED}")
        return
    expected = json.loads(EXPECTED.read_text()) if EXPECTED.exists() else {}
    ns500, ms500 = cases["place_1000_on_500"]
    same_as_reference_live(ns500, ms500)
    figures: list[tuple[str, str]] = []
    loads = [os.getloadavg()[0]]
    for case, (ns, ms) in cases.items():
        times = []
        for _ in range(ROUNDS):
            took, placed = place_all(ns, ms, pl.Placer)
            check_placed(case, placed, expected)
            times.append(took)
        n_placed = sum(" None " not in p for p in placed)
        print(f"{case}: placed {n_placed} of {len(placed)} replicas onto {len(ns)} nodes, each round as the reference")
        figures.append((f"{case}_s", spread(times, "s")))
        loads.append(os.getloadavg()[0])
    for size, ns in (("500", ns500), ("5000", cases["place_1000_on_5000"][0])):
        runs = [explain_once(ns, pl.Placer) for _ in range(ROUNDS)]
        ref_s, want = explain_once(ns, ReferencePlacer)
        for _, view in runs:
            if view != want:
                fail(f"explain_{size}: the explanation differs from the reference's: {view.summary!r}")
        print(f"explanation over {size} nodes: {runs[0][1].summary}")
        figures.append((f"explain_{size}", spread([r[0] for r in runs], "ms", 1000, 1)))
        figures.append((f"explain_{size}_reference", f"{ref_s * 1000:.1f} ms (1 round, the placer as it was)"))
    loads.append(os.getloadavg()[0])
    print(f"load_average_1m: {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cpus (during the figures)")
    for name, value in figures:
        print(f"{name}: {value}")


if __name__ == "__main__":
    main()
