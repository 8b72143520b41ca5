"""What differs between databases under the same SQL: one :class:`DialectHooks` per backend.

:class:`~llmgw.control.store.sql.SqlStore` runs the same tables, migrations and queries on every
database SQLAlchemy speaks; the few things a database needs besides (file permissions and pragmas
for SQLite, the in-process writer lock; timeouts, keepalives, pre-ping and a migration lock for
PostgreSQL) live in its hooks class, picked by the URL's backend name
(:data:`llmgw.control.store.sql.HOOKS`). A database without hooks of its own gets this base class:
no preparation, no lock, the driver's defaults.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine


class DialectHooks:
    """The hooks of a database with no special needs; subclass per backend and override."""

    def prepare(self, url: sa.URL) -> None:
        """Before the engine is made (e.g. create and protect a database file); may raise OSError."""

    def engine_options(self, url: sa.URL) -> tuple[sa.URL, dict[str, Any]]:
        """The URL and the keyword arguments :func:`sqlalchemy.create_engine` is called with
        (e.g. driver timeouts, pool pre-ping); here the URL as given and no arguments."""
        return url, {}

    def configure(self, engine: Engine) -> None:
        """After the engine is made, before the first connection (e.g. per-connection settings)."""

    def writer(self) -> contextlib.AbstractContextManager[object]:
        """What a write transaction holds in this process around its ``BEGIN … COMMIT``: nothing
        here (the database queues writers itself without sleeping)."""
        return contextlib.nullcontext()

    def abort_thread(self, thread: int) -> int:
        """End the store calls thread ``thread`` (``threading.get_ident()``) is in, from another
        thread; how many were ended. Nothing here: only PostgreSQL's can hang past every driver
        bound (:mod:`llmgw.control.store.postgres`)."""
        return 0

    def bound_holds(self, hold_max_s: float) -> None:
        """End any call holding a connection for longer than ``hold_max_s`` seconds, from now on
        (a long-running server). Nothing here."""

    def close(self) -> None:
        """When the store closes (stop what :meth:`bound_holds` started)."""

    def lock_migrations(self, conn: Connection) -> None:
        """Called first in the migration transaction: keep other processes from migrating the same
        database at once. Nothing here (SQLite's write transaction already excludes them)."""


def describe_url(url: sa.URL) -> str:
    """The database in words for error messages, without the password: ``the SQLite database
    /var/lib/llmgw/llmgw.db``, ``PostgreSQL at 10.0.0.1:5432,10.0.0.2:5432 (database llmgw)``."""
    if url.get_backend_name() == "sqlite":
        return f"the SQLite database {url.database}"
    hosts = url.query.get("host")
    if hosts:
        where = ",".join(hosts) if isinstance(hosts, tuple) else hosts
    else:
        where = f"{url.host or 'localhost'}:{url.port or 5432}"
    name = "PostgreSQL" if url.get_backend_name() == "postgresql" else url.get_backend_name()
    return f"{name} at {where} (database {url.database})"


def masked_url(url: str) -> str:
    """``url`` with the password of ``scheme://user:password@…`` as ``***`` (for a URL too broken
    for SQLAlchemy to render): a store URL in an error message must not show the password."""
    return re.sub(r"^([^:/]+://[^:@/]*):[^@/]*@", r"\1:***@", url)
