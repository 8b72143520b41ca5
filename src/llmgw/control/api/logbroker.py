"""Engine logs read through the agent that runs the engine.

The control plane cannot reach a node (the agent listens on nothing), so a log read rides the
heartbeat: the admin API asks the :class:`LogBroker` for a replica's log; the broker queues a
:class:`~llmgw.protocol.LogRequest` for that node; the node's next heartbeat reply carries it;
the agent reads the file and posts a :class:`~llmgw.protocol.LogReply` to ``/agent/v1/logs``,
which resolves the waiting request. Latency is at most one heartbeat interval (2 s) plus a round
trip; a node that does not answer within ``timeout_s`` gets an error that says so.

What it does not guarantee: a request queued for a node that is lost is answered by nobody and
times out; requests are kept in memory, so a control plane restart drops them (the caller asks
again).
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

from llmgw.errors import UnreachableError
from llmgw.protocol import LogReply, LogRequest


@dataclass
class LogBroker:
    """Pending log reads per node, and the futures waiting on them."""

    pending: dict[str, list[LogRequest]] = field(default_factory=dict)
    waiting: dict[str, tuple[str, asyncio.Future[LogReply]]] = field(default_factory=dict)

    async def read(
        self, node: str, replica_id: str, *, lines: int = 100, offset: int | None = None, timeout_s: float = 10.0
    ) -> LogReply:
        """Ask ``node`` for ``replica_id``'s log: the last ``lines`` lines, or what follows byte ``offset``.

        Raises:
            UnreachableError: the node did not answer within ``timeout_s`` seconds.
        """
        req = LogRequest(id=secrets.token_hex(8), replica_id=replica_id, lines=lines, offset=offset)
        fut: asyncio.Future[LogReply] = asyncio.get_running_loop().create_future()
        self.waiting[req.id] = (node, fut)
        self.pending.setdefault(node, []).append(req)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError as e:
            raise UnreachableError(
                f"node {node} did not send replica {replica_id}'s log within {timeout_s:.0f} s; "
                "is its agent running? ('llmgw ctl nodes')"
            ) from e
        finally:
            self.waiting.pop(req.id, None)
            queued = self.pending.get(node, [])
            if req in queued:
                queued.remove(req)

    def take(self, node: str) -> list[LogRequest]:
        """The requests to put in ``node``'s heartbeat reply (each is handed out once)."""
        return self.pending.pop(node, [])

    def answer(self, node: str, reply: LogReply) -> bool:
        """Resolve a waiting read with the agent's reply; False when none waits (or another node's)."""
        entry = self.waiting.get(reply.id)
        if entry is None or entry[0] != node or entry[1].done():
            return False
        entry[1].set_result(reply)
        return True
