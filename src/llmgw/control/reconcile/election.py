"""Which control plane leads: a lease in the database's term row, an advisory lock for fast handover, or SQLite alone.

Several control planes share one PostgreSQL database (kept by Patroni); exactly one of them, the
**leader**, runs the reconcilers (:mod:`llmgw.control.reconcile.leader`, the judge keeper). The
algorithm is docs/ha.md §3.3, measured there (runs r7-r10: a new leader 0.24 s after ``kill -9`` of
the leading control plane, a leader on a frozen primary stopped acting 4.3 s after the freeze, one
on an orphaned primary 2.2 s after the promotion, never two leaders), with the **lease as the
truth**: the ``cp_leader`` row (``term``, ``holder``, ``renewed_at``) is the lease,
and a lease that stopped renewing is taken over whatever state the old holder's session is in.

1. **One dedicated connection** (:class:`PgElection`): psycopg's async connection, autocommit,
   never pooled, made from the store's own URL (multi-host, ``connect_timeout``:
   :mod:`llmgw.control.store.postgres`), with its own TCP keepalives on both ends
   (:data:`ELECTION_LIBPQ`, :data:`ELECTION_SERVER_SETTINGS`: a leader cut off by the network has
   its server session ended in about 4 s instead of PostgreSQL's default of hours) and an
   ``application_name`` that names it (:data:`APP_FOLLOWER`, then :data:`APP_LEADER` with the term
   once it leads), so the other control planes can find the term's session in ``pg_stat_activity``.
2. **Time is the database's**: ``since`` and ``renewed_at`` are written from the server's
   ``clock_timestamp()``, and followers judge the lease's age on that same clock (no skew between
   control planes). The lease has ended when ``renewed_at`` is more than ``lease_s`` old; a
   follower takes it over :data:`TAKEOVER_GRACE_S` later, when the old leader's watchdog (5.) has
   stopped it.
3. **Following**, every ``renew_s`` (and again just after the lease's end): read the lease, the
   session holding the advisory lock (``pg_locks``) and whether the term's session still exists;
   try the lock if nobody holds it (never while holding it: session locks stack). Then:

   a. *holding the lock*: take the term when the lease has ended, nobody ever led, the term was
      this control plane's own, or the term's session is gone (a killed leader: the fast path,
      no need to wait for the lease);
   b. *not holding it, the lease ended*: unless the lock is held by a session active within
      ``lease_s`` (it takes the lease itself, by a.), end the stale sessions
      (``pg_terminate_backend`` of the lock holder and of the term's session when idle for more
      than ``lease_s``: a frozen backend, a leader cut off) and take the term anyway. A frozen
      backend only dies when it runs again, and its lock with it; the lease does not wait for that.

   A term is taken by one compare-and-set write, ``UPDATE cp_leader SET term=term+1, holder=…
   WHERE id=1 AND term=<the term read> [AND the lease ended] RETURNING term``: of two followers
   only one matches, and on an orphaned primary the write hangs, so an orphan never makes a leader.
4. **Leading**, every ``renew_s``: ``SELECT pg_is_in_recovery()`` and a renewal that *writes*
   (``UPDATE cp_leader SET renewed_at=<server now> WHERE id=1 AND term=$t RETURNING term``), each
   under a client-side timeout (``op_timeout_s``, 2 s: ``statement_timeout`` did not fire while
   a commit waited on synchronous replication, nor on a frozen server). A leader that took the
   term by lease without the lock (a frozen old session still holds it) takes the lock when it
   is free. The lease's start is when the renewal was **sent** (``time.monotonic()`` before the
   call): the server wrote ``renewed_at`` after that, so the leader's own lease ends no later than
   the one followers judge.
5. **A watchdog** every :data:`WATCHDOG_S`: when the last successful renewal was sent more than
   ``lease_s`` ago the control plane stops acting at once, even while a call hangs.
6. **Any error**, recovery, or a renewal that matched no row (another term began): step down,
   close the connection in the background (a hung close must not hold the loop), and contend
   again on a new one after ``renew_s``.

Stepping down cancels the work started by :meth:`Election.while_leading` at once; its writes were
fenced anyway (:meth:`~llmgw.control.store.base.Store.fenced`: every reconciler write transaction
checks the term first), so a write already on its way from a stale leader is refused. A frozen
session's own statement, if it ever runs, is refused the same way: the term it renews is gone.

Ending another session needs the same database role (every control plane connects as one) or
``pg_signal_backend``; without it the stale session is logged and left, and the term is taken
anyway (the lease decides, the lock is only the fast path). What cannot be taken over: a session
frozen *inside* a write of the ``cp_leader`` row holds that row's lock until it runs again (a
renewal lasts milliseconds; nobody leads meanwhile, which is safe).

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
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import sqlalchemy as sa

from llmgw.control.store import Store
from llmgw.control.store.postgres import with_defaults

if TYPE_CHECKING:
    import psycopg  # imported where used: 80 ms of every control plane's start, SQLite ones too

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The session advisory lock's key (an arbitrary constant that fits in 32 bits, "lmLd" in ASCII,
#: so that ``pg_locks`` shows it as ``classid 0, objid KEY, objsubid 1``).
LOCK_KEY = 0x6C6D4C64

#: Seconds between two looks of the watchdog at the lease (docs/ha.md §3.3 step 4).
WATCHDOG_S = 0.1

#: The client-side timeout of every election statement (seconds; docs/ha.md §3.3 step 3).
OP_TIMEOUT_S = 2.0

#: Seconds a closing connection is given before it is abandoned.
CLOSE_TIMEOUT_S = 2.0

#: libpq parameters of the election connection, whatever the store's URL says (seconds; ms for
#: ``tcp_user_timeout``): the client notices a dead server or network in about 4 s.
ELECTION_LIBPQ: dict[str, str] = {
    "keepalives": "1",
    "keepalives_idle": "2",
    "keepalives_interval": "1",
    "keepalives_count": "2",
    "tcp_user_timeout": "4000",
}

#: The same on the server's side of the election connection (``-c`` settings any role may set):
#: a leader cut off by the network has its session, and so its lock, ended by the server about 4 s
#: after its last packet (PostgreSQL's default follows the kernel's: 2 hours of idle first).
ELECTION_SERVER_SETTINGS: dict[str, int] = {
    "tcp_keepalives_idle": 2,
    "tcp_keepalives_interval": 1,
    "tcp_keepalives_count": 2,
    "tcp_user_timeout": 4000,
}

#: ``application_name`` of a follower's election connection (followed by the control plane's name).
APP_FOLLOWER = "llmgw election "

#: ``application_name`` of the leader's election connection: this, the term, a space, the name
#: (PostgreSQL keeps the first 63 bytes: the term comes first so that it survives).
APP_LEADER = "llmgw leader term "

#: Seconds after the lease's end at which a follower looks again (its next look is planned then).
EXPIRY_SLACK_S = 0.05

#: Seconds a follower waits past the lease's end before taking it over: the old leader's watchdog
#: looks every :data:`WATCHDOG_S`, so it has stopped acting by then even on a busy event loop
#: (measured without it: the new term began up to 0.1 s before the old leader's watchdog fired).
TAKEOVER_GRACE_S = 0.5

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


def election_kwargs(url: str, name: str) -> dict[str, Any]:
    """:func:`connect_kwargs` for the election connection of control plane ``name``: the election's
    own keepalives on both ends (:data:`ELECTION_LIBPQ`, :data:`ELECTION_SERVER_SETTINGS`, which
    replace the URL's) and ``application_name`` :data:`APP_FOLLOWER` + ``name``.

    Example::

        >>> kw = election_kwargs("postgresql+psycopg://u@h:5432/db?keepalives_idle=60", "cp1")
        >>> kw["keepalives_idle"], kw["application_name"], "tcp_keepalives_idle=2" in kw["options"]
        ('2', 'llmgw election cp1', True)
    """
    kwargs = connect_kwargs(url)
    kwargs.update(ELECTION_LIBPQ)
    options = str(kwargs.get("options", ""))
    extra = [f"-c {k}={v}" for k, v in ELECTION_SERVER_SETTINGS.items()]
    kwargs["options"] = " ".join([options, *extra]).strip()  # a later -c wins over the URL's own
    kwargs["application_name"] = APP_FOLLOWER + name
    return kwargs


class PgElection(_Changes):
    """The PostgreSQL election (module docstring; docs/ha.md §3.3).

    Args:
        url: the store's SQLAlchemy URL (``postgresql+psycopg://…``).
        name: this control plane's name, recorded as the term's holder.
        lease_s: ``cluster.lease_s`` (5 s): the leader stops acting when its last successful
            renewal was sent longer ago than this, and followers take over a lease whose
            ``renewed_at`` is older than this (database clock).
        renew_s: ``cluster.renew_s`` (1 s): seconds between renewals, and between a follower's looks.
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
        self.kwargs = election_kwargs(url, name)
        self.lease_s = lease_s
        self.renew_s = renew_s
        self.op_timeout_s = op_timeout_s
        self.key = key
        self._last_ok = 0.0
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.last_error = ""
        self._terminate_error = ""
        #: What the last takeover by lease ended: the pids ``pg_terminate_backend`` was called on.
        self.terminated: list[int] = []

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
        import psycopg  # noqa: PLC0415 - see the module's imports

        self._conn = await asyncio.wait_for(
            psycopg.AsyncConnection.connect(autocommit=True, **self.kwargs), self.op_timeout_s * 3
        )
        self.last_error = ""
        while not stop.is_set():
            wait = await self._follow() if not self.leading else await self._renew()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)

    async def _op(self, sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        """One statement on the election connection under the client-side timeout; its first row."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("the election connection was closed (lease lapsed)")

        async def go() -> tuple[Any, ...] | None:
            cur = await conn.execute(sql, params)  # our constant statements
            return await cur.fetchone()

        # Not asyncio.wait_for: a cancelled psycopg call first asks the server to cancel and then
        # waits up to 5 s more for the statement to end (psycopg's AsyncConnection.wait), which a
        # frozen backend never does, so the 2 s timeout became ~7 s. Past the timeout the call is
        # cancelled, the connection closed under it, and neither is waited for.
        call = asyncio.ensure_future(go())
        done, _ = await asyncio.wait({call}, timeout=self.op_timeout_s)
        if call in done:
            return call.result()
        call.cancel()
        call.add_done_callback(_swallow)
        self._drop()
        raise TimeoutError(f"no answer from the database in {self.op_timeout_s:g} s (client-side timeout)")

    #: The advisory lock's row(s) in ``pg_locks``, in this database (locks are per database).
    _LOCK = (
        "locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND classid = %(hi)s AND objid = %(lo)s AND objsubid = 1 AND granted"
    )

    # Every statement below is built from these constant fragments; values go as parameters.
    _HELD = f"SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid() AND {_LOCK})"  # noqa: S608

    #: The server's clock in unix seconds (what ``since`` and ``renewed_at`` are written from).
    _NOW = "extract(epoch FROM clock_timestamp())::float8"

    #: Seconds since a session last changed state (started or ended a statement) on the server.
    _IDLE = "extract(epoch FROM clock_timestamp() - coalesce(s.state_change, s.backend_start))::float8"

    #: The term's session: the one that leads the term ``cp_leader`` names (``application_name``).
    _TERM_SESSION = (
        "s.datname = current_database() AND s.pid <> pg_backend_pid()"
        " AND s.application_name = left(%(leader_app)s::text || l.term || ' ' || l.holder, 63)"
    )

    #: The follower's look: term, holder, the lease's age, the lock holder (pid, idle seconds; NULL
    #: when free), whether the term's session exists.
    _LOOK = (
        f"SELECT l.term, l.holder, {_NOW} - l.renewed_at,"  # noqa: S608
        f" lk.pid, (SELECT {_IDLE} FROM pg_stat_activity s WHERE s.pid = lk.pid),"
        f" EXISTS (SELECT 1 FROM pg_stat_activity s WHERE {_TERM_SESSION})"
        f" FROM cp_leader l LEFT JOIN LATERAL (SELECT pid FROM pg_locks WHERE {_LOCK} LIMIT 1) lk ON true"
        " WHERE l.id = 1"
    )

    #: End the stale sessions: the lock holder and the term's session, when idle beyond the lease.
    _END_STALE = (
        "SELECT coalesce(array_agg(s.pid), '{}'), coalesce(bool_and(pg_terminate_backend(s.pid)), true)"  # noqa: S608
        " FROM pg_stat_activity s, cp_leader l"
        f" WHERE l.id = 1 AND s.datname = current_database() AND s.pid <> pg_backend_pid()"
        f" AND {_IDLE} > %(lease)s"
        f" AND (s.pid IN (SELECT pid FROM pg_locks WHERE {_LOCK}) OR ({_TERM_SESSION}))"
    )

    #: Take the term read (compare-and-set) and name this session after it, in one round trip.
    _TAKE = (
        "WITH t AS (UPDATE cp_leader SET term = term + 1, holder = %(me)s,"  # noqa: S608
        f" since = {_NOW}, renewed_at = {_NOW}"
        " WHERE id = 1 AND term = %(seen)s"
        f" AND (NOT %(ended_only)s OR renewed_at < {_NOW} - %(over)s) RETURNING term)"
        " SELECT term,"
        " set_config('application_name', left(%(leader_app)s::text || term || ' ' || %(me)s::text, 63), false)"
        " FROM t"
    )

    def _params(self, **more: Any) -> dict[str, Any]:
        return {
            "key": self.key, "hi": self.key >> 32, "lo": self.key & 0xFFFFFFFF, "lease": self.lease_s,
            "leader_app": APP_LEADER, "me": self.name, **more,
        }

    async def _follow(self) -> float:
        """Look at the lease and the lock; take the term when step 3 of the module docstring says so.
        Returns the seconds until the next look (sooner when the lease is about to end)."""
        look = await self._op(self._LOOK, self._params())
        if look is None:
            raise RuntimeError("the cp_leader row is missing; the store's migration 5 has not run")
        term, holder, age, lock_pid, lock_idle, term_session = look
        over = self.lease_s + TAKEOVER_GRACE_S  # the lease's age at which it counts as ended
        ended = float(age) > over
        mine = lock_pid is not None and lock_pid == self.backend_pid
        if lock_pid is None:
            got = await self._op("SELECT pg_try_advisory_lock(%(key)s)", self._params())
            mine = bool(got and got[0])
            if not mine:
                return self.renew_s  # a live session took the lock just now: it takes the term
        if mine:
            if ended or int(term) == 0 or not holder or holder == self.name or not term_session:
                await self._take(int(term), ended_only=False)
        elif ended and not (lock_pid is not None and lock_idle is not None and float(lock_idle) <= self.lease_s):
            await self._end_stale()
            await self._take(int(term), ended_only=True)
        if self.leading or ended:
            return self.renew_s
        return max(EXPIRY_SLACK_S, min(self.renew_s, over - float(age) + EXPIRY_SLACK_S))

    async def _end_stale(self) -> None:
        """``pg_terminate_backend`` the lock holder and the term's session where idle beyond the
        lease; a refusal (another role, no ``pg_signal_backend``) is logged once, not raised."""
        import psycopg  # noqa: PLC0415 - see the module's imports

        try:
            row = await self._op(self._END_STALE, self._params())
        except psycopg.errors.InsufficientPrivilege as e:
            if str(e) != self._terminate_error:
                log.warning("control plane %s: cannot end the stale leader's session (%s); taking the "
                            "lease anyway", self.name, e)
            self._terminate_error = str(e)
            return
        pids = [int(p) for p in (row[0] if row else [])]
        if pids:
            log.warning("control plane %s: the lease ended; ended the stale session(s) %s", self.name, pids)
        self.terminated = pids

    async def _take(self, seen: int, *, ended_only: bool) -> None:
        """Take term ``seen + 1`` if the row still says ``seen`` (and, with ``ended_only``, its lease
        ended); on success this control plane leads, its lease counted from the send."""
        sent = time.monotonic()
        row = await self._op(
            self._TAKE, self._params(seen=seen, ended_only=ended_only, over=self.lease_s + TAKEOVER_GRACE_S)
        )
        if row is None:
            return  # another control plane took it first, or the lease was renewed meanwhile
        self._last_ok = sent
        self._set(True, int(row[0]), "")

    async def _renew(self) -> float:
        """Still ours? Not a standby, and the term row written at our term; take the lock when free.
        Returns ``renew_s``."""
        row = await self._op(f"SELECT pg_is_in_recovery(), ({self._HELD})", self._params())
        if row is None or row[0]:
            raise RuntimeError("the database is a standby now (pg_is_in_recovery); a failover happened")
        if not row[1]:  # a term taken by lease while a frozen session held the lock: take it when free
            await self._op("SELECT pg_try_advisory_lock(%(key)s)", self._params())
        sent = time.monotonic()
        renewed = await self._op(
            f"UPDATE cp_leader SET renewed_at = {self._NOW} WHERE id = 1 AND term = %(term)s RETURNING term",  # noqa: S608
            self._params(term=self.term),
        )
        if renewed is None:
            raise RuntimeError(f"term {self.term} is no longer the database's term")
        if self.leading:
            self._last_ok = sent
        return self.renew_s

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


def _swallow(task: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned call's outcome (its connection was closed under it), so that asyncio
    does not log "exception was never retrieved"."""
    if not task.cancelled():
        task.exception()


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
