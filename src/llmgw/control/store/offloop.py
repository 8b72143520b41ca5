"""Store and reconcile work off the event loop: a bounded thread pool and a coalescing runner.

The control plane serves heartbeats, the admin API and the gateway on one asyncio loop. Every
store call (SQLAlchemy Core over SQLite or PostgreSQL) blocks the thread that makes it, and the
reconcile work around it (placement over all nodes, explanations, parsing catalog rows) is plain
CPU. Done on the loop, each stalls every connection the loop serves: measured, 2.0 s p50 /
3.1 s p99 heartbeat latency with 200 agents while 50 models were added (``bench/heartbeats.py``).

Three pieces, used the same way everywhere:

* :class:`OffLoop` -- ``await db.run(store.method, *args, **kwargs)`` runs the call on a bounded
  pool of threads (:data:`WORKERS`) and gives its result (or raises its exception) on the loop.
  Call sites stay one line and keep the store's method names, so the store stays synchronous
  and testable without a loop.
* :class:`Batcher` -- ``await beats.submit(item)``: items that arrive while a batch is being
  written make the next batch, written in one call (one SQLite write transaction for all the
  heartbeats that arrived meanwhile).
* :class:`Coalescer` -- ``refresh.request()`` (cheap, from the loop) asks for a job (a routing
  table rebuild) to run; requests that arrive while it runs collapse into one more run. A burst of
  100 heartbeats or 50 model adds costs two rebuilds, not 100.

Why a thread pool and not SQLAlchemy's asyncio API, by measurement (``bench/store_offloop.py``:
2,000 heartbeat-shaped calls -- read and parse a node row, write the heartbeat, read it back -- 8
in flight, SQLite WAL, 200 nodes, on the 2-core development machine at load 7-9, three runs):

===================  ===============  ===================  ===================
variant              throughput       loop lag p50         loop lag p99
===================  ===============  ===================  ===================
thread pool (this)   374-451 ops/s    2.4-2.9 ms           17-23 ms
asyncio + aiosqlite  114-142 ops/s    1.5-2.5 ms           11-14 ms
===================  ===============  ===================  ===================

* The asyncio API does a third of the work per second for about the same loop lag per second: its
  lag per call is higher. aiosqlite still runs each statement on a thread (one per connection)
  and SQLAlchemy's async layer adds a greenlet switch per statement; the CPU-heavy part of our
  calls (pydantic rows from JSON columns, placement, explanations) stays on the loop; and each of
  the store's ~30 methods would need an async twin while the leader and tools use the sync ones.
* A thread pool moves the whole call (query, row parsing, placement) off the loop with one
  ``await``, and the store stays one synchronous class. The GIL makes the threads share a core
  with the loop (a leader pass may hold the loop off for CPython's switch interval, 5 ms, at
  each of a heartbeat's hand-offs between the loop and a store thread: four since a heartbeat is
  one read and one write, :mod:`llmgw.control.api.agent`), and most of a store call waits on
  SQLite with the GIL released.

What it bought, ``bench/heartbeats.py`` (200 agents over mTLS to a real ``llmgw server run``, 50
models added through the admin API, 100 replicas placed and reported ready; same machine, whose
load from other work the figures follow, so both sides are given at similar load):

* before (store calls, a routing rebuild after every heartbeat and leader passes on the loop;
  py-spy: 95 % of the process's samples on the loop thread, 43 % rebuilding the routing table
  for every heartbeat, 12 % reading the whole catalog for every reply, 14 % leader passes):
  during the burst heartbeat p50 113 ms / p99 274 ms at load 3 (server 0.90 cores), 1,301 /
  2,477 ms at load 5 (an admin add 354 ms p50), 2,825 / 5,042 ms at load 8; after it 24 ms /
  263 ms (load 3) and 1,212 ms p50 (load 5);
* after: during the burst p50 4-7 ms / p99 27-39 ms at load 3-4 (server 0.42 cores), p99
  108-253 ms in earlier runs at load 5-7 before the last two steps below; after it 5-6 / 23-38 ms.
  The idle phase of the same runs (no models at all) had p99 18-43 ms: the rest is the machine.

The steps, in the order they were measured: store calls off the loop and routing rebuilds
coalesced (p99 2.5 s -> 0.34-0.46 s at load 5); writers queued on an in-process lock instead of
SQLite's busy handler and explanations written only when they change; heartbeats written in
batches; GIL switch interval 1 ms, then 0.2 ms; the leader woken by new or returning nodes only,
not by every replica report, and at most once a second (``leader.MIN_GAP_S``).

The switch interval went back to CPython's default (5 ms) once a heartbeat was one read and one
write instead of five trips (about a dozen hand-offs) with a routing rebuild awaited before the
reply: measured then with ``bench/heartbeats.py`` (200 agents, 50 models; the 2-core machine at
load 4-5 from other work), no gain either way (the machine's load dominated both). It is
:data:`SWITCH_INTERVAL_S` again since ``bench/scale.py`` measured 5,000 nodes on a quiet machine
(load 1.2-2, 2026-12-04, 200 model adds): burst heartbeat p99 130 and 240 ms with 5 ms, 81, 180
and 97 ms with 1 ms (the spread between runs of one setting is as large as the gain). There a
leader pass over 5,000 nodes runs for tenths of a second on a worker thread, and each of a
heartbeat's hand-offs (the loop, a store thread, SQLite releasing the GIL around each step) waits
out the interval behind it.

SQLite serializes writers; the pool is small (:data:`WORKERS`) so few transactions contend, and
writers queue on the store's in-process lock (:mod:`llmgw.control.store.sqlite`), not in SQLite's
sleeping busy handler. Work that is long (a leader pass) takes one worker while the others keep
serving heartbeats.

**A deadline on every call** (``deadline_s``; the control plane's API pool uses
:data:`STORE_DEADLINE_S`): a call that has not answered by then raises
:class:`~llmgw.errors.StoreUnavailable` naming the database and what to check (the APIs answer 503
``store_unavailable``), and one the driver refuses (connection refused, a pool with no free
connection) raises it at once. The call itself cannot be interrupted in its thread: it keeps the
thread until the driver gives up (PostgreSQL: ``statement_timeout``, ``tcp_user_timeout`` and
``connect_timeout``, 2-5 s, :mod:`llmgw.control.store.postgres`), unless it is ended: with
``abort`` (the control plane passes :meth:`~llmgw.control.store.sql.SqlStore.abort_thread`), a call
past its deadline has its connection shut down at once, so a commit that would wait forever (an
orphaned primary's sync wait, a frozen server) frees its thread within milliseconds instead of
never. While every thread holds such an overdue call, new calls fail at once instead of queueing
behind them, so a hung database costs each request at most the deadline, never a pile-up.

**Reads on threads of their own** (:meth:`OffLoop.read`, :data:`READERS` threads): the calls that
only read (the admin API's lists and gets, the gateway's key reads) never queue behind writes that
are stuck, and a read answers from whichever member the pool reaches (an orphaned primary answers
reads; only its commits hang).

What it does not guarantee: a cancelled ``await`` does not stop the call in its thread (it runs to
the end of its own transaction, which is why every store method is one short transaction); the
order of two calls made concurrently is not defined (the store's revisions decide races, as
before).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, ParamSpec, TypeVar

import sqlalchemy as sa

from llmgw.errors import StoreUnavailable

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")
ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")

#: Threads for store calls. Four: one for a long leader pass, one for a routing rebuild, two for
#: heartbeats and admin calls; more only adds writers contending for SQLite's single write lock.
WORKERS = 4

#: Seconds a thread holds the GIL while another waits for it (``sys.setswitchinterval``) in the
#: control plane: 1 ms, not CPython's 5, so that a heartbeat's hand-offs do not each wait 5 ms behind
#: a leader pass (module docstring: burst p99 81-180 ms, median 97, against 130-240 ms).
SWITCH_INTERVAL_S = 0.001

#: Threads for :meth:`OffLoop.read` (besides :data:`WORKERS`): two, so one slow read leaves one.
READERS = 2

#: Seconds an API's store call may take before it answers 503 ``store_unavailable``. Every store
#: method is one short transaction (a few ms); a PostgreSQL failover makes writes wait ~20 s
#: (docs/ha.md §1.4: Patroni's floor), during which an API answering 503 after 5 s lets its client
#: retry instead of holding its request.
STORE_DEADLINE_S = 5.0

#: Seconds between routing refreshes that only heartbeats asked for (:class:`Coalescer`'s
#: ``min_gap_s``; an admin write's runs at once). While replicas start in a burst every ready report
#: asks for one: back to back they took a quarter of the control plane's GIL time (py-spy, 500
#: simulated nodes, 200 model adds) while heartbeats waited for it. The gateway still routes to a
#: replica once its ready report was answered (it waits for the refresh in flight when a model has
#: no ready replica).
ROUTES_MIN_GAP_S = 0.25

#: The driver's errors that mean "the database cannot be reached", not "this call is wrong".
UNREACHABLE = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError)


_CHECK = (
    "check that the database runs and that this control plane reaches it (store.url in server.yaml; "
    "'llmgw ctl cluster' shows the database's members)"
)


class OffLoop:
    """A bounded thread pool for blocking store calls, and a smaller one for calls that only read.

    Args:
        workers: threads for :meth:`run` (:data:`WORKERS`).
        deadline_s: seconds a call may take before it raises :class:`StoreUnavailable`; None: no deadline.
        database: how the messages name the database.
        abort: called with the thread id of a call past its deadline, to end it there (e.g.
            :meth:`~llmgw.control.store.sql.SqlStore.abort_thread`); None: the call runs on.
        readers: threads for :meth:`read` (:data:`READERS`).

    Example::

        db = OffLoop()
        node = await db.run(store.get_node, "node-1")
        db.close()
    """

    def __init__(
        self,
        workers: int = WORKERS,
        *,
        deadline_s: float | None = None,
        database: str = "the database",
        abort: Callable[[int], object] | None = None,
        readers: int = READERS,
    ) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmgw-store")
        self._reads = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="llmgw-store-read")
        self.workers = workers
        self.readers = readers
        self.deadline_s = deadline_s
        self.database = database
        self.abort = abort
        self._overdue = 0  # calls past their deadline still holding a thread (of self._pool)
        self._overdue_reads = 0  # ... of self._reads

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on a pool thread; its return value, or its exception raised here.

        Raises:
            StoreUnavailable: the call did not answer within ``deadline_s`` (when set), every thread
                holds an overdue call, or the driver could not reach the database.
        """
        return await self._call(False, functools.partial(fn, *args, **kwargs))

    async def read(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """As :meth:`run`, on the readers' threads: for a call that only reads (it never queues
        behind a write, however stuck). Raises as :meth:`run`."""
        return await self._call(True, functools.partial(fn, *args, **kwargs))

    async def _call(self, reading: bool, call: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        overdue, size = (self._overdue_reads, self.readers) if reading else (self._overdue, self.workers)
        if self.deadline_s is not None and overdue >= size:
            raise StoreUnavailable(
                f"{self.database} has not answered the last {overdue} calls within {self.deadline_s:g} s; "
                f"{_CHECK}"
            )
        thread: list[int] = []

        def on_thread() -> T:
            thread.append(threading.get_ident())
            return call()

        fut = loop.run_in_executor(self._reads if reading else self._pool, on_thread)
        try:
            if self.deadline_s is None:
                return await fut
            return await asyncio.wait_for(asyncio.shield(fut), self.deadline_s)
        except TimeoutError:
            if not thread and fut.cancel():  # still queued: it never runs (it would start late, on
                raise StoreUnavailable(  # whatever held the threads, with nobody waiting for it)
                    f"{self.database} did not answer within {self.deadline_s:g} s (every store thread was busy); "
                    f"{_CHECK}"
                ) from None
            if reading:
                self._overdue_reads += 1
                fut.add_done_callback(self._answered_read)
            else:
                self._overdue += 1
                fut.add_done_callback(self._answered)
            if self.abort is not None and thread:
                try:
                    self.abort(thread[0])  # its connection shut down: the thread is free again
                except Exception:
                    log.exception("could not end an overdue store call")
            raise StoreUnavailable(f"{self.database} did not answer within {self.deadline_s:g} s; {_CHECK}") from None
        except UNREACHABLE as e:
            text = str(e.orig if isinstance(e, sa.exc.DBAPIError) else e).strip()
            first = text.splitlines()
            if "read-only" in text:  # libpq's target_session_attrs=read-write found only standbys
                raise StoreUnavailable(
                    f"{self.database} has no writable primary now: the members that answer are standbys "
                    "(a failover is under way; Patroni promotes one within about 20-30 s); "
                    "'llmgw ctl cluster' shows the database's members"
                ) from e
            raise StoreUnavailable(
                f"{self.database} cannot be reached ({first[0] if first else e.__class__.__name__}); {_CHECK}"
            ) from e

    def _answered(self, fut: asyncio.Future[Any]) -> None:
        self._overdue -= 1
        if not fut.cancelled():
            fut.exception()  # retrieved: an overdue call's failure was already answered as a 503

    def _answered_read(self, fut: asyncio.Future[Any]) -> None:
        self._overdue_reads -= 1
        if not fut.cancelled():
            fut.exception()

    def close(self) -> None:
        """Wait for the calls in flight, then stop the threads."""
        self._reads.shutdown(wait=True)
        self._pool.shutdown(wait=True)


async def run_off(db: OffLoop | None, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` on ``db`` (:meth:`OffLoop.run`, with its deadline) when there is one,
    else on the loop's default executor (a reconciler built without a pool: tools and tests).
    Raises what ``fn`` raises, and as :meth:`OffLoop.run`."""
    if db is not None:
        return await db.run(fn, *args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


class Batcher(Generic[ItemT, ResultT]):
    """Hands items submitted on the loop to ``write(batch)`` on the pool, one batch at a time: the
    items that arrive while a batch is written make the next batch.

    Args:
        db: the pool.
        write: takes the batch, returns one result per item, in order (it runs on a pool thread).

    Used for heartbeats (:meth:`llmgw.control.store.base.Store.write_heartbeats`): one SQLite write
    transaction for every heartbeat that arrived meanwhile, instead of one each.
    """

    def __init__(self, db: OffLoop, write: Callable[[list[ItemT]], Sequence[ResultT]]) -> None:
        self.db = db
        self.write = write
        self._pending: list[tuple[ItemT, asyncio.Future[ResultT]]] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        """Items waiting for the next batch (the one being written not counted)."""
        return len(self._pending)

    async def submit(self, item: ItemT) -> ResultT:
        """Queue ``item``; its result once its batch is written (the batch's exception, if it raised)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[ResultT] = loop.create_future()
        self._pending.append((item, fut))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                results = await self.db.run(self.write, [item for item, _ in batch])
            except Exception as e:  # handed to every waiter of the batch
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut), result in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(result)


class Coalescer:
    """Runs ``job`` on request, never twice at once; requests during a run collapse into one rerun.
    A failing job is logged at its first failure and when it works again, not at every try.

    Args:
        job: the coroutine function to run (e.g. ``lambda: db.run(router.refresh)``).
        name: for the log when a run fails (the next request runs it again).
        min_gap_s: after a run, a rerun asked for by :meth:`request` alone starts no sooner than
            this (s) after it ended; one that a :meth:`done` caller waits for starts at once. 0:
            back to back. Bounds the share of the process a stream of requests can take (the
            routing refresh requested by every heartbeat that reports a replica ready).

    Build it on the loop that runs the job; :meth:`request` may then be called from that loop or
    from any thread (a leader pass running on a store thread calls it through ``on_change``).
    """

    def __init__(self, job: Callable[[], Awaitable[object]], *, name: str, min_gap_s: float = 0.0) -> None:
        self.job = job
        self.name = name
        self.min_gap_s = min_gap_s
        self._loop = asyncio.get_running_loop()
        self._wanted = False
        self._urgent = asyncio.Event()  # a done() caller waits: no gap before the next run
        self._task: asyncio.Task[None] | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._failing = ""  # why the runs fail, "" while they succeed (logged once per outage)

    async def done(self) -> None:
        """Request a run and wait until a run that started after this call has finished (a
        heartbeat or an admin write answers only once the gateway's table shows it). Call it
        on the loop."""
        fut = self._loop.create_future()
        self._waiters.append(fut)
        self._urgent.set()
        self.request()
        await fut

    def request(self) -> None:
        """Ask for a run: now if none is running, else once more after the current one."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is not self._loop:
            self._loop.call_soon_threadsafe(self.request)
            return
        self._wanted = True
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        while self._wanted:
            self._wanted = False
            waiters, self._waiters = self._waiters, []
            try:
                await self.job()
            except Exception as e:
                # Logged once per run of failures (a database outage fails every request for as long
                # as it lasts); the caller keeps what the last good run made.
                if not self._failing:
                    log.exception("%s failed; the next request runs it again", self.name)
                self._failing = self._failing or str(e) or e.__class__.__name__
            else:
                if self._failing:
                    log.info("%s works again", self.name)
                self._failing = ""
            finally:
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(None)
            if self._wanted and self.min_gap_s > 0 and not self._waiters:
                self._urgent.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), self.min_gap_s)

    async def idle(self) -> None:
        """Wait until no run is in progress or wanted (the gateway before it answers "no ready
        replica", tests, shutdown)."""
        while self._task is not None and not self._task.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._task)
