"""The agent API in a process of its own (``cluster.agent_api_process: true``) in an HA cluster.

Two control planes (llmgw's ``serve``, in this process: real admin API, real gateway, the leader
election with a 2 s lease) on one real PostgreSQL database; each serves its mTLS agent API from a
real child process (``python -m llmgw.control.agentworker``) that learns the election's view over
its channel (pushed every ``PUSH_S`` when it changes). Real HTTP, real mTLS with a certificate from
the cluster CA. The node is the test's client: it heartbeats to the follower's agent API only, posts
ready reports and log answers as the agent (:mod:`llmgw.agent.loop.loop`) does; no engine runs (a
ready replica's endpoint is a port nothing listens on, so the gateway's answer is 502).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from llmgw.control.agentproc import PUSH_S
from llmgw.control.reconcile.election import TAKEOVER_GRACE_S
from llmgw.protocol import HeartbeatReply, LogReply, ReplicaState, ReplicaStatus
from tests.helpers.control import (
    ADMIN_AUTH,
    CHAT_MODEL,
    Install,
    agent_api_processes,
    beat_reply,
    heartbeat,
    pg_install,
    ready_and_routed,
    serving,
)
from tests.helpers.postgres import Cluster
from tests.helpers.waits import until

AUTH, MODEL = ADMIN_AUTH, CHAT_MODEL
LEASE_S, RENEW_S = 2.0, 0.2  # pg_install's cluster.lease_s and renew_s
FAILOVER_S = LEASE_S + TAKEOVER_GRACE_S + RENEW_S + PUSH_S + 1.5
"""The leader stopped: its lease ends at most LEASE_S later (a clean stop closes its session, and the
follower takes the term at its next look, so it is usually much sooner), the follower takes it over
TAKEOVER_GRACE_S after that at its next look (RENEW_S), and its agent API process has the new view
within PUSH_S; 1.5 s of slack for a busy 2-core machine (a beat's round trip included)."""




def ha_install(root: Path, name: str, url: str, tls_of: Install | None = None) -> Install:
    """:func:`pg_install` with ``cluster.agent_api_process: true``."""
    inst = pg_install(root, name, url, tls_of=tls_of)
    doc = yaml.safe_load(inst.config.read_text())
    doc["cluster"]["agent_api_process"] = True
    inst.config.write_text(yaml.safe_dump(doc))
    return inst


async def leads(s: aiohttp.ClientSession, inst: Install) -> int:
    """``inst``'s term while its ``GET /api/v1/health`` says it leads, else 0."""
    async with s.get(inst.admin + "/api/v1/health") as r:
        got = await r.json()
    return int(got["term"]) if got.get("leader") else 0


@asynccontextmanager
async def two_control_planes(
    tmp_path: Path, pg: Cluster, s: aiohttp.ClientSession
) -> AsyncIterator[tuple[Install, Install, AsyncExitStack]]:
    """Leader A (served first, waited for until it leads), then follower B; closing the stack yielded
    with them stops A alone (B stops at the end of the block)."""
    url = pg.new_database()
    a = ha_install(tmp_path / "a", "cp-a", url)
    b = ha_install(tmp_path / "b", "cp-b", url, tls_of=a)
    async with AsyncExitStack() as outer:
        a_stack = await outer.enter_async_context(AsyncExitStack())
        await a_stack.enter_async_context(serving(a, stop_s=20))
        await until("A leads", lambda: leads(s, a), within_s=15)
        await outer.enter_async_context(serving(b, stop_s=20))
        assert len(agent_api_processes()) == 2  # one agent API process per control plane
        yield a, b, a_stack




async def test_replies_from_the_followers_process_name_the_leader_and_then_the_follower_once_it_stops(
    tmp_path: Path, pg_cluster: Cluster
) -> None:
    async with aiohttp.ClientSession() as s, two_control_planes(tmp_path, pg_cluster, s) as (a, b, a_stack):
        ctx = a.agent_ctx("node-1")
        term = await leads(s, a)
        assert term >= 1

        async def names_a() -> HeartbeatReply | None:
            reply = await beat_reply(s, b, ctx)
            return reply if sorted(reply.control_planes) == sorted([a.agent_url, b.agent_url]) else None

        # (a) B's process answers with the leader A, A's term and both members (B reads the members
        # every second, and its process has them PUSH_S later).
        reply = await until("B's replies name both members", names_a, within_s=10)
        assert (reply.node_id, reply.term, reply.leader) == ("node-1", term, a.agent_url)
        assert await leads(s, a) == term  # no election happened meanwhile

        # (b) A stops: B leads a higher term, and its process's replies say so within FAILOVER_S.
        await a_stack.aclose()
        stopped = time.monotonic()
        assert len(agent_api_processes()) == 1  # A's agent API process ended with it

        async def names_b() -> HeartbeatReply | None:
            reply = await beat_reply(s, b, ctx)
            return reply if reply.leader == b.agent_url else None

        reply = await until("B's replies name B as the leader", names_b, within_s=FAILOVER_S)
        took = time.monotonic() - stopped
        assert reply.term > term, (reply.term, term)
        assert b.agent_url in reply.control_planes
        assert await leads(s, b) == reply.term
        print(f"B's process named B the leader of term {reply.term} {took:.2f} s after A stopped")


async def test_a_node_beating_to_the_followers_process_is_placed_routed_and_its_logs_read_on_the_leader(
    tmp_path: Path, pg_cluster: Cluster
) -> None:
    async with aiohttp.ClientSession() as s, two_control_planes(tmp_path, pg_cluster, s) as (a, b, _):
        ctx = a.agent_ctx("node-1")
        assert (await beat_reply(s, b, ctx)).node_id == "node-1"  # registered through B's process
        async with s.post(b.admin + "/api/v1/models", json=MODEL, headers=AUTH) as r:
            assert r.status == 201, await r.text()

        async def placed() -> Any:
            return (await beat_reply(s, b, ctx)).desired or None

        # (c) The leader A places the replica; B's process hands it to the node.
        [spec] = await until("the leader's placement reaches node-1 through B's process", placed, within_s=15)
        assert spec.model == "chat"
        await ready_and_routed(s, b, ctx, spec.id, "chat")  # B's gateway routes to it at once

        # (d) A log read asked on the leader's admin API: the request reaches the node in a reply of
        # B's process (through the store), the answer posted there reaches A's waiting read.
        async def read() -> tuple[int, Any]:
            async with s.get(f"{a.admin}/api/v1/replicas/{spec.id}/logs?lines=2", headers=AUTH) as r:
                return r.status, await r.json()

        reading = asyncio.create_task(read())

        ready = ReplicaStatus(id=spec.id, state=ReplicaState.READY, endpoint="127.0.0.1:9")

        async def carried() -> Any:
            return (await beat_reply(s, b, ctx, heartbeat(ready))).log_requests or None

        [req] = await until("a reply of B's process carries A's log request", carried, within_s=8)
        assert (req.replica_id, req.lines) == (spec.id, 2)
        text = "load_model: done\nslot 0: idle\n"
        answer = LogReply(id=req.id, replica_id=spec.id, text=text, offset=len(text))
        async with s.post(b.agent_url + "/agent/v1/logs", data=answer.model_dump_json(), ssl=ctx) as r:
            assert r.status == 200, await r.text()
        status, body = await asyncio.wait_for(reading, 10)
        assert status == 200, body
        assert body == {"replica": spec.id, "node": "node-1", "text": text, "offset": len(text)}
