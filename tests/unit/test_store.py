"""Store: migrations, optimistic concurrency, models/nodes/replicas/explanations round trips."""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa

from llmgw.catalog import Model, Profile
from llmgw.control.store import ReplicaRow, Store, default_url, open_store
from llmgw.control.store.rows import PlacementSummary
from llmgw.control.store.schema import MIGRATIONS
from llmgw.errors import Conflict, StoreError
from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ProvisionState, ReplicaState, ReplicaStatus
from llmgw.views import ExplainView, Rejection


def model(name: str = "m1", aliases: list[str] | None = None) -> Model:
    return Model(name=name, aliases=aliases or [], source="file:/x.gguf", profiles=[Profile(name="cpu")])


def heartbeat(**kw: object) -> Heartbeat:
    inv = Inventory(cores=4, memory_total_bytes=8_000_000_000, memory_available_bytes=6_000_000_000)
    return Heartbeat(inventory=inv, **kw)  # type: ignore[arg-type]


def test_open_migrates_once_and_reopening_keeps_the_data(store_url: str) -> None:
    s = open_store(store_url)  # opened here: it is reopened below
    assert s.schema_versions() == [v for v, _ in MIGRATIONS]
    assert s.migrate() == []  # nothing applied twice
    s.add_model(model(), now=1.0)
    s.close()
    again = open_store(store_url)  # reopening keeps the data and applies nothing
    assert again.migrate() == []
    assert [m.name for m in again.list_models()] == ["m1"]
    again.close()


def test_sqlite_runs_in_wal_mode(tmp_path: Path) -> None:
    s = open_store(default_url("", tmp_path / "a" / "llmgw.db"))
    with s.engine.connect() as conn:  # type: ignore[attr-defined]
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    s.close()


def test_bad_url_is_a_store_error() -> None:
    with pytest.raises(StoreError, match="not a database URL"):
        open_store("not a url")


def test_model_add_get_update_conflict_delete(store: Store) -> None:
    row = store.add_model(model("m1", ["alias1"]), now=10.0)
    assert row.revision == 1
    got = store.get_model("m1")
    assert got is not None
    assert got.model == row.model
    assert got.created_at == 10.0
    with pytest.raises(Conflict, match="already exists"):
        store.add_model(model("m1"), now=11.0)
    with pytest.raises(Conflict, match="'alias1' is already a name or alias of model 'm1'"):
        store.add_model(model("m2", ["alias1"]), now=11.0)
    with pytest.raises(Conflict, match="'alias1'"):
        store.add_model(model("alias1"), now=11.0)

    changed = row.model.model_copy(update={"description": "new"})
    up = store.update_model(changed, revision=1, now=12.0)
    assert up.revision == 2
    with pytest.raises(Conflict, match="changed since revision 1"):
        store.update_model(changed, revision=1, now=13.0)  # a stale writer loses
    assert store.delete_model("m1") is True
    assert store.delete_model("m1") is False
    assert store.get_model("m1") is None


def test_node_heartbeat_insert_then_update_and_revision_checks(store: Store) -> None:
    eng = EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")
    n = store.upsert_node_heartbeat("node-a", heartbeat(labels={"a": "b"}, engines=[eng]), 5.0)
    assert (n.state, n.revision, n.first_seen, n.last_seen) == ("ready", 1, 5.0, 5.0)
    assert n.labels == {"a": "b"}
    assert n.engines == [eng]
    lost = store.update_node(n, state="lost")
    assert lost.revision == 2
    with pytest.raises(Conflict):
        store.update_node(n, cordoned=True)  # n is revision 1: stale
    again = store.upsert_node_heartbeat("node-a", heartbeat(), 9.0)
    assert (again.state, again.revision, again.first_seen, again.last_seen) == ("ready", 3, 5.0, 9.0)
    assert [x.id for x in store.list_nodes()] == ["node-a"]


def test_replicas_crud_and_reports_only_touch_own_node(store: Store) -> None:
    r = store.add_replica(ReplicaRow(id="m1-abc123", model="m1", node="node-a", profile="cpu", key="k"))
    assert r.state == "pending"
    with pytest.raises(Conflict):
        store.add_replica(r)
    store.add_replica(ReplicaRow(id="m1-other", model="m1", node="node-b", profile="cpu", key="k"))
    reports = [
        ReplicaStatus(id="m1-abc123", state=ReplicaState.READY, endpoint="127.0.0.1:5000"),
        ReplicaStatus(id="m1-other", state=ReplicaState.FAILED, err="not yours"),
    ]
    res = store.apply_reports("node-a", reports, now=20.0)
    assert res.changed == ["m1-abc123"]
    mine = store.get_replica("m1-abc123")
    assert mine is not None
    assert (mine.state, mine.endpoint, mine.ready_at, mine.revision) == ("ready", "127.0.0.1:5000", 20.0, 2)
    other = store.get_replica("m1-other")
    assert other is not None
    assert other.state == "pending"
    with pytest.raises(Conflict):
        store.update_replica(replace(r, err="stale"))
    assert [x.id for x in store.list_replicas(node="node-b")] == ["m1-other"]
    assert store.delete_replica("m1-other", revision=99) is False
    assert store.delete_replica("m1-other") is True


def test_a_running_replica_its_node_no_longer_reports_goes_back_to_pending(store: Store) -> None:
    """A heartbeat lists every replica its agent runs: one that was ready and is missing (its engine
    was stopped while the agent was down) loses its endpoint, so the gateway stops routing to it;
    a pending one (placed, not yet picked up) and another node's are left alone."""
    for rid, node in (("m1-ready", "node-a"), ("m1-placed", "node-a"), ("m1-b", "node-b")):
        store.add_replica(ReplicaRow(id=rid, model="m1", node=node, profile="cpu", key="k"))
    store.apply_reports("node-a", [ReplicaStatus(id="m1-ready", state=ReplicaState.READY, endpoint="h:1")], 5.0)
    store.apply_reports("node-b", [ReplicaStatus(id="m1-b", state=ReplicaState.READY, endpoint="h:2")], 5.0)

    res = store.apply_reports("node-a", [], now=9.0)  # the agent came back without that engine
    assert res.changed == ["m1-ready"]
    gone = store.get_replica("m1-ready")
    assert gone is not None
    assert (gone.state, gone.endpoint, gone.updated_at) == ("pending", "", 9.0)
    assert {r.id: r.state for r in store.list_replicas()} == {"m1-ready": "pending", "m1-placed": "pending",
                                                              "m1-b": "ready"}
    assert store.apply_reports("node-a", [], now=10.0).changed == []  # nothing more to say


def test_explanations_replace(store: Store) -> None:
    rej = Rejection(node="n", profile="cpu", kind="filtered", code="node_cordoned", reason="node is cordoned")
    store.set_explanation(ExplainView(model="m1", placed=False, rejections=[rej]), now=1.0)
    store.set_explanation(ExplainView(model="m1", placed=True), now=2.0)
    got = store.get_explanation("m1")
    assert got is not None
    assert got.placed is True
    assert store.get_explanation("nope") is None
    assert store.explanation_summaries() == {"m1": PlacementSummary("", placed=True)}
    store.set_explanation(ExplainView(model="m1", placed=False, summary="0 of 3 nodes fit"), now=3.0)
    store.set_explanation(ExplainView(model="m2", placed=True, summary="placed on n"), now=3.0)
    both = {"m1": PlacementSummary("0 of 3 nodes fit", placed=False),
            "m2": PlacementSummary("placed on n", placed=True)}
    assert store.explanation_summaries() == both
    assert store.explanation_summaries() == both  # read again
    store.delete_explanation("m2")
    assert store.explanation_summaries() == {"m1": PlacementSummary("0 of 3 nodes fit", placed=False)}


def test_schema_is_plain_sql(store: Store) -> None:
    names = set(sa.inspect(store.engine).get_table_names())
    assert {"models", "nodes", "replicas", "explanations", "schema_migrations"} <= names


def test_sqlite_files_are_private(tmp_path: Path) -> None:
    """The database holds replica API keys: it and its -wal/-shm are 0600, a new directory 0700
    (before, they were 0644 like any file under the default umask)."""
    old = os.umask(0o022)
    try:
        db = tmp_path / "state" / "llmgw.db"
        store = open_store(f"sqlite:///{db}")
        store.list_models()
        names = {p.name: stat.S_IMODE(p.stat().st_mode) for p in db.parent.iterdir()}
        store.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
    assert names["llmgw.db"] == 0o600
    assert names.get("llmgw.db-wal", 0o600) == 0o600
    assert names.get("llmgw.db-shm", 0o600) == 0o600
    assert "llmgw.db-wal" in names  # WAL mode made them: the check above saw real files


# --- uniqueness by database constraint (model_names, migration 4) ---


def test_names_and_aliases_follow_updates_and_deletes(store: Store) -> None:
    store.add_model(model("m1", ["a"]), now=1.0)
    m2 = store.add_model(model("m2"), now=1.0)
    up = store.update_model(model("m1", ["b"]), revision=1, now=2.0)  # 'a' is free again, 'b' taken
    store.add_model(model("m3", ["a"]), now=3.0)
    with pytest.raises(Conflict, match=r"^'b' is already a name or alias of model 'm1'; pick another alias"):
        store.add_model(model("m4", ["b"]), now=3.0)
    with pytest.raises(Conflict, match=r"^'a' is already a name or alias of model 'm3'; pick another name or"):
        store.add_model(model("a"), now=3.0)  # the new model's own name is taken (a new user read 'alias')
    with pytest.raises(Conflict, match=r"^'b' is already a name or alias of model 'm1'$"):
        store.update_model(model("m2", ["b", "c"]), revision=m2.revision, now=4.0)
    after = store.get_model("m2")  # the refused update wrote nothing, not even 'c'
    assert after is not None
    assert (after.revision, after.model.aliases) == (1, [])
    store.add_model(model("m5", ["c"]), now=5.0)
    assert store.delete_model("m1") is True
    store.add_model(model("m6", ["b", "m1"]), now=6.0)  # m1's name and alias went with it
    assert up.revision == 2


def test_uniqueness_is_a_primary_key_in_the_schema(store: Store) -> None:
    """Names/aliases, node ids, replica ids and certificate serials are keys the database keeps."""
    inspector = sa.inspect(store.engine)  # type: ignore[attr-defined]
    keys = {t: inspector.get_pk_constraint(t)["constrained_columns"] for t in inspector.get_table_names()}
    assert keys["model_names"] == ["name"]
    assert keys["models"] == ["name"]
    assert keys["nodes"] == ["id"]
    assert keys["replicas"] == ["id"]
    assert keys["revoked_certs"] == ["serial"]
    assert sorted(keys["node_certs"]) == ["node", "serial"]
    store.add_model(model("m1", ["a"]), now=1.0)
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(sa.text("INSERT INTO model_names (name, model) VALUES ('a', 'other')"))


def test_migration_4_fills_model_names_and_survives_a_clash(store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Rows from before migration 4, two of them claiming alias 'x' (written by hand) and one not
    JSON at all: the migration keeps every model's own name, gives 'x' to the older model, logs
    the other, and the loser's next update is refused naming the owner."""
    url = store_url
    s = open_store(url)  # a path of its own: reopened below, as an upgraded control plane
    rows = [("b", model("b", ["x", "y"]).model_dump_json(), 2.0), ("a", model("a", ["x"]).model_dump_json(), 1.0),
            ("junk", "not json", 3.0)]
    with s.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(sa.text("DROP TABLE model_names"))
        conn.execute(sa.text("DELETE FROM schema_migrations WHERE version = 4"))
        for name, spec, t in rows:
            conn.execute(sa.text("INSERT INTO models VALUES (:n, 1, :s, :t, :t)"), {"n": name, "s": spec, "t": t})
    s.close()
    with caplog.at_level("WARNING"):
        again = open_store(url)
    try:
        assert 4 in again.schema_versions()
        with again.engine.begin() as conn:  # type: ignore[attr-defined]
            owners = dict(conn.execute(sa.text("SELECT name, model FROM model_names")).all())
        assert owners == {"a": "a", "b": "b", "junk": "junk", "x": "a", "y": "b"}
        assert "alias 'x' of model 'b' is already a name or alias of model 'a'" in caplog.text
        with pytest.raises(Conflict, match=r"^'x' is already a name or alias of model 'a'$"):
            again.update_model(model("b", ["x", "y"]), revision=1, now=4.0)
        assert again.update_model(model("b", ["y"]), revision=1, now=4.0).revision == 2
        with pytest.raises(Conflict, match="its stored row is broken: remove it first"):
            again.add_model(model("junk"), now=5.0)
    finally:
        again.close()


def test_the_store_fixture_is_the_interface(store: Store) -> None:
    """Every backend implements the whole :class:`Store` interface (an abstract method left out
    would make the backend impossible to instantiate)."""
    assert isinstance(store, Store)
    assert not getattr(type(store), "__abstractmethods__", frozenset())


def test_rows_read_again_unchanged_are_the_objects_parsed_before_and_changed_ones_are_new(store: Store) -> None:
    """The routing refresh, the autoscaler and the leader list every model and replica several times
    a second in a burst: an unchanged row is not parsed again, a written one is."""
    store.add_model(model("m1"), now=1.0)
    store.add_replica(ReplicaRow(id="m1-aaaaaa", model="m1", node="node-a", profile="cpu", key="k"))
    (m_before,), (r_before,) = store.list_models(), store.list_replicas()
    (m_again,), (r_again,) = store.list_models(), store.list_replicas()
    assert m_again.model is m_before.model
    assert r_again is r_before
    store.update_model(model("m1").model_copy(update={"version": "2"}), revision=m_before.revision, now=2.0)
    store.update_replica(replace(r_before, state="ready", endpoint="10.0.0.1:8080"))
    (m_after,), (r_after,) = store.list_models(), store.list_replicas()
    assert m_after.model is not m_before.model
    assert m_after.model.version == "2"
    assert (r_after.state, r_after.endpoint, r_after.revision) == ("ready", "10.0.0.1:8080", r_before.revision + 1)
    assert store.get_replica("m1-aaaaaa") is r_after
    assert store.delete_model("m1")
    assert store.list_models() == []
    store.add_model(model("m1", ["back"]), now=3.0)  # the same name again, another spec
    assert store.list_models()[0].model.aliases == ["back"]


def test_parsed_rows_keep_two_generations_at_most() -> None:
    """:class:`ParsedRows` drops rows no longer read: at most two generations are kept."""
    from llmgw.control.store.codec import ParsedRows, replica_values  # noqa: PLC0415 - only here
    from llmgw.control.store.schema import replicas_t  # noqa: PLC0415

    engine = sa.create_engine("sqlite://")
    replicas_t.metadata.create_all(engine, tables=[replicas_t])
    rows = [ReplicaRow(id=f"m-{i:06d}", model="m", node="n", profile="cpu", key="k") for i in range(25)]
    with engine.begin() as conn:
        conn.execute(replicas_t.insert(), [replica_values(r) for r in rows])
        got = conn.execute(sa.select(replicas_t).order_by(replicas_t.c.id)).all()
    cache = ParsedRows(per_generation=10)
    first = [cache.replica(r) for r in got]
    assert [r.id for r in first] == [r.id for r in rows]
    assert len(cache) <= 20
    assert cache.replica(got[-1]) is first[-1]  # the young generation kept it
    assert cache.replica(got[0]) is not first[0]  # two generations ago: parsed again
    assert cache.replica(got[0]) == first[0]
