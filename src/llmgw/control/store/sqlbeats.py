"""The SQL store's heartbeat path, a part of :class:`~llmgw.control.store.sql.SqlStore` kept in its
own module: a heartbeat is one read transaction (:meth:`SqlBeats.read_heartbeat`, or
:meth:`SqlBeats.read_pulse` for a pulse) and one batched write transaction
(:meth:`SqlBeats.write_heartbeats`: a pulse writes one conditional ``UPDATE`` of ``last_seen``),
and the statements they share with the single-purpose methods of :mod:`llmgw.control.store.sql`
take a connection here (``select_replicas``, ``update_replica``, ``refusal``, ``deny_list``,
``note_cert``, ``take_log_requests``, ``upsert_node``, ``touch_node``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from llmgw.catalog import Model
from llmgw.control.store.base import ISSUE_SLACK_S, REMOVAL_PREFIX, report_updates
from llmgw.control.store.codec import heartbeat_values, node_row, replica_row, replica_values
from llmgw.control.store.rows import (
    BeatResult,
    BeatWrite,
    HeartbeatRead,
    ModelRow,
    NodeLiveness,
    PulseRead,
    ReplicaRow,
)
from llmgw.control.store.schema import (
    GROUPED,
    log_requests_t,
    models_t,
    node_certs_t,
    nodes_t,
    replicas_t,
    revoked_certs_t,
)
from llmgw.control.store.sqlchanges import mark as mark_changes
from llmgw.control.store.sqlpart import SqlPart
from llmgw.errors import Conflict, Revoked
from llmgw.protocol import LogRequest

# The statements every beat runs, built once with bound parameters: built per call, making the
# expressions and their cache keys was a fifth of a pulse's read (cProfile, 5,000 nodes, 2026-12-06).
_REFUSAL = sa.select(revoked_certs_t).where(
    revoked_certs_t.c.serial.in_([sa.bindparam("serial", type_=sa.String), sa.bindparam("removal", type_=sa.String)])
)
_DENIED = sa.select(revoked_certs_t).where(revoked_certs_t.c.serial.in_(sa.bindparam("serials", expanding=True)))
_LIVENESS = sa.select(
    nodes_t.c.id, nodes_t.c.state, nodes_t.c.instance, nodes_t.c.last_seen, nodes_t.c.digest
).where(nodes_t.c.id == sa.bindparam("node"))
_NODE = sa.select(nodes_t).where(nodes_t.c.id == sa.bindparam("node"))
_MODELS = sa.select(models_t).where(models_t.c.name.in_(sa.bindparam("names", expanding=True)))
_TOUCH = (
    nodes_t.update()
    .where(nodes_t.c.id == sa.bindparam("b_node"), nodes_t.c.state == "ready",
           nodes_t.c.digest == sa.bindparam("b_digest"), nodes_t.c.digest != "")
    .values(last_seen=sa.bindparam("b_now"), revision=nodes_t.c.revision + 1)
)


class SqlBeats(SqlPart):
    """The heartbeat methods of :class:`~llmgw.control.store.base.Store` over SQLAlchemy Core; mixed
    into :class:`~llmgw.control.store.sql.SqlStore`, whose ``_tx``, ``_wtx`` and ``_model_row`` they use."""

    def _model_row(self, row: sa.Row[Any]) -> ModelRow | None:  # pragma: no cover - SqlStore's
        raise NotImplementedError

    def read_heartbeat(self, node_id: str, serial: str, issued_at: float | None) -> HeartbeatRead:
        """One read transaction: the verdict on the certificate, the node, its replicas and their models."""
        refused, row, replicas, models = self._read_beat(node_id, serial, issued_at, _NODE)
        if refused is not None:
            return HeartbeatRead(refused)
        return HeartbeatRead(None, node_row(row) if row else None, replicas, models)

    def read_pulse(self, node_id: str, serial: str, issued_at: float | None) -> PulseRead:
        """One read transaction, as :meth:`read_heartbeat` but with the node's liveness columns only."""
        refused, row, replicas, models = self._read_beat(node_id, serial, issued_at, _LIVENESS)
        if refused is not None:
            return PulseRead(refused)
        before = NodeLiveness(row.id, row.state, row.instance, row.last_seen, row.digest) if row else None
        return PulseRead(None, before, replicas, models)

    def _read_beat(
        self, node_id: str, serial: str, issued_at: float | None, node_q: sa.Select[Any]
    ) -> tuple[tuple[str, float] | None, sa.Row[Any] | None, list[ReplicaRow], dict[str, Model]]:
        """A beat's read transaction: ``(refusal, the node's row by node_q, its replicas, their
        models by name)``; with a refusal, nothing else is read."""
        with self._tx() as conn:
            refused = refusal(conn, node_id, serial, issued_at) if serial else None
            if refused is not None:
                return refused, None, [], {}
            row = conn.execute(node_q, {"node": node_id}).first()
            replicas = select_replicas(conn, node=node_id)
            names = sorted({r.model for r in replicas})
            rows = conn.execute(_MODELS, {"names": names}).all() if names else []
        return None, row, replicas, {m.name: m.model for m in (self._model_row(r) for r in rows) if m is not None}

    def count_nodes(self) -> int:
        """How many nodes are stored (any state): what the heartbeat interval is sized by."""
        with self._tx() as conn:
            return int(conn.scalar(sa.select(sa.func.count()).select_from(nodes_t)) or 0)

    def write_heartbeats(self, beats: Sequence[BeatWrite]) -> list[BeatResult]:
        """One write transaction for the whole batch (as :meth:`record_heartbeats`), tried again
        from the start (up to three times) when another writer inserted a row it inserts
        meanwhile (a node, a serial: PostgreSQL, several control planes)."""
        for attempt in range(3):
            try:
                with self._wtx() as conn:
                    return self._write_heartbeats(conn, beats)
            except sa.exc.IntegrityError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _write_heartbeats(self, conn: Connection, beats: Sequence[BeatWrite]) -> list[BeatResult]:
        """:meth:`write_heartbeats` inside its transaction.

        The revocation check again, in the write transaction node removal takes, so a heartbeat in
        flight while its node was removed never writes it back: its serial revoked, or its node
        removed and the serial neither remembered for it since (``node_certs``, which the removal
        empties) nor on a certificate issued after the removal (a re-join's new certificate, whose
        serial this very write remembers)."""
        denied, removed, admitted = deny_list(conn, [(b.node_id, b.serial) for b in beats])
        out = []
        full: list[str] = []
        for b in beats:
            gone = denied.get(b.serial) if b.serial else None
            if gone is None and b.serial and b.node_id in removed and (b.node_id, b.serial) not in admitted:
                removal = denied[REMOVAL_PREFIX + b.node_id]
                if b.issued_at is None or b.issued_at < removal.revoked_at - ISSUE_SLACK_S:
                    gone = removal
            if gone is not None:
                out.append(BeatResult(Revoked(b.serial, gone.node, gone.revoked_at)))
                continue
            if b.note and b.serial and (b.node_id, b.serial) not in admitted:
                note_cert(conn, b.node_id, b.serial, b.now)
            if b.hb is None:  # a pulse: alive, state unchanged
                if not touch_node(conn, b.node_id, b.digest, b.now):
                    out.append(BeatResult(None, stale=True))
                    continue
                out.append(BeatResult(None, [], take_log_requests(conn, b.node_id, b.now) if b.logs else []))
                continue
            values = heartbeat_values(b.hb, b.now, b.digest)
            if not any(upsert_node(conn, b.node_id, values, b.now) for _ in range(5)):
                out.append(BeatResult(Conflict(
                    f"node '{b.node_id}' kept changing while its heartbeat was recorded; it will retry"
                )))
                continue
            placed = select_replicas(conn, node=b.node_id)
            updates = report_updates(b.node_id, placed, b.hb.replicas, b.now)
            changed = [r.id for r in updates if update_replica(conn, r)]
            full.append(b.node_id)
            out.append(BeatResult(None, changed, take_log_requests(conn, b.node_id, b.now) if b.logs else []))
        # A full beat is a change (its agent sends one only when its state moved): the leader's next
        # pass reads the node again (one insert for the batch; pulses mark nothing).
        mark_changes(conn, "node", full, max((b.now for b in beats), default=0.0))
        return out


def upsert_node(conn: Connection, node_id: str, values: dict[str, Any], now: float) -> int:
    """Insert the node or update it at the revision just read; rows written (0: it raced)."""
    cur = conn.execute(sa.select(nodes_t.c.revision).where(nodes_t.c.id == node_id)).first()
    if cur is None:
        return int(
            conn.execute(
                nodes_t.insert().values(id=node_id, revision=1, cordoned=False, first_seen=now, **values)
            ).rowcount
        )
    return int(
        conn.execute(
            nodes_t.update()
            .where(nodes_t.c.id == node_id, nodes_t.c.revision == cur.revision)
            .values(revision=cur.revision + 1, **values)
        ).rowcount
    )


def touch_node(conn: Connection, node_id: str, digest: str, now: float) -> bool:
    """A pulse's write: ``last_seen`` (and the revision, so that a leader's read-then-write of the
    node at the old revision, marking it lost, fails) of a ``ready`` node whose stored digest is
    ``digest``; False when there is no such node (lost meanwhile, or another full beat moved its
    digest): nothing written."""
    return bool(conn.execute(_TOUCH, {"b_node": node_id, "b_digest": digest, "b_now": now}).rowcount)


def select_replicas(conn: Connection, *, model: str | None = None, node: str | None = None) -> list[ReplicaRow]:
    """:meth:`~llmgw.control.store.sql.SqlStore.list_replicas` on ``conn``."""
    if node is None:
        q = sa.select(replicas_t).order_by(replicas_t.c.created_at, replicas_t.c.id)
        if model is not None:
            q = q.where(replicas_t.c.model == model)
        return [replica_row(r) for r in conn.execute(q)]
    # A group replica uses every member's node: its head is ``node``, its workers are in ``members``
    # (compact JSON, so the LIKE finds the exact key; checked again below). Two halves, each on an
    # index (``node``; the partial ``ix_replicas_grouped``, whose predicate is repeated as is): one
    # WHERE with OR scanned every replica (3.0 ms a heartbeat at 20,000 replicas, 2026-12-06).
    member = f'%"node":{json.dumps(node)}%'
    params = {"node": node, "member": member, "model": model}
    out = [replica_row(r) for r in conn.execute(_ON_NODE if model is None else _ON_NODE_OF_MODEL, params)]
    return [r for r in out if r.node == node or any(m.node == node for m in r.members)]


def _on_node(of_model: bool) -> sa.CompoundSelect[Any]:
    """:func:`select_replicas`' statement for a node (bound ``node``, ``member``: the LIKE pattern
    of it in ``members``, and ``model`` when ``of_model``), built once."""
    c = replicas_t.c
    node: sa.BindParameter[str] = sa.bindparam("node")
    model: sa.BindParameter[str] = sa.bindparam("model")
    mine = sa.select(replicas_t).where(c.node == node)
    grouped = sa.select(replicas_t).where(sa.text(GROUPED), c.node != node, c.members.like(sa.bindparam("member")))
    if of_model:
        mine, grouped = mine.where(c.model == model), grouped.where(c.model == model)
    # Ordered by the database, as the list of every replica is: ids compare by its collation, which
    # a sort here (by code point) would not follow on PostgreSQL, and the desired list's digest is in order.
    return sa.union_all(mine, grouped).order_by(sa.literal_column("created_at"), sa.literal_column("id"))


_ON_NODE = _on_node(False)
_ON_NODE_OF_MODEL = _on_node(True)


def update_replica(conn: Connection, replica: ReplicaRow) -> int:
    """Write ``replica`` (its revision bumped) over the row still at ``replica.revision``; rows
    written (0: it raced)."""
    values = replica_values(replace(replica, revision=replica.revision + 1))
    del values["id"]
    return int(
        conn.execute(
            replicas_t.update()
            .where(replicas_t.c.id == replica.id, replicas_t.c.revision == replica.revision)
            .values(**values)
        ).rowcount
    )


def refusal(conn: Connection, node_id: str, serial: str, issued_at: float | None) -> tuple[str, float] | None:
    """:meth:`~llmgw.control.store.sql.SqlStore.refused_cert` on ``conn``."""
    rows = {r.serial: r for r in conn.execute(_REFUSAL, {"serial": serial, "removal": REMOVAL_PREFIX + node_id})}
    if serial in rows:
        return rows[serial].node, rows[serial].revoked_at
    removal = rows.get(REMOVAL_PREFIX + node_id)
    if removal is not None and issued_at is not None and issued_at < removal.revoked_at - ISSUE_SLACK_S:
        return removal.node, removal.revoked_at
    return None


def deny_list(
    conn: Connection, beats: Sequence[tuple[str, str]]
) -> tuple[dict[str, sa.Row[Any]], set[str], set[tuple[str, str]]]:
    """For heartbeats ``(node id, serial)`` (serial ``""``: unknown, not checked): the
    ``revoked_certs`` rows of their serials and of their nodes' removals (by serial), the nodes
    removed, and the ``(node, serial)`` pairs remembered for those nodes since their removal."""
    serials = [serial for _, serial in beats if serial]
    removals = [REMOVAL_PREFIX + node for node, serial in beats if serial]
    denied = {r.serial: r for r in conn.execute(_DENIED, {"serials": [*serials, *removals]})} if serials else {}
    removed = {r.node for k, r in denied.items() if k.startswith(REMOVAL_PREFIX)}
    admitted = {
        (r.node, r.serial)
        for r in conn.execute(sa.select(node_certs_t).where(node_certs_t.c.node.in_(removed)))
    } if removed else set()
    return denied, removed, admitted


def note_cert(conn: Connection, node_id: str, serial: str, now: float) -> None:
    """:meth:`~llmgw.control.store.sql.SqlStore.note_cert` on ``conn`` (IntegrityError: another writer
    inserted it meanwhile)."""
    known = conn.scalar(
        sa.select(sa.func.count())
        .select_from(node_certs_t)
        .where(node_certs_t.c.node == node_id, node_certs_t.c.serial == serial)
    )
    if not known:
        conn.execute(node_certs_t.insert().values(node=node_id, serial=serial, first_seen=now))


def take_log_requests(
    conn: Connection, node: str, now: float, which: sa.ColumnElement[bool] | None = None
) -> list[LogRequest]:
    """Mark the log requests queued for ``node`` (``which`` of them; None: all) handed out at
    ``now``, in one conditional update, and return them oldest first."""
    q = log_requests_t.c
    rows = conn.execute(
        log_requests_t.update()
        .where(q.node == node, q.handed_at.is_(None), *([which] if which is not None else []))
        .values(handed_at=now)
        .returning(q.id, q.replica_id, q.lines, q.start, q.created_at)
    ).all()
    rows = sorted(rows, key=lambda r: (r.created_at, r.id))
    return [LogRequest(id=r.id, replica_id=r.replica_id, lines=r.lines, offset=r.start) for r in rows]
