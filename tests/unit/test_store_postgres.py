"""The store on PostgreSQL: driver defaults, multi-host URLs, timeouts, reconnecting after a
restart, concurrent writers (on both backends) where SQLite's in-process lock no longer
serializes them, and ``llmgw server migrate-store`` (SQLite into PostgreSQL).

Everything runs against the session's real, throwaway PostgreSQL cluster
(:mod:`tests.helpers.postgres`); no mocks.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from llmgw.catalog import Model, Profile
from llmgw.cli.main import app as cli_app
from llmgw.control.store import ReplicaRow, Store, default_url, open_store
from llmgw.control.store.postgres import with_defaults
from llmgw.control.store.rows import PlacementSummary
from llmgw.control.store.schema import MIGRATIONS
from llmgw.control.store.sql import SqlStore
from llmgw.errors import Conflict, StoreError
from llmgw.protocol import Heartbeat, Inventory
from llmgw.views import ExplainView
from tests.helpers.net import free_port
from tests.helpers.postgres import Cluster

T = TypeVar("T")


def model(name: str, aliases: list[str] | None = None) -> Model:
    return Model(name=name, aliases=aliases or [], source="file:/x.gguf", profiles=[Profile(name="cpu")])


def heartbeat() -> Heartbeat:
    inv = Inventory(cores=4, memory_total_bytes=8_000_000_000, memory_available_bytes=6_000_000_000)
    return Heartbeat(inventory=inv)


def at_once(n: int, fn: Callable[[int], T]) -> list[T | Exception]:
    """``fn(0..n-1)`` on ``n`` threads released together; each result, or the exception it raised."""
    gate = threading.Barrier(n)

    def one(i: int) -> T | Exception:
        gate.wait()
        try:
            return fn(i)
        except Exception as e:
            return e

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


@pytest.fixture
def pg_store(pg_cluster: Cluster) -> Iterator[Store]:
    s = open_store(pg_cluster.new_database())
    yield s
    s.close()


# --- URL defaults (no server needed) ---


def test_defaults_are_added_and_the_url_wins() -> None:
    url = with_defaults(sa.make_url("postgresql://u:pw@db.example:5433/llmgw?connect_timeout=9"))
    assert url.drivername == "postgresql+psycopg"  # psycopg 3, the driver the postgres extra installs
    assert url.query["connect_timeout"] == "9"  # given: kept
    assert url.query["keepalives_idle"] == "5"
    assert url.query["tcp_user_timeout"] == "5000"
    assert url.query["options"] == (
        "-c statement_timeout=5000 -c lock_timeout=5000 -c idle_in_transaction_session_timeout=10000"
    )
    own = with_defaults(sa.make_url("postgresql+psycopg://u@h/db?options=-c statement_timeout=100"))
    assert own.query["options"] == (
        "-c statement_timeout=100 -c lock_timeout=5000 -c idle_in_transaction_session_timeout=10000"
    )


def test_multi_host_query_is_kept_for_libpq() -> None:
    url = with_defaults(sa.make_url(
        "postgresql+psycopg://u@/db?host=a:5432&host=b:5433&target_session_attrs=read-write"
    ))
    assert url.query["host"] == ("a:5432", "b:5433")
    assert url.query["target_session_attrs"] == "read-write"


# --- a real server ---


def test_every_connection_carries_the_timeouts(pg_store: Store) -> None:
    with pg_store.engine.connect() as conn:  # type: ignore[attr-defined]
        server = {k: conn.exec_driver_sql(f"SHOW {k}").scalar() for k in
                  ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")}
        client = conn.connection.dbapi_connection.info.get_parameters()  # type: ignore[union-attr]
    assert server == {"statement_timeout": "5s", "lock_timeout": "5s", "idle_in_transaction_session_timeout": "10s"}
    assert {k: client[k] for k in ("connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval",
                                   "keepalives_count", "tcp_user_timeout")} == {
        "connect_timeout": "2", "keepalives": "1", "keepalives_idle": "5", "keepalives_interval": "1",
        "keepalives_count": "3", "tcp_user_timeout": "5000"}
    # pooled connections are pinged on checkout by the store's Holds (where a hanging ping can be ended)
    assert pg_store.hooks.holds.engine is pg_store.engine  # type: ignore[attr-defined]


def test_a_statement_past_its_timeout_fails_instead_of_hanging(pg_cluster: Cluster) -> None:
    s = open_store(pg_cluster.new_database() + "?options=-c statement_timeout=300")
    try:
        start = time.monotonic()
        with pytest.raises(sa.exc.OperationalError, match="statement timeout"), s.engine.connect() as conn:  # type: ignore[attr-defined]
            conn.exec_driver_sql("SELECT pg_sleep(10)")
        assert time.monotonic() - start < 3
        assert s.get_model("m") is None  # the pool's connection is usable again
    finally:
        s.close()


def test_a_host_that_never_answers_costs_connect_timeout_and_names_the_host() -> None:
    """A listener that accepts and never speaks (a hung server, a half-open tunnel): the open fails
    after ``connect_timeout`` (2 s: libpq's floor) with a StoreError naming the host, not after minutes."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(StoreError, match=f"127.0.0.1:{port}"):
            open_store(f"postgresql+psycopg://postgres@127.0.0.1:{port}/x?connect_timeout=2")
        assert time.monotonic() - start < 5


def test_multi_host_url_skips_a_dead_host(pg_cluster: Cluster) -> None:
    """libpq multi-host, as a Patroni cluster's URL lists its members: the first host refuses, the
    second is the writable primary."""
    db = pg_cluster.new_database().rsplit("/", 1)[1]
    dead = free_port()
    url = (f"postgresql+psycopg://postgres@/{db}?host=127.0.0.1:{dead}&host=127.0.0.1:{pg_cluster.port}"
           "&target_session_attrs=read-write")
    s = open_store(url)
    try:
        s.add_model(model("m"), now=1.0)
        assert [m.name for m in s.list_models()] == ["m"]
    finally:
        s.close()


def test_the_store_reconnects_after_postgresql_restarts(pg_cluster: Cluster) -> None:
    """PostgreSQL restarted under an open store (every pooled connection is dead): the next call
    succeeds, reconnected by the pool's pre-ping, without reopening the store."""
    s = open_store(pg_cluster.new_database())
    try:
        s.add_model(model("before"), now=1.0)
        assert s.get_model("before") is not None  # a pooled connection now exists
        pg_cluster.restart()
        assert s.get_model("before") is not None
        s.add_model(model("after"), now=2.0)
        assert [m.name for m in s.list_models()] == ["after", "before"]
    finally:
        s.close()


def test_concurrent_opens_migrate_once(pg_cluster: Cluster) -> None:
    """Control planes starting together on one empty database: each migration applied once (the
    advisory lock), every open succeeds."""
    url = pg_cluster.new_database()
    stores = at_once(4, lambda _i: open_store(url))
    try:
        assert all(isinstance(s, Store) for s in stores), stores
        with stores[0].engine.connect() as conn:  # type: ignore[union-attr]
            versions = sorted(conn.exec_driver_sql("SELECT version FROM schema_migrations").scalars())
        assert versions == [v for v, _ in MIGRATIONS]
    finally:
        for s in stores:
            if isinstance(s, Store):
                s.close()


# --- concurrent writers, on both backends ---


def test_racing_adds_of_one_name_give_one_model_and_clear_conflicts(store: Store) -> None:
    results = at_once(6, lambda i: store.add_model(model("m", [f"a{i}"]), now=float(i)))
    ok = [r for r in results if not isinstance(r, Exception)]
    conflicts = [r for r in results if isinstance(r, Conflict)]
    assert len(ok) == 1, results
    assert len(conflicts) == 5, results
    assert all("model 'm' already exists" in str(c) for c in conflicts)


def test_racing_aliases_are_held_by_one_model(store: Store) -> None:
    results = at_once(6, lambda i: store.add_model(model(f"m{i}", ["shared"]), now=float(i)))
    assert sum(not isinstance(r, Exception) for r in results) == 1, results
    for r in results:
        if isinstance(r, Exception):
            assert isinstance(r, Conflict)
            assert "'shared' is already a name or alias of model" in str(r)


def test_racing_heartbeats_of_new_nodes_are_all_recorded(store: Store) -> None:
    """Four control planes recording the first heartbeats of the same nodes at once: inserts race
    on the primary key, the losers retry as updates, and every heartbeat counts."""
    beats = [(f"n{j}", heartbeat(), 1.0, "") for j in range(5)]
    results = at_once(4, lambda _i: store.record_heartbeats(beats))
    assert results == [[None] * 5] * 4
    assert {n.id: n.revision for n in store.list_nodes()} == {f"n{j}": 4 for j in range(5)}
    assert at_once(4, lambda _i: store.upsert_node_heartbeat("single", heartbeat(), 2.0).id) == ["single"] * 4


def test_racing_first_writes_of_explanations_and_facts(store: Store) -> None:
    view = ExplainView(model="m", placed=False, summary="s")
    assert at_once(6, lambda i: store.set_explanation(view, now=float(i))) == [None] * 6
    assert store.explanation_summaries() == {"m": PlacementSummary("s", placed=False)}
    assert at_once(6, lambda i: store.set_gguf_facts("hf:x", body="", error=f"e{i}", now=float(i))) == [None] * 6
    assert list(store.list_gguf_facts()) == ["hf:x"]
    assert at_once(6, lambda _i: store.note_cert("n", "AB", 1.0)) == [None] * 6
    assert store.node_serials("n") == ["AB"]


# --- llmgw server migrate-store ---


def test_migrate_store_copies_a_sqlite_install_into_postgresql(tmp_path: Path, pg_cluster: Cluster) -> None:
    """Every table, row for row, through the CLI; a second run is refused (the target is not empty)."""
    sqlite_url = default_url("", tmp_path / "llmgw.db")
    src = open_store(sqlite_url)
    src.add_model(model("m1", ["a1", "a2"]), now=1.0)
    src.add_model(model("m2"), now=2.0)
    src.record_heartbeats([("n1", heartbeat(), 3.0, "AA"), ("n2", heartbeat(), 3.5, "")])
    src.update_node(src.get_node("n2"), cordoned=True)  # type: ignore[arg-type]
    src.add_replica(ReplicaRow(id="r1", model="m1", node="n1", profile="cpu", state="starting", err="",
                               key="k", endpoint="", revision=0, created_at=4.0, updated_at=4.0))
    src.set_explanation(ExplainView(model="m1", placed=True, summary="placed"), now=5.0)
    src.set_gguf_facts("file:/x.gguf", body="{}", error="", now=6.0)
    src.note_cert("n1", "AA", 7.0)
    src.record_heartbeats([("gone", heartbeat(), 8.0, "")])
    src.note_cert("gone", "BB", 8.0)
    assert src.remove_node("gone", now=9.0) == ["BB"]
    src.close()

    target = pg_cluster.new_database()
    runner = CliRunner()
    out = runner.invoke(cli_app, ["--root", str(tmp_path / "root"), "server", "migrate-store",
                                  "--from", sqlite_url, "--to", target])
    assert out.exit_code == 0, out.output
    assert "done models: 2 rows" in out.output
    assert "done model_names: 4 rows" in out.output

    a, b = open_store(sqlite_url), open_store(target)
    try:
        assert a.list_models() == b.list_models()
        assert a.list_nodes() == b.list_nodes()
        assert b.get_node("n2").cordoned  # type: ignore[union-attr]
        assert a.list_replicas() == b.list_replicas()
        assert a.list_explanations() == b.list_explanations()
        assert a.list_gguf_facts() == b.list_gguf_facts()
        assert b.node_serials("n1") == ["AA"]
        assert b.revoked("BB") == a.revoked("BB") == ("gone", 9.0)
        with pytest.raises(Conflict, match="'a1' is already a name or alias of model 'm1'"):
            b.add_model(model("m3", ["a1"]), now=10.0)
    finally:
        a.close()
        b.close()

    again = runner.invoke(cli_app, ["--root", str(tmp_path / "root"), "server", "migrate-store",
                                    "--from", sqlite_url, "--to", target])
    assert again.exit_code != 0
    assert "the target store is not empty: table" in again.output


def test_migrate_store_without_a_source_says_so(tmp_path: Path) -> None:
    out = CliRunner().invoke(cli_app, ["--root", str(tmp_path), "server", "migrate-store",
                                       "--to", "postgresql+psycopg://u@127.0.0.1:1/x"])
    assert out.exit_code == 1
    assert "there is no store to copy at sqlite:///" in out.output


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql+psycopg://llmgw:S3cretPW@127.0.0.1:notaport/llmgw", "is not a database URL"),
        ("postgresql+psycopg://llmgw:S3cretPW@[::1/llmgw", "is not a database URL"),
        ("postgres://llmgw:S3cretPW@db/llmgw", r"write postgresql\+psycopg://"),
    ],
)
def test_a_store_url_that_does_not_parse_says_so_without_its_password(url: str, says: str) -> None:
    """A new operator's typos ended in a Python traceback, or printed the password."""
    with pytest.raises(StoreError, match=says) as err:
        open_store(url)
    assert "S3cretPW" not in str(err.value)
    assert "llmgw:***@" in str(err.value)


def test_a_database_that_does_not_answer_is_named_with_what_to_check() -> None:
    port = free_port()
    with pytest.raises(StoreError) as err:
        open_store(f"postgresql+psycopg://llmgw:S3cretPW@127.0.0.1:{port}/llmgw")
    text = str(err.value)
    assert f"port {port} failed" in text
    assert "check that PostgreSQL runs there" in text
    assert "S3cretPW" not in text


def test_busy_store_threads_reuse_pooled_connections(pg_cluster: Cluster) -> None:
    """Eight threads holding a store connection at once (``server run`` has about that many that
    may: the API pool's workers and readers, the leader's), five rounds: at most eight connections
    opened in all, kept in the pool. With SQLAlchemy's default pool of 5, each round opened three more and
    closed them at checkin (a backend fork and a SCRAM handshake each): a busy control plane opened
    35 sessions in 10 s."""
    s = open_store(pg_cluster.new_database())
    try:
        assert isinstance(s, SqlStore)
        made = 0

        def connected(*_: object) -> None:
            nonlocal made
            made += 1

        sa.event.listen(s.engine, "connect", connected)
        together = threading.Barrier(8)

        def hold(_i: int) -> int:
            with s.engine.connect() as conn:
                one = conn.execute(sa.text("select 1")).scalar_one()
                together.wait(10)  # all eight hold one at once
                return int(one)

        for _ in range(5):
            assert at_once(8, hold) == [1] * 8
        # at most one each (opening the store left one in the pool, which a thread takes)
        assert made <= 8, f"{made} connections opened for 8 threads over 5 rounds"
    finally:
        s.close()
