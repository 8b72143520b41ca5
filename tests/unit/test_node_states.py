"""A node's stored state (inventory, engines, reports, labels, cached weights) parsed once while its
text stays the same (:func:`llmgw.control.store.codec.node_row`): pulses move ``last_seen`` only, so
the leader's full read of every node reuses what it parsed; a full beat that changed the state is
parsed again. Real stores (SQLite and PostgreSQL, the ``store`` fixture), the real heartbeat path."""

from __future__ import annotations

from llmgw.control.store import Store
from llmgw.control.store.rows import BeatWrite
from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ProvisionState

GB = 1_000_000_000
LLAMA = EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")


def beat(store: Store, node: str, now: float, *, available_gb: int = 30, zone: str = "a") -> None:
    inv = Inventory(cores=8, memory_total_bytes=32 * GB, memory_available_bytes=available_gb * GB)
    hb = Heartbeat(inventory=inv, engines=[LLAMA], labels={"zone": zone}, instance=f"i-{node}")
    (res,) = store.write_heartbeats([BeatWrite(node, hb, now)])
    assert res.refused is None


def test_a_node_read_again_shares_its_parsed_state_until_a_beat_changes_it(store: Store) -> None:
    beat(store, "n1", 100.0)
    beat(store, "n2", 100.0)
    first = {n.id: n for n in store.list_nodes()}
    again = {n.id: n for n in store.list_nodes()}
    assert again["n1"].inventory is first["n1"].inventory  # not parsed again
    assert again["n1"].engines[0] is first["n1"].engines[0]
    assert again["n1"].labels == {"zone": "a"}
    # each read's containers are its own: a caller changing one does not change the next read
    assert again["n1"].labels is not first["n1"].labels
    first["n1"].labels["zone"] = "changed by a reader"
    first["n1"].engines.clear()
    third = {n.id: n for n in store.list_nodes()}
    assert third["n1"].labels == {"zone": "a"}
    assert third["n1"].engines == [LLAMA]

    beat(store, "n1", 102.0, available_gb=20, zone="b")  # the state moved: parsed again
    moved = {n.id: n for n in store.list_nodes()}
    assert moved["n1"].inventory.memory_available_bytes == 20 * GB
    assert moved["n1"].labels == {"zone": "b"}
    assert moved["n1"].last_seen == 102.0
    assert moved["n2"].inventory is first["n2"].inventory
    got = store.get_node("n1")
    assert got is not None
    assert got.inventory is moved["n1"].inventory


def test_a_removed_node_that_comes_back_is_read_as_it_is_now(store: Store) -> None:
    beat(store, "n1", 100.0, zone="a")
    assert [n.labels for n in store.list_nodes()] == [{"zone": "a"}]
    store.remove_node("n1", now=150.0)
    assert store.list_nodes() == []
    beat(store, "n1", 200.0, zone="c")
    (back,) = store.list_nodes()
    assert back.labels == {"zone": "c"}
    assert back.first_seen == 200.0
