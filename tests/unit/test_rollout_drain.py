"""Rolling a model to a new version (``ctl model set NAME source=… version=…``, or new profiles)
on a real store and leader: the ready replica placed from the old spec drains, as a scale-down's
does, instead of stopping under the requests it serves; it is never called back to serve the old
version, and the replacement is placed once there is room.

Found in a day-2 operations run: a stream in flight on tiny-b when its version changed ended with
``upstream_failed`` ("closed the connection in the middle of its answer") 2 s later."""

from __future__ import annotations

from pathlib import Path

from llmgw.catalog import Model
from llmgw.control.api.desired import desired_specs
from llmgw.control.reconcile.leader import Leader
from llmgw.control.store import Store, open_store
from llmgw.control.store.rows import READING, GatewayLoadRow
from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ProvisionState, ReplicaState, ReplicaStatus

T0 = 1_700_000_000.0
GB = 1_000_000_000
SPEC = {"name": "chat", "source": "http://m/chat/1/chat.gguf", "version": "1",
        "profiles": [{"name": "cpu", "cpu_cores": 4, "min_memory_gb": 1}]}


def _beat(store: Store, at: float, ready: list[str]) -> None:
    store.upsert_node_heartbeat("node-1", Heartbeat(
        inventory=Inventory(cores=4, memory_total_bytes=64 * GB, memory_available_bytes=64 * GB),
        engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")],
    ), at)
    store.apply_reports("node-1", [ReplicaStatus(id=r, state=ReplicaState.READY, endpoint="127.0.0.1:1")
                                   for r in ready], at)


def _load(store: Store, at: float, in_flight: dict[str, int]) -> None:
    n = sum(in_flight.values())
    store.write_gateway_load("cp-a", [GatewayLoadRow("cp-a", "chat", n, 0, at, in_flight),
                                      GatewayLoadRow("cp-a", READING, 0, 0, at)], now=at)


def test_a_new_version_drains_the_old_replica_and_places_the_new_one_after(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'llmgw.db'}")
    _beat(store, T0, [])
    row = store.add_model(Model.model_validate(SPEC), now=T0)
    leader = Leader(store, node_lost_after_s=1e6, probe=None)
    leader.reconcile_once(T0)
    (old,) = store.list_replicas(model="chat")
    _beat(store, T0 + 1, [old.id])
    _load(store, T0 + 1, {old.id: 1})  # a stream in flight on it

    # Version 2. The node's 4 cores are all the old replica's, so the new one waits for them.
    store.update_model(Model.model_validate(SPEC | {"source": "http://m/chat/2/chat.gguf", "version": "2"}),
                       revision=row.revision, now=T0 + 2)
    # before the leader's pass, a beat's reply tells the agent to keep the engine it runs (draining)
    new_model = store.get_model("chat")
    assert new_model is not None
    (spec,) = desired_specs("node-1", store.list_replicas(model="chat"), {"chat": new_model.model})
    assert (spec.id, spec.version, spec.draining) == (old.id, "2", True)
    first = leader.reconcile_once(T0 + 2.0)
    assert first.drained == [old.id]  # a change: every routing table leaves it out at once
    t = T0 + 2.0
    while t < T0 + 10.0:  # the stream goes on: the old replica stays, draining, and is not called back
        _load(store, t, {old.id: 1})
        leader.reconcile_once(t)
        (still,) = store.list_replicas(model="chat")
        assert still.id == old.id
        assert still.draining_since == T0 + 2.0
        t += 0.5
    _load(store, t, {})  # the stream ended: the old replica stops, and its cores take the new one
    leader.reconcile_once(t + 1.0)
    leader.reconcile_once(t + 1.5)
    (new,) = store.list_replicas(model="chat")
    assert new.id != old.id
    assert new.draining_since is None
