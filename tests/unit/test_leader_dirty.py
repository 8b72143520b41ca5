"""The leader's dirty passes (reconcile/view.py): marks written with the change, on any control
plane, read and consumed by the next pass, which does the same work a full pass would for what
changed; a path that marks nothing is caught by the parts each reads again (view.Roll) or the
full resync; a new leader starts full.

Real stores (SQLite and PostgreSQL, the ``store`` fixture), real heartbeat writes; no mocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from llmgw.catalog import Model, Profile, Scaling
from llmgw.control.placement import estimate as est
from llmgw.control.placement.checks import Reservation
from llmgw.control.placement.placer import Placer
from llmgw.control.reconcile.leader import DEFAULT_INTERVAL_S, Leader
from llmgw.control.reconcile.view import ROLL_PARTS, ROLL_S, Roll, View
from llmgw.control.store import Store, open_store
from llmgw.control.store.offloop import OffLoop
from llmgw.control.store.rows import BeatWrite
from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ProvisionState, ReplicaState, ReplicaStatus
from tests.conftest import Assets
from tests.helpers.nodes import node
from tests.helpers.waits import until

GB = 1_000_000_000
LLAMA = EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")


def model(name: str, n: int = 1) -> Model:
    return Model(name=name, source=f"http://mirror/{name}.gguf", scaling=Scaling(min=n, max=n),
                 profiles=[Profile(name="cpu", min_memory_gb=2, cpu_cores=1)])


def beat(store: Store, node: str, now: float, reports: list[ReplicaStatus] | None = None) -> None:
    """A full heartbeat of ``node`` through the store's heartbeat path (what marks it)."""
    inv = Inventory(cores=8, memory_total_bytes=32 * GB, memory_available_bytes=30 * GB)
    hb = Heartbeat(inventory=inv, engines=[LLAMA], replicas=reports or [], instance=f"i-{node}")
    (res,) = store.write_heartbeats([BeatWrite(node, hb, now)])
    assert res.refused is None


def cluster(store: Store, nodes: int = 3, lost_after_s: float = 30) -> Leader:
    for i in range(nodes):
        beat(store, f"n{i}", 100.0)
    store.add_model(model("a", 2), now=100.0)
    leader = Leader(store, node_lost_after_s=lost_after_s)
    first = leader.reconcile_once(100.0, dirty=True)  # a new leader: a full pass
    assert len(first.created) == 2
    assert store.read_dirty().change_ids == []  # the marks it read are gone
    return leader


def test_a_steady_dirty_pass_reads_marks_only_and_writes_nothing(store: Store) -> None:
    leader = cluster(store)
    res = leader.reconcile_once(101.0, dirty=True)
    assert (res.created, res.removed, res.lost, res.explanations) == ([], [], [], {})


def test_a_model_added_on_another_control_plane_is_placed_by_the_next_dirty_pass(store_url: str) -> None:
    store, other = open_store(store_url), open_store(store_url)  # two control planes, one database
    try:
        leader = cluster(store)
        other.add_model(model("b", 3), now=101.0)
        res = leader.reconcile_once(101.0, dirty=True)
        assert sorted(r.split("-")[0] for r in res.created) == ["b", "b", "b"]
        assert list(res.explanations) == ["b"]  # only the model that changed is visited
        placed = {r.node for r in store.list_replicas(model="b")}
        assert placed == {"n0", "n1", "n2"}  # spread: the kept placer counts model a's replicas
        other.delete_model("b")
        res = leader.reconcile_once(102.0, dirty=True)
        assert len(res.removed) == 3
        assert store.get_explanation("b") is None
    finally:
        other.close()
        store.close()


def test_a_failed_replica_reported_by_a_heartbeat_is_replaced_after_its_backoff(store: Store) -> None:
    leader = cluster(store)
    r = store.list_replicas(model="a")[0]
    beat(store, r.node, 101.0, [ReplicaStatus(id=r.id, state=ReplicaState.FAILED, err="crashed")])
    assert leader.reconcile_once(102.0, dirty=True).removed == []  # 10 s backoff
    res = leader.reconcile_once(112.0, dirty=True)  # no new mark: the view knows it failed
    assert res.removed == [r.id]
    assert len(res.created) == 1
    assert store.get_replica(res.created[0]).restarts == 1  # type: ignore[union-attr]


def test_a_silent_node_is_lost_and_its_replicas_move_without_any_mark(store: Store) -> None:
    leader = cluster(store)
    gone = store.list_replicas(model="a")[0]
    for t in (110.0, 120.0, 131.0):  # the others keep beating (pulses: last_seen only, no mark)
        for n in ("n0", "n1", "n2"):
            if n != gone.node:
                beat(store, n, t)
        store.forget_changes(store.read_dirty().change_ids)
    res = leader.reconcile_once(131.0, dirty=True)
    assert res.lost == [gone.node]
    assert res.removed == [gone.id]
    assert [store.get_replica(c).node for c in res.created] != [gone.node]  # type: ignore[union-attr]


def test_a_cordon_marks_the_node_and_placement_avoids_it(store: Store) -> None:
    leader = cluster(store)
    node = store.get_node("n2")
    assert node is not None
    store.update_node(node, cordoned=True)
    store.add_model(model("c", 3), now=101.0)
    res = leader.reconcile_once(101.0, dirty=True)
    assert len(res.created) == 3
    # n0 and n1 only (one of them twice): the kept placer was rebuilt for the cordoned node
    assert {store.get_replica(c).node for c in res.created} == {"n0", "n1"}  # type: ignore[union-attr]


def test_a_write_that_marks_nothing_is_seen_at_the_full_resync(store: Store) -> None:
    leader = cluster(store, lost_after_s=1000)
    r = store.list_replicas(model="a")[0]
    store.delete_replica(r.id)  # no mark: only a full pass sees it
    assert leader.reconcile_once(101.0, dirty=True).created == []
    res = leader.reconcile_once(100.0 + leader.resync_s, dirty=True)
    assert len(res.created) == 1


def test_a_write_that_marks_nothing_is_seen_within_the_roll_by_dirty_passes(store: Store) -> None:
    """A replica deleted and a node's row changed without a mark: read again by the parts of the
    passes that follow, within ROLL_S and without a full pass."""
    leader = cluster(store, lost_after_s=1000)
    view = leader._view
    assert view is not None
    full_at = view.full_at
    r = store.list_replicas(model="a")[0]
    store.delete_replica(r.id)  # no mark
    created: list[str] = []
    t = 101.0
    while not created:
        assert t < 101.0 + ROLL_S, "not read again within ROLL_S"
        created = leader.reconcile_once(t, dirty=True).created
        t += DEFAULT_INTERVAL_S
    assert len(created) == 1
    assert leader._view is view  # dirty passes only
    assert view.full_at == full_at


def test_the_parts_cover_every_row_once_per_roll_and_passes_within_a_slot_read_none() -> None:
    """Roll: 30 timed passes 2 s apart read each of 1,000 nodes and 50 models exactly once, about a
    thirtieth each; passes closer than a slot read nothing; a long gap reads everything."""
    nodes = {f"node-{i}": None for i in range(1000)}
    models = {f"model-{i}": None for i in range(50)}
    view = View(nodes, models, {}, {}, full_at=0.0)  # type: ignore[arg-type]
    roll = Roll()
    roll.start(1000.0)
    seen: list[str] = []
    sizes = []
    for k in range(1, ROLL_PARTS + 1):
        assert roll.due(view, 1000.0 + k * 2.0 - 0.5) == ([], [])  # a burst's pass within the slot
        got_nodes, got_models = roll.due(view, 1000.0 + k * 2.0)
        seen += got_nodes + got_models
        sizes.append(len(got_nodes))
    assert sorted(seen) == sorted([*nodes, *models])  # every row once
    assert max(sizes) < 3 * 1000 / ROLL_PARTS  # spread: no part holds much more than its share
    assert roll.due(view, 1000.0 + 2 * ROLL_S) == (list(nodes), list(models))  # a gap of a whole roll


def test_a_new_leader_starts_with_a_full_pass(store: Store) -> None:
    cluster(store)
    r = store.list_replicas(model="a")[0]
    store.delete_replica(r.id)  # no mark
    successor = Leader(store, node_lost_after_s=30)
    assert len(successor.reconcile_once(101.0, dirty=True).created) == 1


def test_a_mark_made_after_the_read_stays_for_the_next_pass(store: Store) -> None:
    cluster(store)
    got = store.read_dirty()
    store.add_model(model("d"), now=101.0)
    store.forget_changes(got.change_ids)  # the pass deletes only what it read
    assert set(store.read_dirty().models) == {"d"}


def test_a_kept_placer_caught_up_places_and_explains_as_a_fresh_one() -> None:
    """Placer.release, hold and update_node (what a dirty pass applies) against a placer built
    from scratch on the same nodes and reservations: the same node, the same summary."""
    nodes = [node(f"n{i}", cores=4, mem_gb=32, avail_gb=30) for i in range(4)]
    x1, x2, x3 = (Reservation(n, "x", 2.0, 1, replica=f"x-{n}") for n in ("n0", "n1", "n3"))
    kept = Placer(nodes, [x1, x2])
    a, big = model("a"), Model(name="big", source="http://mirror/big.gguf",
                               profiles=[Profile(name="cpu", min_memory_gb=20, cpu_cores=4)])
    kept.place(a), kept.place(big)  # both profiles' indexes built, as a pass leaves them
    kept.release([("n0", "x-n0")])
    moved = node("n2", cores=4, mem_gb=32, avail_gb=1)  # its free memory went elsewhere
    assert kept.update_node(moved)
    kept.hold([x3])
    fresh = Placer([nodes[0], nodes[1], moved, nodes[3]], [x2, x3])
    for m in (a, big):
        got, want = kept.place(m), fresh.place(m)
        assert (got.node, got.summary) == (want.node, want.summary)
    assert not kept.update_node(node("n1", cores=4, mem_gb=32, avail_gb=30, cordoned=True))  # a filter's field
    assert not kept.update_node(node("n9"))  # a node the placer never had


def test_a_replica_of_a_deleted_model_whose_delete_lost_a_race_does_not_fail_the_pass(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/scale.py's removal burst: a replica of a deleted model whose delete lost a revision race
    (a heartbeat wrote it in between; here the store's delete answers "changed under you" once) was
    kept without its model, and every later pass failed with KeyError on it. Now the pass goes on and
    the next one deletes it."""
    leader = cluster(store)
    store.delete_model("a")
    real = store.delete_replica
    lost = []

    def once(replica_id: str, *, revision: int) -> bool:
        if not lost:
            lost.append(replica_id)
            return False
        return real(replica_id, revision=revision)

    monkeypatch.setattr(store, "delete_replica", once)
    res = leader.reconcile_once(101.0, dirty=True)
    assert len(res.removed) == 1  # one deleted, one kept for the next pass
    assert lost
    res = leader.reconcile_once(102.0, dirty=True)
    assert res.removed == lost
    assert store.list_replicas(model="a") == []


def test_timed_passes_start_an_interval_apart_however_long_a_pass_took(store: Store) -> None:
    """A node's silence is seen within one interval of passing ``node_lost_after_s``: the next timed
    pass starts ``interval_s`` after the last one started (not after it ended: a 1 s pass under load
    made it 3 s), but never sooner than ``min_gap_s`` after it ended."""
    import time  # noqa: PLC0415 - only here

    leader = Leader(store, node_lost_after_s=30, interval_s=2.0, min_gap_s=0.5)
    now = time.monotonic()
    assert 0.5 <= leader.until_next(now - 1.0) <= 1.0  # a 1 s pass: the next starts 1 s after it
    assert leader.until_next(now - 0.1) <= 1.9
    assert leader.until_next(now - 10.0) == 0.5  # a 10 s pass: still a gap after it


async def test_a_leader_cancelled_between_passes_leaves_no_task_behind(store: Store) -> None:
    """A control plane's shutdown cancels the leader while it waits for the next pass: its two
    waiters (the stop and the wake events) stayed pending, and CI's logs filled with "Task was
    destroyed but it is pending!  coro=<Event.wait()>" when the loop closed. They are cancelled on
    every way out."""
    leader = cluster(store)
    stop = asyncio.Event()
    running = asyncio.create_task(leader.run(stop))
    for _ in range(500):  # until its first pass is done and it waits for the next
        await asyncio.sleep(0.01)
        if sum("Event.wait" in repr(t) for t in asyncio.all_tasks()) == 2:
            break
    else:
        pytest.fail("the leader never waited for its next pass")
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    await asyncio.sleep(0)  # a cancelled waiter ends at the loop's next turn
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert left == []


async def test_a_new_models_header_is_read_after_the_pass_that_learns_of_it(store: Store, assets: Assets) -> None:
    """The loop reads the GGUF header of a model its pass just learned of right after that pass, and
    wakes a pass to count it; before, only the pass after next read it (the read came before each
    pass, from the view of the last one): ``ctl model add`` waited 2-3 s for its source check, and
    here, with no timed pass for 60 s, a minute. The header is gemma's own, read from the file
    (:func:`~llmgw.control.placement.estimate.read_facts`) in the reader's stead."""
    gemma = est.read_facts(f"file:{assets.model}")
    reads: list[str] = []

    def read_facts(source: str) -> est.GgufFacts:
        reads.append(source)
        return gemma

    db = OffLoop(workers=2)
    leader = Leader(store, node_lost_after_s=30, db=db, interval_s=60, read_facts=read_facts)
    stop = asyncio.Event()
    running = asyncio.create_task(leader.run(stop))
    try:
        await until("the first pass", lambda: _async(leader._view is not None), within_s=30, every_s=0.05)
        source = "http://mirror/unsized.gguf"
        store.add_model(Model(name="unsized", source=source, profiles=[Profile(name="cpu")]), now=time.time())
        leader.wake()
        await until("the new model's header read", lambda: _async(reads == [source]), within_s=10, every_s=0.05)
        assert store.list_gguf_facts()[source][0]  # stored, no error
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
        db.close()


async def _async(value: bool) -> bool:
    return value
