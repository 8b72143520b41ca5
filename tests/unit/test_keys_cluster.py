"""Stored keys across control planes: two real control planes (``serve`` in-process) on one real
PostgreSQL database, a fake engine (the engine is not what these tests are about).

A key made on one control plane works on the other within a second; a limit holds cluster-wide
within a second of traffic; a revoked key is refused on every control plane within a second; usage
written by both adds up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from llmgw.protocol import HeartbeatReply, ReplicaState, ReplicaStatus
from tests.helpers.control import TOKEN, Install, heartbeat, make_install, serving
from tests.helpers.net import serve_app
from tests.helpers.postgres import Cluster
from tests.helpers.waits import until

AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def fake_engine() -> AsyncIterator[str]:
    """A stand-in for llama-server's chat endpoint: 3 tokens per answer."""

    async def chat(_: web.Request) -> web.Response:
        return web.json_response({
            "id": "x", "object": "chat.completion", "created": 1, "model": "chat",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        })

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner, base = await serve_app(app)
    yield base.removeprefix("http://")
    await runner.cleanup()


def _install(root: Path, name: str, url: str, tls_of: Install | None = None) -> Install:
    inst = make_install(root)
    over: dict[str, Any] = {
        "store": {"url": url},
        "cluster": {"name": name, "lease_s": 2, "renew_s": 0.2},
        "gateway": {"listen": f"127.0.0.1:{inst.ports['gateway']}", "allow_loopback_without_key": False},
    }
    if tls_of is not None:
        pki = tls_of.paths.pki
        over["tls"] = {"ca": str(pki / "ca.pem"), "cert": str(pki / "server.pem"), "key": str(pki / "server-key.pem")}
        inst.ca = tls_of.ca
    inst.write(**over)
    return inst


async def _ready_model(s: aiohttp.ClientSession, inst: Install, endpoint: str) -> None:
    ctx = inst.agent_ctx("node-1")
    async with s.post(inst.agent_url + "/agent/v1/register", data=heartbeat(), ssl=ctx) as r:
        assert r.status == 200, await r.text()
    model = {"name": "chat", "source": "http://m/chat.gguf", "profiles": [{"name": "cpu"}]}
    async with s.post(inst.admin + "/api/v1/models", json=model, headers=AUTH) as r:
        assert r.status == 201, await r.text()

    async def placed() -> str | None:
        async with s.post(inst.agent_url + "/agent/v1/heartbeat", data=heartbeat(), ssl=ctx) as r:
            reply = HeartbeatReply.model_validate_json(await r.read())
        return reply.desired[0].id if reply.desired else None

    replica = await until("a replica is placed", placed, within_s=10)
    ready = ReplicaStatus(id=replica, state=ReplicaState.READY, endpoint=endpoint)
    async with s.post(inst.agent_url + "/agent/v1/heartbeat", data=heartbeat(ready), ssl=ctx) as r:
        assert r.status == 200


async def _chat(s: aiohttp.ClientSession, inst: Install, key: str) -> int:
    url = f"http://127.0.0.1:{inst.ports['gateway']}/v1/chat/completions"
    async with s.post(url, json=BODY, headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
        return r.status


async def test_keys_limits_and_usage_hold_across_two_control_planes(
    tmp_path: Path, pg_cluster: Cluster, fake_engine: str
) -> None:
    url = pg_cluster.new_database()
    a = _install(tmp_path / "a", "cp-a", url)
    b = _install(tmp_path / "b", "cp-b", url, tls_of=a)
    async with serving(a), serving(b), aiohttp.ClientSession() as s:
        await _ready_model(s, a, fake_engine)
        async with s.post(a.admin + "/api/v1/keys", json={"name": "team", "rpm": 10}, headers=AUTH) as r:
            assert r.status == 201, await r.text()
            secret = (await r.json())["secret"]
        made = time.monotonic()

        async def works_on_b() -> bool:
            return await _chat(s, b, secret) == 200

        async def works_on_a() -> bool:
            return await _chat(s, a, secret) == 200

        assert await works_on_a()  # made there: cp-a's gateway has it from the API's answer on
        await until("the new key works on cp-b", works_on_b, within_s=5)  # cp-b: its next key sync
        assert time.monotonic() - made < 2.0
        if time.time() % 60 > 54:  # the 30 requests below take ~5 s: keep them in one minute window
            await asyncio.sleep(61 - time.time() % 60)
        statuses = []
        for i in range(30):  # ~7 requests/s, alternating: every sync sees the other's counts
            statuses.append(await _chat(s, (a, b)[i % 2], secret))
            await asyncio.sleep(0.15)
        admitted = statuses.count(200)
        assert statuses.count(429) == 30 - admitted
        # The limit (less the two answered above when they fell in this minute), plus at most one
        # second of traffic (the control planes add each other's counts every 0.5 s).
        assert 10 - 2 <= admitted <= 10 + 7, statuses

        async with s.post(b.admin + "/api/v1/keys/team/revoke", headers=AUTH) as r:
            assert r.status == 200, await r.text()
        revoked = time.monotonic()

        async def refused_on_a() -> bool:
            return await _chat(s, a, secret) == 401

        await until("the revoked key is refused on cp-a", refused_on_a, within_s=5)
        assert time.monotonic() - revoked < 1.5

        async def usage() -> list[dict[str, Any]] | None:
            async with s.get(a.admin + "/api/v1/usage?key=team", headers=AUTH) as r:
                rows = await r.json()
            total = sum(row["requests"] for row in rows)
            return rows if total >= 2 + admitted else None

        rows = await until("usage from both control planes is written", usage, within_s=5)
        answered = sum(row["requests"] - row["errors"] for row in rows)  # errors: cp-b not routing it yet
        assert answered >= 2 + admitted
        assert sum(row["prompt_tokens"] for row in rows) == answered
        assert sum(row["completion_tokens"] for row in rows) == 2 * answered
