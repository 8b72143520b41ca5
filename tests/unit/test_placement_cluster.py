"""Placement over a cluster (pure): spreading, GPUs never shared, CPU nodes when GPU nodes are full,
cached weights preferred, explanations word for word; the leader's restarts and profile changes."""

from __future__ import annotations

from pathlib import Path

from llmgw.catalog import Model, Profile, Scaling
from llmgw.control.placement import checks
from llmgw.control.placement import placer as pl
from llmgw.control.placement.explain import explain_view, would_fit_if
from llmgw.control.reconcile.leader import Leader
from llmgw.control.reconcile.restarts import backoff_s
from llmgw.control.store import ReplicaRow, Store, default_url, open_store
from llmgw.protocol import GPU, EngineStatus, Heartbeat, Inventory, ProvisionState
from tests.helpers.nodes import LLAMA, h100, node

GB = 1_000_000_000

GPU_P = Profile(name="gpu", gpu_class="h100-80gb", priority=200, min_memory_gb=40)
CPU_P = Profile(name="cpu", priority=100, min_memory_gb=2, cpu_cores=2)


def model(name: str = "m", *profiles: Profile, n: int = 1) -> Model:
    return Model(
        name=name, source="file:/m.gguf", profiles=list(profiles or [CPU_P]), scaling=Scaling(min=n, max=n)
    )


def cluster() -> list[checks.NodeInfo]:
    """Three CPU nodes and two GPU nodes with two H100s each."""
    cpus = [node(f"cpu-{i}", mem_gb=8, cores=4) for i in (1, 2, 3)]
    gpus = [node(f"gpu-{i}", mem_gb=64, cores=16, gpus=[h100(), h100(index=1)]) for i in (1, 2)]
    return cpus + gpus


def place_all(placer: pl.Placer, m: Model, n: int) -> list[checks.Decision]:
    out = []
    for i in range(n):
        d = placer.place(m)
        if d.placed:
            placer.reserve(m, d, f"{m.name}-{i}")
        out.append(d)
    return out


def test_replicas_of_one_model_spread_over_nodes() -> None:
    placer = pl.Placer(cluster()[:3], [])
    ds = place_all(placer, model("m", n=3), 3)
    assert sorted(d.node or "" for d in ds) == ["cpu-1", "cpu-2", "cpu-3"]


def test_two_gpu_replicas_never_share_a_card_and_cpu_takes_over_when_gpus_are_full() -> None:
    placer = pl.Placer(cluster(), [])
    m = model("big", GPU_P, CPU_P)
    ds = place_all(placer, m, 6)
    gpu_slots = [(d.node, d.gpu_indexes) for d in ds if d.profile and d.profile.name == "gpu"]
    assert len(gpu_slots) == 4
    assert len(set(gpu_slots)) == 4
    assert all(len(idx) == 1 for _, idx in gpu_slots)
    # spread first: gpu-1 and gpu-2 get one each before either gets its second card
    assert [n for n, _ in gpu_slots[:2]] == ["gpu-1", "gpu-2"]
    rest = ds[4:]
    assert [(d.node, d.profile.name if d.profile else "") for d in rest] == [("cpu-1", "cpu"), ("cpu-2", "cpu")]
    assert [r.code for r in rest[0].rejections if r.profile == "gpu"][-2:] == ["gpu_exhausted", "gpu_exhausted"]


def test_prefers_a_node_that_holds_the_weights() -> None:
    nodes = [node("a"), node("b", cached=frozenset({"m/1"}))]
    assert pl.place(model("m"), nodes, []).node == "b"
    # spreading still comes first
    assert pl.place(model("m"), nodes, [checks.Reservation("b", "m", 2, 2, replica="m-1")]).node == "a"


def test_memory_used_outside_llmgw_is_not_ignored() -> None:
    nodes = [node("a", mem_gb=8, avail_gb=1), node("b", mem_gb=8, avail_gb=4)]
    assert pl.place(model("m"), nodes, []).node == "b"
    d = pl.place(model("m"), [nodes[0]], [])
    assert d.summary == "0/1 nodes can run it: 1 not enough memory"
    assert d.rejections[0].reason == "needs 2.0 GB memory, 1.0 of 8.0 GB free (7.0 GB used outside llmgw)"


def test_explanation_word_for_word() -> None:
    nodes = [
        node("a", mem_gb=4, cores=8),
        node("b", mem_gb=8, cores=2),
        node("c", cordoned=True),
        node("d", state="lost"),
    ]
    held = [checks.Reservation("a", "other", 3.0, 0, replica="other-111111")]
    placer = pl.Placer(nodes, held)
    m = model("chat", GPU_P, CPU_P.model_copy(update={"cpu_cores": 4}))
    d = placer.place(m)
    assert not d.placed
    assert d.summary == (
        "0/4 nodes can run it: 1 node cordoned, 1 node lost, 1 node with too few cores, 1 not enough memory"
    )
    assert [(r.node, r.profile, r.kind, r.reason) for r in d.rejections] == [
        ("a", "gpu", "filtered", "no GPU of class h100-80gb (has: none)"),
        ("b", "gpu", "filtered", "no GPU of class h100-80gb (has: none)"),
        ("c", "gpu", "filtered", "node is cordoned"),
        ("d", "gpu", "filtered", "node is lost"),
        ("a", "cpu", "exhausted", "needs 2.0 GB memory, 1.0 of 4.0 GB free"),
        ("b", "cpu", "filtered", "needs 4 cores, the node has 2 in all: too small"),
        ("c", "cpu", "filtered", "node is cordoned"),
        ("d", "cpu", "filtered", "node is lost"),
    ]
    assert d.rejections[4].held_by == ["other-111111"]
    assert would_fit_if(d, placer, m) == [
        "free 1.0 GB on a by stopping replica other-111111 (other, 3.0 GB)",
        "add a node with GPU class h100-80gb",
        "uncordon c ('llmgw ctl node uncordon c')",
        "bring d back: its agent is not reporting",
        "b is too small (2 cores in all, needs 4): add a node with at least 4 cores",
    ]


def test_placer_matches_fresh_placement_after_reservations() -> None:
    """The per-node cache gives the same answers as placing from scratch each time."""
    nodes = cluster()
    m = model("big", GPU_P, CPU_P)
    placer = pl.Placer(nodes, [])
    done: list[checks.Reservation] = []
    for i in range(7):
        d = placer.place(m)
        fresh = pl.place(m, nodes, done)
        assert (d.node, d.gpu_indexes, d.summary) == (fresh.node, fresh.gpu_indexes, fresh.summary)
        if d.placed:
            done.append(placer.reserve(m, d, f"big-{i}"))


# --- the leader, over a real store ---


def beat(mem_gb: float = 8, gpus: list[GPU] | None = None, cached: list[str] | None = None) -> Heartbeat:
    inv = Inventory(
        cores=8, memory_total_bytes=int(mem_gb * GB), memory_available_bytes=int(mem_gb * GB), gpus=gpus or []
    )
    return Heartbeat(inventory=inv, engines=[LLAMA], cached=cached or [], instance="i1")


def test_failed_replica_is_replaced_after_backoff_with_its_error_kept(store: Store) -> None:
    assert [backoff_s(n) for n in (0, 1, 2, 5, 9)] == [10, 20, 40, 300, 300]
    store.upsert_node_heartbeat("a", beat(), 100.0)
    store.add_model(model("m"), now=100.0)
    leader = Leader(store, node_lost_after_s=1000)
    leader.reconcile_once(100.0)
    (r,) = store.list_replicas()
    store.update_replica(ReplicaRow(**{**r.__dict__, "state": "failed", "err": "exit 1: boom", "updated_at": 101.0}))
    assert leader.reconcile_once(110.0).created == []  # 9 s: still backing off
    res = leader.reconcile_once(111.0)
    assert res.removed == [r.id]
    (new,) = store.list_replicas()
    assert (new.restarts, new.last_error, new.state) == (1, "exit 1: boom", "pending")
    failed = ReplicaRow(**{**new.__dict__, "state": "failed", "err": "exit 1: again", "updated_at": 112.0})
    store.update_replica(failed)
    assert leader.reconcile_once(131.0).removed == []  # second restart waits 20 s
    assert leader.reconcile_once(132.0).removed == [new.id]
    (third,) = store.list_replicas()
    assert (third.restarts, third.last_error) == (2, "exit 1: again")


def test_profile_change_restarts_replicas_onto_the_new_profile(store: Store) -> None:
    store.upsert_node_heartbeat("a", beat(), 100.0)
    row = store.add_model(model("m", n=2), now=100.0)
    leader = Leader(store, node_lost_after_s=1000)
    leader.reconcile_once(100.0)
    old = {r.id for r in store.list_replicas()}
    assert leader.reconcile_once(101.0).removed == []
    changed = row.model.model_copy(update={"profiles": [CPU_P.model_copy(update={"args": ["--ctx-size", "4096"]})]})
    store.update_model(changed, revision=row.revision, now=102.0)
    res = leader.reconcile_once(102.0)
    assert set(res.removed) == old
    assert len(res.created) == 2
    assert not old & {r.id for r in store.list_replicas()}


def test_gpu_indexes_reach_the_replica_and_the_lost_node_replicas_move(store: Store) -> None:
    for n in ("g1", "g2"):
        store.upsert_node_heartbeat(n, beat(64, gpus=[h100(), h100(index=1)]), 100.0)
    store.add_model(model("big", GPU_P, n=3), now=100.0)
    leader = Leader(store, node_lost_after_s=30)
    leader.reconcile_once(100.0)
    reps = store.list_replicas()
    assert len({(r.node, r.gpu_indexes) for r in reps}) == 3
    assert all(len(r.gpu_indexes) == 1 for r in reps)
    store.upsert_node_heartbeat("g2", beat(64, gpus=[h100(), h100(index=1)]), 125.0)
    res = leader.reconcile_once(135.0)
    assert res.lost == ["g1"]
    reps = store.list_replicas()
    assert sorted((r.node, r.gpu_indexes) for r in reps) == [("g2", (0,)), ("g2", (1,))]
    ex = store.get_explanation("big")
    assert ex is not None
    assert ex.summary == "0/2 nodes can run it: 1 no free GPU, 1 node lost"
    assert ex.would_fit_if == [  # g2's cards are big's own: stopping one of them would not help
        "add a node with room for another replica of big: on g2 its own replicas hold what is short, "
        "and stopping one of them would not help",
        "bring g1 back: its agent is not reporting",
    ]


def test_missing_engine_reported_per_node() -> None:
    failed = EngineStatus(engine="llamacpp", state=ProvisionState.FAILED, detail="no binary")
    d = pl.place(model("m"), [node("a", engines=[failed])], [])
    assert d.summary == "0/1 nodes can run it: 1 node without engine llamacpp installed"
    assert would_fit_if(d, pl.Placer([node("a", engines=[failed])], []), model("m")) == [
        "install engine llamacpp on a node"
    ]


def test_migration_2_adds_the_columns_to_a_database_made_before_it(tmp_path: Path) -> None:
    import sqlalchemy as sa  # noqa: PLC0415

    url = default_url("", tmp_path / "old.db")
    s = open_store(url)
    with s.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM schema_migrations WHERE version = 2"))
        conn.execute(sa.text("DROP TABLE gguf_facts"))
        added = {"nodes": ["instance", "cached"], "replicas": ["gpu_indexes", "last_error", "spec_hash"]}
        for table, cols in added.items():
            for col in cols:
                conn.execute(sa.text(f"ALTER TABLE {table} DROP COLUMN {col}"))
    assert s.migrate() == [2]
    s.upsert_node_heartbeat("a", beat(cached=["m/1"]), 1.0)
    node_row = s.get_node("a")
    assert node_row is not None
    assert (node_row.instance, node_row.cached) == ("i1", ["m/1"])
    s.set_gguf_facts("http://x", body="", error="boom", now=1.0)
    assert s.list_gguf_facts() == {"http://x": ("", "boom", 1.0)}
    s.close()


def test_a_model_at_zero_that_would_fit_nowhere_says_so_though_placed() -> None:
    """A new user's finding: ``scaling.min 0`` and a profile needing 4 cores on 2-core nodes read
    ``placed (0/0 replicas)`` and nothing else; the explanation now says a replica would not fit and
    what would make it fit (the leader's dry run of one more replica is the decision)."""
    placer = pl.Placer([node("small", mem_gb=8, cores=2)], [])
    m = Model(name="m", source="file:/m.gguf", scaling=Scaling(min=0, max=1),
              profiles=[Profile(name="cpu", min_memory_gb=2, cpu_cores=4)])
    view = explain_view(m, decision=placer.place(m), placer=placer, replicas=[], now=0.0)
    assert view.placed
    assert view.summary.startswith("0/0 replicas placed on no node (scaling.min is 0); a replica would not fit "
                                   "when one is wanted: 0/1 nodes can run it")
    assert view.would_fit_if
    fits = Model(name="f", source="file:/m.gguf", scaling=Scaling(min=0, max=1),
                 profiles=[Profile(name="cpu", min_memory_gb=2, cpu_cores=1)])
    view = explain_view(fits, decision=placer.place(fits), placer=placer, replicas=[], now=0.0)
    assert (view.summary, view.would_fit_if) == ("0/0 replicas placed on no node (scaling.min is 0)", [])
    # switched off (scaling.max 0): said so, not as if at zero by choice (a new user's finding)
    off = fits.model_copy(update={"scaling": Scaling(min=0, max=0)})
    view = explain_view(off, decision=placer.place(off), placer=placer, replicas=[], now=0.0)
    assert view.summary == ("0/0 replicas placed on no node (scaling.max is 0: switched off, no replica may run; "
                            "raise it to serve it)")
