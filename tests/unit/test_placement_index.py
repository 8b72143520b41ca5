"""The indexed :class:`~llmgw.control.placement.placer.Placer` against placement's definition
(:class:`~llmgw.control.placement.reference.ReferencePlacer`, the placer as it was before its
indexes): on randomized clusters (CPU and GPU nodes, labels and selectors, lost, cordoned and
engine-less nodes, cards with memory used or unmeasured, cached weights, nodes already full, group
profiles) both make the same decisions with the same verdicts and explanations, word for word."""

from __future__ import annotations

import random

import pytest

from llmgw.catalog import Engine, Model, Profile, Scaling
from llmgw.control.placement import checks
from llmgw.control.placement import placer as pl
from llmgw.control.placement.explain import explain_view
from llmgw.control.placement.reference import ReferencePlacer
from llmgw.protocol import GPU, EngineStatus, ProvisionState
from tests.helpers.nodes import LLAMA, node

CLASSES = ("h100-80gb", "a100-40gb")
ZONES = ("z0", "z1", "z2")


def gpu(rng: random.Random, index: int, klass: str) -> GPU:
    total = {"h100-80gb": 80, "a100-40gb": 40}[klass] * 10**9
    if rng.random() < 0.03:  # memory unknown: a discovery problem, its class loses the "-<n>gb"
        return GPU(index=index, name="H?", klass=klass.rsplit("-", 1)[0], memory_total_bytes=0)
    used = rng.choice((0, 0, 0, 5 * 10**9, 30 * 10**9))
    return GPU(index=index, name=klass.upper(), klass=klass, memory_total_bytes=total, memory_used_bytes=used)


def cluster(rng: random.Random, n: int) -> list[checks.NodeInfo]:
    out = []
    for i in range(n):
        engines = [LLAMA]
        roll = rng.random()
        if roll < 0.05:
            engines = []
        elif roll < 0.08:
            engines = [EngineStatus(engine="llamacpp", state=ProvisionState.FAILED, detail="no binary")]
        elif roll < 0.15:
            engines = [EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED)]  # no rpc: no groups
        gpus = []
        if rng.random() < 0.3:
            klass = rng.choice(CLASSES)
            gpus = [gpu(rng, g, klass) for g in range(rng.choice((1, 2, 4, 8)))]
        mem = rng.choice((8, 16, 32, 64, 128))
        out.append(
            node(
                f"n{rng.randrange(10_000):04d}-{i}",
                state="lost" if rng.random() < 0.05 else "ready",
                cordoned=rng.random() < 0.05,
                labels={"zone": rng.choice(ZONES)} if rng.random() < 0.7 else {},
                engines=engines,
                mem_gb=mem,
                avail_gb=mem * rng.choice((1.0, 0.9, 0.5)),
                cores=rng.choice((4, 8, 16, 32)),
                gpus=gpus,
                cached=frozenset(f"m{k}/1" for k in range(8) if rng.random() < 0.1),
            )
        )
    return out


def profiles(rng: random.Random) -> list[Profile]:
    out = []
    if rng.random() < 0.6:
        klass = rng.choice(CLASSES)
        out.append(
            Profile(
                name="gpu",
                gpu_class=klass,
                gpu_count=rng.choice((1, 1, 2)),
                priority=200,
                min_memory_gb=rng.choice((10, 30, 60, 90)),
                cpu_cores=rng.choice((0, 2)),
            )
        )
    selector = {"zone": rng.choice(ZONES)} if rng.random() < 0.4 else {}
    out.append(
        Profile(
            name="cpu",
            priority=100,
            min_memory_gb=rng.choice((0, 2, 6, 20, 200)),
            cpu_cores=rng.choice((0, 2, 4)),
            node_selector=selector,
        )
    )
    if rng.random() < 0.25:
        out.append(Profile(name="split", priority=50, nodes=rng.choice((2, 3)), min_memory_gb=rng.choice((20, 90))))
    if rng.random() < 0.1:
        out.append(Profile(name="vllm", engine=Engine.VLLM, priority=10, min_memory_gb=1))
    return out


def catalog(rng: random.Random, n: int) -> list[Model]:
    """``n`` random models, then one that fits nowhere (its explanation lists every node)."""
    huge = Model(
        name="huge",
        source="http://mirror/huge/1/h.gguf",
        profiles=[
            Profile(name="gpu", gpu_class="h100-80gb", priority=200, min_memory_gb=100),
            Profile(name="cpu", min_memory_gb=100, cpu_cores=8, node_selector={"zone": "z1"}),
            Profile(name="split", priority=50, nodes=3, min_memory_gb=900),
        ],
    )
    return [
        Model(
            name=f"m{k}",
            source=f"http://mirror/m{k}/1/m.gguf",
            profiles=profiles(rng),
            scaling=Scaling(min=rng.randrange(1, 9), max=10),
        )
        for k in range(n)
    ] + [huge]


def already_placed(rng: random.Random, nodes: list[checks.NodeInfo]) -> list[checks.Reservation]:
    """Replicas of another model that fill some nodes (memory, cores or cards) before the pass."""
    out = []
    for n in rng.sample(nodes, len(nodes) // 4):
        cards = tuple(g.index for g in n.inventory.gpus if rng.random() < 0.6)
        klass = n.inventory.gpus[0].klass if cards else ""
        mem = n.inventory.memory_total_bytes / 1e9 * rng.choice((0.5, 0.95))
        out.append(checks.Reservation(n.id, "old", mem, rng.choice((0, n.inventory.cores)), replica=f"old-{n.id}"))
        if cards:
            out.append(checks.Reservation(n.id, "old", 10.0, 0, klass, cards, f"oldgpu-{n.id}"))
    return out


def same(a: checks.Decision, b: checks.Decision) -> None:
    assert (a.node, a.profile, a.gpu_indexes, a.members, a.summary, a.nodes, a.groups) == (
        b.node,
        b.profile,
        b.gpu_indexes,
        b.members,
        b.summary,
        b.nodes,
        b.groups,
    )
    assert a.verdicts == b.verdicts


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_indexed_placer_decides_and_explains_as_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    nodes = cluster(rng, 40)
    models = catalog(rng, 12)
    held = already_placed(rng, nodes)
    fast, ref = pl.Placer(nodes, held), ReferencePlacer(nodes, held)
    placed = unplaced = 0
    for m in models:
        replicas: list[tuple[str, str]] = []
        for i in range(m.scaling.min):
            d, r = fast.place(m), ref.place(m)
            same(d, r)
            if not d.placed:
                break
            placed += 1
            replicas.append((f"{m.name}-{i}", d.node or ""))
            assert fast.reserve_members(m, d, f"{m.name}-{i}") == ref.reserve_members(m, r, f"{m.name}-{i}")
        d, r = fast.place(m), ref.place(m)  # one more: the explanation the leader would store
        same(d, r)
        unplaced += not d.placed
        got = explain_view(m, decision=d, placer=fast, replicas=replicas, now=0.0)
        want = explain_view(m, decision=r, placer=ref, replicas=replicas, now=0.0)  # type: ignore[arg-type]
        assert got == want
    assert placed > 10
    assert unplaced > 0  # some explanation was of a model that fits nowhere
    for m in models:  # the leader's dry run: one more, the model's own replicas not counted
        dry = fast.without(m.name)
        ref_dry = ReferencePlacer(ref.nodes, [])
        for node_id, usage in ref.usage.items():
            for res in usage.held:
                if res.model != m.name:
                    ref_dry.usage.setdefault(node_id, checks.Usage()).add(res)
        d, r = dry.place(m), ref_dry.place(m)
        same(d, r)
        got = explain_view(m, decision=d, placer=dry, replicas=[], now=0.0)
        assert got == explain_view(m, decision=r, placer=ref_dry, replicas=[], now=0.0)  # type: ignore[arg-type]
    for m in models:  # the dry runs left the placer as it was
        same(fast.place(m), ref.place(m))


def test_usage_added_outside_reserve_is_seen() -> None:
    """The leader's dry run adds reservations straight to ``placer.usage``: the index sees them."""
    nodes = [node("a", mem_gb=8), node("b", mem_gb=16)]
    m = Model(name="m", source="file:/m.gguf", profiles=[Profile(name="cpu", min_memory_gb=6)])
    placer = pl.Placer(nodes, [])
    assert placer.place(m).node == "b"
    placer.usage["b"].add(checks.Reservation("b", "other", 12.0, 0, replica="other-1"))
    d = placer.place(m)
    assert (d.node, [v.rejection.reason for v in d.verdicts]) == ("a", ["needs 6.0 GB memory, 4.0 of 16.0 GB free"])


def test_a_dry_run_reserves_nothing() -> None:
    nodes = [node("a", mem_gb=8)]
    m = Model(name="m", source="file:/m.gguf", profiles=[Profile(name="cpu", min_memory_gb=6)])
    placer = pl.Placer(nodes, [])
    placer.reserve(m, placer.place(m), "m-1")
    dry = placer.without("m")
    d = dry.place(m)
    assert (d.node, placer.place(m).node) == ("a", None)
    with pytest.raises(ValueError, match=r"a dry-run placer \(without m\) reserves nothing"):
        dry.reserve(m, d, "m-2")


def test_verdicts_of_a_placed_decision_stay_as_they_were_at_the_decision() -> None:
    """Verdicts are listed on first read, yet from the fits as they stood when the decision was made."""
    nodes = [node("a", mem_gb=8), node("b", mem_gb=8)]
    m = Model(name="m", source="file:/m.gguf", profiles=[Profile(name="cpu", min_memory_gb=6)])
    placer = pl.Placer(nodes, [])
    first = placer.place(m)
    placer.reserve(m, first, "m-1")
    second = placer.place(m)
    placer.reserve(m, second, "m-2")
    assert (first.node, first.verdicts) == ("a", [])
    assert second.node == "b"
    assert [v.rejection.reason for v in second.verdicts] == ["needs 6.0 GB memory, 2.0 of 8.0 GB free"]
