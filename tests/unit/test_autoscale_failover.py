"""Autoscaling across a leader change, on a real store (SQLite file): the gateways' load goes through
``write_gateway_load`` as a control plane writes it, decisions through ``autoscale_decisions``.

A leader that decided 1 → 3 in panic and then died: the next leader (a new :class:`Autoscaler`
and :class:`Leader` on the same database, nothing in memory) keeps 3 while the load is gone, until
``scale_down_after_s`` of its own; no decision flips the count down and up. The clock is injected
(pure reconcile passes, no event loop), so the test runs in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

from llmgw.catalog import Model
from llmgw.control.gateway.load import LoadCounter, LoadReporter
from llmgw.control.reconcile.autoscale import Autoscaler
from llmgw.control.reconcile.leader import Leader
from llmgw.control.store import Store, open_store
from llmgw.control.store.offloop import OffLoop
from llmgw.control.store.rows import GatewayLoadRow, ReplicaRow
from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ProvisionState, ReplicaState, ReplicaStatus

T0 = 1_700_000_000.0
GB = 1_000_000_000


def _store(tmp_path: Path) -> Store:
    store = open_store(f"sqlite:///{tmp_path / 'llmgw.db'}")
    hb = Heartbeat(
        inventory=Inventory(cores=16, memory_total_bytes=64 * GB, memory_available_bytes=64 * GB),
        engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")],
    )
    store.upsert_node_heartbeat("node-1", hb, T0)
    store.add_model(
        Model.model_validate({
            "name": "chat", "source": "http://m/chat.gguf",
            "scaling": {"min": 1, "max": 5, "target": 2.0, "scale_down_after_s": 30.0},
            "profiles": [{"name": "cpu", "min_memory_gb": 1}],
        }),
        now=T0,
    )
    return store


def _leader(store: Store) -> Leader:
    return Leader(store, node_lost_after_s=1e6, probe=None)


def test_a_new_leader_continues_from_the_recorded_decision(tmp_path: Path) -> None:
    store = _store(tmp_path)
    a, leader_a = Autoscaler(store), _leader(store)
    leader_a.reconcile_once(T0)
    assert len(store.list_replicas()) == 1
    # Two control planes report 3 + 3 in flight: 6 on 0 ready replicas (pending): panic, ceil(6/2) = 3.
    store.write_gateway_load("cp-a", [GatewayLoadRow("cp-a", "chat", 3, 0, T0 + 1)], now=T0 + 1)
    store.write_gateway_load("cp-b", [GatewayLoadRow("cp-b", "chat", 2, 1, T0 + 1)], now=T0 + 1)
    (d,) = a.tick_once(T0 + 1.2)
    assert (d.from_n, d.to_n, d.panic) == (1, 3, True)
    assert d.reason == "scaled 1 → 3: 6.0 in flight or queued per replica over 6 s, target 2, panic"
    leader_a.reconcile_once(T0 + 1.3)
    assert len(store.list_replicas()) == 3

    # Leader A dies; the load ends. Leader B starts with nothing in memory.
    b, leader_b = Autoscaler(store), _leader(store)
    made = []
    t = T0 + 10.0
    while t < T0 + 91.0:  # A's panic holds until T0+61.2 (its decision's time + 60 s), then 30 s of lower desire
        made += b.tick_once(t)
        leader_b.reconcile_once(t)
        t += 0.5
    assert made == []
    assert len([r for r in store.list_replicas() if r.draining_since is None]) == 3
    assert [x.to_n for x in store.list_decisions("chat")] == [3]
    while t < T0 + 100.0:
        made += b.tick_once(t)
        t += 0.5
    assert [(x.from_n, x.to_n, x.at) for x in made] == [(3, 1, T0 + 91.5)]  # once, after 30 s of its own
    # the dashboard's history: A's point, then B's every 15 s from its first pass
    points = store.list_history("chat", since=0)
    assert [round(p.at - T0, 1) for p in points] == [1.2, 10, 25, 40, 55, 70, 85]
    assert {p.wanted for p in points} == {3}
    assert points[0].load == 6.0
    assert made[0].reason.endswith("lower for 30 s")
    leader_b.reconcile_once(t)
    assert len([r for r in store.list_replicas() if r.draining_since is not None]) == 2


def test_decisions_are_kept_per_model_up_to_one_hundred(tmp_path: Path) -> None:
    store = _store(tmp_path)
    from llmgw.control.store.rows import DecisionRow  # noqa: PLC0415 - only here

    for i in range(130):
        store.add_decision(DecisionRow("chat", T0 + i, i, i + 1, f"r{i}"))
    store.add_decision(DecisionRow("other", T0, 0, 1, "x"))
    kept = store.list_decisions("chat", limit=1000)
    assert len(kept) == 100
    assert (kept[0].reason, kept[-1].reason) == ("r129", "r30")
    assert store.last_decisions()["chat"].to_n == 130
    assert len(store.list_decisions("other")) == 1


def test_a_scale_up_that_does_not_fit_explains_and_evicts_nothing(tmp_path: Path) -> None:
    """node-1 has 64 GB: 'big' holds 60 of them; 'chat' (3 GB each) wants 3 after a burst and
    gets only what fits, with placement's usual explanation; 'big' keeps its replica."""
    store = _store(tmp_path)
    store.add_model(
        Model.model_validate({"name": "big", "source": "http://m/big.gguf",
                              "profiles": [{"name": "cpu", "min_memory_gb": 60}]}),
        now=T0,
    )
    row = store.get_model("chat")
    assert row is not None
    spec = row.model.model_dump(mode="json")
    spec["profiles"][0]["min_memory_gb"] = 3
    store.update_model(Model.model_validate(spec), revision=row.revision, now=T0)
    leader, scaler = _leader(store), Autoscaler(store)
    leader.reconcile_once(T0)
    big = [r.id for r in store.list_replicas(model="big")]
    assert len(big) == 1
    store.write_gateway_load("cp-a", [GatewayLoadRow("cp-a", "chat", 6, 0, T0 + 1)], now=T0 + 1)
    (d,) = scaler.tick_once(T0 + 1.2)
    assert d.to_n == 3
    result = leader.reconcile_once(T0 + 1.3)
    assert [r.id for r in store.list_replicas(model="big")] == big  # never evicted
    assert len(store.list_replicas(model="chat")) == 1  # 60 + 3 of 64 GB: one more does not fit
    view = result.explanations["chat"]
    assert (view.placed, view.wanted, view.replicas) == (False, 3, 1)
    assert view.summary == "0/1 nodes can run it: 1 not enough memory", view.summary
    # as for a scaling.min that does not fit; never chat's own replica (stopping it leaves chat short)
    assert view.would_fit_if == [f"free 2.0 GB on node-1 by stopping replica {big[0]} (big, 60.0 GB)"]


def test_decisions_go_with_the_model_and_with_its_autoscaling(tmp_path: Path) -> None:
    """A model no longer autoscaled keeps scaling.min (its decisions forgotten), and so does one
    deleted and added again under its name."""
    store = _store(tmp_path)
    scaler = Autoscaler(store)
    store.write_gateway_load("cp-a", [GatewayLoadRow("cp-a", "chat", 8, 0, T0 + 1)], now=T0 + 1)
    assert [d.to_n for d in scaler.tick_once(T0 + 1.2)] == [4]
    row = store.get_model("chat")
    assert row is not None
    spec = row.model.model_dump(mode="json")
    spec["scaling"] = {"min": 2, "max": 2}
    store.update_model(Model.model_validate(spec), revision=row.revision, now=T0 + 2)
    scaler.tick_once(T0 + 2.5)
    assert store.last_decisions() == {}
    spec["scaling"] = {"min": 1, "max": 5}
    row = store.get_model("chat")
    assert row is not None
    store.update_model(Model.model_validate(spec), revision=row.revision, now=T0 + 3)
    # from scaling.min again (target now the default 4 slots; the load of 8 is still fresh)
    assert scaler.tick_once(T0 + 3.5)[0].reason.startswith("scaled 1 → 2: 8.0 in flight")
    assert store.delete_model("chat")
    assert store.last_decisions() == {}


def test_a_node_lost_while_scaling_up_is_replaced_elsewhere(tmp_path: Path) -> None:
    """Wanted 3 after a burst, spread over node-1 and node-2; node-2 goes silent: its replicas are
    placed again on node-1, the wanted count unchanged (the loss is not a decision)."""
    store = _store(tmp_path)
    hb = Heartbeat(
        inventory=Inventory(cores=16, memory_total_bytes=64 * GB, memory_available_bytes=64 * GB),
        engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")],
    )
    store.upsert_node_heartbeat("node-2", hb, T0)
    leader = Leader(store, node_lost_after_s=10.0, probe=None)
    scaler = Autoscaler(store)
    leader.reconcile_once(T0)
    store.write_gateway_load("cp-a", [GatewayLoadRow("cp-a", "chat", 6, 0, T0 + 1)], now=T0 + 1)
    assert [d.to_n for d in scaler.tick_once(T0 + 1.2)] == [3]
    leader.reconcile_once(T0 + 1.3)
    assert sorted({r.node for r in store.list_replicas()}) == ["node-1", "node-2"]
    store.upsert_node_heartbeat("node-1", hb, T0 + 12)  # node-2 stays silent
    result = leader.reconcile_once(T0 + 12.5)
    assert result.lost == ["node-2"]
    assert [r.node for r in store.list_replicas()] == ["node-1"] * 3
    assert [d.to_n for d in store.list_decisions("chat")] == [3]


def test_a_start_from_zero_goes_to_the_node_holding_the_weights_and_says_so(tmp_path: Path) -> None:
    """Placement prefers a node whose cache holds the weights (the engine start only, no download)
    over one with more free memory, from zero replicas; the next replica spreads first. The
    explanation names the newest placement and the cache."""
    store = open_store(f"sqlite:///{tmp_path / 'llmgw.db'}")
    engines = [EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")]
    big = Inventory(cores=16, memory_total_bytes=64 * GB, memory_available_bytes=64 * GB)
    small = Inventory(cores=16, memory_total_bytes=8 * GB, memory_available_bytes=8 * GB)
    store.upsert_node_heartbeat("node-1", Heartbeat(inventory=big, engines=engines), T0)
    store.upsert_node_heartbeat("node-2", Heartbeat(inventory=small, engines=engines, cached=["zero/1"]), T0)
    store.add_model(Model.model_validate({
        "name": "zero", "source": "http://m/zero.gguf", "scaling": {"min": 0, "max": 2, "target": 1.0},
        "profiles": [{"name": "cpu", "min_memory_gb": 1}],
    }), now=T0)
    leader, scaler = _leader(store), Autoscaler(store)
    leader.reconcile_once(T0)
    assert store.list_replicas() == []
    store.write_gateway_load("cp-a", [GatewayLoadRow("cp-a", "zero", 0, 1, T0 + 1)], now=T0 + 1)  # one held
    assert [(d.from_n, d.to_n) for d in scaler.tick_once(T0 + 1.2)] == [(0, 1)]
    leader.reconcile_once(T0 + 1.3)
    assert [r.node for r in store.list_replicas()] == ["node-2"]
    ex = store.get_explanation("zero")
    assert ex is not None
    assert ex.last_placed == "placed on node-2 (profile cpu; weights zero/1 in its cache)"
    store.write_gateway_load("cp-a", [GatewayLoadRow("cp-a", "zero", 2, 1, T0 + 2)], now=T0 + 2)
    assert [(d.from_n, d.to_n) for d in scaler.tick_once(T0 + 2.2)] == [(1, 2)]
    leader.reconcile_once(T0 + 2.3)
    assert sorted(r.node for r in store.list_replicas()) == ["node-1", "node-2"]  # spread before the cache
    ex = store.get_explanation("zero")
    assert ex is not None
    assert ex.last_placed == "placed on node-1 (profile cpu)"


def test_a_judge_of_a_fail_closed_policy_stored_at_min_zero_is_raised_to_one(tmp_path: Path) -> None:
    """An entry stored with ``min: 0`` before its policy failed closed (server.yaml changed): the
    next leader's autoscaler raises it to 1 and never takes it to zero; a judge of no closed policy
    keeps ``min: 0``."""
    store = _store(tmp_path)
    for name in ("judge-b", "judge-c"):
        store.add_model(Model.model_validate({
            "name": name, "source": f"http://m/{name}.gguf", "scaling": {"min": 0, "max": 2},
            "profiles": [{"name": "cpu", "min_memory_gb": 1}],
        }), now=T0)
    woken: list[bool] = []
    scaler = Autoscaler(store, closed_judges={"judge-b": "safety"}, wake=lambda: woken.append(True))
    assert scaler.tick_once(T0) == []
    scaling = {r.name: (r.model.scaling.min, r.model.scaling.max) for r in store.list_models()}
    assert (scaling["judge-b"], scaling["judge-c"]) == ((1, 2), (0, 2))
    assert woken == [True]
    leader = _leader(store)
    leader.reconcile_once(T0 + 1)
    assert sorted(r.model for r in store.list_replicas() if r.model.startswith("judge")) == ["judge-b"]
    for t in (T0 + 700, T0 + 1400, T0 + 5000):  # past scale_to_zero_after_s without any load
        assert [d for d in scaler.tick_once(t) if d.model == "judge-b"] == []
        leader.reconcile_once(t + 0.1)
    assert [r.model for r in store.list_replicas() if r.model == "judge-b"] == ["judge-b"]


def _one_ready_replica_made_autoscaled(tmp_path: Path, **scaling: float) -> tuple[Store, ReplicaRow]:
    """A store with model ``onb`` placed and ready on node-1 at one fixed replica, then made
    autoscaled (``min`` 0, ``max`` 1, and ``scaling``'s windows) at T0 + 2: the store and its replica."""
    store = _store(tmp_path)
    fixed = Model.model_validate({"name": "onb", "source": "http://m/onb.gguf", "scaling": {"min": 1, "max": 1},
                                  "profiles": [{"name": "cpu", "min_memory_gb": 1}]})
    row = store.add_model(fixed, now=T0)
    _leader(store).reconcile_once(T0)
    (rep,) = store.list_replicas(model="onb")
    ready = ReplicaStatus(id=rep.id, state=ReplicaState.READY, endpoint="127.0.0.1:1")
    store.upsert_node_heartbeat("node-1", Heartbeat(
        inventory=Inventory(cores=16, memory_total_bytes=64 * GB, memory_available_bytes=64 * GB),
        engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")], replicas=[ready],
    ), T0 + 1)
    spec = fixed.model_dump() | {"scaling": {"min": 0, "max": 1, **scaling}}
    store.update_model(Model.model_validate(spec), revision=row.revision, now=T0 + 2)
    return store, rep


def test_a_running_model_made_autoscaled_keeps_its_replica_until_it_is_quiet_for_long_enough(tmp_path: Path) -> None:
    """A new user's finding: ``ctl model set onb scaling.min=0 scaling.max=1 scaling.scale_to_zero_after_s=60``
    on a model serving one replica stopped it at once, with no decision recorded (before its first
    decision an autoscaled model was placed at ``scaling.min``). It now starts from the replicas it
    has: kept while quiet, then 1 → 0 with its reason once ``scale_to_zero_after_s`` passed."""
    store, rep = _one_ready_replica_made_autoscaled(tmp_path, scale_to_zero_after_s=60.0, scale_down_after_s=30.0)
    a, leader = Autoscaler(store), _leader(store)
    made = []
    t = T0 + 2.0
    while t < T0 + 61.0:  # quiet, but not for scale_to_zero_after_s yet: the replica stays
        leader.reconcile_once(t)
        made += a.tick_once(t)
        t += 0.5
    assert made == []
    assert [r.id for r in store.list_replicas(model="onb") if r.draining_since is None] == [rep.id]
    while t < T0 + 64.0:
        made += a.tick_once(t)
        t += 0.5
    assert [(d.from_n, d.to_n) for d in made] == [(1, 0)]
    assert made[0].reason.startswith("scaled 1 → 0: no request for 6")


def test_short_requests_keep_the_last_replica_from_going_to_zero(tmp_path: Path) -> None:
    """A new user's finding: a model asked for 0.1 s every 8 s went 1 → 0 "no request for 30 s" every
    30 s, the next request waiting for a start: the gateway's load is read once a second and a
    request that starts and ends between two readings was never seen. Each reading now carries the
    requests that arrived since the last (a real :class:`LoadCounter` read by the
    :class:`LoadReporter` into the store), and the last replica stays while they come; once they
    stop, it goes after ``scale_to_zero_after_s``."""
    store, _rep = _one_ready_replica_made_autoscaled(tmp_path, scale_to_zero_after_s=30.0, scale_down_after_s=10.0)
    a = Autoscaler(store)
    counter = LoadCounter()
    reporter = LoadReporter(store, OffLoop(), "cp-a", counter)
    made = []
    t = T0 + 2.0
    while t < T0 + 100.0:  # a request of 0.1 s every 8 s: never in flight at a reading
        if (t - T0) % 8 == 0:
            with counter.holding("onb"):
                counter.arrived("onb")
        if (t - T0) % 1 == 0:  # the reporter's second
            store.write_gateway_load("cp-a", reporter.rows(t), now=t)
        made += a.tick_once(t)
        t += 0.5
    assert made == [], [d.reason for d in made]
    while t < T0 + 140.0:  # no request any more
        if (t - T0) % 1 == 0:
            store.write_gateway_load("cp-a", reporter.rows(t), now=t)
        made += a.tick_once(t)
        t += 0.5
    assert [(d.from_n, d.to_n) for d in made] == [(1, 0)]
    assert made[0].reason.startswith("scaled 1 → 0: no request for 3")


def test_a_drain_waits_for_a_reading_of_every_control_plane_after_it_settled() -> None:
    """CI (2026-12-05): a control plane's load reading came late; with no row of it at or after the
    drain's settling time, "no row" read as nothing in flight and the replica was stopped under a
    stream. A control plane's reading row says when it read; the drain waits for one from each."""
    from llmgw.control.reconcile.drainer import READING, drained  # noqa: PLC0415

    r = ReplicaRow(id="m-2", model="m", node="n", profile="cpu", key="k", draining_since=T0)
    before = [GatewayLoadRow("cp-a", "m", 1, 0, T0 + 0.5, {"m-2": 1}), GatewayLoadRow("cp-a", READING, 0, 0, T0 + 0.5)]
    assert not drained(r, before, T0 + 2.5)  # cp-a's last reading is from before the drain settled
    idle_a = [GatewayLoadRow("cp-a", READING, 0, 0, T0 + 1.6)]  # nothing in flight, read after it settled
    late_b = [GatewayLoadRow("cp-b", "m", 1, 0, T0 + 0.9, {"m-2": 1}), GatewayLoadRow("cp-b", READING, 0, 0, T0 + 0.9)]
    assert not drained(r, [*idle_a, *late_b], T0 + 2.5)  # cp-b has not read since
    idle_b = [GatewayLoadRow("cp-b", READING, 0, 0, T0 + 1.8)]
    assert drained(r, [*idle_a, *idle_b], T0 + 2.5)
    busy_b = [GatewayLoadRow("cp-b", "m", 1, 0, T0 + 1.8, {"m-2": 1}), *idle_b]
    assert not drained(r, [*idle_a, *busy_b], T0 + 2.5)
    assert drained(r, before, T0 + 30.0)  # the bound holds whatever the readings
