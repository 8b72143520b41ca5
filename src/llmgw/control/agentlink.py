"""The channel between the control plane and its agent API process (``cluster.agent_api_process``):
one Unix socket pair, a JSON object per line, ``{"k": KIND, ...}``.

From the control plane (:mod:`llmgw.control.agentproc`) to the agent API process
(:mod:`llmgw.control.agentworker`):

- ``init`` ``{url, cluster: [term, leader, members], own: [node...]}``: the first line, once per
  process: the store's URL (never on the command line, which ``ps`` shows: it may hold a password)
  and what replies name;
- ``cluster`` ``{cluster, own}``: the election's view changed (each reply carries it);
- ``stop``: stop accepting, finish the heartbeats in flight, exit.

From the agent API process to the control plane:

- ``ready``: every listening socket is served;
- ``changed`` ``{node, came}``: a heartbeat changed what the gateway routes to (a routing refresh);
  ``came``: the node registered or came back from lost (the leader's next pass);
- ``nodes`` ``{n}``: the node count the cadence read, when it moved the lost threshold;
- ``metrics`` ``{node, pages}``: a node's engine metrics pages (``GET /metrics`` shows them).

A plain pulse sends nothing: the channel carries what changed, not the beats (at 5,000 nodes the
heartbeats arrive at 50 a second; the messages at a few a second, while models are placed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Any

MAX_LINE = 64 * 2**20
"""The longest message (bytes): a ``metrics`` post of 64 pages of 256 KiB (the agent API's own
bounds, :mod:`llmgw.control.api.enginemetrics`) with room for JSON's escapes."""


class Link:
    """One end of the channel: :meth:`send` never waits (the bytes are buffered), :meth:`recv` the
    next message or None once the other end is gone.

    Args:
        reader, writer: the socket's streams (:meth:`open`).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    async def open(cls, sock: socket.socket) -> Link:
        """The link over ``sock`` (one end of a ``socket.socketpair()``), owned from now on."""
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_LINE)
        return cls(reader, writer)

    def send(self, kind: str, **fields: Any) -> None:
        """Queue the message ``{"k": kind, **fields}``; dropped when the other end is gone (its
        :meth:`recv` says so)."""
        if not self._writer.is_closing():
            self._writer.write(json.dumps({"k": kind, **fields}, separators=(",", ":")).encode() + b"\n")

    async def drain(self) -> None:
        """Wait until what was sent left this process's buffer (no error when the other end is gone)."""
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self._writer.drain()

    async def recv(self) -> dict[str, Any] | None:
        """The next message, or None at the end: the other end closed (or died), or it sent a line
        that is not a JSON object or is longer than :data:`MAX_LINE`."""
        try:
            line = await self._reader.readline()
        except (ConnectionError, ValueError):  # ValueError: a line past the limit
            return None
        if not line:
            return None
        try:
            msg = json.loads(line)
        except ValueError:
            return None
        return msg if isinstance(msg, dict) else None

    def close(self) -> None:
        """Close this end (the other's :meth:`recv` returns None)."""
        self._writer.close()
