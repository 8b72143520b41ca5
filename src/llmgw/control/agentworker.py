"""The agent API in a process of its own (``cluster.agent_api_process: true``):
``python -m llmgw.control.agentworker``, started and supervised by the control plane
(:mod:`llmgw.control.agentproc`), never by hand.

Why: every heartbeat costs the process that answers it about 1 ms of its event loop (TLS, HTTP,
the handler) and 0.4 ms of its store thread (py-spy, 5,000 simulated nodes, 50 beats/s). In the
control plane's own process that is the gateway's loop and GIL: bench/scale.py measured the gateway's
added latency +0.02-0.03 ms (3-6 %) higher while the beats flowed than while they were held. Here the
beats are answered by another process, which the operating system schedules beside the gateway.

It serves the listening sockets the control plane bound (inherited: ``--listen-fd``; a port already
taken was the control plane's error, before this process started) with the same app
(:func:`~llmgw.control.api.agent.build_agent_app`) on a store of its own (the URL comes over the
channel: :mod:`llmgw.control.agentlink`). What the control plane's memory holds comes over the channel
too: the election's view for every reply (``cluster``); what only the control plane can act on goes
back (``changed``: a routing refresh; ``came``: the leader's pass; ``nodes``: the lost threshold;
``metrics``: engine pages). Log reads go through the store (:class:`~llmgw.control.api.logbroker.LogBroker`
in store mode), as between control planes.

It stops on ``stop``, SIGTERM or SIGINT, and when the channel closes (the control plane died): it
stops accepting, lets the heartbeats in flight finish (``SHUTDOWN_TIMEOUT_S``) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from llmgw import tlsconf
from llmgw.config import load_server_config
from llmgw.control.agentlink import Link
from llmgw.control.api.agent import build_agent_app
from llmgw.control.api.cadence import Cadence
from llmgw.control.api.logbroker import LogBroker
from llmgw.control.gcpauses import GcPauses
from llmgw.control.listeners import new_runner
from llmgw.control.openfiles import raise_open_files_limit
from llmgw.control.startcheck import agent_api_tls
from llmgw.control.store import api_pool, open_store
from llmgw.control.store.offloop import SWITCH_INTERVAL_S
from llmgw.errors import LlmgwError
from llmgw.protocol import EngineMetricsText

log = logging.getLogger(__name__)


class View:
    """The control plane's view each reply names, as last sent over the channel (``init``, ``cluster``)."""

    def __init__(self, msg: dict[str, Any]) -> None:
        self.fields: tuple[int, str, list[str]] = (0, "", [])
        self.own: frozenset[str] = frozenset()
        self.take(msg)

    def take(self, msg: dict[str, Any]) -> None:
        """Keep ``msg``'s ``cluster`` (``[term, leader, members]``) and ``own`` (node ids)."""
        term, leader, members = msg.get("cluster") or (0, "", [])
        self.fields = (int(term), str(leader), [str(m) for m in members])
        self.own = frozenset(str(n) for n in msg.get("own") or ())

    def cluster(self) -> tuple[int, str, list[str]]:
        """``(term, leader's agent URL, live members' agent URLs)`` for a reply."""
        return self.fields

    def own_nodes(self) -> frozenset[str]:
        """The control planes' own nodes (their ``llmgw.control-plane`` label is honoured)."""
        return self.own


class RelayedPages:
    """The agent API's ``engines``: each post of engine metrics pages goes to the control plane."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def put(self, node: str, pages: list[EngineMetricsText]) -> None:
        """Send ``node``'s pages (the control plane keeps and bounds them: ``EngineMetrics.put``)."""
        self.link.send("metrics", node=node, pages=[p.model_dump(mode="json") for p in pages])


async def serve(config_path: Path, listen_fds: list[int], link_fd: int) -> int:
    """Serve the agent API on ``listen_fds`` until told to stop; 0 then, 2 when the first message
    on ``link_fd`` is not ``init``.

    Raises:
        ConfigError, PkiError, StoreError: server.yaml, its TLS files or the store cannot be used
            (the control plane checked them first; they changed since).
    """
    link = await Link.open(socket.socket(fileno=link_fd))
    try:
        return await _serve(config_path, listen_fds, link)
    finally:
        link.close()  # also when it failed to start (closed again at a stop: harmless)


async def _serve(config_path: Path, listen_fds: list[int], link: Link) -> int:
    """:func:`serve` once the channel is open."""
    init = await link.recv()
    if init is None or init.get("k") != "init":
        log.error("the agent API process got no 'init' from the control plane; exiting")
        return 2
    config = load_server_config(config_path)
    raise_open_files_limit()
    tls = agent_api_tls(config)
    tlsconf.small_read_buffers()
    store = open_store(str(init["url"]))
    db = api_pool(store)
    view = View(init)
    logs = LogBroker(store=store, db=db)  # the control plane's reads reach this process through the store
    cadence: Cadence

    def lost_after(_seconds: float) -> None:
        link.send("nodes", n=cadence.nodes)

    cadence = Cadence(config.cluster.max_heartbeats_per_s, config.node_lost_after_s,
                      count=lambda: db.read(store.count_nodes), on_lost_after=lost_after)

    def on_heartbeat(node: str, changed: bool) -> None:
        if changed:
            link.send("changed", node=node, came=False)

    def on_node(node: str) -> None:
        link.send("changed", node=node, came=True)

    app = build_agent_app(
        store, on_heartbeat=on_heartbeat, node_lost_after_s=config.node_lost_after_s, logs=logs, db=db,
        on_node=on_node, cluster=view.cluster, engines=RelayedPages(link), cadence=cadence,
        own_nodes=view.own_nodes,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as in the control plane: the store threads hand off often
    # The connections kept per node live here: the control plane's schedule of full collections,
    # their survivors frozen (llmgw.control.gcpauses; docs/operating.md "Memory and pauses per node").
    pauses = GcPauses(freeze=True)
    runner = new_runner(app, "agent_listen")
    await runner.setup()
    sites = [web.SockSite(runner, socket.socket(fileno=fd), ssl_context=tls) for fd in listen_fds]
    try:
        for site in sites:
            await site.start()
        gc.freeze()  # what startup made lives as long as the process (as in the control plane)
        pauses.install()
        link.send("ready")

        async def follow() -> None:
            while (msg := await link.recv()) is not None and msg.get("k") != "stop":
                if msg.get("k") == "cluster":
                    view.take(msg)
            stop.set()

        following = asyncio.create_task(follow())
        await asyncio.gather(logs.watch(stop), pauses.run(stop), stop.wait())
        following.cancel()
    finally:
        pauses.remove()
        for site in sites:
            with contextlib.suppress(Exception):
                await site.stop()
        await runner.cleanup()  # the heartbeats in flight: SHUTDOWN_TIMEOUT_S
        await logs.idle()
        await link.drain()
        link.close()
        db.close()
        store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m llmgw.control.agentworker --config PATH --listen-fd N [--listen-fd N...] --link-fd N``."""
    ap = argparse.ArgumentParser(prog="llmgw.control.agentworker", description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--listen-fd", type=int, action="append", required=True)
    ap.add_argument("--link-fd", type=int, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s agent-api %(name)s: %(message)s")
    try:
        return asyncio.run(serve(args.config, args.listen_fd, args.link_fd))
    except LlmgwError as e:
        # one line that says what to do (not a chained traceback at every start again, 1-30 s apart);
        # the control plane names this process's pid and exit code after it
        log.error("the agent API process cannot start: %s", e)  # noqa: TRY400 (the message is the news)
        return 1


if __name__ == "__main__":
    sys.exit(main())
