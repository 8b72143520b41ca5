"""The control plane's state store: one interface, SQL backends, and calls kept off the event loop.

Import from here::

    from llmgw.control.store import ModelRow, Store, default_url, open_store

    store = open_store(default_url(config.store.url, paths.database))

The package, by module:

* :mod:`~llmgw.control.store.base` -- :class:`Store`, the interface (its docstrings are the
  contract: optimistic concurrency by revision, uniqueness by database constraint, one bad row
  never hides the others); the errors it raises are in :mod:`llmgw.errors`
  (:class:`~llmgw.errors.Conflict`, :class:`~llmgw.errors.Revoked`, :class:`~llmgw.errors.StoreError`);
* :mod:`~llmgw.control.store.rows` -- the storage shapes (:class:`ModelRow`, :class:`NodeRow`,
  :class:`ReplicaRow`, :class:`BrokenModel`, :class:`ReportResult`);
* :mod:`~llmgw.control.store.schema` -- the tables and the ordered migrations, dialect-neutral;
* :mod:`~llmgw.control.store.sql` -- :class:`SqlStore`, the SQLAlchemy Core backend, with
  :mod:`~llmgw.control.store.codec` (rows to columns and back);
* :mod:`~llmgw.control.store.dialect`, :mod:`~llmgw.control.store.sqlite` and
  :mod:`~llmgw.control.store.postgres` -- what a database needs besides the shared SQL (SQLite: a
  private file, WAL pragmas, an in-process writer lock; PostgreSQL: libpq timeouts and keepalives,
  pool pre-ping, a migration lock), over the same schema and migrations;
* :mod:`~llmgw.control.store.offloop` -- how the asyncio control plane calls the synchronous store.

**Off the event loop, by a bounded thread pool.** Store calls block; the control plane's one
asyncio loop serves heartbeats, the admin API and the gateway, so every call goes through
``await db.run(store.method, ...)`` (:class:`~llmgw.control.store.offloop.OffLoop`, 4 threads).
SQLAlchemy's asyncio API was measured against it (``bench/store_offloop.py``: 2,000
heartbeat-shaped calls, 8 in flight, SQLite WAL, 200 nodes, 2 cores at load 7-9, three runs):

====================  ===============  ===============  ===============
variant               throughput       loop lag p50     loop lag p99
====================  ===============  ===============  ===============
thread pool (chosen)  374-451 ops/s    2.4-2.9 ms       17-23 ms
asyncio + aiosqlite   114-142 ops/s    1.5-2.5 ms       11-14 ms
====================  ===============  ===============  ===============

The pool does three times the work per second for about the same loop lag per second, moves the
whole call (query and row parsing) off the loop with one ``await``, and keeps one synchronous
interface instead of an async twin of every method. With it (and the batching and coalescing
beside it), heartbeat latency with 200 agents while 50 models were added went from 113 ms p50 /
274 ms p99 to 4-7 ms / 27-39 ms at the same machine load (``bench/heartbeats.py``); the whole
measurement and its steps are in :mod:`~llmgw.control.store.offloop`'s docstring.
"""

from __future__ import annotations

from pathlib import Path

from llmgw.control.store.base import Store
from llmgw.control.store.offloop import STORE_DEADLINE_S, OffLoop
from llmgw.control.store.postgres import HOLD_MAX_S
from llmgw.control.store.rows import BrokenModel, ModelRow, NodeRow, ReplicaRow, ReportResult
from llmgw.control.store.sql import SqlStore

__all__ = [
    "BrokenModel",
    "ModelRow",
    "NodeRow",
    "ReplicaRow",
    "ReportResult",
    "SqlStore",
    "Store",
    "api_pool",
    "default_url",
    "open_store",
]


def default_url(store_url: str, database: Path) -> str:
    """``store_url`` when set, else the SQLite file ``database`` (``paths.database``)."""
    return store_url or f"sqlite:///{database}"


def open_store(url: str) -> Store:
    """The store at ``url`` (a SQLAlchemy URL: ``sqlite:///PATH``, ``postgresql+psycopg://…``),
    migrated to the current schema.

    Raises:
        StoreError: ``url`` is not a database URL, or the database cannot be opened or migrated.
    """
    return SqlStore.open(url)


def api_pool(store: Store) -> OffLoop:
    """The off-loop pool the APIs and the routing table call ``store`` through: a call past
    :data:`~llmgw.control.store.offloop.STORE_DEADLINE_S` is ended (its connection shut down) and
    answered 503, and on a :class:`SqlStore` any call holding a connection past
    :data:`~llmgw.control.store.postgres.HOLD_MAX_S` is (the leader's, which have no deadline). The
    control plane and its agent API process (``cluster.agent_api_process``) each make one."""
    sql = store if isinstance(store, SqlStore) else None
    pool = OffLoop(deadline_s=STORE_DEADLINE_S, database=sql.where if sql else "the database",
                   abort=sql.abort_thread if sql else None)
    if sql is not None:
        sql.bound_holds(HOLD_MAX_S)
    return pool
