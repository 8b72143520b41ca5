"""The control plane process: serve() wiring in-process (all three listeners, a heartbeat through to a
proxied chat answer), port clashes named, and `llmgw server run` as a real process stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml
from aiohttp import web
from typer.testing import CliRunner

from llmgw import tlsconf
from llmgw.cli.main import app as cli_app
from llmgw.control.server import serve
from llmgw.errors import ConfigError, PortInUseError
from llmgw.paths import Paths
from llmgw.protocol import (
    EngineStatus,
    Heartbeat,
    HeartbeatReply,
    Inventory,
    ProvisionState,
    ReplicaState,
    ReplicaStatus,
)

TOKEN = "admin-token-for-tests"
GB = 1_000_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Install:
    root: Path
    paths: Paths
    config: Path
    ports: dict[str, int]
    ca: tlsconf.CA

    def write(self, **over: Any) -> None:
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
        cert, key = self.ca.issue_client(node).write(self.root / "agent", node)
        return tlsconf.client_context(self.paths.pki / "ca.pem", cert, key)


@pytest.fixture
def install(tmp_path: Path) -> Install:
    paths = Paths(tmp_path)
    paths.etc.mkdir(parents=True)
    ca = tlsconf.CA.create()
    ca.write(paths.pki)
    ca.issue_server(["127.0.0.1"]).write(paths.pki, "server")
    (paths.etc / "admin-token").write_text(TOKEN + "\n")
    ports = {"admin": free_port(), "agent": free_port(), "gateway": free_port()}
    inst = Install(tmp_path, paths, paths.server_config, ports, ca)
    inst.write()
    return inst


@dataclass
class Served:
    stop: asyncio.Event
    task: asyncio.Task[None]
    bound: dict[str, tuple[str, int]]


@pytest.fixture
async def served(install: Install) -> AsyncIterator[Served]:
    stop = asyncio.Event()
    started: asyncio.Future[dict[str, tuple[str, int]]] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(install.config, install.paths, stop=stop, on_started=started.set_result))
    done, _ = await asyncio.wait([task, started], timeout=20, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # raises what serve raised
    bound = started.result()
    yield Served(stop, task, bound)
    stop.set()
    await asyncio.wait_for(task, 10)


@pytest.fixture
async def fake_engine() -> AsyncIterator[tuple[str, list[str]]]:
    """A stand-in for llama-server's chat endpoint that records the key it was sent."""
    seen: list[str] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        body = await request.json()
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 1,
                "model": body.get("model", ""),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hi there"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"127.0.0.1:{port}", seen
    await runner.cleanup()


def heartbeat(*replicas: ReplicaStatus) -> str:
    return Heartbeat(
        inventory=Inventory(cores=4, memory_total_bytes=8 * GB, memory_available_bytes=8 * GB),
        engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")],
        replicas=list(replicas),
    ).model_dump_json()


async def test_serve_wires_admin_agent_leader_and_gateway(
    install: Install, served: Served, fake_engine: tuple[str, list[str]]
) -> None:
    admin = f"http://127.0.0.1:{install.ports['admin']}"
    agent = f"https://127.0.0.1:{install.ports['agent']}"
    gateway = f"http://127.0.0.1:{install.ports['gateway']}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    ctx = install.agent_ctx("node-1")
    endpoint, seen = fake_engine
    async with aiohttp.ClientSession() as s:
        async with s.get(admin + "/api/v1/health") as r:
            assert r.status == 200
        async with s.post(agent + "/agent/v1/register", data=heartbeat(), ssl=ctx) as r:
            assert r.status == 200
        model = {"name": "chat", "source": "http://m/chat.gguf", "profiles": [{"name": "cpu"}]}
        async with s.post(admin + "/api/v1/models", json=model, headers=auth) as r:
            assert r.status == 201, await r.text()
        # The admin write wakes the leader: a replica appears without waiting for a tick.
        spec = None
        for _ in range(50):
            async with s.post(agent + "/agent/v1/heartbeat", data=heartbeat(), ssl=ctx) as r:
                reply = HeartbeatReply.model_validate_json(await r.read())
            if reply.desired:
                spec = reply.desired[0]
                break
            await asyncio.sleep(0.1)
        assert spec is not None
        assert reply.node_id == "node-1"
        body = {"model": "chat", "messages": [{"role": "user", "content": "hello"}]}
        async with s.post(gateway + "/v1/chat/completions", json=body) as r:
            assert r.status == 503, await r.text()  # placed, not ready yet
        ready = ReplicaStatus(id=spec.id, state=ReplicaState.READY, endpoint=endpoint)
        async with s.post(agent + "/agent/v1/heartbeat", data=heartbeat(ready), ssl=ctx) as r:
            assert r.status == 200
        async with s.post(gateway + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
    assert answer["choices"][0]["message"]["content"] == "hi there"
    assert seen == [f"Bearer {spec.key}"]


@pytest.mark.parametrize(("which", "setting"), [("admin", "admin_listen"), ("gateway", "gateway.listen")])
async def test_port_in_use_names_the_listener(install: Install, which: str, setting: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", install.ports[which]))
        taken.listen()
        with pytest.raises(PortInUseError) as e:
            await serve(install.config, install.paths, stop=asyncio.Event())
    msg = str(e.value)
    assert setting in msg
    assert f"port {install.ports[which]} is already in use" in msg
    # Nothing half-started stays bound: the other listeners' ports are free again.
    for other, port in install.ports.items():
        if other != which:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


async def test_missing_admin_token_is_a_config_error(install: Install) -> None:
    (install.paths.etc / "admin-token").unlink()
    with pytest.raises(ConfigError, match=r"admin token file .* does not exist; run 'llmgw server init'"):
        await serve(install.config, install.paths, stop=asyncio.Event())


def test_cli_run_reports_a_missing_config(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli_app, ["--root", str(tmp_path), "server", "run"])
    assert result.exit_code == 2
    assert "server.yaml does not exist" in result.output


@pytest.fixture
def process(install: Install) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "LLMGW_ROOT": str(install.root)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "server", "run"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.mark.e2e
def test_server_run_process_serves_and_stops_on_sigterm(
    install: Install, process: subprocess.Popen[bytes]
) -> None:
    url = f"http://127.0.0.1:{install.ports['admin']}/api/v1/health"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
        assert time.monotonic() < deadline, "server run did not answer /api/v1/health in 30 s"
        time.sleep(0.1)
    assert install.paths.database.exists()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 0
