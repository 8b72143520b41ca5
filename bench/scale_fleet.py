"""Simulated agents for bench/scale.py: many nodes in one asyncio process, over real mTLS.

Each :class:`SimAgent` has its own client certificate from the cluster CA (CN = its node id) and
its own aiohttp session (keep-alive, idle connections kept :data:`~llmgw.protocol.KEEPALIVE_S` as
the real agent keeps them). It speaks the real agent's wire with the real
agent's functions (:func:`llmgw.agent.loop.wire.post_heartbeat`, the beat wait and the jittered
backoff of :mod:`llmgw.agent.loop.controlplanes`):

- a :class:`~llmgw.protocol.Pulse` while its state is the one the control plane acknowledged, its
  full :class:`~llmgw.protocol.Heartbeat` otherwise, on ``send_full``, and to register (or re-register
  on a 404);
- its engines are simulated by its reports: every replica it is told to run is reported ``ready``
  at once, with the endpoint :attr:`Fleet.endpoint` gives (the gateway's replicas point at a real
  instant upstream; the others at a closed port, so the leader's probe of a lost node's replica
  fails as for a dead machine); a reply that changes its replicas makes it beat again after
  :data:`CHANGE_BEAT_S`, as the real agent beats at once when a replica changes state;
- a cycle with no answer backs off ``backoff_s(failed, random())`` (full jitter), then the next beat
  is at the interval the control plane asked for, jittered as the real agent jitters it.

What it records (:class:`Records`): each exchange's latency by phase, errors, and for the restart
fault each attempt and each agent's first answer after :attr:`Records.restarted_at`.

Not simulated: the engine metrics an agent pushes, log requests (answered by no one), adoption,
inventory changes (the memory report never moves), the TLS diagnosis of a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw import __version__, tlsconf
from llmgw.agent.loop.controlplanes import JITTER, ControlPlanes, backoff_s, beat_wait_s
from llmgw.agent.loop.wire import post_heartbeat
from llmgw.errors import ApiError, UnreachableError
from llmgw.protocol import (
    KEEPALIVE_S,
    EngineStatus,
    Heartbeat,
    HeartbeatReply,
    Inventory,
    ProvisionState,
    Pulse,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    state_digest,
)

GB = 1_000_000_000
CHANGE_BEAT_S = 0.3
"""A reply that changed the replicas is followed by a beat this soon (s): the real agent beats at
once when a replica changes state, at most ~10 times a second."""
CLOSED_ENDPOINT = "127.0.0.1:9"
"""Where the simulated engines of the bench models "listen": a closed port (refused at once)."""


def issue_certs(ca: tlsconf.CA, names: list[str], out: Path) -> list[tuple[Path, Path]]:
    """One client certificate per name (CN = the name) from ``ca``, all on ONE EC P-256 key: the
    certificates are distinct (serial, CN, signature), generating a key per node would only make the
    setup slower. Returns ``(cert, key)`` paths in ``names``' order."""
    key = ec.generate_private_key(ec.SECP256R1())
    key_path = out / "shared-key.pem"
    out.mkdir(parents=True, exist_ok=True)
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    now = time.time()
    import datetime as dt  # noqa: PLC0415 - only here

    start = dt.datetime.fromtimestamp(now - 3600, dt.UTC)
    end = dt.datetime.fromtimestamp(now + 86400, dt.UTC)
    aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key())
    paths = []
    for name in names:
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(aki, critical=False)
            .sign(ca.key, hashes.SHA256())
        )
        path = out / f"{name}.pem"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths.append((path, key_path))
    return paths


@dataclass
class Beat:
    """One exchange: when it was sent (monotonic s), its latency (ms), whether a pulse went first."""

    at: float
    ms: float
    pulse: bool


@dataclass
class Records:
    """What the fleet saw. ``phase`` names the bench's phase; beats are kept by phase."""

    phase: str = "ramp"
    beats: dict[str, list[Beat]] = field(default_factory=dict)
    errors: dict[str, list[str]] = field(default_factory=dict)
    """Failed exchanges by phase (the first 100 of each phase)."""
    error_count: dict[str, int] = field(default_factory=dict)
    attempts: list[float] = field(default_factory=list)
    """Monotonic times of exchanges tried after :attr:`restarted_at` was set (the restart fault)."""
    restarted_at: float = 0.0
    """Set by the bench when the control plane is killed; 0: no restart under way."""
    reconnects: dict[int, Beat] = field(default_factory=dict)
    """Agent index -> its first answered exchange after :attr:`restarted_at`."""
    interval_s: float = 0.0

    def add(self, beat: Beat) -> None:
        self.beats.setdefault(self.phase, []).append(beat)


@dataclass
class SimAgent:
    """One simulated node (see the module docstring)."""

    index: int
    name: str
    ctx: ssl.SSLContext
    cps: ControlPlanes
    desired: list[ReplicaSpec] = field(default_factory=list)
    desired_digest: str = ""
    acked: str = ""
    registered: bool = False
    interval_s: float = 0.0
    failed: int = 0
    last_ok: float = 0.0
    """Monotonic time of its last answered exchange."""
    sending: bool = False
    """An exchange is in flight (killed now, the control plane may still record a beat that
    :attr:`last_ok` does not count)."""
    alive: bool = True
    task: asyncio.Task[None] | None = None
    skipped: bool = False
    """Its last beat fell due while the fleet was held and was dropped (:attr:`Fleet.flowing`)."""


class Fleet:
    """The simulated agents of one run, beating to the control planes' agent APIs ``urls``.

    Args:
        urls: ``https://127.0.0.1:PORT`` of each control plane's agent API; each agent ranks them
            for itself (:class:`~llmgw.agent.loop.controlplanes.ControlPlanes`: a rendezvous home,
            the next at once when one does not answer), as the real agent does.
        ca: the cluster CA's certificate file (to trust the control plane).
        gateway_endpoint: ``host:port`` of the instant upstream; replicas of ``gateway_model`` are
            reported there, every other replica at :data:`CLOSED_ENDPOINT`.
        gateway_model: the model whose replicas the gateway is measured through.
    """

    def __init__(self, urls: list[str], ca: Path, gateway_endpoint: str, gateway_model: str) -> None:
        self.urls = urls
        self.used: dict[str, int] = {}
        """Answered beats by control plane URL (how the agents spread)."""
        self.ca = ca
        self.gateway_endpoint = gateway_endpoint
        self.gateway_model = gateway_model
        self.agents: list[SimAgent] = []
        self.records = Records()
        self.stop = asyncio.Event()
        self.flowing = asyncio.Event()
        """Cleared: a beat that falls due is dropped, not sent later (bench/scale.py's ``ab`` phase:
        the control plane left idle for a window, the same cluster otherwise). Dropped, because
        beats held and sent when the window ends came at once on top of the next window's own: the
        windows with beats flowing carried about twice the steady rate, from a burst. An agent
        drops no two beats in a row (it sends the second even while held), so no node goes three
        intervals silent and is seen lost (:func:`llmgw.control.api.cadence.lost_after_for`)."""
        self.dropped = 0
        """Beats dropped while held (:attr:`flowing` cleared)."""
        self.sent_held = 0
        """Beats sent while held (an agent's second in a row that fell due then)."""
        self.flowing.set()
        self.jitter = True
        self.keepalive_s = KEEPALIVE_S
        """How long an agent keeps an idle connection (s): the real agent's."""
        """False: back off exactly 1, 2, 5, 10 s (the agent before full jitter), for comparison."""

    def add(self, name: str, cert: Path, key: Path) -> SimAgent:
        """A new agent (not started); its TLS context is made here."""
        ctx = tlsconf.client_context(self.ca, cert, key)
        agent = SimAgent(len(self.agents), name, ctx, ControlPlanes(self.urls, node=name))
        self.agents.append(agent)
        return agent

    def start(self, agent: SimAgent) -> None:
        """Start ``agent``'s loop (it registers at once, as an agent starting does)."""
        agent.task = asyncio.create_task(self._run(agent))

    def kill(self, agent: SimAgent) -> None:
        """The node dies: no more beats, its connection dropped."""
        agent.alive = False
        if agent.task is not None:
            agent.task.cancel()

    async def close(self) -> None:
        """Stop every agent."""
        self.stop.set()
        tasks = [a.task for a in self.agents if a.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def endpoint(self, spec: ReplicaSpec) -> str:
        return self.gateway_endpoint if spec.model == self.gateway_model else CLOSED_ENDPOINT

    def heartbeat(self, agent: SimAgent) -> Heartbeat:
        return Heartbeat(
            agent_version=__version__,
            inventory=Inventory(cores=8, memory_total_bytes=32 * GB, memory_available_bytes=30 * GB),
            labels={"zone": f"z{agent.index % 4}"},
            engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")],
            replicas=[
                ReplicaStatus(id=s.id, state=ReplicaState.READY, endpoint=self.endpoint(s)) for s in agent.desired
            ],
            instance=f"sim-{agent.index}",
            desired_digest=agent.desired_digest,
        )

    async def _exchange(self, s: aiohttp.ClientSession, agent: SimAgent, url: str) -> tuple[HeartbeatReply, bool]:
        """One exchange as the real agent's ``_exchange`` makes it; returns the reply and whether a
        pulse went first."""
        hb = self.heartbeat(agent)
        digest = state_digest(hb)
        pulse = agent.registered and digest == agent.acked
        path = "/agent/v1/heartbeat" if agent.registered else "/agent/v1/register"
        body: Heartbeat | Pulse = hb
        if pulse:
            body = Pulse(digest=digest, instance=hb.instance, desired_digest=agent.desired_digest,
                         agent_version=__version__)
        try:
            reply = await post_heartbeat(s, url, path, body)
            if reply.send_full:
                reply = await post_heartbeat(s, url, path, hb)
        except ApiError as e:
            if e.status != 404 or not agent.registered:
                raise
            agent.registered = False
            reply = await post_heartbeat(s, url, "/agent/v1/register", hb)
        agent.acked = "" if reply.send_full else reply.digest
        return reply, pulse

    async def _cycle(self, s: aiohttp.ClientSession, agent: SimAgent) -> tuple[HeartbeatReply, bool] | None:
        """One beat over the control planes in the agent's order, as the real agent's ``beat_once``:
        a connect error, timeout or 5xx moves to the next one at once; None when none answered."""
        rec = self.records
        for url in agent.cps.order():
            try:
                answer = await self._exchange(s, agent, url)
            except (UnreachableError, ApiError) as e:
                rec.error_count[rec.phase] = rec.error_count.get(rec.phase, 0) + 1
                if len(kept := rec.errors.setdefault(rec.phase, [])) < 100:
                    kept.append(f"{agent.name}: {e}")
                if isinstance(e, ApiError) and 300 <= e.status < 500:
                    return None
                agent.cps.failed(url)
                continue
            agent.cps.succeeded(url)
            agent.cps.learn(answer[0].control_planes)
            self.used[url] = self.used.get(url, 0) + 1
            return answer
        return None

    async def _run(self, agent: SimAgent) -> None:
        rec = self.records
        connector = aiohttp.TCPConnector(ssl=agent.ctx, keepalive_timeout=self.keepalive_s)
        async with aiohttp.ClientSession(connector=connector) as s:
            while not self.stop.is_set():
                if not self.flowing.is_set():
                    if not agent.skipped:
                        agent.skipped = True
                        self.dropped += 1
                        wait = beat_wait_s(2.0, agent.interval_s, random.uniform(*JITTER))
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self.stop.wait(), max(wait, 0.1))
                        continue
                    self.sent_held += 1
                agent.skipped = False
                t = time.monotonic()
                if rec.restarted_at:
                    rec.attempts.append(t)
                changed = False
                agent.sending = True
                try:
                    answer = await self._cycle(s, agent)
                finally:
                    agent.sending = False
                if answer is None:
                    agent.failed += 1
                else:
                    reply, pulse = answer
                    done = time.monotonic()
                    beat = Beat(t, (done - t) * 1000, pulse)
                    rec.add(beat)
                    if rec.restarted_at and t >= rec.restarted_at and agent.index not in rec.reconnects:
                        rec.reconnects[agent.index] = beat
                    agent.failed, agent.last_ok, agent.registered = 0, done, True
                    agent.interval_s = rec.interval_s = reply.interval_s
                    if not reply.desired_unchanged:
                        changed = [d.id for d in reply.desired] != [d.id for d in agent.desired]
                        agent.desired, agent.desired_digest = reply.desired, reply.desired_digest
                draw = random.random() if self.jitter else 1.0
                wait = backoff_s(agent.failed, draw) or beat_wait_s(
                    2.0, agent.interval_s, random.uniform(*JITTER)
                )
                if changed:
                    wait = CHANGE_BEAT_S
                with contextlib.suppress(TimeoutError):  # the real agent waits at least 0.1 s too
                    await asyncio.wait_for(self.stop.wait(), max(wait, 0.1))


LAG_EVERY_S = 0.02
"""How often :func:`loop_lag` wakes (s)."""


async def loop_lag(fleet: Fleet, out: dict[str, list[float]]) -> None:
    """This process's own event loop lag (ms late for a :data:`LAG_EVERY_S` sleep), by the fleet's
    phase, until cancelled: the simulator's share of each heartbeat latency it measures (a beat's
    answer waits for this loop too)."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(LAG_EVERY_S)
        out.setdefault(fleet.records.phase, []).append((time.monotonic() - t - LAG_EVERY_S) * 1000)


#: Collections of the simulator's own heap at least this long (ms) are recorded (:class:`SimGc`).
SIM_GC_MS = 20.0


class SimGc:
    """The simulator's own garbage collections, so its pauses are not read as the control plane's.

    5,000 simulated agents are a large heap in this process: one full collection stopped its loop
    for ~650 ms in a burst (2026-12-04, seen as 3 beats in flight for 660 ms, then none sent for
    that time and ~40 sent at once on its end, the next 50-90 ms queued behind each other: the
    burst's p99 was those ~50 beats). :meth:`quiet` is called once the fleet is up: it collects,
    freezes the survivors (``gc.freeze()``) and stops automatic full collections (the third
    threshold), as the control plane does for itself (:mod:`llmgw.control.gcpauses`); young
    generations are still collected. Every collection of :data:`SIM_GC_MS` or more is recorded by
    phase (``pauses``: phase -> [(generation, ms)]).
    """

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.pauses: dict[str, list[tuple[int, float]]] = {}
        self._started = 0.0
        self._threshold = gc.get_threshold()  # the interpreter's, put back by close()
        gc.callbacks.append(self._on_gc)

    def quiet(self) -> None:
        """Collect now, freeze what survives, and leave full collections off from here on."""
        gc.collect()
        gc.freeze()
        g0, g1, _ = self._threshold
        gc.set_threshold(g0, g1, 1_000_000_000)

    def close(self) -> None:
        """Stop recording; the interpreter's thresholds back (frozen objects stay frozen)."""
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        gc.set_threshold(*self._threshold)

    def longest_ms(self, phase: str) -> float:
        """The longest collection recorded in ``phase`` (ms; 0.0: none of :data:`SIM_GC_MS` or more)."""
        return max((ms for _, ms in self.pauses.get(phase, [])), default=0.0)

    def _on_gc(self, what: str, info: dict[str, int]) -> None:
        if what == "start":
            self._started = time.perf_counter()
            return
        ms = (time.perf_counter() - self._started) * 1000
        if ms >= SIM_GC_MS:
            self.pauses.setdefault(self.fleet.records.phase, []).append((info["generation"], ms))
