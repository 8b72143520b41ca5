"""The SQL store's engine-log requests between control planes (migration 6), a part of
:class:`~llmgw.control.store.sql.SqlStore` kept in its own module.

A control plane that is asked for a replica's log it cannot reach writes a request row for the
node's agent; the agent's heartbeat takes it (:func:`~llmgw.control.store.sqlbeats.take_log_requests`,
shared with the heartbeat's batched write), answers it, and the asking control plane pops the answer.
Rows older than ``keep_s`` (60 s) are deleted at the next request.
"""

from __future__ import annotations

import sqlalchemy as sa

from llmgw.control.store.schema import log_requests_t
from llmgw.control.store.sqlbeats import take_log_requests
from llmgw.control.store.sqlpart import SqlPart
from llmgw.errors import Conflict
from llmgw.protocol import LogReply, LogRequest


class SqlLogs(SqlPart):
    """The migration-6 methods of :class:`~llmgw.control.store.base.Store` over SQLAlchemy Core; mixed into
    :class:`~llmgw.control.store.sql.SqlStore`, whose ``_tx`` and ``_wtx`` they use."""

    def add_log_request(self, node: str, request: LogRequest, *, now: float, keep_s: float = 60.0) -> None:
        try:
            with self._wtx() as conn:
                conn.execute(log_requests_t.delete().where(log_requests_t.c.created_at < now - keep_s))
                conn.execute(
                    log_requests_t.insert().values(
                        id=request.id, node=node, replica_id=request.replica_id, lines=request.lines,
                        start=request.offset, created_at=now,
                    )
                )
        except sa.exc.IntegrityError as e:
            raise Conflict(f"log request '{request.id}' already exists") from e

    def take_log_requests(self, node: str, *, now: float) -> list[LogRequest]:
        q = log_requests_t.c
        with self._tx() as conn:  # the common case, nothing queued: one indexed read, no write
            ids = list(conn.scalars(sa.select(q.id).where(q.node == node, q.handed_at.is_(None))))
        if not ids:
            return []
        with self._wtx() as conn:
            return take_log_requests(conn, node, now, q.id.in_(ids))

    def log_request_nodes(self) -> set[str]:
        q = log_requests_t.c
        with self._tx() as conn:
            return set(conn.scalars(sa.select(q.node).where(q.handed_at.is_(None)).distinct()))

    def answer_log_request(self, node: str, reply: LogReply, *, now: float) -> bool:
        q = log_requests_t.c
        with self._wtx() as conn:
            n = conn.execute(
                log_requests_t.update()
                .where(q.id == reply.id, q.node == node, q.answered_at.is_(None))
                .values(answered_at=now, text=reply.text, next_offset=reply.offset, found=reply.found)
            ).rowcount
        return n > 0

    def pop_log_answer(self, request_id: str) -> LogReply | None:
        q = log_requests_t.c
        with self._tx() as conn:  # polled every ~200 ms while a read waits: a read until answered
            answered = conn.scalar(sa.select(q.answered_at).where(q.id == request_id))
        if answered is None:
            return None
        with self._wtx() as conn:
            row = conn.execute(
                log_requests_t.delete()
                .where(q.id == request_id, q.answered_at.is_not(None))
                .returning(q.replica_id, q.text, q.next_offset, q.found)
            ).first()
        if row is None:  # taken by a racing caller of the same id
            return None
        return LogReply(id=request_id, replica_id=row.replica_id, text=row.text, offset=row.next_offset,
                        found=bool(row.found))

    def forget_log_request(self, request_id: str) -> None:
        with self._wtx() as conn:
            conn.execute(log_requests_t.delete().where(log_requests_t.c.id == request_id))
