"""The SQL store's gateway keys, usage and rate counts (migration 7), a part of
:class:`~llmgw.control.store.sql.SqlStore` kept in its own module.

Counts are added with one ``INSERT … ON CONFLICT … DO UPDATE SET n = n + excluded.n`` statement per
table and batch (SQLite 3.24+ and PostgreSQL share the syntax; SQLAlchemy builds it per dialect), so
two control planes adding to one row at once both count, with no read-modify-write race. Rows are
written in key order, so two control planes' batches lock shared rows in the same order (no deadlock).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from llmgw.control.store.codec import from_columns
from llmgw.control.store.rows import ApiKeyRow, RateDelta, UsageDelta
from llmgw.control.store.schema import api_keys_t, rate_windows_t, usage_daily_t
from llmgw.control.store.sqlpart import SqlPart
from llmgw.errors import Conflict

_USAGE_COUNTS = ("requests", "prompt_tokens", "completion_tokens", "guard_blocks", "errors")


def _key_row(r: sa.Row[Any]) -> ApiKeyRow:
    return from_columns(ApiKeyRow, r, models=tuple(json.loads(r.models)))


def _key_values(row: ApiKeyRow) -> dict[str, Any]:
    return {
        "prefix": row.prefix,
        "digest": row.digest,
        "models": json.dumps(list(row.models)),
        "rpm": row.rpm,
        "tpm": row.tpm,
        "budget_tokens": row.budget_tokens,
        "budget_period": row.budget_period,
        "expires_at": row.expires_at,
        "created_at": row.created_at,
        "revoked_at": row.revoked_at,
        "last_used_at": row.last_used_at,
        "priority": row.priority,
    }


def _add_counts(conn: Connection, table: sa.Table, keys: Sequence[str], counts: Sequence[str],
                rows: list[dict[str, Any]]) -> None:
    """Insert ``rows`` into ``table``, adding ``counts`` to a row whose primary key ``keys`` exists."""
    if not rows:
        return
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    stmt = insert(table)
    stmt = stmt.on_conflict_do_update(
        index_elements=[table.c[k] for k in keys],
        set_={c: table.c[c] + stmt.excluded[c] for c in counts},
    )
    conn.execute(stmt, rows)


class SqlKeys(SqlPart):
    """The migration-7 methods of :class:`~llmgw.control.store.base.Store` over SQLAlchemy Core; mixed into
    :class:`~llmgw.control.store.sql.SqlStore`, whose ``_tx`` and ``_wtx`` they use."""

    def add_key(self, row: ApiKeyRow) -> ApiKeyRow:
        try:
            with self._wtx() as conn:
                conn.execute(api_keys_t.insert().values(name=row.name, revision=1, **_key_values(row)))
        except sa.exc.IntegrityError as e:
            held = self.get_key(row.name)
            if held is not None and held.revoked_at is not None:
                # Usage, rate windows and budgets are counted by name: a new key under a revoked
                # one's name would inherit its usage (and this month's budget spent).
                raise Conflict(
                    f"the name '{row.name}' belongs to a revoked key, and a revoked key's name stays taken "
                    "(its usage stays its own): pick another name"
                ) from e
            raise Conflict(
                f"a key named '{row.name}' already exists; pick another name, or 'llmgw ctl key rotate {row.name}'"
            ) from e
        return replace(row, revision=1)

    def get_key(self, name: str) -> ApiKeyRow | None:
        with self._tx() as conn:
            r = conn.execute(sa.select(api_keys_t).where(api_keys_t.c.name == name)).first()
        return _key_row(r) if r is not None else None

    def list_keys(self) -> list[ApiKeyRow]:
        with self._tx() as conn:
            rows = conn.execute(sa.select(api_keys_t).order_by(api_keys_t.c.name)).all()
        return [_key_row(r) for r in rows]

    def update_key(self, row: ApiKeyRow, *, revision: int) -> ApiKeyRow:
        # last_used_at is accounting's alone (record_accounting raises it without a revision, every
        # sync): an admin's write read before a sync wrote the older time back over it.
        values = {k: v for k, v in _key_values(row).items() if k != "last_used_at"}
        with self._wtx() as conn:
            done = conn.execute(
                api_keys_t.update()
                .where(api_keys_t.c.name == row.name, api_keys_t.c.revision == revision)
                .values(revision=revision + 1, **values)
            ).rowcount
            used = conn.scalar(sa.select(api_keys_t.c.last_used_at).where(api_keys_t.c.name == row.name))
        if not done:
            raise Conflict(f"key '{row.name}' changed or was removed since it was read; read it again")
        return replace(row, revision=revision + 1, last_used_at=used)

    def record_accounting(
        self, cp: str, usage: Sequence[UsageDelta], rates: Sequence[RateDelta], last_used: Mapping[str, float]
    ) -> None:
        with self._wtx() as conn:
            _add_counts(
                conn, usage_daily_t, ("key", "model", "day"), _USAGE_COUNTS,
                [{"key": u.key, "model": u.model, "day": u.day, **{c: getattr(u, c) for c in _USAGE_COUNTS}}
                 for u in sorted(usage, key=lambda u: (u.key, u.model, u.day))],  # one lock order: no deadlock
            )
            _add_counts(
                conn, rate_windows_t, ("key", "cp", "window"), ("requests", "tokens"),
                [{"key": r.key, "cp": cp, "window": r.window, "requests": r.requests, "tokens": r.tokens}
                 for r in rates],
            )
            if last_used:
                conn.execute(
                    api_keys_t.update()
                    .where(api_keys_t.c.name == sa.bindparam("k"))
                    .values(last_used_at=sa.func.coalesce(
                        sa.case((api_keys_t.c.last_used_at > sa.bindparam("t"), api_keys_t.c.last_used_at),
                                else_=sa.bindparam("t")),
                        sa.bindparam("t"),
                    )),
                    [{"k": k, "t": t} for k, t in sorted(last_used.items())],
                )

    def rate_totals(self, *, since_window: int, exclude_cp: str) -> dict[tuple[str, int], tuple[int, int]]:
        t = rate_windows_t
        with self._tx() as conn:
            rows = conn.execute(
                sa.select(t.c.key, t.c.window, sa.func.sum(t.c.requests), sa.func.sum(t.c.tokens))
                .where(t.c.window >= since_window, t.c.cp != exclude_cp)
                .group_by(t.c.key, t.c.window)
            ).all()
        return {(k, int(w)): (int(r), int(n)) for k, w, r, n in rows}

    def key_tokens_by_day(self, *, since_day: str) -> dict[tuple[str, str], int]:
        t = usage_daily_t
        with self._tx() as conn:
            rows = conn.execute(
                sa.select(t.c.key, t.c.day, sa.func.sum(t.c.prompt_tokens + t.c.completion_tokens))
                .where(t.c.day >= since_day)
                .group_by(t.c.key, t.c.day)
            ).all()
        return {(k, d): int(n) for k, d, n in rows}

    def prune_rate_windows(self, *, before_window: int) -> int:
        with self._wtx() as conn:
            return int(conn.execute(rate_windows_t.delete().where(rate_windows_t.c.window < before_window)).rowcount)

    def usage(
        self, *, key: str | None = None, model: str | None = None, since_day: str, until_day: str | None = None
    ) -> list[UsageDelta]:
        t = usage_daily_t
        q = sa.select(t).where(t.c.day >= since_day)
        if until_day is not None:
            q = q.where(t.c.day <= until_day)
        if key is not None:
            q = q.where(t.c.key == key)
        if model is not None:
            q = q.where(t.c.model == model)
        with self._tx() as conn:
            rows = conn.execute(q.order_by(t.c.day, t.c.key, t.c.model)).all()
        return [UsageDelta(r.key, r.model, r.day, *(int(getattr(r, c)) for c in _USAGE_COUNTS)) for r in rows]
