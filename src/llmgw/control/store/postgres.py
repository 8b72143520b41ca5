"""PostgreSQL's part of the store: driver timeouts, keepalives, pre-ping, and one migrator at a time.

The tables, migrations and queries are the same as SQLite's (:mod:`llmgw.control.store.schema`,
:mod:`llmgw.control.store.sql`); this module only sets how the engine talks to the server.

URLs are SQLAlchemy's ``postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB`` (plain ``postgresql://``
is read as psycopg 3, the driver the ``postgres`` extra installs). Query parameters go to libpq
unchanged, so libpq multi-host works as SQLAlchemy documents it (“Specifying multiple fallback
hosts”)::

    postgresql+psycopg://llmgw:PW@/llmgw?host=10.0.0.1:5432&host=10.0.0.2:5432&target_session_attrs=read-write

psycopg tries the hosts in order, ``connect_timeout`` each, and keeps the first that accepts
writes, so after a failover (Patroni) the next connection finds the new primary.

**Defaults, each overridable in the URL's query** (:data:`LIBPQ_DEFAULTS`; a parameter already in
the URL wins):

* ``connect_timeout=2`` (seconds, per host): a host that does not answer costs 2 s, not the
  kernel's SYN retries (about 2 minutes).
* ``options=-c statement_timeout=5000 -c lock_timeout=5000 -c idle_in_transaction_session_timeout=10000``
  (milliseconds): every store method is one short transaction (a few ms), so a statement still
  running after 5 s is stuck (a lock held by a dead session, a runaway plan) and fails instead of
  holding a store thread; a session that leaves a transaction open for 10 s (a control plane frozen
  mid-call) is ended by the server, which frees its row locks. A URL whose ``options`` already sets
  ``statement_timeout`` keeps its own.
* TCP keepalives ``keepalives_idle=5, keepalives_interval=1, keepalives_count=3`` (seconds): an idle
  pooled connection to a host that vanished is found dead in about 8 s instead of the OS default
  of two hours; ``tcp_user_timeout=5000`` (ms): a request the server's kernel does not acknowledge
  within 5 s (host down, network cut) fails the call instead of hanging in retransmits.

**Engine:** ``pool_pre_ping=True`` (each connection taken from the pool is tested with a round trip
first, and a dead one, e.g. after PostgreSQL restarted or failed over, is replaced transparently,
so the store reconnects without a restart); ``pool_timeout=5`` (seconds to wait for a free pooled
connection, instead of 30).

What these do not bound: a server that is frozen (SIGSTOP, a paused VM) or a commit waiting on
synchronous replication on an orphaned primary still acknowledges TCP, so the call waits without
an error (``statement_timeout`` does not fire while a commit waits on replication). Callers that
must act within a deadline (leadership, health) decide from their own monotonic clocks, not from
the call returning.

**Writers are not serialized in process:** PostgreSQL queues row locks itself without sleeping, so
:meth:`PostgresHooks.writer` holds nothing (SQLite's in-process lock is SQLite's alone).
Migrations take a transaction-level advisory lock (:data:`MIGRATION_LOCK`) so that two control
planes starting at once against one database apply each migration once.
"""

from __future__ import annotations

import contextlib
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from llmgw.control.store.dialect import DialectHooks

#: libpq connection parameters set when the URL does not set them (units in the module docstring).
LIBPQ_DEFAULTS: dict[str, str] = {
    "connect_timeout": "2",
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "1",
    "keepalives_count": "3",
    "tcp_user_timeout": "5000",
}

#: Server settings sent with every connection (``options=-c …``), milliseconds.
SERVER_SETTINGS: dict[str, int] = {
    "statement_timeout": 5000,
    "lock_timeout": 5000,
    "idle_in_transaction_session_timeout": 10000,
}

#: Seconds to wait for a free connection from the engine's pool.
POOL_TIMEOUT_S = 5

#: The ``pg_advisory_xact_lock`` key migrations hold (an arbitrary constant: "llmgw" in ASCII).
MIGRATION_LOCK = 0x6C6C6D6777


class PostgresHooks(DialectHooks):
    """PostgreSQL's hooks: libpq timeouts and keepalives, pool pre-ping, a migration lock."""

    def engine_options(self, url: sa.URL) -> tuple[sa.URL, dict[str, Any]]:
        """``url`` with psycopg as its driver and :data:`LIBPQ_DEFAULTS` / :data:`SERVER_SETTINGS`
        added where it sets none, and pre-ping on."""
        return with_defaults(url), {"pool_pre_ping": True, "pool_timeout": POOL_TIMEOUT_S}

    def writer(self) -> contextlib.AbstractContextManager[object]:
        """Nothing: the server queues writers on row locks without sleeping."""
        return contextlib.nullcontext()

    def lock_migrations(self, conn: Connection) -> None:
        """Wait for any other process migrating this database (the lock goes at commit)."""
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})


def with_defaults(url: sa.URL) -> sa.URL:
    """``url`` with driver psycopg (for a bare ``postgresql://``) and every default it lacks.

    Example::

        >>> with_defaults(sa.make_url("postgresql://u@h/db?connect_timeout=9")).query["connect_timeout"]
        '9'
    """
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    query = dict(url.query)
    for key, value in LIBPQ_DEFAULTS.items():
        query.setdefault(key, value)
    options = query.get("options", "")
    if isinstance(options, tuple):  # given more than once: libpq would take one; keep them all
        options = " ".join(options)
    extra = [f"-c {name}={ms}" for name, ms in SERVER_SETTINGS.items() if name not in options]
    query["options"] = " ".join([options, *extra]).strip() if extra else options
    return url.set(query=query)
