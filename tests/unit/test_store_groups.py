"""A group replica (one replica over several nodes) in the store, on SQLite and PostgreSQL: its
members round-trip, every member's node lists it, and a worker's reports land on its member entry,
never on the head's state."""

from __future__ import annotations

from llmgw.control.store import ReplicaRow, Store
from llmgw.protocol import GroupMember, ReplicaState, ReplicaStatus


def _group() -> ReplicaRow:
    return ReplicaRow(
        id="big-1", model="big", node="head", profile="rpc", key="k", created_at=1.0, updated_at=1.0,
        members=(GroupMember(node="head", rank=0, memory_gb=6.0), GroupMember(node="w_1", rank=1, memory_gb=4.0),
                 GroupMember(node="w%2", rank=2, memory_gb=3.5)),
    )


def test_members_round_trip_and_every_members_node_lists_the_group(store: Store) -> None:
    store.add_replica(_group())
    store.add_replica(ReplicaRow(id="solo-1", model="solo", node="wx1", profile="cpu", key="k", created_at=2.0))
    got = store.get_replica("big-1")
    assert got is not None
    assert [(m.node, m.rank, m.memory_gb) for m in got.members] == [("head", 0, 6.0), ("w_1", 1, 4.0), ("w%2", 2, 3.5)]
    assert [r.id for r in store.list_replicas(node="head")] == ["big-1"]
    assert [r.id for r in store.list_replicas(node="w_1")] == ["big-1"]
    assert [r.id for r in store.list_replicas(node="w%2")] == ["big-1"]
    assert [r.id for r in store.list_replicas(node="wx1")] == ["solo-1"]  # LIKE's '_' matched it; the check did not
    assert store.list_replicas(node="w") == []


def test_a_workers_reports_land_on_its_member_entry(store: Store) -> None:
    store.add_replica(_group())
    ready = ReplicaStatus(id="big-1", state=ReplicaState.READY, endpoint="10.0.0.2:50052")
    changed = store.apply_reports("w_1", [ready], now=5.0)
    assert changed.changed == ["big-1"]
    row = store.get_replica("big-1")
    assert row is not None
    assert row.state == "pending"  # the head's state: a worker does not speak for it
    assert [(m.node, m.state, m.endpoint) for m in row.members] == [
        ("head", "", ""), ("w_1", "ready", "10.0.0.2:50052"), ("w%2", "", "")
    ]
    assert store.apply_reports("w_1", [ready], now=6.0).changed == []  # nothing new
    store.apply_reports("w_1", [], now=7.0)  # the worker stopped reporting it
    row = store.get_replica("big-1")
    assert row is not None
    assert row.members[1].endpoint == ""
    assert row.members[1].state == ""
    store.apply_reports("head", [ReplicaStatus(id="big-1", state=ReplicaState.STARTING)], now=8.0)
    row = store.get_replica("big-1")
    assert row is not None
    assert row.state == "starting"



def test_a_failed_group_stays_failed_whatever_its_head_reports(store: Store) -> None:
    from dataclasses import replace  # noqa: PLC0415

    row = store.add_replica(_group())
    store.update_replica(replace(row, state="failed", err="worker on node w_1 failed: rpc-server exited"))
    store.apply_reports("head", [ReplicaStatus(id="big-1", state=ReplicaState.READY, endpoint="h:1")], now=9.0)
    got = store.get_replica("big-1")
    assert got is not None
    assert (got.state, got.endpoint) == ("failed", "")


def test_removing_a_workers_node_removes_its_group_whole(store: Store) -> None:
    from llmgw.protocol import Heartbeat, Inventory  # noqa: PLC0415

    hb = Heartbeat(inventory=Inventory(cores=2, memory_total_bytes=10**9, memory_available_bytes=10**9))
    for node in ("head", "w_1", "w%2"):
        store.upsert_node_heartbeat(node, hb, 1.0)
    store.add_replica(_group())
    store.add_replica(ReplicaRow(id="solo-1", model="solo", node="head", profile="cpu", key="k", created_at=2.0))
    store.remove_node("w_1", now=3.0)
    assert [r.id for r in store.list_replicas()] == ["solo-1"]  # the group went whole; the head's other replica stays


def test_each_node_view_holds_its_own_share_of_a_group() -> None:
    from llmgw.catalog import Model  # noqa: PLC0415
    from llmgw.control.api.nodes import node_view  # noqa: PLC0415
    from llmgw.control.store import NodeRow  # noqa: PLC0415
    from llmgw.protocol import Inventory  # noqa: PLC0415

    inv = Inventory(cores=2, memory_total_bytes=10**9, memory_available_bytes=10**9)
    model = Model.model_validate({"name": "big", "source": "http://m/b.gguf",
                                  "profiles": [{"name": "rpc", "nodes": 3, "min_memory_gb": 13.5}]})
    views = {n: node_view(NodeRow(n, 1, "ready", False, {}, inv, [], [], 0.0, 0.0), [_group()], {"big": model})
             for n in ("head", "w_1", "w%2")}
    got = {n: v.resources.memory_reserved_bytes for n, v in views.items() if v.resources}
    assert got == {"head": 6_000_000_000, "w_1": 4_000_000_000, "w%2": 3_500_000_000}


def test_the_node_list_index_holds_a_group_under_each_member_once() -> None:
    from llmgw.control.api.nodes import by_node  # noqa: PLC0415

    solo = ReplicaRow(id="solo-1", model="solo", node="head", profile="cpu", key="k", created_at=2.0)
    got = {n: [r.id for r in rs] for n, rs in by_node([_group(), solo]).items()}
    assert got == {"head": ["big-1", "solo-1"], "w_1": ["big-1"], "w%2": ["big-1"]}


def test_a_nodes_list_reads_by_index_not_every_replica(store: Store) -> None:
    """A node's replicas (every heartbeat's read) come from two index lookups: by ``node``, and the
    group replicas by the partial index ``ix_replicas_grouped`` (migration 15); one WHERE with an
    OR over ``members LIKE`` read every row (3.0 ms a heartbeat at 20,000 replicas). Both halves
    still find the group under a worker's node and the replica under its own (ordered by creation)."""
    import sqlalchemy as sa  # noqa: PLC0415

    store.add_replica(_group())
    store.add_replica(ReplicaRow(id="solo-1", model="solo", node="w_1", profile="cpu", key="k", created_at=0.5))
    assert [r.id for r in store.list_replicas(node="w_1")] == ["solo-1", "big-1"]
    assert [r.id for r in store.list_replicas(node="w_1", model="big")] == ["big-1"]
    engine: sa.Engine = store.engine  # type: ignore[attr-defined]
    if engine.dialect.name != "sqlite":  # PostgreSQL plans a 2-row table by sequential scan: its plan says nothing
        return
    seen: list[tuple[str, object]] = []

    def keep(_conn: object, _cursor: object, statement: str, params: object, *_: object) -> None:
        if "FROM replicas" in statement:
            seen.append((statement, params))

    sa.event.listen(engine, "before_cursor_execute", keep)
    try:
        store.list_replicas(node="w_1")
    finally:
        sa.event.remove(engine, "before_cursor_execute", keep)
    assert len(seen) == 1, seen
    with engine.connect() as conn:
        plan = [row[-1] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {seen[0][0]}", seen[0][1])]  # type: ignore[arg-type]
    assert any("ix_replicas_node" in step for step in plan), plan
    assert any("ix_replicas_grouped" in step for step in plan), plan
    assert not any(step == "SCAN replicas" for step in plan), plan
