"""A control plane install on loopback for tests: cluster CA, server certificate, admin token,
free ports and server.yaml under one ``LLMGW_ROOT``, and ``serve`` running it in-process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
import httpx
import psutil
import yaml

from llmgw import protocol, tlsconf
from llmgw.control.server import serve
from llmgw.paths import Paths
from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ProvisionState, ReplicaStatus
from tests.helpers.net import free_port

TOKEN = "admin-token-for-tests"
#: The admin API's header with :data:`TOKEN`.
ADMIN_AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: A chat model for the admin API whose weights are never fetched (no engine runs it).
CHAT_MODEL = {"name": "chat", "source": "http://m/chat.gguf", "profiles": [{"name": "cpu"}]}
GB = 1_000_000_000
FAKE_ENGINE = """#!/bin/sh
case "$1" in
  --version) echo "version: 4242 (feedbee)"; exit 0;;
  --help) echo "-m, --model FNAME"; exit 0;;
esac
exec sleep 120
"""
"""A stand-in llama-server: answers ``--version`` and ``--help``, otherwise sleeps like one loading
a model, so placement and GPU assignment run on real agents without a model (replicas stay
``starting``)."""


@dataclass
class Install:
    """One install: ``ports`` maps ``admin``, ``agent`` and ``gateway`` to free loopback ports."""

    root: Path
    paths: Paths
    config: Path
    ports: dict[str, int]
    ca: tlsconf.CA

    @property
    def admin(self) -> str:
        """The admin API's URL."""
        return f"http://127.0.0.1:{self.ports['admin']}"

    @property
    def agent_url(self) -> str:
        """The agent API's URL (mTLS)."""
        return f"https://127.0.0.1:{self.ports['agent']}"

    def write(self, **over: Any) -> None:
        """Write server.yaml: loopback listeners, the install's TLS files, a keyless loopback
        gateway and ``node_lost_after_s: 30``; ``over`` replaces top-level keys."""
        pki = self.paths.pki
        doc: dict[str, Any] = {
            "admin_listen": f"127.0.0.1:{self.ports['admin']}",
            "agent_listen": f"127.0.0.1:{self.ports['agent']}",
            "tls": {
                "ca": str(pki / "ca.pem"),
                "cert": str(pki / "server.pem"),
                "key": str(pki / "server-key.pem"),
            },
            "gateway": {"listen": f"127.0.0.1:{self.ports['gateway']}", "allow_loopback_without_key": True},
            "node_lost_after_s": 30,
        }
        doc.update(over)
        self.config.write_text(yaml.safe_dump(doc))

    def agent_ctx(self, node: str) -> Any:
        """A client TLS context with a certificate for ``node`` (CN = node id) from the install's CA."""
        cert, key = self.ca.issue_client(node).write(self.root / "agent", node)
        return tlsconf.client_context(self.paths.pki / "ca.pem", cert, key)


def make_install(root: Path, **over: Any) -> Install:
    """A CA, a server certificate for 127.0.0.1, the admin token :data:`TOKEN`, three free ports and
    server.yaml (:meth:`Install.write` with ``over``) under ``root``."""
    paths = Paths(root)
    paths.etc.mkdir(parents=True)
    ca = tlsconf.CA.create()
    ca.write(paths.pki)
    ca.issue_server(["127.0.0.1"]).write(paths.pki, "server")
    paths.admin_token.write_text(TOKEN + "\n")
    ports = {"admin": free_port(), "agent": free_port(), "gateway": free_port()}
    inst = Install(root, paths, paths.server_config, ports, ca)
    inst.write(**over)
    return inst


def pg_install(root: Path, name: str, url: str, tls_of: Install | None = None) -> Install:
    """:func:`make_install` of a control plane named ``name`` on the PostgreSQL database ``url``, with a
    short lease (2 s, renewed every 0.2 s); with ``tls_of``, that install's CA and server certificate
    (one cluster)."""
    inst = make_install(root)
    over: dict[str, Any] = {"store": {"url": url}, "cluster": {"name": name, "lease_s": 2, "renew_s": 0.2}}
    if tls_of is not None:
        pki = tls_of.paths.pki
        over["tls"] = {"ca": str(pki / "ca.pem"), "cert": str(pki / "server.pem"), "key": str(pki / "server-key.pem")}
        inst.ca = tls_of.ca
    inst.write(**over)
    return inst


@dataclass
class Served:
    """A control plane served in-process: set ``stop`` to end it; ``bound`` as ``serve`` reports it."""

    stop: asyncio.Event
    task: asyncio.Task[None]
    bound: dict[str, tuple[str, int]]


@asynccontextmanager
async def serving(inst: Install, *, start_s: float = 20, stop_s: float = 15) -> AsyncIterator[Served]:
    """Run ``serve`` over ``inst`` until the block ends; raises what ``serve`` raised if it failed to start."""
    stop = asyncio.Event()
    started: asyncio.Future[dict[str, tuple[str, int]]] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(inst.config, inst.paths, stop=stop, on_started=started.set_result))
    done, _ = await asyncio.wait([task, started], timeout=start_s, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
    if started not in done:
        stop.set()
        raise AssertionError(f"the control plane did not start in {start_s} s")
    try:
        yield Served(stop, task, started.result())
    finally:
        stop.set()
        await asyncio.wait_for(task, stop_s)


def heartbeat(*replicas: ReplicaStatus, cores: int = 4, memory_gb: int = 8) -> str:
    """A heartbeat's JSON body: a node with llama.cpp installed, reporting ``replicas``."""
    return Heartbeat(
        inventory=Inventory(cores=cores, memory_total_bytes=memory_gb * GB, memory_available_bytes=memory_gb * GB),
        engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")],
        replicas=list(replicas),
    ).model_dump_json()


def make_keyed_install(root: Path, *keys: str) -> Install:
    """:func:`make_install` whose gateway takes only ``keys`` (written to ``etc/gateway-keys``),
    loopback clients included."""
    inst = make_install(root)
    keys_file = inst.paths.etc / "gateway-keys"
    keys_file.write_text("# the gateway's keys\n" + "".join(k + "\n" for k in keys))
    inst.write(
        gateway={
            "listen": f"127.0.0.1:{inst.ports['gateway']}",
            "keys_file": str(keys_file),
            "allow_loopback_without_key": False,
        }
    )
    return inst


@contextmanager
def server_run(inst: Install) -> Iterator[subprocess.Popen[bytes]]:
    """:func:`start_server_run` with its output piped; killed at the end if it still runs."""
    proc = start_server_run(inst)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def start_server_run(inst: Install, out: IO[bytes] | int = subprocess.PIPE) -> subprocess.Popen[bytes]:
    """``llmgw server run`` over ``inst`` as a child process, stdout and stderr to ``out``."""
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw", "server", "run"],
        env={**os.environ, "LLMGW_ROOT": str(inst.root)},
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def wait_admin_health(inst: Install, proc: subprocess.Popen[bytes], within_s: float = 30) -> None:
    """Wait until the admin API answers ``/api/v1/health`` with 200; fails with the process's output
    if it exits first, or after ``within_s`` seconds."""
    url = f"{inst.admin}/api/v1/health"
    deadline = time.monotonic() + within_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else "server run exited"
        assert time.monotonic() < deadline, f"server run did not answer /api/v1/health in {within_s:g} s"
        time.sleep(0.1)


async def run_ctl(inst: Install, *args: str) -> tuple[int, str]:
    """``llmgw ctl ARGS`` as a child process against ``inst`` (its root; the admin API and token from
    its files, as an operator's shell on the machine has them): exit code and stdout+stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmgw", "--root", str(inst.root), "ctl", *args,
        env={**os.environ, "LLMGW_ROOT": str(inst.root)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode()


def ctl_on_admin_app(store: Any, *args: str, token: str = "t" * 32) -> str:
    """``llmgw ctl ARGS`` (its Typer app, in this process) against a real admin API over ``store``
    served on a loopback port from a thread of its own; returns its output (exit 0 asserted)."""
    import threading  # noqa: PLC0415

    from aiohttp import web  # noqa: PLC0415
    from typer.testing import CliRunner  # noqa: PLC0415

    from llmgw.cli.main import app as cli  # noqa: PLC0415
    from llmgw.control.api.admin import build_admin_app  # noqa: PLC0415

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_admin_app(store, token=token, on_change=lambda: None, clock=lambda: 1000.0))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        r = CliRunner().invoke(cli, ["ctl", *args, "--server", f"http://127.0.0.1:{port}", "--token", token])
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(runner.cleanup())
        loop.close()
    assert r.exit_code == 0, r.output
    return r.output


async def beat_reply(
    s: aiohttp.ClientSession, inst: Install, ctx: Any, body: str | None = None
) -> protocol.HeartbeatReply:
    """One heartbeat to ``inst``'s agent API over mTLS (``ctx``: :meth:`Install.agent_ctx`), ``body``
    or :func:`heartbeat`'s; its reply (the test fails on another status than 200)."""
    async with s.post(inst.agent_url + "/agent/v1/heartbeat", data=body or heartbeat(), ssl=ctx) as r:
        assert r.status == 200, await r.text()
        return protocol.HeartbeatReply.model_validate_json(await r.read())


def agent_api_processes(pid: int | None = None) -> list[psutil.Process]:
    """The agent API processes (``cluster.agent_api_process``) started by ``pid`` (this process by default);
    a child that exits meanwhile, or is a zombie not yet reaped (another test's), is none of them."""
    found = []
    for child in psutil.Process(pid).children():
        with contextlib.suppress(psutil.Error):  # ZombieProcess, NoSuchProcess: CI saw the first
            if "llmgw.control.agentworker" in " ".join(child.cmdline()):
                found.append(child)
    return found


async def ready_and_routed(s: aiohttp.ClientSession, inst: Install, ctx: Any, replica_id: str, model: str) -> None:
    """Report ``replica_id`` ready at an endpoint nothing listens on (127.0.0.1:9) through ``inst``'s
    agent API, then ask ``inst``'s gateway for ``model``: it must route to the replica at once (502,
    the engine failed), not answer that the model has no ready replica."""
    ready = ReplicaStatus(id=replica_id, state=protocol.ReplicaState.READY, endpoint="127.0.0.1:9")
    await beat_reply(s, inst, ctx, heartbeat(ready))
    chat = {"model": model, "messages": [{"role": "user", "content": "hello"}]}
    async with s.post(f"http://127.0.0.1:{inst.ports['gateway']}/v1/chat/completions", json=chat) as r:
        text = await r.text()
        assert r.status == 502, text
        assert "no_ready_replica" not in text
