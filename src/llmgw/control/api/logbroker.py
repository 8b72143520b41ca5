"""Engine logs read through the agent that runs the engine.

The control plane cannot reach a node (the agent listens on nothing), so a log read rides the
heartbeat: the admin API asks the :class:`LogBroker` for a replica's log; the broker queues a
:class:`~llmgw.protocol.LogRequest` for that node; the node's next heartbeat reply carries it;
the agent reads the file and posts a :class:`~llmgw.protocol.LogReply` to ``/agent/v1/logs``,
which resolves the waiting request. Latency is at most one heartbeat interval (2 s) plus a round
trip; a node that does not answer within ``timeout_s`` gets an error that says so.

Two ways to queue, chosen when the broker is made (:mod:`llmgw.control.server`):

* **In memory** (``LogBroker()``; SQLite, one control plane): the request waits in :attr:`LogBroker.pending`
  and the answer resolves a future. No store call at all: the single-machine path is what it was.
* **Through the store** (``LogBroker(store=..., db=...)``; PostgreSQL, where several control planes
  share the database and an agent heartbeats to any one of them): the request is a row of
  ``log_requests`` (:meth:`~llmgw.control.store.base.Store.add_log_request`); whichever control
  plane the node heartbeats to hands it out (:meth:`LogBroker.wants_stored`: the heartbeat's write
  takes them, :meth:`~llmgw.control.store.base.Store.write_heartbeats`). The agent posts its
  answer to the control plane it uses: that one resolves its own waiting read when it asked, else
  stores the answer in the row, which the asker polls every :data:`POLL_S`
  (:meth:`~llmgw.control.store.base.Store.pop_log_answer`). A read asked on one control plane for a
  node beating to another thus takes one heartbeat interval plus at most twice ``POLL_S`` more.
  Rows are deleted once read, when the asker gives up, and after a minute in any case (a control
  plane that stopped mid-read).

  A heartbeat reads ``log_requests`` only when its node is among those with requests queued, which
  each control plane reads every :data:`POLL_S` (:meth:`LogBroker.watch`: one small query a poll,
  whatever the number of nodes). Measured with ``bench/heartbeats.py`` on a PostgreSQL store (200
  agents, 2 cores, two runs each at load 0.4-1.0), an indexed SELECT in every heartbeat instead took
  ``heartbeat_p99_ms`` from 56-76 ms to 117-120 ms.

What it does not guarantee: a request queued for a node that is lost is answered by nobody and
times out; a heartbeat reply that carried a request but never reached its agent loses that request
(the caller times out and asks again); in memory, a control plane restart drops the requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.errors import UnreachableError
from llmgw.protocol import LogReply, LogRequest

log = logging.getLogger(__name__)

#: Seconds between two reads of the queued nodes (:meth:`LogBroker.watch`) and, while a read waits,
#: of its stored answer (store mode). 200 ms against the 2 s heartbeat interval adds at most a fifth
#: to a cross-control-plane read's latency, for 5 small queries a second per control plane.
POLL_S = 0.2


@dataclass
class LogBroker:
    """Pending log reads per node, and the futures waiting on them.

    Attributes:
        pending: requests queued in memory per node (memory mode only).
        waiting: request id -> (node, future) of the reads this control plane waits on.
        store: the shared store to queue requests and answers in (store mode), None: in memory.
        db: runs the store calls off the event loop (required with ``store``).
        poll_s: seconds between reads of a stored answer (:data:`POLL_S`).
        clock: unix seconds (the rows' times).
    """

    pending: dict[str, list[LogRequest]] = field(default_factory=dict)
    waiting: dict[str, tuple[str, asyncio.Future[LogReply]]] = field(default_factory=dict)
    store: Store | None = None
    db: OffLoop | None = None
    poll_s: float = POLL_S
    clock: Callable[[], float] = time.time
    _cleanup: set[asyncio.Task[None]] = field(default_factory=set)
    _queued: set[str] = field(default_factory=set)  # nodes with stored requests not yet handed out
    _failing: str = ""  # why watch's reads fail, "" while they work (logged once per outage)

    def __post_init__(self) -> None:
        if self.store is not None and self.db is None:
            raise ValueError("LogBroker(store=...) needs db=OffLoop(...) to call the store off the event loop")

    async def read(
        self, node: str, replica_id: str, *, lines: int = 100, offset: int | None = None, timeout_s: float = 10.0
    ) -> LogReply:
        """Ask ``node`` for ``replica_id``'s log: the last ``lines`` lines, or what follows byte ``offset``.

        Raises:
            UnreachableError: the node did not answer within ``timeout_s`` seconds.
            StoreUnavailable: (store mode) the database did not take the request or answer a poll.
        """
        req = LogRequest(id=secrets.token_hex(8), replica_id=replica_id, lines=lines, offset=offset)
        fut: asyncio.Future[LogReply] = asyncio.get_running_loop().create_future()
        self.waiting[req.id] = (node, fut)
        silent = UnreachableError(
            f"node {node} did not send replica {replica_id}'s log within {timeout_s:.0f} s; "
            "is its agent running? ('llmgw ctl nodes')"
        )
        if self.store is not None and self.db is not None:
            return await self._read_stored(self.store, self.db, node, req, fut, timeout_s, silent)
        self.pending.setdefault(node, []).append(req)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError as e:
            raise silent from e
        finally:
            self.waiting.pop(req.id, None)
            queued = self.pending.get(node, [])
            if req in queued:
                queued.remove(req)

    async def _read_stored(
        self, store: Store, db: OffLoop, node: str, req: LogRequest, fut: asyncio.Future[LogReply],
        timeout_s: float, silent: UnreachableError,
    ) -> LogReply:
        """Store mode: queue ``req`` as a row, then wait for the local future or the stored answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        popped = False
        try:
            await db.run(store.add_log_request, node, req, now=self.clock())
            self._queued.add(node)  # a heartbeat to this control plane takes it without waiting for watch
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise silent
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(asyncio.shield(fut), min(self.poll_s, left))
                got = await db.run(store.pop_log_answer, req.id)
                if got is not None:
                    popped = True
                    return got
        finally:
            self.waiting.pop(req.id, None)
            if not popped:  # answered here, timed out, or failed: the row goes, in the background
                task = loop.create_task(_forget(store, db, req.id))
                self._cleanup.add(task)
                task.add_done_callback(self._cleanup.discard)

    def take(self, node: str) -> list[LogRequest]:
        """The requests queued in memory to put in ``node``'s heartbeat reply (each is handed out once)."""
        return self.pending.pop(node, [])

    def take_stored(self, node: str, now: float) -> list[LogRequest]:
        """On a store thread: the requests queued in the store for ``node`` that no control plane has
        handed out yet (each is handed out once, cluster-wide); [] with no store call in memory mode
        or when :meth:`watch` last saw none for ``node``."""
        if self.store is None or not self.wants_stored(node):
            return []
        return self.store.take_log_requests(node, now=now)

    def stored_waiting(self, node: str) -> bool:
        """Whether :meth:`wants_stored` would say yes for ``node`` now (without giving the answer)."""
        return self.store is not None and node in self._queued

    def wants_stored(self, node: str) -> bool:
        """Whether ``node``'s next heartbeat should take the log requests queued in the store (store
        mode, and :meth:`watch` or this control plane saw some for it since the last take); the
        answer is given once (the heartbeat that asked takes them: the agent API's batched write,
        :meth:`~llmgw.control.store.base.Store.write_heartbeats`)."""
        if self.store is None or node not in self._queued:
            return False
        self._queued.discard(node)
        return True

    async def watch(self, stop: asyncio.Event) -> None:
        """Store mode: every ``poll_s``, read which nodes have requests queued by any control plane
        (:meth:`~llmgw.control.store.base.Store.log_request_nodes`), until ``stop`` is set; returns at
        once in memory mode. A failing read is logged once per outage; the heartbeats then take
        only this control plane's own requests."""
        if self.store is None or self.db is None:
            return
        while not stop.is_set():
            try:
                self._queued = await self.db.run(self.store.log_request_nodes) | self._queued
            except Exception as e:
                if not self._failing:
                    log.warning("cannot read the queued log requests (%s); retrying every %g s", e, self.poll_s)
                self._failing = str(e) or e.__class__.__name__
            else:
                if self._failing:
                    log.info("reading the queued log requests works again")
                self._failing = ""
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.poll_s)

    async def answer(self, node: str, reply: LogReply) -> bool:
        """Deliver the agent's reply: resolve this control plane's waiting read, else (store mode)
        store it for the control plane that asked. False when nobody asked ``node`` for ``reply.id``
        (another node's request, expired, or already answered).

        Raises:
            StoreUnavailable: (store mode) the database did not take the answer.
        """
        entry = self.waiting.get(reply.id)
        if entry is not None:
            if entry[0] != node or entry[1].done():
                return False
            entry[1].set_result(reply)
            return True
        if self.store is None or self.db is None:
            return False
        return await self.db.run(self.store.answer_log_request, node, reply, now=self.clock())

    async def idle(self) -> None:
        """Wait for the background deletions of finished reads' rows (tests, shutdown)."""
        while self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)


async def _forget(store: Store, db: OffLoop, request_id: str) -> None:
    """Delete a finished read's row; a failure is left to the row's expiry (:meth:`Store.add_log_request`)."""
    try:
        await db.run(store.forget_log_request, request_id)
    except Exception as e:
        log.debug("log request %s not deleted (%s); it expires within a minute", request_id, e)
