"""The SQL store's autoscaling tables (migration 10), a part of
:class:`~llmgw.control.store.sql.SqlStore` kept in its own module.

``gateway_load``: every control plane rewrites its own rows about once a second (one delete and one
batched insert in one transaction), so the leader reads the whole cluster's load with one
indexed-by-nothing scan of a table of (control planes x models with load) rows. Rows of a control
plane that stopped writing are deleted ``keep_s`` (60 s) later by whoever writes next.

``autoscale_decisions``: appended by the leader when the wanted count of a model changes, pruned to
the newest ``keep`` (100) per model on each append. ``autoscale_history``: a point per autoscaled
model every 15 s (the dashboard's plot of the last hour), older points deleted at each append.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from llmgw.control.store.rows import DecisionRow, GatewayLoadRow, HistoryRow
from llmgw.control.store.schema import autoscale_decisions_t, autoscale_history_t, gateway_load_t
from llmgw.control.store.sqlpart import SqlPart


class SqlScale(SqlPart):
    """The migration-10 methods of :class:`~llmgw.control.store.base.Store` over SQLAlchemy Core; mixed
    into :class:`~llmgw.control.store.sql.SqlStore`, whose ``_tx`` and ``_wtx`` they use."""

    def write_gateway_load(self, control_plane: str, rows: Sequence[GatewayLoadRow], *, now: float,
                           keep_s: float = 60.0) -> None:
        g = gateway_load_t.c
        with self._wtx() as conn:
            conn.execute(gateway_load_t.delete().where(sa.or_(g.control_plane == control_plane, g.at < now - keep_s)))
            if rows:
                conn.execute(
                    gateway_load_t.insert(),
                    [
                        {"control_plane": control_plane, "model": r.model, "in_flight": r.in_flight,
                         "queued": r.queued, "replicas": json.dumps(r.replicas, sort_keys=True), "at": r.at,
                         "arrived": r.arrived}
                        for r in rows
                    ],
                )

    def read_gateway_load(self, *, since: float) -> list[GatewayLoadRow]:
        g = gateway_load_t.c
        with self._tx() as conn:
            rows = conn.execute(sa.select(gateway_load_t).where(g.at >= since)).all()
        return [
            GatewayLoadRow(r.control_plane, r.model, int(r.in_flight), int(r.queued), float(r.at),
                           {str(k): int(v) for k, v in json.loads(r.replicas or "{}").items()}, int(r.arrived))
            for r in rows
        ]

    def add_decision(self, row: DecisionRow, *, keep: int = 100) -> None:
        d = autoscale_decisions_t.c
        with self._wtx() as conn:
            conn.execute(
                autoscale_decisions_t.insert().values(
                    model=row.model, at=row.at, from_n=row.from_n, to_n=row.to_n, reason=row.reason, panic=row.panic
                )
            )
            newest = (
                sa.select(d.id).where(d.model == row.model).order_by(d.id.desc()).limit(keep).scalar_subquery()
            )
            conn.execute(autoscale_decisions_t.delete().where(d.model == row.model, d.id.not_in(newest)))

    def list_decisions(self, model: str, *, limit: int = 100) -> list[DecisionRow]:
        d = autoscale_decisions_t.c
        with self._tx() as conn:
            rows = conn.execute(
                sa.select(autoscale_decisions_t).where(d.model == model).order_by(d.id.desc()).limit(limit)
            ).all()
        return [_decision(r) for r in rows]

    def last_decisions(self) -> dict[str, DecisionRow]:
        d = autoscale_decisions_t.c
        newest = sa.select(sa.func.max(d.id)).group_by(d.model).scalar_subquery()
        with self._tx() as conn:
            rows = conn.execute(sa.select(autoscale_decisions_t).where(d.id.in_(newest))).all()
        return {r.model: _decision(r) for r in rows}

    def add_history(self, rows: Sequence[HistoryRow], *, before: float) -> None:
        h = autoscale_history_t.c
        with self._wtx() as conn:
            conn.execute(autoscale_history_t.delete().where(h.at < before))
            if rows:
                conn.execute(autoscale_history_t.insert(), [
                    {"model": r.model, "at": r.at, "wanted": r.wanted, "ready": r.ready, "load": r.load} for r in rows
                ])

    def list_history(self, model: str, *, since: float) -> list[HistoryRow]:
        h = autoscale_history_t.c
        with self._tx() as conn:
            rows = conn.execute(
                sa.select(autoscale_history_t).where(h.model == model, h.at >= since).order_by(h.at)
            ).all()
        return [HistoryRow(r.model, float(r.at), int(r.wanted), int(r.ready), float(r.load)) for r in rows]

    def forget_decisions(self, model: str) -> None:
        with self._wtx() as conn:
            forget_model(conn, model)


def forget_model(conn: Connection, model: str) -> None:
    """In ``conn``'s transaction: delete ``model``'s decisions and history (it is being deleted; a
    model added again under its name starts from ``scaling.min``)."""
    conn.execute(autoscale_decisions_t.delete().where(autoscale_decisions_t.c.model == model))
    conn.execute(autoscale_history_t.delete().where(autoscale_history_t.c.model == model))


def _decision(r: sa.Row[object]) -> DecisionRow:
    return DecisionRow(r.model, float(r.at), int(r.from_n), int(r.to_n), r.reason, bool(r.panic))
