"""Placement speed, pure (no processes, no store), against its targets.

1. ``place_1000_on_500``: 1,000 replicas (100 models x 10, a GPU profile and a CPU profile each)
   onto 500 nodes (400 CPU nodes of 32 cores / 128 GB, 100 GPU nodes with 8 x h100-80gb), one
   :class:`~llmgw.control.placement.placer.Placer` as the leader's pass uses it. Target <= 1 s.
   Side by side: the same placements with a fresh :func:`placement.place` per replica (no cache:
   every node re-checked every time), on the first 100 replicas, scaled to 1,000.
2. ``explain_500``: one explanation of a model that fits nowhere (every node rejected, the
   summary and the would-fit-if list) over those 500 nodes, full. Target <= 50 ms.

Each figure is the median of ``ROUNDS`` runs. Figures last, one ``name: value unit`` per line.

    .venv/bin/python bench/placement.py
"""

from __future__ import annotations

import statistics
import time

from llmgw.catalog import Model, Profile, Scaling
from llmgw.control.placement import checks
from llmgw.control.placement import placer as pl
from llmgw.control.placement.explain import explain_view
from llmgw.protocol import GPU, EngineStatus, Inventory, ProvisionState

ROUNDS = 5
GB = 1_000_000_000
LLAMA = {"llamacpp": EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")}


def nodes() -> list[checks.NodeInfo]:
    out = []
    for i in range(400):
        inv = Inventory(cores=32, memory_total_bytes=128 * GB, memory_available_bytes=120 * GB)
        out.append(checks.NodeInfo(f"cpu-{i:03d}", "ready", inv, labels={"zone": f"z{i % 4}"}, engines=LLAMA))
    for i in range(100):
        gpus = [
            GPU(index=g, name="NVIDIA H100 80GB HBM3", klass="h100-80gb", memory_total_bytes=80 * GB)
            for g in range(8)
        ]
        inv = Inventory(cores=96, memory_total_bytes=1000 * GB, memory_available_bytes=990 * GB, gpus=gpus)
        out.append(checks.NodeInfo(f"gpu-{i:03d}", "ready", inv, engines=LLAMA))
    return out


def models() -> list[Model]:
    return [
        Model(
            name=f"m{i:03d}",
            source=f"http://mirror/m{i}/1/m.gguf",
            scaling=Scaling(min=10, max=10),
            profiles=[
                Profile(name="gpu", gpu_class="h100-80gb", priority=200, min_memory_gb=40),
                Profile(name="cpu", priority=100, min_memory_gb=4, cpu_cores=4),
            ],
        )
        for i in range(100)
    ]


def place_all(ns: list[checks.NodeInfo], ms: list[Model]) -> tuple[float, int]:
    t = time.perf_counter()
    placer = pl.Placer(ns, [])
    placed = 0
    for m in ms:
        for i in range(m.scaling.min):
            d = placer.place(m)
            if d.placed:
                placer.reserve(m, d, f"{m.name}-{i}")
                placed += 1
    return time.perf_counter() - t, placed


def place_fresh(ns: list[checks.NodeInfo], ms: list[Model], limit: int) -> float:
    t = time.perf_counter()
    done: list[checks.Reservation] = []
    n = 0
    for m in ms:
        for _ in range(m.scaling.min):
            if n == limit:
                return (time.perf_counter() - t) * 1000 / limit
            d = pl.place(m, ns, done)
            if d.node is not None and d.profile is not None:
                p = d.profile
                done.append(
                    checks.Reservation(d.node, m.name, p.min_memory_gb, p.cpu_cores, p.gpu_class, d.gpu_indexes)
                )
            n += 1
    return (time.perf_counter() - t) * 1000 / max(n, 1)


def explain_once(ns: list[checks.NodeInfo]) -> tuple[float, str]:
    huge = Model(
        name="huge",
        source="http://mirror/huge/1/h.gguf",
        profiles=[
            Profile(name="gpu", gpu_class="b200-180gb", priority=200, min_memory_gb=150),
            Profile(name="cpu", min_memory_gb=2000, cpu_cores=8, node_selector={"zone": "z1"}),
        ],
    )
    t = time.perf_counter()
    placer = pl.Placer(ns, [])
    d = placer.place(huge)
    view = explain_view(huge, decision=d, placer=placer, replicas=[], now=0.0)
    return time.perf_counter() - t, view.summary


def main() -> None:
    ns, ms = nodes(), models()
    runs = [place_all(ns, ms) for _ in range(ROUNDS)]
    placed = runs[0][1]
    cached_s = statistics.median(r[0] for r in runs)
    fresh_ms = statistics.median(place_fresh(ns, ms, 100) for _ in range(2))
    explains = [explain_once(ns) for _ in range(ROUNDS)]
    explain_ms = statistics.median(e[0] for e in explains) * 1000
    print(f"placed {placed} of 1000 replicas onto {len(ns)} nodes")
    print(f"explanation: {explains[0][1]}")
    print(f"place_1000_on_500: {cached_s:.3f} s")
    print(f"place_1000_on_500_uncached_estimate: {fresh_ms:.2f} s")  # ms per replica x 1000 / 1000
    print(f"explain_500: {explain_ms:.1f} ms")


if __name__ == "__main__":
    main()
