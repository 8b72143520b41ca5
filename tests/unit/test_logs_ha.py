"""``GET /api/v1/replicas/{id}/logs`` through any control plane of an HA cluster.

Two real control planes (``serve`` in-process: real admin API, real mTLS agent API, the leader
election) on one real PostgreSQL database. The node is played by the agent-API client the other
cluster tests use (real HTTP over mTLS with a certificate from the cluster CA): it heartbeats to
control plane A only, takes the log requests its replies carry and posts the answers, as the agent
(:mod:`llmgw.agent.loop.loop`) does; the engine log text is the test's (no engine runs here, the read
path is what is tested).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import sqlalchemy as sa

from llmgw.protocol import HeartbeatReply, LogReply, LogRequest
from tests.helpers.control import TOKEN, Install, heartbeat, pg_install, serving
from tests.helpers.postgres import Cluster
from tests.helpers.waits import until

AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODEL = {"name": "chat", "source": "http://m/chat.gguf", "profiles": [{"name": "cpu"}]}




async def beat(s: aiohttp.ClientSession, inst: Install, ctx: Any) -> HeartbeatReply:
    """One heartbeat of node-1 to ``inst``; its reply."""
    async with s.post(inst.agent_url + "/agent/v1/heartbeat", data=heartbeat(), ssl=ctx) as r:
        assert r.status == 200, await r.text()
        return HeartbeatReply.model_validate_json(await r.read())


async def requests_from(s: aiohttp.ClientSession, inst: Install, ctx: Any) -> list[LogRequest]:
    """Heartbeat to ``inst`` until a reply carries log requests (every 0.1 s, as a busy agent would)."""

    async def carried() -> list[LogRequest] | None:
        return (await beat(s, inst, ctx)).log_requests or None

    return await until(f"a heartbeat reply of {inst.agent_url} carries a log request", carried, within_s=8)


async def post_log(s: aiohttp.ClientSession, inst: Install, ctx: Any, reply: LogReply) -> tuple[int, Any]:
    async with s.post(inst.agent_url + "/agent/v1/logs", data=reply.model_dump_json(), ssl=ctx) as r:
        return r.status, await r.json()


async def get_logs(s: aiohttp.ClientSession, inst: Install, rid: str, query: str = "") -> tuple[int, Any, float]:
    """``GET /api/v1/replicas/{rid}/logs`` on ``inst``: status, body, seconds taken."""
    started = time.monotonic()
    async with s.get(f"{inst.admin}/api/v1/replicas/{rid}/logs{query}", headers=AUTH) as r:
        return r.status, await r.json(), time.monotonic() - started


async def test_logs_asked_on_either_control_plane_reach_a_node_beating_to_the_other(
    tmp_path: Path, pg_cluster: Cluster
) -> None:
    url = pg_cluster.new_database()
    a = pg_install(tmp_path / "a", "cp-a", url)
    b = pg_install(tmp_path / "b", "cp-b", url, tls_of=a)
    ctx = a.agent_ctx("node-1")
    async with serving(a), serving(b), aiohttp.ClientSession() as s:
        async with s.post(a.agent_url + "/agent/v1/register", data=heartbeat(), ssl=ctx) as r:
            assert r.status == 200, await r.text()
        async with s.post(b.admin + "/api/v1/models", json=MODEL, headers=AUTH) as r:
            assert r.status == 201, await r.text()

        async def placed() -> str | None:
            reply = await beat(s, a, ctx)
            return reply.desired[0].id if reply.desired else None

        rid = await until("a replica is placed on node-1", placed, within_s=15)

        # Asked on B; the node beats to A, which hands the request out and takes the answer.
        asked = asyncio.create_task(get_logs(s, b, rid, "?lines=3"))
        (req,) = await requests_from(s, a, ctx)
        assert (req.replica_id, req.lines, req.offset) == (rid, 3, None)
        assert (await beat(s, a, ctx)).log_requests == []  # handed out once
        assert (await beat(s, b, ctx)).log_requests == []  # by one control plane only
        text = "load_model: done\nserver is listening on http://127.0.0.1:8080\nslot 0: idle\n"
        got = await post_log(s, a, ctx, LogReply(id=req.id, replica_id=rid, text=text, offset=len(text)))
        assert got == (200, {"status": "ok"})
        status, body, _ = await asyncio.wait_for(asked, 10)
        assert status == 200, body
        assert body == {"replica": rid, "node": "node-1", "text": text, "offset": len(text)}
        assert await post_log(s, a, ctx, LogReply(id=req.id, replica_id=rid, text="again")) == (
            404, {"error": {"code": "no_such_request",
                            "message": f"no log request {req.id} waits for node node-1"}},
        )

        # Asked on A, where the node beats: answered through A's own waiting read.
        asked = asyncio.create_task(get_logs(s, a, rid, f"?offset={len(text)}"))
        (req,) = await requests_from(s, a, ctx)
        assert req.offset == len(text)
        assert (await post_log(s, a, ctx, LogReply(id=req.id, replica_id=rid, text="more\n", offset=90)))[0] == 200
        status, body, _ = await asyncio.wait_for(asked, 10)
        assert (status, body["text"], body["offset"]) == (200, "more\n", 90)

        # The node has no log for it: 404 no_log, whichever control plane it answers.
        asked = asyncio.create_task(get_logs(s, b, rid))
        (req,) = await requests_from(s, a, ctx)
        assert (await post_log(s, b, ctx, LogReply(id=req.id, replica_id=rid, found=False)))[0] == 200
        status, body, _ = await asyncio.wait_for(asked, 10)
        assert (status, body["error"]["code"]) == (404, "no_log")

        # Every finished read's row is gone (deleted in the background by the asker).
        engine = sa.create_engine(url)
        try:
            async def empty() -> bool:
                with engine.connect() as conn:
                    return conn.scalar(sa.text("SELECT count(*) FROM log_requests")) == 0

            await until("the log_requests rows are deleted", empty, within_s=5)
        finally:
            engine.dispose()
