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

**Engine:** a pre-ping (each connection taken from the pool is tested with a round trip
first, and a dead one, e.g. after PostgreSQL restarted or failed over, is replaced transparently,
so the store reconnects without a restart; done by :class:`Holds` on checkout rather than by
SQLAlchemy's ``pool_pre_ping``, which pings before any hook could follow the connection);
``pool_timeout=5`` (seconds to wait for a free pooled connection, instead of 30); ``pool_size``
:data:`POOL_SIZE` (12, instead of 5: no connection made and closed per call when busy).

What these do not bound: a server that is frozen (SIGSTOP, a paused VM) or a commit waiting on
synchronous replication on an orphaned primary (its Patroni dead, its PostgreSQL alive and still
read-write, its standbys gone to the new primary) still acknowledges TCP, so the call waits without
an error: ``statement_timeout`` does not fire while a commit waits on replication (docs/ha.md §1.4
s5/r5, and a cancel there would only turn the wait into a local commit with a WARNING). So the
client ends such a call itself, :class:`Holds`:

* **Aborting a stuck call.** Every connection checked out of the pool is recorded with the thread
  holding it. :meth:`Holds.abort_thread` (the API pool calls it when a call passes its 5 s
  deadline, :mod:`llmgw.control.store.offloop`) and the reaper of :meth:`Holds.start_reaper`
  (``server run`` starts it: any connection held longer than :data:`HOLD_MAX_S`, for the calls
  with no deadline, e.g. the leader's passes) shut the connection's socket down
  (``shutdown(SHUT_RDWR)`` on a duplicate of its descriptor): the blocked thread wakes at once with
  "server closed the connection", SQLAlchemy discards the connection, and the thread is free. No
  server round trip is needed, so it works on a frozen server too. The aborted call's outcome is
  unknown (its commit may have been recorded on the orphan, where Patroni's rewind discards it
  later; the API already answered 503), as for any timed-out commit.
* **Reconnecting to the new primary.** The host of an aborted connection is *demoted* for
  :data:`DEMOTE_S`: new connections list it last, several demoted hosts by the time of their last
  demotion (the ``do_connect`` hook reorders libpq's ``host``/``port`` lists), and pooled
  connections to it made before the demotion are dropped when
  taken from the pool. libpq still tries it last, so while it is the only writable member (before
  Patroni promotes another, ~20 s) the store keeps using it; once another member is promoted, the
  next connection goes there. Without this, ``target_session_attrs=read-write`` keeps picking the
  orphan (it is first in the list and still says read-write) and every write hangs again.

**Writers are not serialized in process:** PostgreSQL queues row locks itself without sleeping, so
:meth:`PostgresHooks.writer` holds nothing (SQLite's in-process lock is SQLite's alone).
Migrations take a transaction-level advisory lock (:data:`MIGRATION_LOCK`) so that two control
planes starting at once against one database apply each migration once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection

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

#: Connections the engine's pool keeps (SQLAlchemy's default is 5): as many as ``server run``'s threads
#: may hold at once (the API pool's 4 workers and 2 readers, :mod:`llmgw.control.store.offloop`; the
#: leader's 2; the usage sync, the guard API's and judge keeper's threads). Past the pool's size
#: SQLAlchemy opens an overflow connection and closes it at checkin, so a busy control plane forked
#: a PostgreSQL backend and ran a SCRAM handshake for every few requests: 35 sessions opened in 10 s
#: under 8 concurrent admin clients (869 requests) with 5, 5 (the pool filling) with 12 (2026-12-05).
POOL_SIZE = 12

#: The ``pg_advisory_xact_lock`` key migrations hold (an arbitrary constant: "llmgw" in ASCII).
MIGRATION_LOCK = 0x6C6C6D6777

#: Seconds a connection may stay checked out before the reaper aborts it (:meth:`Holds.start_reaper`):
#: every store method is one short transaction (a few ms); the server's own bounds end a stuck
#: statement at 5 s (``statement_timeout``) and an idle transaction at 10 s, so a hold past 15 s is
#: one they cannot end (a commit waiting on an orphan's standby, a frozen server).
HOLD_MAX_S = 15.0
#: Seconds a host whose call was aborted stays last in the host list for new connections.
DEMOTE_S = 120.0
#: Seconds between the reaper's looks.
REAP_EVERY_S = 0.5

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """A connection checked out of the pool: by which thread, since when (monotonic s), its socket."""

    conn: Any  # the psycopg connection
    fd: int
    host: tuple[str, str]
    thread: int
    since: float
    aborted: bool = False


class Holds:
    """The connections an engine's pool has handed out, so that a stuck call can be ended from
    another thread, and the hosts whose calls were ended (module docstring).

    Args:
        clock: monotonic seconds (injected for tests).
    """

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[int, _Held] = {}  # id(pool entry) -> what holds it
        self.demoted: dict[tuple[str, str], float] = {}  # (host, port) -> when (monotonic s)
        self.aborted = 0  # calls ended so far (tests, logs)
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.engine: Engine | None = None

    def attach(self, engine: Engine) -> None:
        """Follow ``engine``'s pool: connections made, checked out (and pinged: the engine's own
        ``pool_pre_ping`` runs before any checkout hook, where a ping that hangs could not be
        ended) and returned; reorder hosts."""
        self.engine = engine
        sa.event.listen(engine, "do_connect", self._order_hosts)
        sa.event.listen(engine, "connect", self._connected)
        sa.event.listen(engine, "checkout", self._checkout)
        for name in ("checkin", "invalidate", "soft_invalidate", "close", "detach"):
            sa.event.listen(engine, name, self._released)

    # -- pool events -------------------------------------------------------------------------------
    def _order_hosts(self, _dialect: Any, _rec: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        hosts = str(cparams.get("host") or "").split(",")
        if len(hosts) < 2:
            return
        ports = str(cparams.get("port") or "").split(",")
        ports = ports if len(ports) == len(hosts) else [ports[0]] * len(hosts)
        now = self._clock()
        with self._lock:
            late = {h: at for h, at in self.demoted.items() if now - at < DEMOTE_S}
        if not late:
            return
        # the hosts never demoted first (in the URL's order), then the demoted ones, the most
        # recently demoted last: right after a promotion the new primary's first commits may wait
        # for its standby too and get it demoted once, while the orphan is demoted again at every
        # call ended on it; by order of demotion the new primary still comes before the orphan
        pairs = sorted(zip(hosts, ports, strict=True), key=lambda hp: late.get((hp[0], hp[1] or "5432"), -1.0))
        cparams["host"] = ",".join(h for h, _ in pairs)
        if any(p for _, p in pairs):
            cparams["port"] = ",".join(p for _, p in pairs)

    def _connected(self, conn: Any, entry: ConnectionPoolEntry) -> None:
        entry.info["llmgw_made"] = self._clock()
        entry.info["llmgw_fresh"] = True  # no ping at its first checkout
        with contextlib.suppress(Exception):
            entry.info["llmgw_host"] = (str(conn.info.host), str(conn.info.port))

    def _checkout(self, conn: Any, entry: ConnectionPoolEntry, _proxy: PoolProxiedConnection) -> None:
        host = entry.info.get("llmgw_host")
        with self._lock:
            at = self.demoted.get(host) if host is not None else None
        if at is not None and entry.info.get("llmgw_made", 0.0) < at and self._clock() - at < DEMOTE_S:
            # made before its host's call was aborted: it may be on an orphaned primary (the pool
            # takes another, made now, through _order_hosts)
            raise sa.exc.DisconnectionError(f"{host} was demoted: a call on it was stuck")
        try:
            fd = int(conn.fileno())
        except Exception:
            return
        with self._lock:
            self._held[id(entry)] = _Held(conn, fd, host or ("?", "?"), threading.get_ident(), self._clock())
        if not entry.info.pop("llmgw_fresh", False) and self.engine is not None:
            try:  # the pre-ping, as SQLAlchemy's pool_pre_ping does it, but while it can be ended
                self.engine.dialect.do_ping(conn)
            except Exception as e:
                self._released(conn, entry)
                raise sa.exc.InvalidatePoolError(f"the pooled connection failed its ping: {e}") from e

    def _released(self, _conn: Any, entry: ConnectionPoolEntry, *_: Any) -> None:
        with self._lock:
            self._held.pop(id(entry), None)

    # -- ending stuck calls ------------------------------------------------------------------------
    def abort_thread(self, thread: int) -> int:
        """End the store calls ``thread`` is in (its connections' sockets shut down; module
        docstring); returns how many connections were shut down."""
        with self._lock:
            held = [h for h in self._held.values() if h.thread == thread]
            return sum(self._abort(h, "it passed its deadline") for h in held)

    def reap(self, hold_max_s: float = HOLD_MAX_S) -> int:
        """End every call holding a connection for longer than ``hold_max_s`` seconds; returns how many."""
        now = self._clock()
        with self._lock:
            return sum(
                self._abort(h, f"it held its connection for over {hold_max_s:g} s")
                for h in list(self._held.values()) if now - h.since > hold_max_s
            )

    def _abort(self, held: _Held, why: str) -> bool:
        """Shut ``held``'s socket down (under ``self._lock``: a released connection is never touched)."""
        if held.aborted:
            return False
        held.aborted = True
        self.demoted[held.host] = self._clock()
        try:
            if held.conn.pgconn.socket != held.fd:  # libpq dropped it already: the fd is not ours
                return False
            dup = os.dup(held.fd)
        except Exception:
            return False
        with socket.socket(fileno=dup) as sock, contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        self.aborted += 1
        log.warning(
            "ended a store call on %s:%s because %s (a commit waiting on a standby of an orphaned "
            "primary, or a frozen server); new connections try the other members first",
            held.host[0], held.host[1], why,
        )
        return True

    def start_reaper(self, hold_max_s: float = HOLD_MAX_S) -> None:
        """Run :meth:`reap` every :data:`REAP_EVERY_S` seconds in a daemon thread until :meth:`stop`."""
        if self._reaper is not None:
            return

        def loop() -> None:
            while not self._stop.wait(REAP_EVERY_S):
                self.reap(hold_max_s)

        self._reaper = threading.Thread(target=loop, daemon=True, name="llmgw-store-reaper")
        self._reaper.start()

    def stop(self) -> None:
        """Stop the reaper (if it runs)."""
        self._stop.set()


class PostgresHooks(DialectHooks):
    """PostgreSQL's hooks: libpq timeouts and keepalives, pool pre-ping, a migration lock, and the
    stuck-call ending of :class:`Holds`."""

    def __init__(self) -> None:
        self.holds = Holds()

    def configure(self, engine: Engine) -> None:
        """Follow the pool's connections (:class:`Holds`)."""
        self.holds.attach(engine)

    def abort_thread(self, thread: int) -> int:
        """:meth:`Holds.abort_thread`."""
        return self.holds.abort_thread(thread)

    def bound_holds(self, hold_max_s: float = HOLD_MAX_S) -> None:
        """:meth:`Holds.start_reaper`."""
        self.holds.start_reaper(hold_max_s)

    def close(self) -> None:
        """Stop the reaper."""
        self.holds.stop()

    def engine_options(self, url: sa.URL) -> tuple[sa.URL, dict[str, Any]]:
        """``url`` with psycopg as its driver and :data:`LIBPQ_DEFAULTS` / :data:`SERVER_SETTINGS`
        added where it sets none. The pre-ping is :class:`Holds`' (on checkout, where it can be ended),
        not the pool's."""
        return with_defaults(url), {"pool_timeout": POOL_TIMEOUT_S, "pool_size": POOL_SIZE}

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
