"""The store's migrations by the book: a fresh database, migrated step by step from migration 1's
frozen tables, ends at exactly today's tables (SQLite and PostgreSQL); a SQLite database made by
main before migration 1 was frozen (tests/data/store-made-by-f6e5588.db: a model with an alias and
a key, written by that commit's code) opens, migrates and reads back; a database made by the first
release's migration alone (version 1) goes through every later one."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from llmgw.control.store import default_url, open_store
from llmgw.control.store.schema import _V1, MIGRATIONS, metadata, migrations_t

DATA = Path(__file__).parents[1] / "data"


def _shape(engine: sa.Engine) -> dict[str, dict[str, tuple[Any, ...]]]:
    """table -> column -> (type affinity, nullable, primary key, has a server default), and
    ``"<table> indexes"`` -> index name -> (columns, unique), as the database reports them."""
    insp = sa.inspect(engine)
    out: dict[str, dict[str, tuple[Any, ...]]] = {}
    for table in insp.get_table_names():
        pk = set(insp.get_pk_constraint(table)["constrained_columns"])
        out[table] = {
            c["name"]: (c["type"]._type_affinity.__name__, bool(c["nullable"]), c["name"] in pk,
                        c.get("default") is not None)
            for c in insp.get_columns(table)
        }
        out[f"{table} indexes"] = {  # name -> (columns, unique)
            i["name"]: (tuple(i["column_names"]), bool(i["unique"])) for i in insp.get_indexes(table)
        }
    return out


def _today(engine: sa.Engine) -> dict[str, dict[str, tuple[Any, ...]]]:
    """Today's tables (schema.metadata) created directly, read back the same way."""
    metadata.create_all(engine)
    return _shape(engine)


def _assert_ends_at_today(store: Any, direct_url: str) -> None:
    """``store`` (closed here) has exactly the tables ``schema.metadata`` makes at ``direct_url``."""
    migrated = _shape(store.engine)
    store.close()
    direct = sa.create_engine(direct_url)
    try:
        assert migrated == _today(direct)
    finally:
        direct.dispose()


def test_a_fresh_database_migrated_step_by_step_has_todays_tables(tmp_path: Path) -> None:
    store = open_store(default_url("", tmp_path / "migrated.db"))
    assert store.schema_versions() == [v for v, _ in MIGRATIONS]
    _assert_ends_at_today(store, f"sqlite:///{tmp_path / 'direct.db'}")


def test_a_fresh_postgresql_database_migrated_step_by_step_has_todays_tables(pg_cluster: Any) -> None:
    store = open_store(pg_cluster.new_schema())
    _assert_ends_at_today(store, pg_cluster.new_schema())


def test_a_database_at_the_first_migration_goes_through_every_later_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'v1.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        _V1.create_all(conn)
        migrations_t.create(conn)
        conn.execute(migrations_t.insert().values(version=1, applied_at=0.0))
        spec = '{"name": "chat", "aliases": ["c"]}'
        conn.execute(sa.text("INSERT INTO models VALUES ('chat', 1, :spec, 1, 1)"), {"spec": spec})
    engine.dispose()
    store = open_store(default_url("", tmp_path / "v1.db"))
    assert store.schema_versions() == [v for v, _ in MIGRATIONS]
    _assert_ends_at_today(store, f"sqlite:///{tmp_path / 'direct.db'}")


def test_a_database_made_by_main_before_the_freeze_opens_and_reads(tmp_path: Path) -> None:
    db = tmp_path / "llmgw.db"
    shutil.copy(DATA / "store-made-by-f6e5588.db", db)
    store = open_store(default_url("", db))
    assert store.schema_versions() == [v for v, _ in MIGRATIONS]
    row = store.get_model("gpt-x") or store.get_model("chat")
    assert row is not None
    assert (row.name, row.model.aliases) == ("chat", ["gpt-x"])
    key = store.get_key("alice")
    assert key is not None
    assert (key.prefix, key.rpm) == ("sk-alice-0123456", 60)
    _assert_ends_at_today(store, f"sqlite:///{tmp_path / 'direct.db'}")
