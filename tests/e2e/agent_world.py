"""A one-node cluster on real processes, for agent tests and ``bench/adopt.py``.

- :class:`ControlPlane`: the real agent API (:func:`~llmgw.control.api.agent.build_agent_app`), the
  real SQLite store and the real leader, in this process, over mTLS on a fixed port, so it can be
  stopped and started again on the same address (a control-plane restart). The leader runs a
  pass at start (as ``llmgw server run`` does) and after every heartbeat.
- :class:`AgentProcess`: ``python -m llmgw agent`` as a child process (so it can be SIGKILLed).
- A plain HTTP file server that serves the gemma GGUF as the mirror would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from aiohttp import web

from llmgw import tlsconf
from llmgw.catalog import Model, Profile, Scaling
from llmgw.control.api.agent import build_agent_app
from llmgw.control.reconcile.leader import Leader
from llmgw.control.store import ReplicaRow, Store, default_url, open_store
from llmgw.paths import Paths
from llmgw.protocol import ReplicaStatus
from tests.helpers.net import free_port

GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # scripts/assets pins it
NODE = "node-1"


@dataclass
class ControlPlane:
    """The real agent API + store + leader (see the module docstring).

    ``clock_offset_s`` shifts the control plane's clock, to play a restart after a long outage.
    """

    dir: Path
    port: int
    node_lost_after_s: float = 30.0
    clock_offset_s: float = 0.0
    store: Store | None = None
    leader: Leader | None = None
    _runner: web.AppRunner | None = None
    lost: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def clock(self) -> float:
        return time.time() + self.clock_offset_s

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _pass(self) -> None:
        assert self.leader is not None
        result = self.leader.reconcile_once(self.clock())
        self.lost += result.lost
        self.removed += result.removed

    async def start(self) -> None:
        self.store = open_store(default_url("", self.dir / "llmgw.db"))
        self.leader = Leader(self.store, node_lost_after_s=self.node_lost_after_s, clock=self.clock)
        self._pass()  # ``llmgw server run`` starts its leader at once, before any agent reports
        app = build_agent_app(self.store, on_heartbeat=lambda _n, _c: self._pass(), clock=self.clock)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        ctx = tlsconf.server_context(self.dir / "ca.pem", self.dir / "server.pem", self.dir / "server-key.pem")
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=ctx).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.store is not None:
            self.store.close()
            self.store = None

    def replicas(self) -> list[ReplicaRow]:
        assert self.store is not None
        return sorted(self.store.list_replicas(), key=lambda r: r.id)

    def reported(self) -> list[ReplicaStatus]:
        """What the node last reported (pids included)."""
        assert self.store is not None
        node = self.store.get_node(NODE)
        return sorted(node.replicas, key=lambda r: r.id) if node else []

    async def wait(self, pred: Callable[[], bool], within_s: float, what: str) -> float:
        """Poll ``pred`` every 50 ms; returns the seconds it took. Raises AssertionError on timeout."""
        t0 = time.monotonic()
        while not pred():
            if time.monotonic() - t0 > within_s:
                raise AssertionError(f"not within {within_s} s: {what}; replicas {self.replicas()}")
            await asyncio.sleep(0.05)
        return time.monotonic() - t0


@dataclass
class AgentProcess:
    """``python -m llmgw agent --config <config>`` under ``LLMGW_ROOT=<root>``."""

    root: Path
    config: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def agent_state(self) -> Path:
        return Paths(self.root).agent_state

    def start(self) -> None:
        env = {**os.environ, "LLMGW_ROOT": str(self.root)}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw", "agent", "--config", str(self.config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def term(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def make_cluster(
    tmp: Path, *, llama_server: Path, files_url: str, replicas: int = 2, cores: int = 1
) -> tuple[ControlPlane, AgentProcess, Model]:
    """PKI, agent.yaml and the gemma model (``replicas`` CPU replicas of ``cores`` cores each)."""
    cpdir = tmp / "cp"
    cpdir.mkdir(parents=True)
    ca = tlsconf.CA.create()
    ca.write(cpdir)
    ca.issue_server(["127.0.0.1"]).write(cpdir, "server")
    cert, key = ca.issue_client(NODE).write(tmp / "etc", "agent")
    cp = ControlPlane(cpdir, free_port())
    root = tmp / "root"
    config = tmp / "etc" / "agent.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": cp.url,
                "node_id": NODE,
                "tls": {"ca": str(cpdir / "ca.pem"), "cert": str(cert), "key": str(key)},
                "engines": {"llamacpp": {"binary": str(llama_server)}},
                "heartbeat_interval_s": 0.5,
            }
        )
    )
    model = Model(
        name="gemma",
        version="q4",
        source=f"{files_url}/gemma.gguf",
        sha256=GEMMA_SHA256,
        profiles=[Profile(name="cpu", cpu_cores=cores, args=["--ctx-size", "1024", "-np", "1"])],
        scaling=Scaling(min=replicas, max=replicas),
    )
    return cp, AgentProcess(root, config, tmp / "agent.log"), model
