"""The SQL store's dirty marks (migration 12) and the leader's batched writes, a part of
:class:`~llmgw.control.store.sql.SqlStore` kept in its own module: what heartbeats and admin
writes changed, for the leader's next pass.

A write that changes what the leader reconciles inserts one ``changes`` row per node or model it
touched (:func:`mark`), in its own transaction, on whichever control plane it lands: a full
heartbeat (its node), a model added, updated or deleted, a node cordoned or removed, a replica
restarted by an admin. Pulses mark nothing: liveness is found by :meth:`SqlChanges.silent_nodes`,
one indexed-by-nothing scan the database does, not Python.

The leader reads every row in the table with the rows they name (:meth:`SqlChanges.read_dirty`, one
transaction), and after its pass deletes exactly the rows it read (by id). Why a table read whole
and deleted by id rather than a sequence number read "since the last seen": on PostgreSQL, ids
from a sequence commit out of order (a transaction that took id 10 may commit after one that took
11 was read), so a cursor would skip 10; here a row committed late is simply still there at the
next pass. Duplicates cost nothing (the leader reads a set). The table holds only what changed
since the last pass: rows pile up only while no leader runs, and the next leader's first pass is
a full one that deletes them all.

A pass that places a burst (200 models added at once) writes its new replicas and explanations
in one transaction each (:meth:`SqlChanges.add_replicas`, :meth:`SqlChanges.set_explanations`),
not two per model: 400 commits were two thirds of such a pass at 2,000 nodes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import replace

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from llmgw.control.store.codec import node_row, replica_row, replica_values
from llmgw.control.store.rows import DirtyRead, ModelRow, NodeRow, ReplicaRow
from llmgw.control.store.schema import changes_t, explanations_t, models_t, nodes_t, replicas_t
from llmgw.control.store.sqlpart import SqlPart
from llmgw.errors import Conflict
from llmgw.views import ExplainView

#: Ids per ``IN (...)`` list (SQLite allows 32,766 parameters; PostgreSQL 65,535).
CHUNK = 500


def mark(conn: Connection, kind: str, keys: Iterable[str], now: float) -> None:
    """Insert one ``changes`` row per key (``kind`` ``"node"`` or ``"model"``), in ``conn``'s transaction."""
    rows = [{"kind": kind, "key": k, "at": now} for k in dict.fromkeys(keys)]
    if rows:
        conn.execute(changes_t.insert(), rows)


def _chunks(xs: Collection[str]) -> list[list[str]]:
    s = sorted(xs)
    return [s[i : i + CHUNK] for i in range(0, len(s), CHUNK)]


class SqlChanges(SqlPart):
    """The migration-12 methods of :class:`~llmgw.control.store.base.Store` over SQLAlchemy Core;
    mixed into :class:`~llmgw.control.store.sql.SqlStore`, whose ``_tx``, ``_wtx`` and
    ``_model_row`` they use."""

    def _model_row(self, row: sa.Row[object]) -> ModelRow | None:  # pragma: no cover - SqlStore's
        raise NotImplementedError

    def note_changes(self, *, nodes: Collection[str] = (), models: Collection[str] = (), now: float) -> None:
        with self._wtx() as conn:
            mark(conn, "node", nodes, now)
            mark(conn, "model", models, now)

    def forget_changes(self, ids: Collection[int]) -> None:
        if not ids:
            return
        s = sorted(ids)
        with self._wtx() as conn:
            for i in range(0, len(s), CHUNK):
                conn.execute(changes_t.delete().where(changes_t.c.id.in_(s[i : i + CHUNK])))

    def add_replicas(self, replicas: Sequence[ReplicaRow]) -> None:
        if not replicas:
            return
        try:
            with self._wtx() as conn:
                conn.execute(replicas_t.insert(), [replica_values(replace(r, revision=1)) for r in replicas])
        except sa.exc.IntegrityError as e:
            raise Conflict(f"one of replicas {', '.join(r.id for r in replicas)} already exists") from e

    def set_explanations(self, views: Sequence[ExplainView], *, now: float) -> None:
        if not views:
            return
        latest = {v.model: v for v in views}
        with self._wtx() as conn:
            for part in _chunks(latest):
                conn.execute(explanations_t.delete().where(explanations_t.c.model.in_(part)))
            conn.execute(explanations_t.insert(), [
                {"model": k, "body": v.model_dump_json(), "updated_at": now} for k, v in latest.items()
            ])

    def silent_nodes(self, *, before: float) -> list[str]:
        c = nodes_t.c
        with self._tx() as conn:
            return list(conn.scalars(sa.select(c.id).where(c.state == "ready", c.last_seen < before).order_by(c.id)))

    def read_dirty(self, *, nodes: Collection[str] = (), models: Collection[str] = ()) -> DirtyRead:
        with self._tx() as conn:
            marks = conn.execute(sa.select(changes_t.c.id, changes_t.c.kind, changes_t.c.key)).all()
            node_ids = {m.key for m in marks if m.kind == "node"} | set(nodes)
            names = {m.key for m in marks if m.kind == "model"} | set(models)
            got: dict[str, NodeRow | None] = dict.fromkeys(node_ids)
            for part in _chunks(node_ids):
                for r in conn.execute(sa.select(nodes_t).where(nodes_t.c.id.in_(part))):
                    got[r.id] = node_row(r)
            rows: dict[str, sa.Row[object]] = {}
            for part in _chunks(names):
                rows.update((r.name, r) for r in conn.execute(sa.select(models_t).where(models_t.c.name.in_(part))))
            q = replicas_t.c
            wheres = [q.members != "[]"]  # every group: a member's node may be the one marked
            wheres += [q.node.in_(part) for part in _chunks(node_ids)]
            wheres += [q.model.in_(part) for part in _chunks(names)]
            replicas: dict[str, sa.Row[object]] = {}
            for where in wheres:
                for r in conn.execute(sa.select(replicas_t).where(where)):
                    replicas.setdefault(r.id, r)
        return DirtyRead([m.id for m in marks], got, self._models(names, rows),
                         sorted((replica_row(r) for r in replicas.values()), key=lambda r: (r.created_at, r.id)))

    def _models(self, names: Collection[str], rows: dict[str, sa.Row[object]]) -> dict[str, ModelRow | None]:
        return {n: (self._model_row(rows[n]) if n in rows else None) for n in names}
