"""The control plane process: serve() wiring in-process (all three listeners, a heartbeat through to a
proxied chat answer) and port clashes named; `llmgw server run` as a real process is in
tests/e2e/test_processes.py."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from typer.testing import CliRunner

from llmgw.cli.main import app as cli_app
from llmgw.control.server import serve
from llmgw.errors import ConfigError, PortInUseError
from llmgw.protocol import (
    HeartbeatReply,
    ReplicaState,
    ReplicaStatus,
)
from tests.helpers.control import (
    TOKEN,
    Install,
    Served,
    heartbeat,
    make_install,
    serving,
)
from tests.helpers.net import serve_app


@pytest.fixture
def install(tmp_path: Path) -> Install:
    return make_install(tmp_path)


@pytest.fixture
async def served(install: Install) -> AsyncIterator[Served]:
    async with serving(install, stop_s=10) as got:
        yield got


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
    runner, base = await serve_app(app)
    yield base.removeprefix("http://"), seen
    await runner.cleanup()


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
