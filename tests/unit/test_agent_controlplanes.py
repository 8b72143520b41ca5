"""The agent follows several control planes: rotation, back-off, terms, members learned from replies.

The control planes are real aiohttp HTTPS servers with mTLS (certificates from a real cluster CA),
posing as control planes that share one database (:class:`Db`: the registered nodes, the term and
the desired list live there, as they do in PostgreSQL). They are stand-ins, not real control
planes: two real control planes need a shared PostgreSQL and a leader election that another part of
issue 11 builds; the agent only sees the agent API, which these serve byte-for-byte as the protocol
models say. "Killing" one closes its listening socket and its connections (the agent sees refused
connections); restarting it binds the same port again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import stat
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw.agent.loop.controlplanes import BACKOFF_S, ControlPlanes, Terms, backoff_s, rendezvous
from llmgw.agent.loop.loop import Agent
from llmgw.config import AgentConfig
from llmgw.paths import Paths
from llmgw.protocol import Heartbeat, HeartbeatReply, LogReply, LogRequest, ReplicaSpec, state_digest
from llmgw.tlsconf import CA, client_context, peer_common_name, server_context
from tests.helpers.waits import until

INTERVAL_S = 0.1
"""The agent's heartbeat interval in these tests: well under the first back-off step (1 s). The
tests count beats, so each beat waited for is one interval (and the agent's own 0.1 s between
beats) of the test's time; a bound on a beat's timing is this interval plus the same slack as at
0.3 s."""


@dataclass
class Db:
    """What the control planes share (their database): registered nodes, term, desired replicas."""

    term: int = 5
    desired: list[ReplicaSpec] = field(default_factory=list)
    nodes: set[str] = field(default_factory=set)
    members: list[str] = field(default_factory=list)


@dataclass
class Call:
    """One request a control plane received."""

    at: float
    path: str
    body: bytes


class FakeControlPlane:
    """An HTTPS agent API on 127.0.0.1 (mTLS) answering from ``db``; ``term``, ``desired`` and
    ``status`` override the database's answer (a stale control plane, a 503)."""

    def __init__(self, name: str, db: Db, ssl_ctx: ssl.SSLContext) -> None:
        self.name, self.db, self.ssl_ctx = name, db, ssl_ctx
        self.calls: list[Call] = []
        self.term: int | None = None
        self.desired: list[ReplicaSpec] | None = None
        self.status = 200
        self.reads_pulses = False  # True: acknowledges digests and reads pulses (this version)
        self.log_requests: list[LogRequest] = []
        self.port = 0
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def beats(self) -> list[Call]:
        return [c for c in self.calls if c.path != "/agent/v1/logs"]

    async def handle(self, request: web.Request) -> web.Response:
        transport = request.transport
        assert transport is not None
        cn = peer_common_name(transport.get_extra_info("peercert")) or ""
        body = await request.read()
        self.calls.append(Call(time.monotonic(), request.path, body))
        if request.path == "/agent/v1/logs":
            return web.json_response({})
        doc = json.loads(body)
        if "inventory" not in doc and not self.reads_pulses:  # an older control plane's answer to a pulse
            return web.json_response({"error": {"code": "invalid_heartbeat", "message": "inventory: Field required"}},
                                     status=400)
        digest = doc["digest"] if "inventory" not in doc else state_digest(Heartbeat.model_validate_json(body))
        if self.status != 200:
            err = {"error": {"code": "store_unavailable", "message": "the database does not answer"}}
            return web.json_response(err, status=self.status)
        if request.path == "/agent/v1/heartbeat" and cn not in self.db.nodes:
            return web.json_response({"error": {"code": "unknown_node", "message": cn}}, status=404)
        self.db.nodes.add(cn)
        reply = HeartbeatReply(
            node_id=cn,
            desired=self.db.desired if self.desired is None else self.desired,
            term=self.db.term if self.term is None else self.term,
            leader=self.db.members[0] if self.db.members else "",
            control_planes=self.db.members,
            log_requests=self.log_requests,
            digest=digest if self.reads_pulses else "",
        )
        self.log_requests = []
        return web.json_response(json.loads(reply.model_dump_json()))

    async def start(self) -> None:
        app = web.Application()
        for path in ("/agent/v1/register", "/agent/v1/heartbeat", "/agent/v1/logs"):
            app.router.add_post(path, self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, ssl_context=self.ssl_ctx)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def kill(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()
        self.runner = None


@dataclass
class World:
    cps: list[FakeControlPlane]
    db: Db
    tmp: Path
    ca_pem: Path
    cert: Path
    key: Path

    def config(self, urls: list[str]) -> AgentConfig:
        inv = self.tmp / "inventory.yaml"
        inv.write_text("cores: 4\nmemory_total_bytes: 8000000000\nmemory_available_bytes: 6000000000\n")
        fake = self.tmp / "llama-server"
        fake.write_text('#!/bin/sh\necho "version: 4242 (feedbee)"\n')
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
        return AgentConfig.model_validate(
            {
                "server": urls[0],
                "servers": urls[1:],
                "node_id": "node-1",
                "tls": {"ca": self.ca_pem, "cert": self.cert, "key": self.key},
                "discovery": {"inventory_file": str(inv)},
                "engines": {"llamacpp": {"binary": str(fake)}},
                "heartbeat_interval_s": INTERVAL_S,
            }
        )


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    ca = CA.create()
    pki = tmp_path / "pki"
    ca.write(pki)
    srv_cert, srv_key = ca.issue_server(["127.0.0.1"]).write(pki, "server")
    cert, key = ca.issue_client("node-1").write(tmp_path / "etc", "agent")
    db = Db()
    cps = [FakeControlPlane(n, db, server_context(pki / "ca.pem", srv_cert, srv_key)) for n in "abc"]
    for cp in cps:
        await cp.start()
    yield World(cps, db, tmp_path, pki / "ca.pem", cert, key)
    for cp in cps:
        if cp.runner is not None:
            await cp.kill()


@dataclass
class Running:
    agent: Agent
    task: asyncio.Task[None]
    stop: asyncio.Event


@pytest.fixture
async def start_agent(world: World) -> AsyncIterator[object]:
    """``await start(cfg)`` runs a real :class:`Agent` (the loop ``run_agent`` drives) on this loop."""
    running: list[Running] = []
    sessions: list[aiohttp.ClientSession] = []

    async def start(cfg: AgentConfig) -> Running:
        ctx = client_context(cfg.tls.ca, cfg.tls.cert, cfg.tls.key)
        api = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx))
        plain = aiohttp.ClientSession()
        sessions.extend([api, plain])
        agent = await asyncio.to_thread(Agent, cfg, Paths(world.tmp / "root"), api=api, plain=plain)
        stop = asyncio.Event()
        r = Running(agent, asyncio.create_task(agent.run(stop)), stop)
        running.append(r)
        return r

    yield start
    for r in running:
        r.stop.set()
        await asyncio.wait_for(r.task, 15)
    for s in sessions:
        await s.close()


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llmgw.agent" and r.levelno >= logging.WARNING]


async def test_killed_control_plane_the_next_beat_goes_to_another_at_once(
    world: World, start_agent: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    a, b, c = ranked(world.cps)  # the agent's home first
    run = await start_agent(world.config([a.url, b.url, c.url]))  # type: ignore[operator]
    await until("the agent beats at a", lambda: _n(a, 3))
    assert b.calls == []
    assert c.calls == []
    await a.kill()
    killed = time.monotonic()

    last_a = a.calls[-1].at
    await until("the agent beats at b", lambda: _n(b, 3))
    first_b = b.beats()[0]
    # The same beat: no back-off (1 s) between a's last answer and b's first heartbeat.
    assert first_b.at - last_a < INTERVAL_S + 0.6, (first_b.at - last_a, killed - last_a)
    assert first_b.path == "/agent/v1/heartbeat"  # b shares the database: the node is registered there
    assert run.agent.failed_cycles == 0
    assert run.agent.control_planes.current == b.url
    assert c.calls == []
    switches = [w for w in warnings(caplog) if w.startswith(f"control plane {a.url} does not answer")]
    assert len(switches) == 1, warnings(caplog)  # logged once, not every beat
    assert f"; using {b.url}" in switches[0]
    assert not any("no control plane answers" in w for w in warnings(caplog))

    # Everything goes to the current one: a log request from b is answered to b.
    b.log_requests = [LogRequest(id="q-1", replica_id="r-x", lines=5)]
    await until("the log reply reaches b", lambda: _logs(b))
    (reply,) = [LogReply.model_validate_json(x.body) for x in b.calls if x.path == "/agent/v1/logs"]
    assert (reply.id, reply.found) == ("q-1", False)

    # A 5xx (b's database is unreachable) rotates to c in the same beat; a was moved to the end.
    b.status = 503
    await until("the agent beats at c", lambda: _n(c, 2))
    assert run.agent.control_planes.order() == [c.url, a.url, b.url]
    assert any(w.startswith(f"control plane {b.url} does not answer (answered 503") for w in warnings(caplog))
    assert run.agent.failed_cycles == 0


async def test_all_down_backs_off_then_recovers_when_one_returns(
    world: World, start_agent: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    a, b, c = ranked(world.cps)  # the agent's home first
    run = await start_agent(world.config([a.url, b.url, c.url]))  # type: ignore[operator]
    await until("the agent beats at a", lambda: _n(a, 2))
    for cp in world.cps:
        await cp.kill()
    # Record when each failed cycle ends.
    seen: list[float] = []

    async def cycles(n: int) -> bool:
        if run.agent.failed_cycles > len(seen):
            seen.append(time.monotonic())
        return len(seen) >= n

    await until("two failed cycles", lambda: cycles(2), within_s=8, every_s=0.02)
    # At most 1 s between the first two cycles (a jittered draw below the first cap; each cycle
    # itself costs a few refused connects: ms).
    assert seen[1] - seen[0] <= BACKOFF_S[0] + 0.5, seen
    (down,) = [w for w in warnings(caplog) if "no control plane answers" in w]  # logged once
    assert "(3 tried)" in down
    assert "trying again within 1 s" in down
    for cp in world.cps:
        assert cp.url in down

    await b.start()  # same port
    await until("the agent beats at b again", lambda: _n(b, 1), within_s=8)
    # The next try came within the second back-off step (a draw below 2 s), not at the interval.
    after = b.beats()[0].at - seen[1]
    assert after <= BACKOFF_S[1] + 0.5, after
    await until("beats at the interval again", lambda: _n(b, 3), within_s=3)
    assert run.agent.failed_cycles == 0
    assert any(f"control plane {b.url} answers again" in m or f"using {b.url}" in m for m in _messages(caplog))


async def test_a_reply_with_a_lower_term_is_not_applied(
    world: World, start_agent: object, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    # Each unusable reply here is a failed cycle, backed off: up to 1, 2, then 5 s before the beat
    # the test waits for. The back-off is not what this test measures (test_all_down_… does):
    # a fifth of the caps, read at each cycle (backoff_s), well inside every wait's 10 s.
    monkeypatch.setattr("llmgw.agent.loop.controlplanes.BACKOFF_S", tuple(s / 5 for s in BACKOFF_S))
    a, b = ranked(world.cps[:2])
    world.db.desired = [_spec("r-1")]
    run = await start_agent(world.config([a.url, b.url]))  # type: ignore[operator]
    await until("r-1 runs", lambda: _has_runner(run, "r-1"))
    assert run.agent.state.term == 5

    # b is lost; a is left on a stale database (term 3) that no longer lists r-1 and wants r-2.
    await b.kill()
    a.term, a.desired = 3, [_spec("r-2")]
    n = len(a.beats())
    await until("two more beats at a", lambda: _n(a, n + 2), within_s=10)
    assert set(run.agent.state.runners) == {"r-1"}  # not stopped, r-2 not started
    assert run.agent.terms.highest == 5
    assert run.agent.state.term == 5
    stale = [w for w in warnings(caplog) if w.startswith(f"control plane {a.url} answered with term 3, older")]
    assert len(stale) == 1, warnings(caplog)  # two stale replies, logged once
    assert "older than term 5 seen before: it is on a stale database; its reply is not applied" in stale[0]
    assert run.agent.failed_cycles >= 1  # no usable answer: a stale term is a failure, backed off

    # A control plane that has just started answers term 0 until it reads the election: not applied
    # either, and said at INFO, not as a stale database (an operator saw that after each restart
    # with the agent API in a process of its own).
    a.term = 0
    n = len(a.beats())
    await until("one more beat at a", lambda: _n(a, n + 1), within_s=10)
    assert set(run.agent.state.runners) == {"r-1"}
    assert not [w for w in warnings(caplog) if "answered with term 0" in w]
    assert any(f"control plane {a.url} does not know the cluster's term yet" in m for m in _messages(caplog))

    # A newer term (a new leader wrote it) is applied: r-1 stops, r-2 starts.
    a.term = 6
    await until("r-2 replaces r-1", lambda: _only_runner(run, "r-2"), within_s=10)
    assert run.agent.terms.highest == 6


async def test_a_draining_replica_keeps_its_engine_whatever_its_new_spec_says(
    world: World, start_agent: object
) -> None:
    """A new version rolled out (``ctl model set NAME source=… version=2``): the old replica drains
    while its requests finish, and its spec now names the new weights. The agent restarted it onto
    them in place, cutting its streams (an operator's finding); a draining spec keeps the runner as
    it is, and a draining replica the agent does not run is not started."""
    a = ranked(world.cps[:1])[0]
    world.db.desired = [_spec("r-1")]
    run = await start_agent(world.config([a.url]))  # type: ignore[operator]
    await until("r-1 runs", lambda: _has_runner(run, "r-1"))
    runner = run.agent.state.runners["r-1"]
    v2 = _spec("r-1").model_copy(update={"version": "v2", "source_url": "http://127.0.0.1:9/m/v2/w.gguf"})
    world.db.desired = [v2.model_copy(update={"draining": True}), _spec("r-9").model_copy(update={"draining": True})]
    n = len(a.beats())
    await until("three more beats", lambda: _n(a, n + 3), within_s=10)
    assert run.agent.state.runners == {"r-1": runner}  # the same engine; r-9 not started
    world.db.desired = [v2]  # not draining (the control plane's view if it served again): restarted onto v2
    await until("r-1 restarted onto v2", lambda: _runs_version(run, "r-1", "v2"), within_s=10)


async def test_members_named_in_replies_are_used(
    world: World, start_agent: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    home, a, c = ranked(world.cps)  # ranked for node-1 over all three
    world.db.members = [a.url, home.url + "/", c.url, "http://plain.example:7443"]
    run = await start_agent(world.config([a.url]))  # agent.yaml names a only
    await until("the agent beats at a", lambda: _n(a, 1))
    # Learned, after agent.yaml's own; a non-https URL is ignored; trailing slashes do not duplicate.
    assert any(f"learned from {a.url}: {home.url}, {c.url}" in m for m in _messages(caplog))
    # The home among every member known is the first ranked: the agent moves there at once.
    await until("the agent beats at its home", lambda: _n(home, 2))
    assert run.agent.control_planes.home == home.url
    assert run.agent.control_planes.order() == [home.url, a.url, c.url]
    await home.kill()
    await until("the agent beats at a again", lambda: _n(a, 3))  # the next ranked, not c
    assert run.agent.failed_cycles == 0
    assert c.calls == []


async def test_a_pulse_to_a_control_plane_that_reads_none_is_followed_by_the_full_state(
    world: World, start_agent: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    a, b = ranked(world.cps[:2])
    a.reads_pulses = True  # upgraded; b is not (a rolling upgrade)
    run = await start_agent(world.config([a.url, b.url]))  # type: ignore[operator]
    await until("pulses at a", lambda: asyncio.sleep(0, sum(_pulse(c) for c in a.beats()) >= 2))
    a.status = 503
    await until("two beats at b", lambda: _n(b, 2))
    first, second = b.beats()[:2]
    assert (_pulse(first), _pulse(second)) == (True, False)  # the pulse refused, the full state at once
    assert run.agent.failed_cycles == 0
    assert run.agent.control_planes.current == b.url
    assert any(f"control plane {b.url} reads no pulses" in m for m in _messages(caplog))
    await until("more beats at b", lambda: _n(b, 4))
    assert not any(_pulse(c) for c in b.beats()[2:])  # b acknowledges no digest: full beats from now on


def _pulse(call: Call) -> bool:
    return b"inventory" not in call.body


def ranked(cps: list[FakeControlPlane]) -> list[FakeControlPlane]:
    """``cps`` in node-1's rendezvous order (its home first): the order its agent tries them in."""
    order = rendezvous("node-1", [cp.url for cp in cps])
    return sorted(cps, key=lambda cp: order.index(cp.url))


def test_rotation_order_and_sticking() -> None:
    cps = ControlPlanes(["https://a:7443", "https://b:7443/", "https://a:7443", "https://c:7443"])
    assert cps.order() == ["https://a:7443", "https://b:7443", "https://c:7443"]
    cps.failed("https://a:7443")
    assert cps.current == "https://b:7443"
    cps.failed("https://b:7443")
    cps.succeeded("https://c:7443")
    assert cps.order() == ["https://c:7443", "https://a:7443", "https://b:7443"]
    cps.succeeded("https://a:7443")
    assert cps.order() == ["https://a:7443", "https://c:7443", "https://b:7443"]
    with pytest.raises(ValueError, match=r"give agent\.yaml 'server' or 'servers'"):
        ControlPlanes(["", " "])


def test_learned_members_are_dropped_after_a_while_configured_ones_never() -> None:
    now = [0.0]
    cps = ControlPlanes(["https://a:7443"], forget_s=60, clock=lambda: now[0])
    assert cps.learn(["https://a:7443", "https://b:7443", "https://c:7443"]) == ["https://b:7443", "https://c:7443"]
    assert cps.learn([]) == []  # a control plane that knows no peers changes nothing
    now[0] = 10
    cps.learn(["https://b:7443"])  # a and c unnamed from now on
    now[0] = 69
    cps.learn(["https://b:7443"])
    assert cps.order() == ["https://a:7443", "https://b:7443", "https://c:7443"]
    now[0] = 70.5
    cps.learn(["https://b:7443"])
    assert cps.order() == ["https://a:7443", "https://b:7443"]  # c dropped; a is agent.yaml's
    now[0] = 200
    cps.succeeded("https://b:7443")
    cps.learn(["https://a:7443"])  # b is current: not dropped while in use, only once it is not
    now[0] = 300
    cps.learn(["https://a:7443"])
    assert cps.order() == ["https://b:7443", "https://a:7443"]
    cps.failed("https://b:7443")
    cps.learn(["https://a:7443"])
    assert cps.order() == ["https://a:7443"]


def test_backoff_and_terms() -> None:
    assert [backoff_s(n) for n in range(7)] == [0, 1, 2, 5, 10, 10, 10]  # the caps (draw 1)
    assert [backoff_s(n, 0.5) for n in range(6)] == [0, 0.5, 1, 2.5, 5, 5]
    assert backoff_s(4, 0.0) == 0
    with pytest.raises(ValueError, match=r"draw must be in \[0, 1\], not 1.5"):
        backoff_s(1, 1.5)
    t = Terms()
    assert t.accept(0)
    assert t.accept(4)
    assert t.accept(4)
    assert not t.accept(3)
    assert not t.accept(0)
    assert t.highest == 4


async def _n(cp: FakeControlPlane, n: int) -> bool:
    return len(cp.beats()) >= n


async def _logs(cp: FakeControlPlane) -> bool:
    return any(c.path == "/agent/v1/logs" for c in cp.calls)


async def _has_runner(run: Running, rid: str) -> bool:
    return rid in run.agent.state.runners


async def _runs_version(run: Running, rid: str, version: str) -> bool:
    runner = run.agent.state.runners.get(rid)
    return runner is not None and runner.spec.version == version


async def _only_runner(run: Running, rid: str) -> bool:
    return set(run.agent.state.runners) == {rid}


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llmgw.agent"]


def _spec(rid: str) -> ReplicaSpec:
    # Its weights are at a port nothing listens on: the runner fails fetching, no engine starts.
    return ReplicaSpec(
        id=rid, model="m", version="v1", profile="cpu", engine="llamacpp",
        source_url="http://127.0.0.1:9/m/v1/w.gguf", sha256="0" * 64, file_name="w.gguf", key="k",
    )
