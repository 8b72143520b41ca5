"""The agent API in a process of its own, from the control plane's side (``cluster.agent_api_process``).

The control plane binds the agent API's sockets itself (a port already taken is its
:class:`~llmgw.errors.PortInUseError`, as for the other listeners), then starts
``python -m llmgw.control.agentworker`` (:mod:`llmgw.control.agentworker`) with them and one end of
a socket pair, the channel (:mod:`llmgw.control.agentlink`). :class:`AgentProcess`:

- :meth:`~AgentProcess.start`: the process, and its ``ready`` (every socket served) before the
  control plane's admin API answers its health check (init and the tests connect to the agent API
  right after it);
- :meth:`~AgentProcess.run`: relays what the process sends (``changed``: a routing refresh and, for a
  node that came, the leader's pass; ``nodes``: the lost threshold; ``metrics``: engine pages for
  ``GET /metrics``) and sends the election's view when it changes (read every :data:`PUSH_S`:
  a reply names the new leader and term at most that much later than in one process). A process
  that exits is started again (after :data:`RESPAWN_MIN_S`, doubling to :data:`RESPAWN_MAX_S`); the
  sockets stay bound meanwhile, so agents' connections wait in the backlog, never refused;
- :meth:`~AgentProcess.stop_accepting` and :meth:`~AgentProcess.close` at shutdown: ``stop``, the
  heartbeats in flight finished, the process gone within :data:`STOP_S` (else killed).

The process dies with the control plane: when the channel closes, it stops (its end reads EOF).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from llmgw.control.agentlink import Link
from llmgw.control.api.cadence import Cadence
from llmgw.control.api.enginemetrics import EngineMetrics
from llmgw.control.listeners import SHUTDOWN_TIMEOUT_S
from llmgw.errors import ServiceError
from llmgw.protocol import EngineMetricsText

log = logging.getLogger(__name__)

PUSH_S = 0.2
"""Seconds between two reads of the election's view (term, leader, members, own nodes); a change is
sent to the agent API process at once."""

START_S = 30.0
"""How long the process may take to serve its sockets (s; its imports take ~1 s on a busy 2-core machine)."""

RESPAWN_MIN_S = 1.0
RESPAWN_MAX_S = 30.0
"""A process that exited is started again after 1 s, then 2, 4... up to 30 s while it keeps failing:
failing to start, or dying within 30 s of serving (the OOM killer as the agents reconnect); one that
served longer than that is started again after 1 s."""

STOP_S = 2 * SHUTDOWN_TIMEOUT_S + 2.0
"""How long a stopping process may take (its listener's shutdown, :data:`SHUTDOWN_TIMEOUT_S` twice at
most, and a second), after which it is killed."""


class AgentProcess:
    """The agent API's process, started, relayed and supervised.

    Args:
        config_path: server.yaml (the process reads its TLS files and settings from it).
        store_url: the store's SQLAlchemy URL (sent over the channel, never on the command line).
        socks: the agent API's listening sockets (:func:`~llmgw.control.listeners.bind_sockets`);
            closed by :meth:`close`.
        on_changed: ``(node, came)`` for each ``changed``: a routing refresh, and the leader's pass
            when ``came`` (the control plane's ``Wakes``).
        engines: where relayed engine pages are kept.
        cadence: the control plane's cadence, told each node count the process read.
        cluster: ``(term, leader's agent URL, live members' agent URLs)``, read every :data:`PUSH_S`.
        own_nodes: the control planes' own nodes, read with ``cluster``.
        python: the interpreter to run (this one).
    """

    def __init__(
        self,
        config_path: Path,
        store_url: str,
        socks: list[socket.socket],
        *,
        on_changed: Callable[[str, bool], None],
        engines: EngineMetrics,
        cadence: Cadence,
        cluster: Callable[[], tuple[int, str, list[str]]],
        own_nodes: Callable[[], frozenset[str]],
        python: str = sys.executable,
    ) -> None:
        self.config_path, self.store_url, self.socks = config_path, store_url, socks
        self.on_changed, self.engines, self.cadence = on_changed, engines, cadence
        self.cluster, self.own_nodes, self.python = cluster, own_nodes, python
        self.proc: asyncio.subprocess.Process | None = None
        self.served_at = 0.0  # when the running process said 'ready' (monotonic s)
        self.starts = 0
        self._link: Link | None = None
        self._view: dict[str, Any] = {}
        self._stopping = False

    @property
    def pid(self) -> int | None:
        """The running process's id, None before :meth:`start`."""
        return self.proc.pid if self.proc is not None else None

    def _read_view(self) -> dict[str, Any]:
        term, leader, members = self.cluster()
        return {"cluster": [term, leader, list(members)], "own": sorted(self.own_nodes())}

    async def start(self) -> None:
        """Start the process and wait until it serves the sockets.

        Raises:
            ServiceError: it exited first (its own log says why: server.yaml or the store changed
                since the control plane read them) or did not answer within :data:`START_S`.
        """
        if self._link is not None:  # the last process's: dropped unclosed, a cycle gc.freeze() keeps for ever
            self._link.close()
        parent, child = socket.socketpair()
        fds = [s.fileno() for s in self.socks]
        argv = [self.python, "-m", "llmgw.control.agentworker", "--config", str(self.config_path),
                *(a for fd in fds for a in ("--listen-fd", str(fd))), "--link-fd", str(child.fileno())]
        try:
            proc = await asyncio.create_subprocess_exec(*argv, pass_fds=(*fds, child.fileno()))
        finally:
            child.close()
        self.proc, self.starts = proc, self.starts + 1
        link = self._link = await Link.open(parent)
        self._view = self._read_view()
        link.send("init", url=self.store_url, **self._view)
        timed_out = False
        deadline = time.monotonic() + START_S
        while True:  # messages before 'ready' are taken (a restart's cadence counts the nodes as it starts)
            try:
                first = await asyncio.wait_for(link.recv(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                first, timed_out = None, True
            if first is None or first.get("k") == "ready":
                break
            self._take(first)
        if first is None:
            if timed_out:  # hung (never told to stop): waiting STOP_S more for it would change nothing
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await self._end(proc)
            if timed_out:
                raise ServiceError(
                    f"the agent API process (pid {proc.pid}) did not serve {self._where()} within "
                    f"{START_S:g} s and was killed; its log lines above say how far it got"
                )
            why = ("its log lines above say why" if (proc.returncode or 0) >= 0 else
                   "by another program or the kernel's OOM killer ('journalctl -k' shows the latter)")
            raise ServiceError(
                f"the agent API process (pid {proc.pid}) {_how(proc)} before serving {self._where()}; {why}"
            )
        self.served_at = time.monotonic()
        log.info("agent API served by process %d on %s", proc.pid, self._where())

    def _where(self) -> str:
        return ", ".join(f"{s.getsockname()[0]}:{s.getsockname()[1]}" for s in self.socks)

    async def run(self, stop: asyncio.Event) -> None:
        """Relay the process's messages and send it the election's view until ``stop`` is set;
        start it again when it exits (see the module docstring)."""
        pushing = asyncio.create_task(self._push(stop))
        stopped = asyncio.create_task(stop.wait())
        backoff = RESPAWN_MIN_S
        try:
            while not stop.is_set():
                relay = asyncio.create_task(self._relay())
                await asyncio.wait([relay, stopped], return_when=asyncio.FIRST_COMPLETED)
                if stop.is_set() or self._stopping:
                    relay.cancel()
                    return
                if time.monotonic() - self.served_at >= RESPAWN_MAX_S:
                    backoff = RESPAWN_MIN_S  # it served a while: not failing over and over
                if self.proc is not None:
                    await self._end(self.proc)
                    log.error("the agent API process %d %s; starting another in %.0f s",
                              self.proc.pid, _how(self.proc), backoff)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff)
                if stop.is_set() or self._stopping:  # _stopping: closed meanwhile, the sockets with it
                    return
                backoff = min(backoff * 2, RESPAWN_MAX_S)  # back to the least once one serves a while
                try:
                    await self.start()
                except (ServiceError, OSError) as e:
                    log.error("%s", e)  # noqa: TRY400 (the message says what to read)
        finally:
            pushing.cancel()
            stopped.cancel()

    async def _relay(self) -> None:
        """The process's messages, until its channel ends."""
        link = self._link
        while link is not None and (msg := await link.recv()) is not None:
            self._take(msg)

    def _take(self, msg: dict[str, Any]) -> None:
        """Act on one message of the process (see the module docstring); others are ignored."""
        kind = msg.get("k")
        if kind == "changed":
            self.on_changed(str(msg.get("node", "")), bool(msg.get("came")))
        elif kind == "nodes":
            self.cadence.set_nodes(int(msg.get("n", 0)))
        elif kind == "metrics":
            try:
                pages = [EngineMetricsText.model_validate(p) for p in msg.get("pages") or []]
            except ValidationError as e:
                log.warning("engine pages relayed for node %s do not validate: %s", msg.get("node"), e)
                return
            self.engines.put(str(msg.get("node", "")), pages)

    async def _push(self, stop: asyncio.Event) -> None:
        """Send the election's view whenever it changed, every :data:`PUSH_S`."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PUSH_S)
            view = self._read_view()
            if view != self._view and self._link is not None:
                self._view = view
                self._link.send("cluster", **view)

    def stop_accepting(self) -> None:
        """Tell the process to stop: it stops accepting and finishes the heartbeats in flight (shutdown)."""
        self._stopping = True
        if self._link is not None:
            self._link.send("stop")

    async def close(self) -> None:
        """Stop the process (:meth:`stop_accepting`), wait for it (:data:`STOP_S`, then killed) and close
        the sockets."""
        self.stop_accepting()
        if self.proc is not None:
            await self._end(self.proc)
        if self._link is not None:
            self._link.close()
        for sock in self.socks:
            sock.close()

    async def _end(self, proc: asyncio.subprocess.Process) -> None:
        """``proc`` gone: waited for up to :data:`STOP_S`, then killed."""
        try:
            await asyncio.wait_for(proc.wait(), STOP_S)
        except TimeoutError:
            log.warning("the agent API process %d did not stop within %.0f s; killed", proc.pid, STOP_S)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def _how(proc: asyncio.subprocess.Process) -> str:
    """How ``proc`` ended, in words: ``exited with 1``, ``was killed by SIGKILL``."""
    code = proc.returncode
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with {code}"
