"""Copy a whole store into another, empty one: ``llmgw server migrate-store --to URL``.

A single-machine install keeps its state in SQLite; an HA install keeps it in PostgreSQL. Both run
the same schema (:mod:`llmgw.control.store.schema`), so moving is a row-for-row copy of every
table: both stores are opened (which migrates each to the current schema first), the target must
be empty, and every row is written in **one** target transaction, so a copy that fails part-way
leaves the target empty, never half-filled. Afterwards each table's row count is compared.

Leadership and membership are not rows to copy: the target's ``cp_leader`` row (migration 5) takes
the source's term, so terms keep growing across the move (agents ignore a term lower than one they
have seen), and ``control_planes`` is rebuilt by the control planes within seconds.

Stop the control plane first: rows it writes during the copy would not be in the target.
"""

from __future__ import annotations

import sqlalchemy as sa

from llmgw.control.store.schema import control_planes_t, cp_leader_t, metadata, migrations_t
from llmgw.control.store.sql import SqlStore
from llmgw.errors import StoreError

#: Rows read and inserted per batch (a few MB at most: node rows are a few kB of JSON each).
BATCH = 500


def copy_store(source: SqlStore, target: SqlStore) -> dict[str, int]:
    """Copy every row of every table from ``source`` into ``target``; returns the rows copied per
    table. ``schema_migrations`` is not copied: opening the target already recorded its migrations;
    ``cp_leader`` is set to the source's term (counted as its one row), ``control_planes`` is not copied.

    Raises:
        StoreError: the target already holds rows (it names the table), a row does not fit the
            target (a value longer than its column allows: SQLite never enforced lengths), or the
            counts differ afterwards.
    """
    tables = [t for t in metadata.sorted_tables if t not in (migrations_t, cp_leader_t, control_planes_t)]
    with target.engine.connect() as conn:
        for table in [*tables, control_planes_t]:
            n = conn.scalar(sa.select(sa.func.count()).select_from(table))
            if n:
                raise StoreError(
                    f"the target store is not empty: table '{table.name}' has {n} rows; "
                    "migrate into a new, empty database"
                )
        if target.leader().term:
            raise StoreError(
                "the target store is not empty: a control plane already led on it (cp_leader's term is "
                f"{target.leader().term}); migrate into a new, empty database"
            )
    was = source.leader()
    copied: dict[str, int] = {}
    try:
        with target.engine.begin() as dst, source.engine.connect() as src:
            for table in tables:
                rows = src.execution_options(yield_per=BATCH).execute(sa.select(table))
                copied[table.name] = 0
                for batch in rows.partitions():
                    dst.execute(table.insert(), [dict(r._mapping) for r in batch])
                    copied[table.name] += len(batch)
            dst.execute(
                cp_leader_t.update().where(cp_leader_t.c.id == 1)
                .values(term=was.term, holder=was.holder, since=was.since, renewed_at=was.renewed_at)
            )
    except sa.exc.DBAPIError as e:
        raise StoreError(f"copying the store failed, nothing was written to the target: {e.orig}") from e
    with target.engine.connect() as conn:
        for table in tables:
            n = conn.scalar(sa.select(sa.func.count()).select_from(table))
            if n != copied[table.name]:
                raise StoreError(f"table '{table.name}': {copied[table.name]} rows copied but {n} in the target")
    return copied
