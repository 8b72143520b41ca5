"""Which control plane leads: a PostgreSQL session advisory lock plus a fenced term, or SQLite alone.

Several control planes share one PostgreSQL database (kept by Patroni); exactly one of them, the
**leader**, runs the reconcilers (:mod:`llmgw.control.reconcile.leader`, the judge keeper). The
algorithm is ha.md §3.3, measured there (runs r7-r10: a new leader 0.24 s after ``kill -9`` of
the leading control plane, a leader on a frozen primary stopped acting 4.3 s after the freeze, one
on an orphaned primary 2.2 s after the promotion, never two leaders):

1. **One dedicated connection** (:class:`PgElection`): psycopg's async connection, autocommit,
   never pooled (a pooled connection given back still holding the lock, or a transaction-level
   lock, gives no mutual exclusion), made from the store's own URL (multi-host, keepalives,
   ``connect_timeout``: :mod:`llmgw.control.store.postgres`).
2. **Following**, every ``renew_s``: if ``pg_locks`` shows this session holds the lock, take the
   term; else ``pg_try_advisory_lock(K)`` (never called while the lock is held: session locks
   stack). On success the term is taken by a durable write,
   ``UPDATE cp_leader SET term=term+1, holder=… WHERE id=1 RETURNING term``: on an orphaned
   primary that write hangs, so an orphan never makes a leader.
3. **Leading**, every ``renew_s``: ``SELECT pg_is_in_recovery(), <lock held>`` and a renewal that
   *writes* (``UPDATE cp_leader SET renewed_at=… WHERE id=1 AND term=$t RETURNING term``), each
   under a client-side timeout (``op_timeout_s``, 2 s: ``statement_timeout`` did not fire while
   a commit waited on synchronous replication, nor on a frozen server). A success sets the lease's
   start (``time.monotonic()``).
4. **A watchdog** every :data:`WATCHDOG_S`: when the last successful renewal is older than
   ``lease_s`` the control plane stops acting at once, even while a call hangs.
5. **Any error**, a missing lock, recovery, or a renewal that matched no row: step down, close the
   connection in the background (a hung close must not hold the loop), and contend again on a
   new one after ``renew_s``.

Stepping down cancels the work started by :meth:`Election.while_leading` at once; its writes were
fenced anyway (:meth:`~llmgw.control.store.base.Store.fenced`: every reconciler write transaction
checks the term first), so a write already on its way from a stale leader is refused.

With SQLite (:class:`SoloElection`) the one process that owns the file leads: it takes a new term
once at start and never steps down.

What it does not guarantee: side effects outside the database (commands to agents) are fenced
by the agents, which keep the highest term they have seen (``HeartbeatReply.term``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

import psycopg
import sqlalchemy as sa

from llmgw.control.store import Store
from llmgw.control.store.postgres import with_defaults

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The session advisory lock's key (an arbitrary constant that fits in 32 bits, "lmLd" in ASCII,
#: so that ``pg_locks`` shows it as ``classid 0, objid KEY, objsubid 1``).
LOCK_KEY = 0x6C6D4C64

#: Seconds between two looks of the watchdog at the lease (ha.md §3.3 step 4).
WATCHDOG_S = 0.1

#: The client-side timeout of every election statement (seconds; ha.md §3.3 step 3).
OP_TIMEOUT_S = 2.0

#: Seconds a closing connection is given before it is abandoned.
CLOSE_TIMEOUT_S = 2.0

Work = Callable[[int, asyncio.Event], Coroutine[Any, Any, None]]


class Election(Protocol):
    """What the control plane reads of an election: whether it leads, the term, and when that changes."""

    @property
    def leading(self) -> bool:
        """True while this control plane leads (its lease is fresh)."""

    @property
    def term(self) -> int:
        """The term this control plane was granted when it last became leader (0: never led)."""

    async def run(self, stop: asyncio.Event) -> None:
        """Contend (and lead) until ``stop`` is set, then give leadership up."""

    async def changed(self) -> None:
        """Return at the next change of :attr:`leading`."""


class _Changes:
    """Leading/term state with an event that fires on every change."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._leading = False
        self._term = 0
        self._event = asyncio.Event()

    @property
    def leading(self) -> bool:
        return self._leading

    @property
    def term(self) -> int:
        return self._term

    def _set(self, leading: bool, term: int, why: str) -> None:
        if leading == self._leading and term == self._term:
            return
        was = self._leading
        self._leading, self._term = leading, term
        if leading:
            log.info("control plane %s leads (term %d)", self.name, term)
        elif was:
            log.warning("control plane %s stopped leading (term %d): %s", self.name, term, why)
        self._event.set()
        self._event = asyncio.Event()

    async def changed(self) -> None:
        await self._event.wait()


class SoloElection(_Changes):
    """SQLite: this process leads from its start to its end, with a new term taken once at start
    (:meth:`~llmgw.control.store.base.Store.take_term`).

    Args:
        store: the store (SQLite: one control plane per file).
        name: this control plane's name (``cluster.name``).
        run_off: runs a blocking call off the loop (the control plane's ``OffLoop.run``).
    """

    def __init__(self, store: Store, name: str, run_off: Callable[..., Awaitable[Any]]) -> None:
        super().__init__(name)
        self.store = store
        self.run_off = run_off

    async def run(self, stop: asyncio.Event) -> None:
        """Take a term, lead until ``stop`` is set."""
        term = await self.run_off(lambda: self.store.take_term(self.name, now=time.time()))
        self._set(True, int(term), "")
        await stop.wait()
        self._set(False, int(term), "shutting down")


def connect_kwargs(url: str) -> dict[str, Any]:
    """libpq keyword arguments for psycopg from the store's SQLAlchemy URL, with the store's
    defaults (timeouts, keepalives, multi-host: :func:`~llmgw.control.store.postgres.with_defaults`).

    Example::

        >>> connect_kwargs("postgresql+psycopg://u@h:5432/db")["connect_timeout"]
        '2'
    """
    sa_url = with_defaults(sa.make_url(url))
    _, kwargs = sa_url.get_dialect()().create_connect_args(sa_url)
    return dict(kwargs)


class PgElection(_Changes):
    """The PostgreSQL election (module docstring; ha.md §3.3).

    Args:
        url: the store's SQLAlchemy URL (``postgresql+psycopg://…``).
        name: this control plane's name, recorded as the term's holder.
        lease_s: ``cluster.lease_s`` (5 s): the leader stops acting when its last successful
            renewal is older than this.
        renew_s: ``cluster.renew_s`` (1 s): seconds between renewals, and between tries to lead.
        op_timeout_s: the client-side timeout of each statement (:data:`OP_TIMEOUT_S`); keep it
            below ``lease_s``.
        key: the advisory lock's key (:data:`LOCK_KEY`; tests sharing one database use others).

    Raises:
        ValueError: ``op_timeout_s`` is not below ``lease_s``, or ``key`` is negative.
    """

    def __init__(
        self,
        url: str,
        name: str,
        *,
        lease_s: float = 5.0,
        renew_s: float = 1.0,
        op_timeout_s: float = OP_TIMEOUT_S,
        key: int = LOCK_KEY,
    ) -> None:
        super().__init__(name)
        if op_timeout_s >= lease_s:
            raise ValueError(f"op_timeout_s ({op_timeout_s} s) must be below lease_s ({lease_s} s)")
        if key < 0:
            raise ValueError(f"the lock key must be >= 0, not {key}")
        self.kwargs = connect_kwargs(url)
        self.lease_s = lease_s
        self.renew_s = renew_s
        self.op_timeout_s = op_timeout_s
        self.key = key
        self._last_ok = 0.0
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.last_error = ""

    @property
    def backend_pid(self) -> int | None:
        """The server process of the election connection (tests terminate it), None when closed."""
        conn = self._conn
        return conn.info.backend_pid if conn is not None and not conn.closed else None

    async def run(self, stop: asyncio.Event) -> None:
        """Contend and lead until ``stop`` is set; then step down and close the connection (which
        releases the lock). Errors are logged once per change and never end the loop."""
        watchdog = asyncio.create_task(self._watchdog(stop))
        try:
            while not stop.is_set():
                try:
                    await self._session(stop)
                except Exception as e:  # any failure: step down, drop the connection, contend again
                    why = f"{e.__class__.__name__}: {e}".strip()
                    if why != self.last_error:
                        log.warning("control plane %s: election connection failed (%s); contending again",
                                    self.name, why)
                    self.last_error = why
                    self._set(False, self.term, why)
                self._drop()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.renew_s)
        finally:
            watchdog.cancel()
            self._set(False, self.term, "shutting down")
            self._drop()
            if self._closing:
                await asyncio.wait(self._closing, timeout=CLOSE_TIMEOUT_S)

    async def _session(self, stop: asyncio.Event) -> None:
        """One connection's life: follow, lead, renew, until an error or ``stop``."""
        self._conn = await asyncio.wait_for(
            psycopg.AsyncConnection.connect(autocommit=True, **self.kwargs), self.op_timeout_s * 3
        )
        self.last_error = ""
        while not stop.is_set():
            if not self.leading:
                await self._follow()
            else:
                await self._renew()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.renew_s)

    async def _op(self, sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        """One statement on the election connection under the client-side timeout; its first row."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("the election connection was closed (lease lapsed)")

        async def go() -> tuple[Any, ...] | None:
            cur = await conn.execute(sql, params)  # our constant statements
            return await cur.fetchone()

        return await asyncio.wait_for(go(), self.op_timeout_s)

    _HELD = (
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        " AND classid = %(hi)s AND objid = %(lo)s AND objsubid = 1 AND granted)"
    )

    def _key_params(self) -> dict[str, Any]:
        return {"key": self.key, "hi": self.key >> 32, "lo": self.key & 0xFFFFFFFF}

    async def _follow(self) -> None:
        """Try to lead: hold the lock (checked in pg_locks first: never lock twice), then take a term."""
        held = await self._op(self._HELD, self._key_params())
        if not (held and held[0]):
            got = await self._op("SELECT pg_try_advisory_lock(%(key)s)", self._key_params())
            if not (got and got[0]):
                return
        row = await self._op(
            "UPDATE cp_leader SET term = term + 1, holder = %(me)s, since = %(now)s, renewed_at = %(now)s"
            " WHERE id = 1 RETURNING term",
            {"me": self.name, "now": time.time()},
        )
        if row is None:
            raise RuntimeError("the cp_leader row is missing; the store's migration 5 has not run")
        self._last_ok = time.monotonic()
        self._set(True, int(row[0]), "")

    async def _renew(self) -> None:
        """Still ours? Not a standby, lock held, and the term row written at our term."""
        row = await self._op(
            f"SELECT pg_is_in_recovery(), ({self._HELD})", self._key_params()
        )
        if row is None or row[0]:
            raise RuntimeError("the database is a standby now (pg_is_in_recovery); a failover happened")
        if not row[1]:
            raise RuntimeError("the advisory lock is no longer held by this session")
        renewed = await self._op(
            "UPDATE cp_leader SET renewed_at = %(now)s WHERE id = 1 AND term = %(term)s RETURNING term",
            {"now": time.time(), "term": self.term},
        )
        if renewed is None:
            raise RuntimeError(f"term {self.term} is no longer the database's term")
        if self.leading:
            self._last_ok = time.monotonic()

    async def _watchdog(self, stop: asyncio.Event) -> None:
        """Stop acting when the lease lapsed, even while a call hangs; the session then reconnects."""
        while not stop.is_set():
            await asyncio.sleep(WATCHDOG_S)
            if self.leading and time.monotonic() - self._last_ok > self.lease_s:
                self._set(False, self.term, f"no successful renewal for {self.lease_s:g} s (lease lapsed)")
                self._drop()

    def _drop(self) -> None:
        """Close the election connection in the background (which releases the lock server-side)."""
        conn, self._conn = self._conn, None
        if conn is None or conn.closed:
            return

        async def close() -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), CLOSE_TIMEOUT_S)

        task = asyncio.create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


async def while_leading(election: Election, work: Work, stop: asyncio.Event) -> None:
    """Run ``work(term, ended)`` each time ``election`` leads, until ``stop`` is set; on step-down
    ``ended`` is set and the work is cancelled at once (a stale leader stops acting).

    ``work`` should end when ``ended`` is set (it is cancelled anyway); its own failure is logged
    and it is started again at the next term.
    """
    while not stop.is_set():
        if not election.leading:
            await _first(election.changed(), stop.wait())
            continue
        term = election.term
        ended = asyncio.Event()
        task = asyncio.create_task(work(term, ended))
        while election.leading and election.term == term and not stop.is_set() and not task.done():
            await _first(election.changed(), stop.wait(), task)
        ended.set()
        if not task.done():
            task.cancel()
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            log.error("the leader's work failed in term %d", term, exc_info=task.exception())
        if election.leading and election.term == term and not stop.is_set():
            await _first(election.changed(), stop.wait())  # ended on its own: wait for the next change


async def _first(*waits: Awaitable[Any]) -> None:
    """Wait until the first of ``waits`` finishes; cancel the rest (not an asyncio.Task given)."""
    tasks = [w if isinstance(w, asyncio.Future) else asyncio.ensure_future(w) for w in waits]
    owned = [t for t, w in zip(tasks, waits, strict=True) if t is not w]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in owned:
            t.cancel()
