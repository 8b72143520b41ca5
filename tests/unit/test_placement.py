"""Placement: one table per filter/fit, then the pipeline (profiles, spreading, summary) and the leader."""

from __future__ import annotations

from collections.abc import Callable

from llmgw.catalog import Engine, Model, Profile, Scaling
from llmgw.control.placement import checks
from llmgw.control.placement import placer as pl
from llmgw.control.reconcile.leader import Leader
from llmgw.control.store import Store
from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ProvisionState
from tests.helpers.nodes import LLAMA, h100, node

GB = 1_000_000_000


def cand(n: checks.NodeInfo, p: Profile | None = None, usage: checks.Usage | None = None) -> checks.Candidate:
    return checks.Candidate(n, p or Profile(name="cpu"), usage or checks.Usage())


Case = tuple[str, checks.Candidate, str | None]


def run_table(fit: Callable[[checks.Candidate], checks.Miss | None], cases: list[Case]) -> None:
    for name, c, want in cases:
        miss = fit(c)
        got = miss.reason if miss else None
        assert got == want, name


def test_node_ready() -> None:
    run_table(
        checks.node_ready,
        [("ready", cand(node()), None), ("lost", cand(node(state="lost")), "node is lost")],
    )


def test_not_cordoned() -> None:
    run_table(
        checks.not_cordoned,
        [("open", cand(node()), None), ("cordoned", cand(node(cordoned=True)), "node is cordoned")],
    )


def test_node_selector() -> None:
    sel = Profile(name="cpu", node_selector={"llmgw.control-plane": "true"})
    run_table(
        checks.node_selector,
        [
            ("no selector", cand(node()), None),
            ("match", cand(node(labels={"llmgw.control-plane": "true", "x": "y"}), sel), None),
            ("missing", cand(node(), sel), "label llmgw.control-plane=true does not match"),
            (
                "wrong value",
                cand(node(labels={"llmgw.control-plane": "no"}), sel),
                "label llmgw.control-plane=true does not match",
            ),
        ],
    )


def test_engine_installed() -> None:
    failed = EngineStatus(
        engine="llamacpp", state=ProvisionState.FAILED, detail="no llama-server: build failed"
    )
    installing = EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLING)
    vllm = Profile(name="gpu", engine=Engine.VLLM)
    run_table(
        checks.engine_installed,
        [
            ("installed", cand(node()), None),
            (
                "failed",
                cand(node(engines=[failed])),
                "engine llamacpp not installed (failed: no llama-server: build failed)",
            ),
            ("installing", cand(node(engines=[installing])), "engine llamacpp not installed (installing)"),
            ("absent", cand(node(), vllm), "engine vllm not installed (not reported by the node)"),
        ],
    )


def test_gpu_class() -> None:
    gpu = Profile(name="gpu", gpu_class="h100-80gb")
    run_table(
        checks.gpu_class,
        [
            ("cpu profile", cand(node()), None),
            ("has it", cand(node(gpus=[h100()]), gpu), None),
            ("no gpu", cand(node(), gpu), "no GPU of class h100-80gb (has: none)"),
            (
                "other class",
                cand(node(gpus=[h100().model_copy(update={"klass": "a10-24gb"})]), gpu),
                "no GPU of class h100-80gb (has: a10-24gb)",
            ),
        ],
    )


def test_memory() -> None:
    p2 = Profile(name="cpu", min_memory_gb=2)
    gpu = Profile(name="gpu", gpu_class="h100-80gb", min_memory_gb=40)
    run_table(
        checks.memory,
        [
            ("zero reserves nothing", cand(node(mem_gb=0.5)), None),
            ("fits", cand(node(mem_gb=8), p2), None),
            ("exactly fits", cand(node(mem_gb=8), p2, checks.Usage(memory_gb=6)), None),
            (
                "used up",
                cand(node(mem_gb=7.8), p2, checks.Usage(memory_gb=6.4)),
                "needs 2.0 GB memory, 1.4 of 7.8 GB free",
            ),
            (
                "a gpu profile's memory is on the card",
                cand(node(gpus=[h100()]), gpu, checks.Usage(memory_gb=100)),
                None,
            ),
            (
                "used outside llmgw",
                cand(node(mem_gb=8, avail_gb=1.5), p2),
                "needs 2.0 GB memory, 1.5 of 8.0 GB free (6.5 GB used outside llmgw)",
            ),
            (
                "outside use beyond the reservations",
                cand(node(mem_gb=8, avail_gb=1.0), p2, checks.Usage(memory_gb=3)),
                "needs 2.0 GB memory, 1.0 of 8.0 GB free (4.0 GB used outside llmgw)",
            ),
            ("reserved but not yet used", cand(node(mem_gb=8, avail_gb=8), p2, checks.Usage(memory_gb=5)), None),
        ],
    )
    miss = checks.memory(cand(node(mem_gb=7.8), p2, checks.Usage(memory_gb=6.4)))
    assert miss is not None
    assert (miss.need, miss.free, miss.label) == (2.0, 1.4, "not enough memory")


def test_gpus() -> None:
    gpu = Profile(name="gpu", gpu_class="h100-80gb", min_memory_gb=40)
    two = Profile(name="gpu2", gpu_class="h100-80gb", min_memory_gb=100, gpu_count=2)
    taken = checks.Usage(gpus_taken={0: "m-aaaaaa"})
    run_table(
        checks.gpus,
        [
            ("cpu profile", cand(node()), None),
            ("fits", cand(node(gpus=[h100()]), gpu), None),
            ("card taken", cand(node(gpus=[h100()]), gpu, taken), "needs 1 GPU h100-80gb, 0 of 1 free"),
            ("second card free", cand(node(gpus=[h100(), h100(index=1)]), gpu, taken), None),
            (
                "used outside llmgw",
                cand(node(gpus=[h100(used_gb=50)]), gpu),
                "card 0 has 30.0 of 80.0 GB free, needs 40.0 (50.0 GB used outside llmgw)",
            ),
            ("two cards, 50 GB each", cand(node(gpus=[h100(), h100(index=1)]), two), None),
            ("two cards wanted, one free", cand(node(gpus=[h100(), h100(index=1)]), two, taken),
             "needs 2 GPU h100-80gb, 1 of 2 free"),
        ],
    )
    assert checks.pick_gpus(cand(node(gpus=[h100(), h100(index=1), h100(index=2)]), gpu, taken)) == (1,)
    miss = checks.gpus(cand(node(gpus=[h100()]), gpu, taken))
    assert miss is not None
    assert miss.held_by == ("m-aaaaaa",)


def test_cores() -> None:
    p2 = Profile(name="cpu", cpu_cores=2)
    run_table(
        checks.cores,
        [
            ("zero reserves nothing", cand(node(cores=1), Profile(name="cpu"), checks.Usage(cpu_cores=9)), None),
            ("fits", cand(node(cores=4), p2, checks.Usage(cpu_cores=2)), None),
            ("used up", cand(node(cores=4), p2, checks.Usage(cpu_cores=3)), "needs 2 cores, 1 of 4 free"),
        ],
    )


def test_pipeline_order_first_failure_wins() -> None:
    p = Profile(name="cpu", min_memory_gb=100, node_selector={"a": "b"})
    v = checks.check(cand(node(state="lost", cordoned=True), p))
    assert v is not None
    assert (v.rejection.code, v.rejection.kind) == ("node_not_ready", "filtered")
    v = checks.check(cand(node(labels={"a": "b"}), p))
    assert v is not None
    assert (v.rejection.code, v.rejection.kind) == ("memory_too_small", "filtered")  # 100 GB on an 8 GB node
    v = checks.check(cand(node(labels={"a": "b"}, avail_gb=2), p.model_copy(update={"min_memory_gb": 4})))
    assert v is not None
    assert (v.rejection.code, v.rejection.kind) == ("memory_exhausted", "exhausted")


def model(*profiles: Profile, scaling: Scaling | None = None) -> Model:
    return Model(name="m", source="file:/m.gguf", profiles=list(profiles), scaling=scaling or Scaling())


def test_place_tries_profiles_by_priority_and_keeps_earlier_rejections() -> None:
    gpu = Profile(name="gpu", gpu_class="h100-80gb", priority=200, min_memory_gb=1)
    cpu = Profile(name="cpu", priority=100, min_memory_gb=1)
    d = pl.place(model(cpu, gpu), [node("a"), node("b", gpus=[h100()])], [])
    assert (d.node, d.profile and d.profile.name) == ("b", "gpu")
    d = pl.place(model(cpu, gpu), [node("a")], [])
    assert (d.node, d.profile and d.profile.name) == ("a", "cpu")
    assert [r.code for r in d.rejections] == ["gpu_class_mismatch"]
    assert d.summary == "placed on a (profile cpu)"


def test_place_spreads_then_prefers_free_memory_then_id() -> None:
    m = model(Profile(name="cpu", min_memory_gb=1))
    nodes = [node("b", mem_gb=8), node("a", mem_gb=8), node("c", mem_gb=16)]
    assert pl.place(m, nodes, []).node == "c"  # most free memory
    res = [checks.Reservation("c", "m", 1, 0)]
    assert pl.place(m, nodes, res).node == "a"  # fewest of this model, then id
    other = [checks.Reservation("c", "other", 10, 0)]
    assert pl.place(m, nodes, other).node == "a"  # c has 6 GB free now, a and b 8: a by id


def test_summary_counts_per_reason_sorted() -> None:
    p = Profile(name="cpu", min_memory_gb=2, node_selector={"llmgw.control-plane": "true"})
    nodes = [
        node("a", labels={"llmgw.control-plane": "true"}, mem_gb=8, avail_gb=1),
        node("b"),
        node("c"),
    ]
    d = pl.place(model(p), nodes, [])
    assert not d.placed
    assert (
        d.summary
        == "0/3 nodes can run it: 1 not enough memory, 2 nodes without the label llmgw.control-plane=true"
    )
    assert {r.node: r.kind for r in d.rejections} == {"a": "exhausted", "b": "filtered", "c": "filtered"}
    assert pl.place(model(p), [], []).summary.startswith("0/0 nodes can run it: no node has registered")


def test_summary_counts_a_node_under_its_furthest_verdict() -> None:
    gpu = Profile(name="gpu", gpu_class="h100-80gb", priority=200)
    cpu = Profile(name="cpu", min_memory_gb=10)
    d = pl.place(model(cpu, gpu), [node("a", mem_gb=16, avail_gb=8)], [])
    assert d.summary == "0/1 nodes can run it: 1 not enough memory"
    d = pl.place(model(cpu, gpu), [node("a", mem_gb=8)], [])  # too small: a filter past the GPU class
    assert d.summary == "0/1 nodes can run it: 1 node with too little memory"


# --- the leader, over a real store ---


def hb(labels: dict[str, str] | None = None, mem_gb: float = 8) -> Heartbeat:
    inv = Inventory(cores=4, memory_total_bytes=int(mem_gb * GB), memory_available_bytes=int(mem_gb * GB))
    return Heartbeat(inventory=inv, labels=labels or {}, engines=[LLAMA])


def test_leader_places_min_spread_and_explains(store: Store) -> None:
    store.upsert_node_heartbeat("a", hb(), 100.0)
    store.upsert_node_heartbeat("b", hb(), 100.0)
    m = Model(
        name="chat",
        source="file:/m.gguf",
        profiles=[Profile(name="cpu", min_memory_gb=2)],
        scaling=Scaling(min=2, max=3),
    )
    store.add_model(m, now=100.0)
    leader = Leader(store, node_lost_after_s=30)
    res = leader.reconcile_once(101.0)
    assert len(res.created) == 2
    reps = store.list_replicas(model="chat")
    assert sorted(r.node for r in reps) == ["a", "b"]
    assert all(r.state == "pending" and r.id.startswith("chat-") and len(r.key) > 20 for r in reps)
    ex = store.get_explanation("chat")
    assert ex is not None
    assert (ex.placed, ex.replicas, ex.wanted) == (True, 2, 2)
    assert leader.reconcile_once(102.0).created == []  # steady state


def test_leader_marks_lost_and_replaces_and_removes_deleted_models(store: Store) -> None:
    store.upsert_node_heartbeat("a", hb(), 100.0)
    store.upsert_node_heartbeat("b", hb(), 100.0)
    store.add_model(Model(name="chat", source="file:/m.gguf", profiles=[Profile(name="cpu")]), now=100.0)
    leader = Leader(store, node_lost_after_s=30)
    leader.reconcile_once(100.0)
    (first,) = store.list_replicas()
    survivor = "b" if first.node == "a" else "a"
    store.upsert_node_heartbeat(survivor, hb(), 125.0)
    res = leader.reconcile_once(135.0)
    assert res.lost == [first.node]
    assert res.removed == [first.id]
    (second,) = store.list_replicas()
    assert second.node == survivor
    store.delete_model("chat")
    res = leader.reconcile_once(136.0)
    assert res.removed == [second.id]
    assert store.list_replicas() == []
    assert store.get_explanation("chat") is None


def test_leader_explains_when_nothing_fits(store: Store) -> None:
    store.upsert_node_heartbeat("a", hb(mem_gb=1), 100.0)
    store.add_model(
        Model(name="big", source="file:/m.gguf", profiles=[Profile(name="cpu", min_memory_gb=4)]), now=100.0
    )
    Leader(store, node_lost_after_s=30).reconcile_once(100.0)
    ex = store.get_explanation("big")
    assert ex is not None
    assert not ex.placed
    assert ex.summary == "0/1 nodes can run it: 1 node with too little memory"
    assert ex.rejections[0].reason == "needs 4.0 GB memory, the node has 1.0 GB in all: too small"
    assert ex.would_fit_if == ["a is too small (1.0 GB memory in all, needs 4.0): add a node with at least 4.0 GB"]
    assert store.list_replicas() == []
