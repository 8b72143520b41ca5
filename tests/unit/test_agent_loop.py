"""The agent loop against a real mTLS control-plane stand-in (aiohttp, the cluster CA's certificates).

No engine is launched: the desired replica asks for vLLM, which a node without an NVIDIA GPU cannot
run, so it goes fetching → failed, which exercises fetch, reconcile and reporting without llama-server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from llmgw.agent.loop.loop import run_agent
from llmgw.config import AgentConfig
from llmgw.paths import Paths
from llmgw.protocol import Heartbeat, HeartbeatReply, ReplicaSpec
from llmgw.tlsconf import CA, peer_common_name, server_context
from tests.helpers.nodes import declared_node

WEIGHTS = b"GGUF" + b"\0" * 1000


@dataclass
class ControlPlane:
    """Records every heartbeat; answers with ``desired``."""

    desired: list[ReplicaSpec] = field(default_factory=list)
    calls: list[tuple[str, str | None, Heartbeat]] = field(default_factory=list)
    got: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        transport = request.transport
        assert transport is not None
        cn = peer_common_name(transport.get_extra_info("peercert"))
        beat = Heartbeat.model_validate_json(await request.read())
        self.calls.append((request.path, cn, beat))
        self.got.set()
        reply = HeartbeatReply(node_id=cn or "", desired=self.desired)
        return web.json_response(json.loads(reply.model_dump_json()))


async def start_site(
    app: web.Application, ssl_ctx: ssl.SSLContext | None = None
) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_ctx)
    await site.start()
    return runner, runner.addresses[0][1]


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[tuple[AgentConfig, ControlPlane, str]]:
    ca = CA.create()
    pki = tmp_path / "pki"
    ca.write(pki)
    srv_cert, srv_key = ca.issue_server(["127.0.0.1"]).write(pki, "server")
    cert, key = ca.issue_client("node-1").write(tmp_path / "etc", "agent")
    cp = ControlPlane()
    api = web.Application()
    api.router.add_post("/agent/v1/register", cp.handle)
    api.router.add_post("/agent/v1/heartbeat", cp.handle)
    api_runner, api_port = await start_site(api, server_context(pki / "ca.pem", srv_cert, srv_key))
    files = web.Application()

    async def weights(request: web.Request) -> web.Response:
        return web.Response(body=WEIGHTS)

    files.router.add_get("/{tail:.*}", weights)
    files_runner, files_port = await start_site(files)
    inv, fake = declared_node(tmp_path)
    cfg = AgentConfig.model_validate(
        {
            "server": f"https://127.0.0.1:{api_port}",
            "node_id": "node-1",
            "tls": {"ca": pki / "ca.pem", "cert": cert, "key": key},
            "labels": {"zone": "a"},
            "discovery": {"inventory_file": str(inv)},
            "engines": {"llamacpp": {"binary": str(fake)}},
            "heartbeat_interval_s": 0.2,
        }
    )
    yield cfg, cp, f"http://127.0.0.1:{files_port}"
    await api_runner.cleanup()
    await files_runner.cleanup()


async def wait_for(cp: ControlPlane, pred: Any, within_s: float = 10) -> tuple[str, str | None, Heartbeat]:
    async def loop() -> tuple[str, str | None, Heartbeat]:
        while True:
            for call in reversed(cp.calls):
                if pred(call):
                    return call
            cp.got.clear()
            await cp.got.wait()

    return await asyncio.wait_for(loop(), within_s)


async def test_register_heartbeat_reconcile(
    tmp_path: Path, world: tuple[AgentConfig, ControlPlane, str]
) -> None:
    cfg, cp, files = world
    stop = asyncio.Event()
    task = asyncio.create_task(run_agent(cfg, Paths(tmp_path / "root"), stop=stop))
    try:
        path, cn, beat = await wait_for(cp, lambda c: True)
        assert path == "/agent/v1/register"
        assert cn == "node-1"  # the node is its certificate
        assert beat.inventory.cores == 4
        assert beat.labels == {"zone": "a"}
        engine, vllm = beat.engines
        assert (engine.engine, engine.state, engine.version) == ("llamacpp", "installed", "4242")
        assert (vllm.engine, vllm.state) == ("vllm", "unsupported")  # no NVIDIA GPU here
        assert "needs an NVIDIA GPU" in vllm.detail

        await wait_for(cp, lambda c: c[0] == "/agent/v1/heartbeat")
        cp.desired = [
            ReplicaSpec(
                id="r-1",
                model="m",
                version="v1",
                profile="gpu",
                engine="vllm",
                source_url=f"{files}/m/v1/w.gguf",
                sha256=hashlib.sha256(WEIGHTS).hexdigest(),
                file_name="w.gguf",
                key="k",
            )
        ]
        _, _, beat = await wait_for(cp, lambda c: any(r.state == "failed" for r in c[2].replicas))
        (rep,) = beat.replicas
        assert rep.id == "r-1"
        assert "vllm is not usable on this node: vLLM needs an NVIDIA GPU" in rep.err
        cached = tmp_path / "root" / "var/lib/llmgw-agent/cache/m/v1/w.gguf"
        assert cached.read_bytes() == WEIGHTS  # fetched before the engine was looked at

        cp.desired = []
        await wait_for(cp, lambda c: c[0] == "/agent/v1/heartbeat" and not c[2].replicas)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_unreachable_control_plane_is_retried(
    tmp_path: Path, world: tuple[AgentConfig, ControlPlane, str]
) -> None:
    cfg, cp, _ = world
    # Nothing listens on port 9 of loopback: the agent must keep trying, not exit.
    down = cfg.model_copy(update={"server": "https://127.0.0.1:9"})
    stop = asyncio.Event()
    task = asyncio.create_task(run_agent(down, Paths(tmp_path / "root"), stop=stop))
    await asyncio.sleep(0.7)
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, 10)
    assert cp.calls == []
