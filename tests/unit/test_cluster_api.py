"""Several real control planes (``serve`` in-process, real listeners, mTLS) on one real PostgreSQL
database: one leads, every one serves, ``/api/v1/cluster``, ``/api/v1/health`` and ``ctl cluster``
say so, and a database outage leaves the gateway routing while admin writes answer 503 fast.

Patroni is not run by the unit tests (tests/ha runs it): ``cluster.patroni`` names a closed port
and a stand-in answering Patroni's documented ``GET /cluster`` shape, to check that the first URL
that answers is used and that one that does not is reported, not fatal.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
import sqlalchemy as sa
from aiohttp import web
from typer.testing import CliRunner

from llmgw.cli.main import app as cli_app
from llmgw.control.api.cluster import parse_patroni, read_patroni
from llmgw.control.reconcile import membership
from llmgw.protocol import HeartbeatReply, ReplicaState, ReplicaStatus
from llmgw.views import ClusterView
from tests.helpers.control import TOKEN, Install, heartbeat, make_install, serving
from tests.helpers.net import free_port, serve_app
from tests.helpers.postgres import Cluster
from tests.helpers.waits import until

AUTH = {"Authorization": f"Bearer {TOKEN}"}

PATRONI_CLUSTER = {
    "members": [
        {"name": "pg1", "role": "leader", "state": "running", "api_url": "http://127.0.0.1:8008/patroni",
         "host": "127.0.0.1", "port": 5432, "timeline": 3},
        {"name": "pg2", "role": "sync_standby", "state": "streaming", "api_url": "http://127.0.0.1:8009/patroni",
         "host": "127.0.0.1", "port": 5433, "timeline": 3, "lag": 0},
        {"name": "pg3", "role": "replica", "state": "streaming", "api_url": "http://127.0.0.1:8010/patroni",
         "host": "127.0.0.1", "port": 5434, "timeline": 3, "lag": "unknown"},
    ],
    "scope": "llmgw",
}


@pytest.fixture
async def patroni_stand_in() -> AsyncIterator[str]:
    """An HTTP server answering ``GET /cluster`` as Patroni's REST API does (see the module docstring)."""

    async def cluster(_: web.Request) -> web.Response:
        return web.json_response(PATRONI_CLUSTER)

    app = web.Application()
    app.router.add_get("/cluster", cluster)
    runner, base = await serve_app(app)
    yield base
    await runner.cleanup()


@pytest.fixture
async def fake_engine() -> AsyncIterator[str]:
    """A stand-in for llama-server's chat endpoint (the engine is not what these tests are about)."""

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({
            "id": "x", "object": "chat.completion", "created": 1, "model": body.get("model", ""),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi there"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        })

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner, base = await serve_app(app)
    yield base.removeprefix("http://")
    await runner.cleanup()


def _ha_install(root: Path, name: str, url: str, patroni: list[str], tls_of: Install | None = None) -> Install:
    """A control plane install on the PostgreSQL database ``url``, named ``name``, with a short lease;
    with ``tls_of``, that install's CA and server certificate (one cluster, one CA)."""
    inst = make_install(root)
    over: dict[str, Any] = {
        "store": {"url": url},
        "cluster": {"name": name, "patroni": patroni, "lease_s": 2, "renew_s": 0.2},
    }
    if tls_of is not None:
        pki = tls_of.paths.pki
        over["tls"] = {"ca": str(pki / "ca.pem"), "cert": str(pki / "server.pem"), "key": str(pki / "server-key.pem")}
        inst.ca = tls_of.ca
    inst.write(**over)
    return inst


async def _get(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url, headers=AUTH) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_two_control_planes_one_leader_both_serve_and_say_so(
    tmp_path: Path, pg_cluster: Cluster, patroni_stand_in: str
) -> None:
    url = pg_cluster.new_database()
    patroni = [f"http://127.0.0.1:{free_port()}", patroni_stand_in]  # the first does not answer
    a = _ha_install(tmp_path / "a", "cp-a", url, patroni)
    b = _ha_install(tmp_path / "b", "cp-b", url, patroni, tls_of=a)
    async with serving(a) as served_a, aiohttp.ClientSession() as s:
        await until("cp-a leads alone", lambda: _leads(s, a), within_s=10)  # started first: it leads
        async with serving(b):

            async def both_listed() -> ClusterView | None:
                view = ClusterView.model_validate(await _get(s, b.admin + "/api/v1/cluster"))
                names = [c.name for c in view.control_planes]
                return view if names == ["cp-a", "cp-b"] and view.leader else None

            view = await until("cp-b lists both control planes and the leader", both_listed, within_s=10)
            health = {n: await _get(s, i.admin + "/api/v1/health") for n, i in (("cp-a", a), ("cp-b", b))}
            assert [n for n, h in health.items() if h["leader"]] == ["cp-a"]
            term = health["cp-a"]["term"]
            assert term >= 1
            assert health["cp-b"]["term"] == term
            assert {h["database"] for h in health.values()} == {"ok"}
            assert view.me == "cp-b"
            assert view.leader == "cp-a"
            assert view.term == term
            assert view.database.reachable
            assert all(c.alive for c in view.control_planes)
            assert [c.name for c in view.control_planes if c.leader] == ["cp-a"]
            assert [(m.name, m.role, m.state, m.host, m.lag) for m in view.patroni] == [
                ("pg1", "leader", "running", "127.0.0.1:5432", None),
                ("pg2", "sync_standby", "streaming", "127.0.0.1:5433", 0),
                ("pg3", "replica", "streaming", "127.0.0.1:5434", "unknown"),
            ]

            # The follower answers heartbeats too, naming the term, the leader and both members.
            async with s.post(b.agent_url + "/agent/v1/register", data=heartbeat(),
                              ssl=a.agent_ctx("node-1")) as r:
                assert r.status == 200, await r.text()
                reply = HeartbeatReply.model_validate_json(await r.read())
            assert reply.term == term
            assert reply.leader == a.agent_url
            assert sorted(reply.control_planes) == sorted([a.agent_url, b.agent_url])

            # ctl cluster, as an operator runs it against the follower.
            out = await asyncio.to_thread(
                CliRunner().invoke, cli_app,
                ["--root", str(tmp_path / "b"), "ctl", "cluster", "--server", b.admin, "--token", TOKEN],
            )
            assert out.exit_code == 0, out.output
            assert f"term {term}, leader cp-a" in out.output
            for word in ("cp-a", "cp-b", "pg1", "sync_standby", "streaming", "127.0.0.1:5434"):
                assert word in out.output

            # The leader goes away: cp-b takes over with a higher term.
            served_a.stop.set()
            await asyncio.wait_for(served_a.task, 15)
            stopped = time.monotonic()
            await until("cp-b leads", lambda: _leads(s, b), within_s=10)
            took = time.monotonic() - stopped
            assert (await _get(s, b.admin + "/api/v1/health"))["term"] > term
            assert took < 3, f"takeover took {took:.2f} s"


async def test_a_leader_that_stepped_down_is_not_named_while_nobody_leads(tmp_path: Path, pg_cluster: Cluster) -> None:
    """Issue 19 item 5: the term's holder stepped down (its renewals hang: a session holds the
    ``cp_leader`` row, so nobody can take a term either) while its control plane stays alive. The
    follower's ``GET /api/v1/cluster``, its heartbeat replies and ``ctl cluster`` said the old holder
    led, exactly while no reconciler ran; now: no leader, and since when. Real control planes
    (in-process ``serve``, real listeners) on a real PostgreSQL 15; lease 2 s."""
    url = pg_cluster.new_database()
    a = _ha_install(tmp_path / "a", "cp-a", url, [])
    b = _ha_install(tmp_path / "b", "cp-b", url, [], tls_of=a)
    u = sa.make_url(url)
    db = {"host": u.host, "port": u.port, "user": u.username, "dbname": u.database}
    async with serving(a), aiohttp.ClientSession() as s:
        await until("cp-a leads alone", lambda: _leads(s, a), within_s=10)
        async with serving(b):

            async def view_of_b() -> ClusterView:
                return ClusterView.model_validate(await _get(s, b.admin + "/api/v1/cluster"))

            async def names_a() -> bool:
                return (await view_of_b()).leader == "cp-a"

            await until("cp-b names cp-a the leader", names_a, within_s=10)
            with psycopg.connect(**db) as blocker:  # type: ignore[arg-type]
                blocker.execute("SELECT term FROM cp_leader WHERE id = 1 FOR UPDATE")  # renewals now hang
                blocked = time.time()
                await until("cp-a steps down", lambda: _not(_leads(s, a)), within_s=4)

                async def none_named() -> ClusterView | None:
                    v = await view_of_b()
                    return v if not v.leader else None

                view = await until("cp-b says nobody leads", none_named, within_s=4)
                assert view.no_leader_since is not None
                assert blocked - 2.5 <= view.no_leader_since <= time.time(), (blocked, view.no_leader_since)
                assert not any(c.leader for c in view.control_planes)
                health = [await _get(s, i.admin + "/api/v1/health") for i in (a, b)]
                assert [h["leader"] for h in health] == [False, False]

                async with s.post(b.agent_url + "/agent/v1/register", data=heartbeat(),
                                  ssl=a.agent_ctx("node-1")) as r:
                    assert r.status == 200, await r.text()
                    reply = HeartbeatReply.model_validate_json(await r.read())
                assert reply.leader == ""

                out = await asyncio.to_thread(
                    CliRunner().invoke, cli_app,
                    ["--root", str(tmp_path / "b"), "ctl", "cluster", "--server", b.admin, "--token", TOKEN],
                )
                assert out.exit_code == 0, out.output
                assert "no leader since" in out.output, out.output
                assert "leader cp-a" not in out.output

                # The dashboard's overview, logged in with the admin token.
                jar = aiohttp.CookieJar(unsafe=True)  # cookies for 127.0.0.1
                async with aiohttp.ClientSession(cookie_jar=jar) as ui:
                    async with ui.get(b.admin + "/ui/login") as r:
                        csrf = re.search(r'name="csrf" value="([^"]+)"', await r.text())
                    assert csrf is not None
                    form = {"csrf": csrf.group(1), "token": TOKEN, "next": ""}
                    async with ui.post(b.admin + "/ui/login", data=form) as r:
                        assert r.status == 200, await r.text()
                        page = await r.text()
                assert "Leader: <strong>no leader since" in page, page[:3000]
                blocker.rollback()
            await until("a leader again", lambda: _either_leads(s, a, b), within_s=10)

            async def named() -> ClusterView | None:
                v = await view_of_b()
                return v if v.leader else None

            again = await until("cp-b names the new leader", named, within_s=5)
            assert again.no_leader_since is None


async def _not(c: Any) -> bool:
    return not await c


async def _either_leads(s: aiohttp.ClientSession, *insts: Install) -> bool:
    return any([await _leads(s, i) for i in insts])


def _libpq(url: str) -> dict[str, Any]:
    u = sa.make_url(url)
    return {"host": u.host, "port": u.port, "user": u.username, "dbname": "postgres", "autocommit": True}


async def test_database_outage_admin_writes_503_fast_gateway_keeps_routing(
    tmp_path: Path, pg_cluster: Cluster, fake_engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Health's ``database`` (unreachable, then ok again for "leading again") is the last members read,
    # each READ_EVERY_S (1 s); read every 0.2 s here, as often as the lease is renewed. The bounds
    # waited on (8 and 10 s) are far more than either interval.
    monkeypatch.setattr(membership, "READ_EVERY_S", 0.2)
    url = pg_cluster.new_database()
    dbname = sa.make_url(url).database
    inst = _ha_install(tmp_path / "a", "cp-a", url, [])
    ctx = inst.agent_ctx("node-1")
    gateway = f"http://127.0.0.1:{inst.ports['gateway']}"
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hello"}]}
    model = {"name": "chat", "source": "http://m/chat.gguf", "profiles": [{"name": "cpu"}]}
    async with serving(inst), aiohttp.ClientSession() as s:
        await until("leading", lambda: _leads(s, inst), within_s=10)
        async with s.post(inst.agent_url + "/agent/v1/register", data=heartbeat(), ssl=ctx) as r:
            assert r.status == 200
        async with s.post(inst.admin + "/api/v1/models", json=model, headers=AUTH) as r:
            assert r.status == 201, await r.text()

        async def placed() -> Any:
            async with s.post(inst.agent_url + "/agent/v1/heartbeat", data=heartbeat(), ssl=ctx) as r:
                reply = HeartbeatReply.model_validate_json(await r.read())
            return reply.desired[0] if reply.desired else None

        spec = await until("a replica is placed", placed, within_s=10)
        ready = ReplicaStatus(id=spec.id, state=ReplicaState.READY, endpoint=fake_engine)
        async with s.post(inst.agent_url + "/agent/v1/heartbeat", data=heartbeat(ready), ssl=ctx) as r:
            assert r.status == 200
        async with s.post(gateway + "/v1/chat/completions", json=chat) as r:
            assert r.status == 200, await r.text()

        # The database goes away: no new connections, every open one ended.
        with psycopg.connect(**_libpq(url)) as admin:
            admin.execute(f"ALTER DATABASE {dbname} ALLOW_CONNECTIONS false")  # type: ignore[arg-type]
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (dbname,))
        try:
            started = time.monotonic()
            async with s.post(inst.admin + "/api/v1/models", json={**model, "name": "other"}, headers=AUTH) as r:
                took = time.monotonic() - started
                body = await r.json()
            assert r.status == 503, body
            assert body["error"]["code"] == "store_unavailable"
            assert f"127.0.0.1:{pg_cluster.port}" in body["error"]["message"]
            assert took < 6
            async with s.post(inst.agent_url + "/agent/v1/heartbeat", data=heartbeat(ready), ssl=ctx) as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "store_unavailable"
            for _ in range(5):  # the gateway answers from its routing snapshot
                async with s.post(gateway + "/v1/chat/completions", json=chat) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["choices"][0]["message"]["content"] == "hi there"

            async def unreachable() -> Any:
                h = await _get(s, inst.admin + "/api/v1/health")
                return h if h["database"] == "unreachable" and not h["leader"] else None

            await until("health says the database is unreachable and it does not lead", unreachable, within_s=8)
            view = ClusterView.model_validate(await _get(s, inst.admin + "/api/v1/cluster"))
            assert not view.database.reachable
            assert view.database.error
        finally:
            with psycopg.connect(**_libpq(url)) as admin:
                admin.execute(f"ALTER DATABASE {dbname} ALLOW_CONNECTIONS true")  # type: ignore[arg-type]
        # Back without a restart: writes work and it leads again.
        await until("leading again", lambda: _leads(s, inst), within_s=10)
        async with s.post(inst.admin + "/api/v1/models", json={**model, "name": "other"}, headers=AUTH) as r:
            assert r.status == 201, await r.text()


async def _leads(s: aiohttp.ClientSession, inst: Install) -> bool:
    h = await _get(s, inst.admin + "/api/v1/health")
    return bool(h["leader"]) and h["database"] == "ok"


def test_parse_patroni_refuses_what_is_not_patroni() -> None:
    with pytest.raises(ValueError, match="no 'members' list"):
        parse_patroni({"status": "ok"})
    assert [m.name for m in parse_patroni(PATRONI_CLUSTER)] == ["pg1", "pg2", "pg3"]


async def test_a_configured_member_missing_from_patroni_s_list_is_said(patroni_stand_in: str) -> None:
    """A member that is down drops out of Patroni's own list: ``ctl cluster`` says how many of the
    configured members are missing rather than showing a shorter table with no word."""
    four = [patroni_stand_in, *(f"http://127.0.0.1:{free_port()}" for _ in range(3))]  # 3 answer in the list
    members, error = await read_patroni(four)
    assert [m.name for m in members] == ["pg1", "pg2", "pg3"]
    assert error == "1 of the 4 members in cluster.patroni are not in Patroni's list (down, or not joined yet)"
    members, error = await read_patroni(four[:3])
    assert (len(members), error) == (3, "")
