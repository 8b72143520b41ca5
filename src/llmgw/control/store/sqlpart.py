"""What the parts of :class:`~llmgw.control.store.sql.SqlStore` kept in modules of their own
(:mod:`~llmgw.control.store.sqlbeats`, :mod:`~llmgw.control.store.sqlkeys`,
:mod:`~llmgw.control.store.sqllogs`) use of it: its read and write transactions."""

from __future__ import annotations

from contextlib import AbstractContextManager

from sqlalchemy.engine import Connection


class SqlPart:
    """A mixin of :class:`~llmgw.control.store.sql.SqlStore`: ``_tx`` (one read transaction) and
    ``_wtx`` (one write transaction, the dialect's writer lock taken) are SqlStore's."""

    def _tx(self) -> AbstractContextManager[Connection]:  # pragma: no cover - SqlStore's
        raise NotImplementedError

    def _wtx(self) -> AbstractContextManager[Connection]:  # pragma: no cover - SqlStore's
        raise NotImplementedError
