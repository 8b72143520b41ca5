"""Placement's explanations as an operator reads them (:mod:`llmgw.control.placement.explain`): no
line sends them to free what freeing cannot give (a node too small, the model's own replicas), the
"newest replica" line stays true, and the words agree with their counts."""

from __future__ import annotations

from llmgw.catalog import Model, Profile, Scaling
from llmgw.control.placement import checks
from llmgw.control.placement import placer as pl
from llmgw.control.placement.explain import newest_line, would_fit_if
from llmgw.control.placement.reference import ReferencePlacer
from llmgw.control.reconcile.leader import Leader
from llmgw.control.store import Store
from llmgw.protocol import Heartbeat, Inventory
from tests.helpers.nodes import LLAMA, h100, node

GB = 1_000_000_000


def model(name: str, *profiles: Profile, n: int = 1) -> Model:
    return Model(name=name, source="file:/m.gguf", profiles=list(profiles), scaling=Scaling(min=n, max=n))


# --- 1: cores beyond a node's total are "too small", never "free N" ---


def test_cores_beyond_every_node_are_too_small_not_free() -> None:
    nodes = [node("node-a", cores=2), node("node-b", cores=2)]
    held = [checks.Reservation("node-b", "other", 0, 1, replica="other-111111")]
    placer = pl.Placer(nodes, held)
    m = model("big", Profile(name="cpu", cpu_cores=64))
    d = placer.place(m)
    assert not d.placed
    assert [(r.node, r.kind, r.code, r.reason, r.need, r.total) for r in d.rejections] == [
        ("node-a", "filtered", "cores_too_small", "needs 64 cores, the node has 2 in all: too small", 64.0, 2.0),
        ("node-b", "filtered", "cores_too_small", "needs 64 cores, the node has 2 in all: too small", 64.0, 2.0),
    ]
    assert d.summary == "0/2 nodes can run it: 2 nodes with too few cores"
    assert would_fit_if(d, placer, m) == [
        "node-a and node-b are too small (2 cores each, needs 64): add a node with at least 64 cores"
    ]


def test_cores_too_small_is_judged_per_node_not_per_node_class() -> None:
    """Two nodes alike but for their cores: the small one is too small, the big one takes the
    replica (the index shares a filter's outcome per node class, so cores must be part of it)."""
    nodes = [node("a", cores=2), node("b", cores=16)]
    m = model("m", Profile(name="cpu", cpu_cores=8))
    for placer in (pl.Placer(nodes, []), ReferencePlacer(nodes, [])):
        d = placer.place(m)
        assert d.node == "b"
        assert [(r.node, r.code) for r in d.rejections] == [("a", "cores_too_small")]


def test_a_node_with_fewer_cores_than_asked_but_busy_is_still_too_small() -> None:
    """Exhausted (some held) and too small at once: too small wins, no "free" line for it; the node
    that has the cores in all gets the "free" line."""
    nodes = [node("a", cores=2), node("b", cores=8)]
    held = [
        checks.Reservation("a", "x", 0, 2, replica="x-aaaaaa"),
        checks.Reservation("b", "y", 0, 6, replica="y-bbbbbb"),
    ]
    placer = pl.Placer(nodes, held)
    m = model("m", Profile(name="cpu", cpu_cores=4))
    d = placer.place(m)
    assert [(r.node, r.code) for r in d.rejections] == [("a", "cores_too_small"), ("b", "cores_exhausted")]
    assert would_fit_if(d, placer, m) == [
        "free 2 cores on b by stopping replica y-bbbbbb (y)",
        "a is too small (2 cores in all, needs 4): add a node with at least 4 cores",
    ]


# --- 2: never stop a replica of the model being explained ---


def test_no_line_stops_a_replica_of_the_model_itself() -> None:
    """Scaling gemma-copy to 3 with its 2 replicas on node-b, the only node with room: stopping one
    of them leaves it at 2 of 3, so no line says so; node-a's other model may be stopped."""
    nodes = [node("node-a", cores=2), node("node-b", cores=2)]
    held = [
        checks.Reservation("node-a", "other", 1, 2, replica="other-aaaaaa"),
        checks.Reservation("node-b", "gemma-copy", 1, 1, replica="gemma-copy-7cb876"),
        checks.Reservation("node-b", "gemma-copy", 1, 1, replica="gemma-copy-99e0f1"),
    ]
    placer = pl.Placer(nodes, held)
    m = model("gemma-copy", Profile(name="cpu", min_memory_gb=1, cpu_cores=1), n=3)
    d = placer.place(m)
    assert not d.placed
    assert would_fit_if(d, placer, m) == [
        "free 1 core on node-a by stopping replica other-aaaaaa (other)",
        "add a node with room for another replica of gemma-copy: on node-b its own replicas hold what is "
        "short, and stopping one of them would not help",
    ]


def test_own_replicas_are_never_named_for_memory_or_gpus() -> None:
    nodes = [node("g", gpus=[h100()]), node("c", mem_gb=4)]
    held = [
        checks.Reservation("g", "m", 40, 0, gpu_class="h100-80gb", gpu_indexes=(0,), replica="m-111111"),
        checks.Reservation("c", "m", 3, 0, replica="m-222222"),
    ]
    placer = pl.Placer(nodes, held)
    gpu = model("m", Profile(name="gpu", gpu_class="h100-80gb", min_memory_gb=40), n=2)
    d = placer.place(gpu)
    assert [(r.node, r.code, r.held_by) for r in d.rejections] == [
        ("c", "gpu_class_mismatch", []),
        ("g", "gpu_exhausted", ["m-111111"]),
    ]
    assert would_fit_if(d, placer, gpu) == [
        "add a node with room for another replica of m: on g its own replicas hold what is short, "
        "and stopping one of them would not help",
        "add a node with GPU class h100-80gb",
    ]
    cpu = model("m", Profile(name="cpu", min_memory_gb=2), n=2)
    placer = pl.Placer([nodes[1]], held)
    d = placer.place(cpu)
    assert [(r.node, r.code, r.reason) for r in d.rejections] == [
        ("c", "memory_exhausted", "needs 2.0 GB memory, 1.0 of 4.0 GB free"),
    ]
    assert would_fit_if(d, placer, cpu) == [
        "add a node with room for another replica of m: on c its own replicas hold what is short, "
        "and stopping one of them would not help",
    ]


# --- 3: the "newest replica" line describes a replica that is there ---


def beat(mem_gb: float) -> Heartbeat:
    inv = Inventory(cores=4, memory_total_bytes=int(mem_gb * GB), memory_available_bytes=int(mem_gb * GB))
    return Heartbeat(inventory=inv, engines=[LLAMA])


def test_newest_replica_line_says_it_is_gone_once_its_node_is_lost(store: Store) -> None:
    store.upsert_node_heartbeat("node-a", beat(1), 100.0)
    store.upsert_node_heartbeat("node-b", beat(8), 100.0)
    store.add_model(model("chat", Profile(name="cpu", min_memory_gb=2), n=2), now=100.0)
    leader = Leader(store, node_lost_after_s=30)
    leader.reconcile_once(100.0)
    ex = store.get_explanation("chat")
    assert ex is not None
    assert (ex.placed, ex.replicas, ex.last_placed) == (True, 2, "placed on node-b (profile cpu)")
    store.upsert_node_heartbeat("node-a", beat(1), 125.0)  # node-b goes silent
    assert leader.reconcile_once(135.0).lost == ["node-b"]
    ex = store.get_explanation("chat")
    assert ex is not None
    assert (ex.placed, ex.replicas, ex.wanted) == (False, 0, 2)
    assert ex.last_placed == "placed on node-b (profile cpu); that replica is gone"


def test_newest_line_follows_the_replica() -> None:
    newest = ("chat-1a2b3c", "placed on node-b (profile cpu)")
    assert newest_line(newest, {"chat-1a2b3c", "chat-999999"}, ()) == "placed on node-b (profile cpu)"
    assert newest_line(newest, {"chat-999999"}, {"chat-1a2b3c"}) == (
        "placed on node-b (profile cpu); that replica is draining"
    )
    assert newest_line(newest, set(), ()) == "placed on node-b (profile cpu); that replica is gone"
    assert newest_line(None, set(), ()) == ""


# --- 4: words that agree with their counts ---


def test_summary_counts_read_as_sentences() -> None:
    zone = Profile(name="cpu", node_selector={"zone": "nowhere"})
    d = pl.place(model("m", zone), [node("node-a"), node("node-b")], [])
    assert d.summary == "0/2 nodes can run it: 2 nodes without the label zone=nowhere"
    d = pl.place(model("m", Profile(name="cpu", min_memory_gb=16)), [node("a"), node("b")], [])
    assert d.summary == "0/2 nodes can run it: 2 nodes with too little memory"
    gpu = Profile(name="gpu", gpu_class="h100-80gb", min_memory_gb=100)
    nodes = [
        node("a"), node("b", engines=[]), node("g", gpus=[h100()]), node("k", state="lost"), node("l", state="lost")
    ]
    d = pl.place(model("m", gpu), nodes, [])
    assert d.summary == (
        "0/5 nodes can run it: 1 node with a GPU too small, 1 node without a GPU of class h100-80gb, "
        "1 node without engine llamacpp installed, 2 nodes lost"
    )


def test_one_core_is_singular() -> None:
    placer = pl.Placer([node("a", cores=2)], [checks.Reservation("a", "x", 0, 2, replica="x-aaaaaa")])
    m = model("m", Profile(name="cpu", cpu_cores=1))
    d = placer.place(m)
    assert d.rejections[0].reason == "needs 1 core, 0 of 2 free"
    assert would_fit_if(d, placer, m) == ["free 1 core on a by stopping replica x-aaaaaa (x)"]


def test_nodes_too_small_for_memory_are_one_line() -> None:
    nodes = [node("a", mem_gb=4), node("b", mem_gb=8), node("c", mem_gb=8), node("d", mem_gb=2), node("e", mem_gb=2)]
    placer = pl.Placer(nodes, [])
    m = model("m", Profile(name="cpu", min_memory_gb=1000))
    assert would_fit_if(placer.place(m), placer, m) == [
        "a, b, c and 2 more are too small (2.0 to 8.0 GB memory, needs 1000.0): "
        "add a node with at least 1000.0 GB"
    ]


def test_fewer_gpus_than_gpu_count_is_too_small_not_free() -> None:
    """gpu_count 2 on nodes with one card of the class: stopping the replica holding g1's card frees
    one card, never two."""
    nodes = [node("g1", gpus=[h100()]), node("g2", gpus=[h100()])]
    held = [checks.Reservation("g1", "other", 40, 0, gpu_class="h100-80gb", gpu_indexes=(0,), replica="other-aaaaaa")]
    placer = pl.Placer(nodes, held)
    m = model("m", Profile(name="gpu", gpu_class="h100-80gb", gpu_count=2, min_memory_gb=80))
    d = placer.place(m)
    assert [(r.node, r.kind, r.code, r.reason) for r in d.rejections] == [
        ("g1", "filtered", "gpu_count_too_small", "has 1 h100-80gb card, the profile needs 2: too small"),
        ("g2", "filtered", "gpu_count_too_small", "has 1 h100-80gb card, the profile needs 2: too small"),
    ]
    assert d.summary == "0/2 nodes can run it: 2 nodes with too few GPUs"
    assert would_fit_if(d, placer, m) == [
        "g1 and g2 are too small (1 h100-80gb card each, needs 2): add a node with at least 2 h100-80gb cards"
    ]


def test_a_node_whose_cores_the_models_own_replica_holds_suggests_a_smaller_cpu_cores() -> None:
    """One machine of 2 cores whose only replica (the starter, cpu_cores 2) holds both: a second one
    (autoscaling) fits nowhere, and stopping the first would not help; with cpu_cores 1 each, two
    would share the 2 cores, so that is said too (the lines said only "add a node": a new user's
    finding). At 1 core already there is nothing smaller to suggest."""
    nodes = [node("box", cores=2)]
    held = [checks.Reservation("box", "starter", 0, 2, replica="starter-aaaaaa")]
    placer = pl.Placer(nodes, held)
    m = model("starter", Profile(name="cpu", cpu_cores=2), n=2)
    d = placer.place(m)
    assert not d.placed
    assert would_fit_if(d, placer, m) == [
        "add a node with room for another replica of starter: on box its own replicas hold what is short, "
        "and stopping one of them would not help",
        "or give profile cpu of starter cpu_cores 1 ('llmgw ctl model set-profiles'): 2 replicas would share "
        "the 2 cores they may use on box",
    ]
    one = pl.Placer([node("box", cores=2)], [checks.Reservation("box", "small", 0, 1, replica="small-a"),
                                              checks.Reservation("box", "small", 0, 1, replica="small-b")])
    small = model("small", Profile(name="cpu", cpu_cores=1), n=3)
    assert would_fit_if(one.place(small), one, small) == [
        "add a node with room for another replica of small: on box its own replicas hold what is short, "
        "and stopping one of them would not help",
    ]
