"""The control planes bench/scale.py runs: ``llmgw server run`` processes, their CPU and memory.

One on SQLite (the default), or three on one throwaway PostgreSQL (``--ha``: the tests' cluster,
tests/helpers/postgres.py, and one CA and server certificate for all three, as
``server add-control-plane`` makes them). :class:`ControlPlane` starts and stops one process and
reads its CPU (user + system seconds, psutil) and its largest resident set (sampled each second), its
agent API process's (``cluster.agent_api_process``, the default here: ``--agent-api``) counted in both.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers.control import Install, make_install
from tests.helpers.postgres import Cluster, start_cluster

#: The CPUs each control plane is confined to (``--pin``: the first one), None: wherever the
#: scheduler puts it. Set by bench/scale.py before it starts one.
CP_CPUS: set[int] | None = None
#: The CPUs its agent API process (``cluster.agent_api_process``) is moved to once it runs (``--pin``:
#: the others, beside the simulated fleet), None: it stays where the control plane is.
AGENT_API_CPUS: set[int] | None = None

START_S = 60.0
"""How long a control plane may take to answer ``/api/v1/health`` (s; ~6 s here under load)."""


class ControlPlane:
    """``llmgw server run`` over ``inst`` as a child process (its output to ``server.log`` in its root)."""

    def __init__(self, inst: Install) -> None:
        self.inst = inst
        self.proc: subprocess.Popen[bytes] | None = None
        self.ps: psutil.Process | None = None
        self.rss_max = 0
        self.rss_phase_max: dict[str, int] = {}  # bytes, the largest in each phase :attr:`phase` named
        self.phase = ""
        self._cpu_before = 0.0  # CPU seconds of earlier processes (a restart starts a new one)

    async def start(self) -> None:
        """Start it and wait until its admin API answers.

        Raises:
            SystemExit: it exited or did not answer within :data:`START_S` (its log's tail printed)."""
        if self.ps is not None:
            self._cpu_before = self.cpu()
        log = (self.inst.root / "server.log").open("ab")
        # --pin: taskset confines the process and every thread it starts (a preexec_fn could deadlock
        # in a child forked from this threaded process)
        pin = ["taskset", "-c", ",".join(map(str, sorted(CP_CPUS)))] if CP_CPUS is not None else []
        self.proc = subprocess.Popen(  # noqa: ASYNC220 - its start is not what is measured
            [*pin, sys.executable, "-m", "llmgw", "server", "run"],
            env={**os.environ, "LLMGW_ROOT": str(self.inst.root)}, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + START_S
        async with httpx.AsyncClient(base_url=self.inst.admin, timeout=5) as client:
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/api/v1/health")).status_code == 200:
                        self._move_agent_api()
                        return
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    print((self.inst.root / "server.log").read_text()[-3000:])
                    raise SystemExit(f"the control plane under {self.inst.root} did not start")
                await asyncio.sleep(0.1)

    def _move_agent_api(self) -> None:
        """``--pin``: every thread of the agent API process to :data:`AGENT_API_CPUS` (threads it
        starts later inherit it)."""
        if AGENT_API_CPUS is None or self.ps is None:
            return
        for child in self.ps.children():
            with contextlib.suppress(psutil.Error, OSError):
                for thread in child.threads():
                    os.sched_setaffinity(thread.id, AGENT_API_CPUS)

    def processes(self) -> list[psutil.Process]:
        """The control plane's process and its children (the agent API process,
        ``cluster.agent_api_process``): what its CPU and memory count."""
        assert self.ps is not None
        with contextlib.suppress(psutil.Error):
            return [self.ps, *self.ps.children()]
        return []

    def cpu(self) -> float:
        """CPU seconds (user + system) of this control plane since the first start, its agent API
        process's included (one started again after a death is counted from its start)."""
        used = 0.0
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                used += sum(p.cpu_times()[:2])
        return self._cpu_before + used

    def own_cpu(self) -> float:
        """CPU seconds of the control plane's own process (the gateway's), now."""
        assert self.ps is not None
        return self._times(self.ps)

    def children_cpu(self) -> float:
        """CPU seconds of its children (the agent API process), now; 0 without one."""
        return sum(self._times(p) for p in self.processes()[1:])

    @staticmethod
    def _times(p: psutil.Process) -> float:
        with contextlib.suppress(psutil.Error):
            return sum(p.cpu_times()[:2])
        return 0.0

    async def sample_rss(self) -> None:
        """Keep :attr:`rss_max` and :attr:`rss_phase_max` (bytes) up to date, every second, until cancelled."""
        while True:
            if self.ps is not None:
                rss = 0
                for p in self.processes():
                    with contextlib.suppress(psutil.Error):
                        rss += p.memory_info().rss
                if rss:
                    self.rss_max = max(self.rss_max, rss)
                    self.rss_phase_max[self.phase] = max(self.rss_phase_max.get(self.phase, 0), rss)
            await asyncio.sleep(1.0)

    async def stop(self) -> None:
        """SIGTERM, up to 20 s to exit, then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        for _ in range(200):
            if self.proc.poll() is not None:
                return
            await asyncio.sleep(0.1)
        self.proc.kill()
        self.proc.wait()


def installs(
    root: Path, *, ha: bool, rate: float, lost_after_s: float, agent_api_process: bool = True
) -> tuple[list[Install], Cluster | None]:
    """One install on SQLite, or (``ha``) three on a new PostgreSQL cluster sharing the first's CA
    and server certificate; each with ``cluster.max_heartbeats_per_s`` ``rate``,
    ``cluster.agent_api_process`` and ``node_lost_after_s`` ``lost_after_s``. Returns the installs
    and the PostgreSQL cluster (to stop)."""
    cluster: dict[str, Any] = {"max_heartbeats_per_s": rate, "agent_api_process": agent_api_process}
    if not ha:
        return [make_install(root, cluster=cluster, node_lost_after_s=lost_after_s)], None
    pg = start_cluster()
    url = pg.new_database()
    out: list[Install] = []
    for i in range(3):
        inst = make_install(root / f"cp{i}")
        over: dict[str, Any] = {
            "store": {"url": url},
            "cluster": {"name": f"cp{i}", **cluster},
            "node_lost_after_s": lost_after_s,
        }
        if out:
            pki = out[0].paths.pki
            over["tls"] = {"ca": str(pki / "ca.pem"), "cert": str(pki / "server.pem"),
                           "key": str(pki / "server-key.pem")}
            inst.ca = out[0].ca
            inst.paths.admin_token.write_text(out[0].paths.admin_token.read_text())
        inst.write(**over)
        out.append(inst)
    return out, pg
