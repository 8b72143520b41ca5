"""The node agent's loop: report what this node has and runs, receive what it should run, reconcile.

On start, once:

1. Discover the inventory (cores, memory, GPUs; or the declared ``discovery.inventory_file``).
2. Locate llama-server and check it runs (``--version``, ``--help``): the engine status to report.
3. Adopt engines an earlier agent launched (record whose pid, start time and command line all
   match; other records are dropped). They keep serving meanwhile.

Each pass (every ``heartbeat_interval_s``, or the reply's longer ``interval_s`` in a large cluster,
at a random 80-100 % of it; or at once when a replica changes state, so the control plane learns
of ``ready`` without waiting a whole interval):

1. Build a :class:`~llmgw.protocol.Heartbeat`: inventory (memory re-read every pass but reported
   only when it moved by :data:`MEMORY_STEP` of the total, GPUs and the engine every
   :data:`REDISCOVER_S`), labels, engine statuses, every runner's status; and its
   :func:`~llmgw.protocol.state_digest`.
2. POST it over mTLS to ``/agent/v1/register`` until one register succeeds, then to
   ``/agent/v1/heartbeat`` (a 404 re-registers at once: the control plane forgot this node). When
   its digest is the one the control plane acknowledged last (``HeartbeatReply.digest``), a
   :class:`~llmgw.protocol.Pulse` goes instead; a reply ``send_full`` (or a 400 from a control
   plane that reads no pulses) is followed at once by the full heartbeat. The
   control plane is the current one of :class:`~llmgw.agent.loop.controlplanes.ControlPlanes`; one that
   does not answer (connect error, TLS failure, timeout, 5xx) or answers with a term below the
   highest seen is moved to the end of the list and the next is tried in the same pass.
3. Reconcile with the reply's ``desired`` list (not when ``desired_unchanged``: the list is the
   one last applied): start a runner for each new spec, stop runners whose
   id is no longer desired, and restart one whose spec changed. Stopping is a task of its own,
   so a slow engine (SIGTERM honoured only between batches) does not hold up the heartbeat.
   Only a reply whose term is at least the highest seen is applied; its ``control_planes`` are
   added to the list the agent rotates through.

A pass in which no control plane answered is logged (first failure, then every
:data:`LOG_REPEAT_S`) and the next pass waits a random time below 1, 2, 5, then 10 s
(:data:`~llmgw.agent.loop.controlplanes.BACKOFF_S`, full jitter: agents cut off together do not
come back together); a switch to another control plane is logged once,
a stale term once per control plane and term; running engines are left alone: only an applied
reply that no longer lists a replica stops it. A failure that can hide a TLS refusal (a disconnect
or a reset right after connecting) is explained before it is logged (:mod:`llmgw.agent.loop.tlsdiag`: a
certificate from another CA, a server certificate this agent does not trust), with what to do.
Stopping the agent (``stop`` set, SIGTERM, SIGINT) detaches the runners and leaves every engine
running, for the next agent to adopt.

A node removed from the cluster (``llmgw ctl node rm``) has its certificate revoked: the agent API
answers 403 ``certificate_revoked``. The agent then stops its engines (a removed node runs
nothing for the cluster; ``--force`` drained it already) and :func:`run_agent` raises
:class:`NodeRemoved` with the control plane's message: how to re-join (``llmgw server add-node``).

Not guaranteed: replicas are reported as the agent last saw them (up to one watch interval late);
a failed replica is not retried by the agent itself, the control plane decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from dataclasses import dataclass, field

import aiohttp

from llmgw import __version__
from llmgw.agent.engines import llamacpp
from llmgw.agent.engines.llamacpp import LLAMACPP
from llmgw.agent.engines.provision import GITHUB_RELEASES, Provisioner
from llmgw.agent.engines.vllm import VLLM, VllmProvisioner
from llmgw.agent.loop import tlsdiag
from llmgw.agent.loop.controlplanes import BACKOFF_S, JITTER, ControlPlanes, Terms, backoff_s, beat_wait_s
from llmgw.agent.loop.identity import agent_tls
from llmgw.agent.loop.metrics import push_loop
from llmgw.agent.loop.wire import NO_TERM_YET, REQUEST_TIMEOUT, STALE_TERM, cached_weights, post_heartbeat, reason
from llmgw.agent.node import logs
from llmgw.agent.node.cache import NodeCache, link_local_connector
from llmgw.agent.node.discovery import discover_inventory
from llmgw.agent.node.records import (
    adoptable,
    drop_record,
    instance_id,
    private_dir,
    replica_dir,
    replicas_dir,
    stop_process_group,
)
from llmgw.agent.replicas.runner import ReplicaRunner, RunnerEnv
from llmgw.config import AgentConfig
from llmgw.errors import ApiError, ConfigError, LlmgwError, NodeRemoved, UnreachableError
from llmgw.paths import Paths
from llmgw.protocol import (
    KEEPALIVE_S,
    EngineStatus,
    GroupRole,
    Heartbeat,
    HeartbeatReply,
    Inventory,
    LogReply,
    LogRequest,
    Pulse,
    ReplicaSpec,
    state_digest,
)

log = logging.getLogger("llmgw.agent")

REDISCOVER_S = 60.0
FAREWELL_BEAT_S = 3.0  # the last heartbeat after group members stopped with the agent (best effort)
"""GPUs and the engine binary are re-read this often (nvidia-smi is too slow for every beat)."""

MEMORY_STEP = 0.02
"""The available memory is reported again only when it moved by this fraction of the total (2 %:
1.3 GB on a 64 GB node): a figure that moves every beat would make every beat a full one."""

LOG_REPEAT_S = 30.0
"""An ongoing control-plane failure is logged again this often, not every beat."""

ADOPT_WAIT_S = 1.5
"""How long the first heartbeat waits for adopted engines to answer ``/health`` (each takes ms)."""



@dataclass
class AgentState:
    """What the loop knows between passes (exposed for tests and ``status`` commands).

    ``term`` and ``leader`` are the last applied reply's (the leadership term, the leading control
    plane's agent-API URL or ""). ``acked``: the state digest the control plane last acknowledged
    (a pulse is sent while the state's digest is this one); ``desired_digest``: the digest of the
    desired list last applied; ``interval_s``: the last reply's interval (0: none yet);
    ``pulses``/``fulls``: beats sent of each kind, ``asked_full``: ``send_full`` replies.
    """

    inventory: Inventory
    engines: list[EngineStatus]
    runners: dict[str, ReplicaRunner] = field(default_factory=dict)
    registered: bool = False
    node_id: str = ""
    beats: int = 0
    term: int = 0
    leader: str = ""
    acked: str = ""
    desired_digest: str = ""
    interval_s: float = 0.0
    pulses: int = 0
    fulls: int = 0
    asked_full: int = 0


class Agent:
    """The loop of one node agent (see the module docstring); :func:`run_agent` drives it."""

    def __init__(
        self,
        cfg: AgentConfig,
        paths: Paths,
        *,
        api: aiohttp.ClientSession,
        plain: aiohttp.ClientSession,
    ) -> None:
        self.cfg = cfg
        self.agent_state = paths.agent_state
        self.api = api
        self.changed = asyncio.Event()
        max_bytes = int(cfg.cache_max_gb * 1e9) if cfg.cache_max_gb else None
        self.cache = NodeCache(self.agent_state / "cache", max_bytes=max_bytes)
        inventory = discover_inventory(cfg)
        self.state = AgentState(inventory=inventory, engines=[])
        self.env = RunnerEnv(
            agent_state=self.agent_state,
            advertise_address=cfg.advertise_address,
            cores=inventory.cores,
            has_gpus=bool(inventory.gpus),
            cache=self.cache,
            session=plain,
            on_change=self.changed.set,
            tls=(cfg.tls.ca, cfg.tls.cert, cfg.tls.key),
            max_threads=cfg.engine_max_threads(os.environ),
        )
        self._last_discovery = time.monotonic()
        lc = cfg.engines.llamacpp
        self.provisioner = Provisioner(
            self.agent_state,
            base_url=lc.release_url or GITHUB_RELEASES,
            variant=lc.variant,
            on_done=self._rediscover_soon,
        )
        self.vllm = VllmProvisioner(self.agent_state, configured=cfg.engines.vllm.binary)
        self._refresh_engines()
        self._stopping: set[asyncio.Task[None]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_error = ("", "", 0.0)  # (raw failure, text logged, when logged)
        self.control_planes = ControlPlanes(cfg.control_planes, node=cfg.node_id)
        self.terms = Terms()
        self.failed_cycles = 0  # consecutive beats in which no control plane answered
        self._stale_logged: dict[str, str] = {}  # control plane -> the stale-term line last logged
        # Kept in the state dir: a restarted agent is the same instance (no 409 while it adopts).
        self.instance = instance_id(self.agent_state)

    def _refresh_engines(self) -> None:
        status, server = llamacpp.probe(self.cfg, self.agent_state)
        if server is None and self.cfg.engines.llamacpp.binary is None:
            # Nothing configured, on PATH or installed: install the pinned release (CPU nodes) or
            # say what to do (NVIDIA nodes); the next refresh finds what the install put there.
            status = self.provisioner.status(has_nvidia=bool(self.state.inventory.gpus))
        if server is None:
            log.warning("llamacpp: %s", status.detail)
        self.env.engine, self.env.engine_problem = server, status.detail
        # Declared GPUs (tests, hardware discovery cannot see) get no multi-GB vLLM download.
        vstatus, vserver = self.vllm.status(
            has_nvidia=bool(self.state.inventory.gpus), install=self.cfg.discovery.inventory_file is None
        )
        self.env.vllm, self.env.vllm_problem = vserver, vstatus.detail
        # What a group member needs beside the engine (placement leaves out nodes without it).
        if server is not None and (features := LLAMACPP.group_features(server)):
            status = status.model_copy(update={"features": features})
        if vserver is not None and (features := VLLM.group_features(vserver)):
            vstatus = vstatus.model_copy(update={"features": features})
        self.state.engines = [status, vstatus]

    def _rediscover_soon(self) -> None:
        self._last_discovery = float("-inf")  # the next heartbeat re-probes the engines

    def adopt(self) -> None:
        """Take over the engines an earlier agent left running (records that still match)."""
        for record in adoptable(self.agent_state):
            if record.spec.role is not None:
                # A group member's traffic ran through the dead agent's tunnels: stop it, the
                # control plane's spec starts the group again (the head waits for its workers).
                log.info("replica %s: stopping the group member an earlier agent left (pid %d)", record.id, record.pid)
                stop_process_group(record.pid, grace_s=self.env.stop_grace_s)
                drop_record(self.agent_state, record.id)
                continue
            log.info(
                "replica %s: adopting llama-server pid %d on port %d", record.id, record.pid, record.port
            )
            self.state.runners[record.id] = ReplicaRunner.adopt(record, self.env)

    def heartbeat(self) -> Heartbeat:
        """This pass's report."""
        if time.monotonic() - self._last_discovery > REDISCOVER_S:
            self._last_discovery = time.monotonic()
            self.state.inventory = discover_inventory(self.cfg)
            self.env.has_gpus = bool(self.state.inventory.gpus)
            self._refresh_engines()
        elif self.cfg.discovery.inventory_file is None:
            import psutil  # noqa: PLC0415 - cheap per-beat refresh of the one fast-moving figure

            inv = self.state.inventory
            available = int(psutil.virtual_memory().available)
            if abs(available - inv.memory_available_bytes) > MEMORY_STEP * inv.memory_total_bytes:
                inv.memory_available_bytes = available
        return Heartbeat(
            agent_version=__version__,
            inventory=self.state.inventory,
            labels=dict(self.cfg.labels),
            engines=list(self.state.engines),
            replicas=[r.status() for r in self.state.runners.values()],
            instance=self.instance,
            cached=cached_weights(self.cache.root),
            desired_digest=self.state.desired_digest,
        )

    def report(self) -> tuple[Heartbeat, str]:
        """This pass's report and its :func:`~llmgw.protocol.state_digest` (run off the loop)."""
        hb = self.heartbeat()
        return hb, state_digest(hb)

    async def beat_once(self, *, apply: bool = True) -> HeartbeatReply | None:
        """One exchange with a control plane and the reconcile that follows (not with ``apply``
        False: the last report of an agent going away); None when no control plane gave a usable
        answer this beat.

        Tries :attr:`control_planes`' order in turn, at once (:mod:`llmgw.agent.loop.controlplanes`): a
        connect error, TLS failure, timeout, 5xx, unreadable body or stale term moves to the next.
        A 4xx is an answer (logged; a 404 re-registers with the same control plane at once).

        Raises:
            NodeRemoved: the control plane answered 403 ``certificate_revoked``.
        """
        beat, digest = await asyncio.to_thread(self.report)
        was = self.control_planes.current
        failures: list[tuple[str, LlmgwError]] = []
        for url in self.control_planes.order():
            try:
                reply = await self._exchange(url, beat, digest)
            except UnreachableError as e:
                failures.append((url, e))
                self.control_planes.failed(url)
                continue
            except ApiError as e:
                if e.status == 403 and e.code == "certificate_revoked":
                    raise NodeRemoved(str(e).partition(": ")[2] or str(e)) from e
                if e.code == STALE_TERM and self._stale_logged.get(url) != str(e):
                    self._stale_logged[url] = str(e)
                    log.warning("%s", e)
                elif e.code == NO_TERM_YET:
                    log.info("%s", e)
                if e.status >= 500 or e.status < 300:  # 5xx, a stale term, a 2xx that is no heartbeat reply
                    failures.append((url, e))
                    self.control_planes.failed(url)
                    continue
                self.failed_cycles = 0  # a 4xx: it answered, the request is what is wrong
                self.control_planes.succeeded(url)
                if e.status == 404:
                    self.state.registered = False
                await self._log_failure([(url, e)])
                return None
            self._answered(url, was, failures)
            if apply:
                await self._apply(url, reply)
            return reply
        self.failed_cycles += 1
        await self._log_failure(failures)
        return None

    async def _exchange(self, url: str, beat: Heartbeat, digest: str) -> HeartbeatReply:
        """Register or heartbeat with ``url``: a :class:`~llmgw.protocol.Pulse` when ``digest`` (of
        ``beat``) is the acknowledged one, else ``beat``; the full ``beat`` at once after a pulse
        answered ``send_full`` or 400 (a control plane of an older version). A 404 to a heartbeat
        (``url`` does not know this node) is followed by a register at once. Raises what
        :func:`post_heartbeat` raises, and ApiError with code :data:`STALE_TERM` for a reply with a
        term below the highest seen."""
        path = "/agent/v1/heartbeat" if self.state.registered else "/agent/v1/register"
        st = self.state
        small = self.state.registered and digest == st.acked
        body: Heartbeat | Pulse = beat
        if small:
            body = Pulse(digest=digest, instance=self.instance, term=self.terms.highest,
                         desired_digest=st.desired_digest, agent_version=__version__)
        try:
            reply = await self._post(url, path, body)
            if reply.send_full:
                st.asked_full += 1
                reply = await self._post(url, path, beat)
        except ApiError as e:
            if small and e.status == 400:
                log.info("control plane %s reads no pulses (%s): sending the full state", url, e)
                reply = await self._post(url, path, beat)
            elif e.status != 404 or not self.state.registered:
                raise
            else:
                log.info("control plane %s does not know this node: registering again", url)
                self.state.registered = False
                reply = await self._post(url, "/agent/v1/register", beat)
        st.acked = "" if reply.send_full else reply.digest
        if not self.terms.accept(reply.term):
            if reply.term == 0:
                raise ApiError(
                    f"control plane {url} does not know the cluster's term yet (term 0: it has just "
                    "started); its reply is not applied",
                    status=200,
                    code=NO_TERM_YET,
                )
            raise ApiError(
                f"control plane {url} answered with term {reply.term}, older than term "
                f"{self.terms.highest} seen before: it is on a stale database; its reply is not applied",
                status=200,
                code=STALE_TERM,
            )
        return reply

    async def _post(self, url: str, path: str, body: Heartbeat | Pulse) -> HeartbeatReply:
        """:func:`post_heartbeat`, counting the beats of each kind."""
        if isinstance(body, Pulse):
            self.state.pulses += 1
        else:
            self.state.fulls += 1
        return await post_heartbeat(self.api, url, path, body)

    def _answered(self, url: str, was: str, failures: list[tuple[str, LlmgwError]]) -> None:
        """Bookkeeping and the log lines for an answer from ``url`` (``was`` was current before)."""
        self.failed_cycles = 0
        self.control_planes.succeeded(url)
        if url != was and not any(u == was for u, _ in failures):
            # Not a failure: the order tried this node's home first (rendezvous), and it answered.
            log.info("control plane %s is this node's home (rendezvous hashing); moving there from %s", url, was)
        elif url != was:
            why = "; ".join(f"{u}: {reason(e)}" for u, e in failures if u != was)
            first = next((e for u, e in failures if u == was), None)
            log.warning(
                "control plane %s does not answer (%s); using %s%s",
                was,
                reason(first) if first else "not tried",
                url,
                f" (also failed: {why})" if why else "",
            )
        elif self._last_error[0]:
            log.info("control plane %s answers again", url)
        self._last_error = ("", "", 0.0)

    async def _apply(self, url: str, reply: HeartbeatReply) -> None:
        """Take a reply whose term is current: registration, members, leader, desired, log requests."""
        if not self.state.registered:
            log.info("registered with %s as node %s", url, reply.node_id)
            if reply.node_id and reply.node_id != self.cfg.node_id:
                log.warning(
                    "the control plane knows this node as %s (its certificate's CN), agent.yaml says %s",
                    reply.node_id,
                    self.cfg.node_id,
                )
        self.state.registered, self.state.node_id = True, reply.node_id
        self.state.beats += 1
        self.state.term, self.state.leader = reply.term, reply.leader
        self.state.interval_s = reply.interval_s
        added = self.control_planes.learn(reply.control_planes)
        if added:
            log.info("control plane(s) learned from %s: %s", url, ", ".join(added))
        if not reply.desired_unchanged:
            await self.reconcile(reply.desired)
            self.state.desired_digest = reply.desired_digest
        for runner in self.state.runners.values():
            runner.pin_if_free()  # one that started while its cores were taken, once they are not
        for req in reply.log_requests:
            self._answer_log(req)

    def _answer_log(self, req: LogRequest) -> None:
        """Read a replica's engine log and post it to the control plane, in the background."""
        try:
            path = replica_dir(self.agent_state, req.replica_id) / "engine.log"
        except ValueError:
            text, offset, found = "", 0, False
        else:
            text, offset, found = logs.answer(path, lines=req.lines, offset=req.offset)
        body = LogReply(id=req.id, replica_id=req.replica_id, text=text, offset=offset, found=found)

        async def post() -> None:
            try:
                async with self.api.post(
                    self.control_planes.current + "/agent/v1/logs", data=body.model_dump_json(),
                    headers={"Content-Type": "application/json"}, timeout=REQUEST_TIMEOUT,
                ) as resp:
                    await resp.read()
            except (aiohttp.ClientError, TimeoutError) as e:
                log.warning("could not send replica %s's log: %s", req.replica_id, e)

        task = asyncio.get_running_loop().create_task(post())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reconcile(self, desired: list[ReplicaSpec]) -> None:
        """Start new specs, stop undesired runners, restart runners whose spec changed; a draining
        replica's runner is kept as it is (:attr:`~llmgw.protocol.ReplicaSpec.draining`), and a
        draining spec with no runner here is not started."""
        wanted = {s.id: s for s in desired}
        for rid, runner in list(self.state.runners.items()):
            spec = wanted.get(rid)
            if spec is not None and spec.draining:
                continue  # its requests finish on the engine they started on
            if spec is None or spec != runner.spec:
                why = "no longer desired" if spec is None else "its spec changed"
                log.info("replica %s: stopping (%s)", rid, why)
                del self.state.runners[rid]
                task = asyncio.create_task(runner.stop())
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)
                if spec is not None:
                    await task  # the same id is started again below: the old one must be gone first
        for rid, spec in wanted.items():
            if rid not in self.state.runners and not spec.draining:
                log.info(
                    "replica %s: starting %s/%s (profile %s)", rid, spec.model, spec.version, spec.profile
                )
                runner = ReplicaRunner(spec, self.env)
                self.state.runners[rid] = runner
                runner.start()

    async def _log_failure(self, failures: list[tuple[str, LlmgwError]]) -> None:
        """Log a beat that got no usable answer (one ``(url, error)`` per control plane tried),
        explained, when it is new or :data:`LOG_REPEAT_S` passed since the same was logged; the TLS
        diagnosis runs only then (one extra connection per control plane at most)."""
        raw, now = "; ".join(f"{u}: {e}" for u, e in failures), time.monotonic()
        last_raw, last_text, at = self._last_error
        if raw == last_raw and now - at <= LOG_REPEAT_S:
            return
        texts = [await self._explain(url, e) for url, e in failures]
        many = f"no control plane answers ({len(texts)} tried): "
        text = texts[0] if len(texts) == 1 else many + "; ".join(texts)
        if text == last_text and now - at <= LOG_REPEAT_S:
            self._last_error = (raw, text, at)  # the same cause in other words ("reset", "disconnected")
            return
        if self.failed_cycles:
            wait = backoff_s(self.failed_cycles)
            log.warning(
                "%s; trying again within %g s (backing off to at most %g s, jittered), engines keep running",
                text, wait, BACKOFF_S[-1],
            )
        else:
            log.warning("%s; retrying every %.0f s, engines keep running", text, self.cfg.heartbeat_interval_s)
        self._last_error = (raw, text, now)

    async def _explain(self, url: str, e: LlmgwError) -> str:
        """The text to log for a failed exchange with ``url``: the TLS diagnosis when there is one."""
        if not tlsdiag.may_be_tls(e.__cause__):
            return str(e)
        tls = self.cfg.tls
        why = await asyncio.to_thread(tlsdiag.diagnose, url, self.cfg.node_id, tls.ca, tls.cert, tls.key)
        return f"control plane {url}: {why}" if why else str(e)

    async def stop_all(self) -> None:
        """Stop every engine this agent runs (the node was removed from the cluster)."""
        runners, self.state.runners = list(self.state.runners.values()), {}
        await asyncio.gather(*(r.stop() for r in runners), return_exceptions=True)
        if runners:
            log.info("stopped %d engine(s)", len(runners))

    async def run(self, stop: asyncio.Event) -> None:
        """Beat until ``stop`` is set; then detach every runner (engines keep running)."""
        self.adopt()
        if self.state.runners:
            # The first report carries adopted replicas as ready, not as pending/starting (which
            # would drop them from routing for a beat); an engine that does not answer in time is
            # reported as it stands and keeps being probed.
            settles = [asyncio.ensure_future(r.wait_settled()) for r in self.state.runners.values()]
            _, waiting = await asyncio.wait(settles, timeout=ADOPT_WAIT_S)
            for pending in waiting:
                pending.cancel()
        pushing = asyncio.create_task(
            push_loop(
                self.env.session, self.api,
                # A group worker's endpoint is its RPC tunnel, not an HTTP engine: the head's metrics are the group's.
                lambda: [(r.status(), r.spec.model, r.spec.key) for r in self.state.runners.values()
                         if r.spec.role is not GroupRole.WORKER],
                lambda: self.control_planes.current, stop,
            )
        )
        try:
            while not stop.is_set():
                self.changed.clear()
                try:
                    await self.beat_once()
                except NodeRemoved as e:
                    log.error("%s", e)  # noqa: TRY400 - the message is the point; a traceback is noise
                    await self.stop_all()
                    raise
                # After a cycle no control plane answered: back off (a replica's change waits too).
                wait = backoff_s(self.failed_cycles, random.random()) or beat_wait_s(  # noqa: S311 - jitter
                    self.cfg.heartbeat_interval_s, self.state.interval_s, random.uniform(*JITTER)  # noqa: S311 - jitter
                )
                waiters = [asyncio.ensure_future(stop.wait())]
                if not self.failed_cycles:
                    waiters.append(asyncio.ensure_future(self.changed.wait()))
                try:
                    await asyncio.wait(waiters, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waiters:
                        w.cancel()
                # A change right after a beat is sent at once, but never more than ~10 beats/s.
                await asyncio.sleep(min(0.1, self.cfg.heartbeat_interval_s))
        finally:
            pushing.cancel()
            if self._stopping:
                await asyncio.gather(*self._stopping, return_exceptions=True)
            for runner in self.state.runners.values():
                await runner.detach()
            stopped = [rid for rid, r in self.state.runners.items() if r.spec.role is not None]
            for rid in stopped:  # group members stop with their agent (their tunnels end with it)
                del self.state.runners[rid]
            if stopped:
                # Say so at once: the gateway stops routing to a head that is gone, and a group whose
                # worker went starts again, instead of waiting node_lost_after_s for the silence.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.beat_once(apply=False), FAREWELL_BEAT_S)  # report, start nothing
            log.info("agent stopped; %d engine(s) left running for the next agent, %d group member(s) stopped",
                     len(self.state.runners), len(stopped))


async def run_agent(cfg: AgentConfig, paths: Paths, *, stop: asyncio.Event | None = None) -> None:
    """Run the node agent until ``stop`` is set (forever when None).

    Talks to one of ``cfg.control_planes`` at a time (rotating on failure, see
    :mod:`llmgw.agent.loop.controlplanes`) over mTLS with this node's certificate (``cfg.tls``). Engines
    are left running when it returns.

    Raises:
        NodeRemoved: the control plane revoked this node's certificate (its engines are stopped).
        PkiError: the CA, certificate or key in ``cfg.tls`` cannot be loaded.
        ConfigError: ``discovery.inventory_file`` is set but unusable, the state directory
            cannot be made 0700, or ``LLMGW_ENGINE_MAX_THREADS`` is not a whole number of at least 1.
    """
    stop = stop or asyncio.Event()
    ssl_ctx = agent_tls(cfg)
    # Its own modes, whoever made the directory (init does too; a node started by hand with
    # 'server add-node' and 'llmgw agent' had 0755 and 0644 engine logs under the default umask).
    try:
        private_dir(replicas_dir(paths.agent_state))
        private_dir(paths.agent_state)
    except OSError as e:
        raise ConfigError(
            f"the agent's state directory {paths.agent_state} cannot be made private (0700): {e}; "
            "run the agent as the user that owns it (root on a node)"
        ) from e
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl_ctx, keepalive_timeout=KEEPALIVE_S)) as api,
        aiohttp.ClientSession(connector=link_local_connector()) as plain,  # weights' downloads
    ):
        agent = await asyncio.to_thread(Agent, cfg, paths, api=api, plain=plain)
        await agent.run(stop)
