"""One replica on this node, from weights to a serving engine: :class:`ReplicaRunner`.

The runner is engine-neutral: what differs between llama-server and vLLM (argv, environment,
readiness, a taken port, the cause of a failure) is asked of the :class:`~llmgw.agent.engines.base.Engine`
the replica's ``spec.engine`` names (:func:`~llmgw.agent.engines.engine_for`); that seam is the
one this module is split along. So is a group member's part (``spec.role``): a worker's whole run
and a head's extra flags are its engine's :class:`~llmgw.agent.engines.base.GroupPart`
(:meth:`~llmgw.agent.engines.base.Engine.group_part`: llama.cpp's rpc-server, vLLM's Ray), which
the runner drives through :class:`~llmgw.agent.engines.base.GroupHost` (:meth:`ReplicaRunner.set_state`,
:meth:`~ReplicaRunner.engine_log`, :meth:`~ReplicaRunner.tail`, :meth:`~ReplicaRunner.fetch_weights`).

States (who moves each transition):

- ``fetching``: the runner copies the weights from the mirror into the node cache (resumed,
  sha256 verified; a verified file already there is reused).
- ``starting``: the runner launched the engine and polls its ``GET /health`` every
  :attr:`RunnerEnv.probe_interval_s`; llama-server listens before it loads and answers 503
  ``Loading model`` until the model is in, then 200. (``/v1/models`` is *not* readiness: it answers
  200 during load.)
- ``ready``: ``/health`` answered 200 *and* the engine says it serves
  (:meth:`~llmgw.agent.engines.base.Engine.serving`: llama-server's task loop answered ``GET /slots``
  or a 1-token completion, since a wedged server still says ok on ``/health``, LC #27388; vLLM does
  not answer before it serves). The runner keeps watching the process.
- ``failed``: the weights could not be fetched, the engine is missing, it exited (before or
  after ready), or it was not ready by its start deadline (:attr:`RunnerEnv.start_deadline_s`,
  :attr:`RunnerEnv.vllm_start_deadline_s`). ``err`` carries the exit code or signal (a SIGKILL
  named as an out-of-memory kill when the cgroup or kernel log says so,
  :mod:`llmgw.agent.engines.exits`) and the engine's own last :data:`TAIL_LINES` log lines
  (llama-server logs ``failed to load model`` / ``error loading model: …`` and exits 1 on a bad file).
- ``stopped``: :meth:`ReplicaRunner.stop` ended it (SIGTERM to its process group, SIGKILL after
  the grace). A failed runner stays failed: the control plane decides whether to try again.

A port is chosen free just before launch; when the engine still finds it taken (llama-server logs
``couldn't bind HTTP server socket`` and exits 1 before loading) another is tried, up to
:data:`PORT_TRIES` times.

The engine runs in a new session with stdout+stderr appended to
``<agent_state>/replicas/<id>/engine.log`` and a scrubbed environment
(:func:`~llmgw.agent.engines.base.engine_environment`: no ``LLAMA_ARG_*``, which would silently
set flags; no ``LLAMA_API_KEY`` or ``HF_TOKEN``). Its record (see :mod:`llmgw.agent.node.records`) lets
a restarted agent adopt it. Cancelling a runner's task (:meth:`ReplicaRunner.detach`) never stops
its engine: only :meth:`ReplicaRunner.stop` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp
import psutil

from llmgw.agent.engines import engine_for, llamacpp
from llmgw.agent.engines import vllm as vllm_engine
from llmgw.agent.engines.base import Engine, GroupPart, Installed, Launch, engine_environment, host_port
from llmgw.agent.engines.exits import describe_exit, oom_evidence, oom_kills
from llmgw.agent.node import logs
from llmgw.agent.node.cache import NodeCache
from llmgw.agent.node.logs import rotate, tail_after
from llmgw.agent.node.pinning import CoreAllocator, format_cpus, pin_process
from llmgw.agent.node.records import (
    STOP_GRACE_S,
    ReplicaRecord,
    drop_record,
    live_process,
    open_log,
    private_dir,
    replica_dir,
    stop_process_group,
    write_private,
    write_record,
)
from llmgw.errors import EngineError, LlmgwError
from llmgw.proctime import since_boot
from llmgw.protocol import GroupRole, ReplicaSpec, ReplicaState, ReplicaStatus

log = logging.getLogger(__name__)

TAIL_LINES = 50
"""Engine log lines carried in ``err``: llama-server's load error, its cause and the lines before."""

PORT_TRIES = 3
"""Launches with a fresh port when the chosen one was taken in between."""

_detached: list[subprocess.Popen[bytes]] = []
"""Popen objects of engines left running on purpose, kept so their finaliser does not warn."""


def _exit_message(engine: Engine[Any], code: int | None, when: str, tail: str, *, oom: str | None = None) -> str:
    cause = engine.cause(tail)
    return (
        f"{engine.label} exited {describe_exit(code, oom=oom)} {when}"
        + (f": {cause}" if cause else "")
        + (f"; its last lines:\n{tail}")
    )


@dataclass
class RunnerEnv:
    """What every runner on this node shares.

    Each engine has its own fields here (its build, why there is none, its start deadline: what the
    agent loop sets after probing); :meth:`installed` is the one table that maps them to engine
    names, so the runner itself never asks which engine it runs.

    Attributes:
        agent_state: ``<agent_state>``; replicas live under ``replicas/<id>``.
        advertise_address: where engines bind and the gateway dials them.
        cores: the node's logical cores (``--threads`` when a spec reserves none).
        max_threads: ``engines.max_threads`` (:meth:`llmgw.config.AgentConfig.engine_max_threads`): the
            most compute threads an engine runs, or None.
        has_gpus: whether the node has GPUs (a CPU replica then gets ``--device none``).
        cache: the node's model cache.
        session: a plain-HTTP aiohttp session for the mirror and the engines' ``/health``.
        engine: the usable llama-server build, or None; engine_problem: why not.
        vllm: the usable ``vllm``, or None; vllm_problem: why not; vllm_start_deadline_s: its
            start deadline (minutes: vLLM compiles and captures CUDA graphs before it answers).
        on_change: called when a runner changes state (the loop sends a heartbeat early).
        probe_interval_s: seconds between ``/health`` polls while starting (0.25–0.5 s: a 270M
            model loads in ~1.6 s here, so a coarser poll would double its time to ready).
        start_deadline_s: a llama-server replica not ready after this long is failed.
        watch_interval_s: seconds between checks that a ready engine still runs.
        stop_grace_s: SIGTERM → SIGKILL grace.
        clock: monotonic seconds (a seam).
        port_picker: picks the engine's port on an address (a seam; default: bind port 0).
        base_env: the environment engines inherit before scrubbing.
        cpus: hands out each replica's cores (see :mod:`llmgw.agent.node.pinning`).
        pin: pin engines to their cores (off only to measure what pinning buys).
        log_max_bytes, log_keep: engine log rotation (:mod:`llmgw.agent.node.logs`).
        tls: this agent's ``(ca, cert, key)`` PEM paths: a group replica's members talk over them
            (:mod:`llmgw.agent.groups.groupnet`); None where no group can run (tests of one-node replicas).
    """

    agent_state: Path
    advertise_address: str
    cores: int
    has_gpus: bool
    cache: NodeCache
    session: aiohttp.ClientSession
    engine: llamacpp.LlamaServer | None = None
    engine_problem: str = llamacpp.NO_BINARY
    vllm: vllm_engine.VllmServer | None = None
    vllm_problem: str = vllm_engine.NO_GPU
    vllm_start_deadline_s: float = vllm_engine.START_DEADLINE_S
    on_change: Callable[[], None] = lambda: None
    probe_interval_s: float = 0.3
    start_deadline_s: float = 300.0
    watch_interval_s: float = 1.0
    stop_grace_s: float = STOP_GRACE_S
    clock: Callable[[], float] = time.monotonic
    port_picker: Callable[[str], int] = llamacpp.free_port
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    cpus: CoreAllocator = field(default_factory=CoreAllocator)
    log_max_bytes: int = logs.MAX_BYTES
    log_keep: int = logs.KEEP
    pin: bool = True
    tls: tuple[Path, Path, Path] | None = None
    max_threads: int | None = None

    def installed(self, engine: str) -> Installed[Any]:
        """What this node has of ``engine`` (a registered name): its build or why none, and its
        start deadline. The table that maps the per-engine fields above to engine names."""
        table: dict[str, Installed[Any]] = {
            llamacpp.ENGINE: Installed(self.engine, self.engine_problem, self.start_deadline_s),
            vllm_engine.ENGINE: Installed(self.vllm, self.vllm_problem, self.vllm_start_deadline_s),
        }
        return table[engine]

    @property
    def probe_host(self) -> str:
        """The address to probe: the advertise address, loopback when that is a wildcard."""
        return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.advertise_address, self.advertise_address)


class _Failed(Exception):
    """The runner gives up; the message becomes ``err``."""


class ReplicaRunner:
    """Runs one :class:`ReplicaSpec` (see the module docstring for the states).

    Use :meth:`start` (or :meth:`adopt` for an engine an earlier agent launched), read
    :meth:`status` at will, and end with :meth:`stop` (engine stopped) or :meth:`detach` (the
    agent exits; the engine keeps serving).
    """

    def __init__(self, spec: ReplicaSpec, env: RunnerEnv) -> None:
        self.spec = spec
        self.env = env
        self.state = ReplicaState.PENDING
        self.err = ""
        self.port = 0
        self.pid: int | None = None
        self.started_at: float | None = None
        self.cpus: list[int] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._record: ReplicaRecord | None = None
        self._model_path: Path | None = None
        self._log_offset = 0
        self._oom_before: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._settled = asyncio.Event()
        self.dir = replica_dir(env.agent_state, spec.id)
        self.log_path = self.dir / "engine.log"
        self._group: GroupPart | None = None  # a group member's part (its engine's: Engine.group_part)

    # --- public -------------------------------------------------------------------------------

    def start(self) -> None:
        """Begin fetching and launching in a task of the running loop."""
        self._task = asyncio.create_task(self._run(), name=f"replica-{self.spec.id}")

    @classmethod
    def adopt(cls, record: ReplicaRecord, env: RunnerEnv) -> ReplicaRunner:
        """A runner for an engine an earlier agent launched (already checked by the records module)."""
        runner = cls(record.spec, env)
        runner._record = record
        runner.pid, runner.port, runner.started_at = record.pid, record.port, record.started_at
        runner.cpus = env.cpus.claim(record.id, record.cpus)
        with contextlib.suppress(LlmgwError):
            runner._model_path = env.cache.path_for(record.spec)
            env.cache.in_use.add(runner._model_path)
        runner._task = asyncio.create_task(runner._run_adopted(), name=f"replica-{record.id}")
        return runner

    def pin_if_free(self) -> bool:
        """Pin a ready engine that runs unpinned because its cores were taken when it started (a
        profile change starts the new replica before the old one has stopped), now that enough are
        free; True when it was pinned. It stayed unpinned for its whole life, spinning on cores
        reserved for the replicas placed after it (an operator's finding)."""
        spec = self.spec
        if (not self.env.pin or self.cpus or spec.cpu_cores <= 0 or self.state != ReplicaState.READY
                or self.pid is None or self._record is None or self._group is not None):
            return False
        cpus = self.env.cpus.allocate(spec.id, spec.cpu_cores)
        if not cpus:
            return False
        try:
            pin_process(self.pid, cpus)
        except OSError as e:
            self.env.cpus.release(spec.id)
            log.warning("replica %s: cannot pin pid %d to cores %s: %s", spec.id, self.pid, cpus, e)
            return False
        self.cpus = cpus
        self._record = self._record.model_copy(update={"cpus": cpus})
        write_record(self.env.agent_state, self._record)
        log.info("replica %s: pinned to cores %s, free now (it ran unpinned)", spec.id, format_cpus(cpus))
        return True

    def status(self) -> ReplicaStatus:
        """What the agent reports for this replica now (a group worker: its part's endpoint, such
        as a llama.cpp worker's tunnel)."""
        if self._group is not None and self._group.endpoint:
            endpoint = self._group.endpoint
        else:
            endpoint = host_port(self.env.advertise_address, self.port) if self.port else ""
        return ReplicaStatus(
            id=self.spec.id,
            state=self.state,
            err=self.err,
            endpoint=endpoint,
            pid=self.pid,
            started_at=self.started_at,
            group_endpoint=self._group.group_endpoint if self._group is not None else "",
        )

    async def wait_settled(self) -> ReplicaState:
        """Wait until the replica is ready, failed or stopped; returns that state (for callers and tests)."""
        await self._settled.wait()
        return self.state

    async def stop(self) -> None:
        """Stop the engine (SIGTERM its group, SIGKILL after the grace) and drop its record."""
        await self._cancel_task()
        await self._kill()
        drop_record(self.env.agent_state, self.spec.id)
        self._release()
        if self.state != ReplicaState.FAILED:
            self._set(ReplicaState.STOPPED)

    async def detach(self) -> None:
        """Stop watching but leave the engine running and its record in place (agent shutdown).

        A group member is stopped instead: its traffic runs through this agent's tunnels, which end
        with it, so the group is started again by the next agent (the head waits for its workers)."""
        if self.spec.role is not None:
            await self.stop()
            return
        await self._cancel_task()
        if self._proc is not None and self._proc.poll() is None:
            _detached.append(self._proc)

    # --- what a group member's part asks of its runner (engines.base.GroupHost) ---------------

    def set_state(self, state: ReplicaState) -> None:
        """Move to ``state`` (the loop hears of it through ``on_change``)."""
        self._set(state)

    def engine_log(self, starting: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """The engine log, open for appending after a ``--- llmgw agent: <starting>`` line."""
        return self._engine_log(starting)

    def tail(self) -> str:
        """The engine log's last :data:`TAIL_LINES` lines since the latest start."""
        return self._tail()

    async def fetch_weights(self) -> Path:
        """``fetching``: the weights into the node cache, held for this replica; their path."""
        self._set(ReplicaState.FETCHING)
        self._model_path = await self.env.cache.ensure(self.env.session, self.spec)
        return self._model_path

    # --- the run ------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            if self.spec.role is GroupRole.WORKER:
                self._group = engine_for(self.spec.engine).group_part()
                await self._group.run_worker(self)
                return
            self._model_path = await self.fetch_weights()
            engine = engine_for(self.spec.engine)
            build = engine.usable(self.env.installed(engine.name))
            extra: list[str] = []
            if self.spec.role is GroupRole.HEAD:
                self._group = engine.group_part()
                extra = await self._group.head_args(self, build, self._model_path)
            for attempt in range(1, PORT_TRIES + 1):
                await asyncio.to_thread(self._launch, engine, build, self._model_path, extra)
                if await self._wait_ready(engine):
                    break
                log.warning(
                    "replica %s: port %d was taken; trying another (%d/%d)",
                    self.spec.id,
                    self.port,
                    attempt,
                    PORT_TRIES,
                )
            else:
                await self._fail(
                    f"{engine.label} could not bind a port after {PORT_TRIES} tries; "
                    f"its last lines:\n{self._tail()}"
                )
                return
            await self._watch(engine)
        except (_Failed, LlmgwError, OSError) as e:
            await self._fail(str(e))

    async def _run_adopted(self) -> None:
        try:
            engine = engine_for(self.spec.engine)
            # Straight to ready when it answers at once: reporting ``starting`` first would take a
            # serving replica out of the routing table for a heartbeat.
            if not self._exited()[0] and await self._health(engine) == 200:
                log.info("replica %s: adopted, serving on port %d", self.spec.id, self.port)
                self._set(ReplicaState.READY)
                await self._watch(engine)
                return
            self._set(ReplicaState.STARTING)
            if not await self._wait_ready(engine):
                await self._fail(f"adopted {engine.label} lost its port; its last lines:\n{self._tail()}")
                return
            await self._watch(engine)
        except (_Failed, LlmgwError) as e:
            await self._fail(str(e))

    @contextlib.contextmanager
    def _engine_log(self, starting: str) -> Iterator[IO[bytes]]:
        """The engine log, open for appending, with a ``--- llmgw agent: <starting>`` line; the
        offset after it is where this start's lines begin (what a failure quotes)."""
        with open_log(self.log_path) as logf:
            logf.write(f"--- llmgw agent: {starting}\n".encode())
            logf.flush()
            self._log_offset = logf.tell()
            yield logf

    def _launch(self, engine: Engine[Any], build: Any, model_path: Path, extra: list[str] | None = None) -> None:
        """Start the engine (blocking parts: bind probe, file writes, fork); state ``starting``."""
        env = self.env
        private_dir(self.dir)
        key_file = self.dir / "api-key"
        write_private(key_file, self.spec.key + "\n")
        self.port = env.port_picker(env.advertise_address)
        self.cpus = env.cpus.allocate(self.spec.id, self.spec.cpu_cores) if env.pin else []
        self._oom_before = oom_kills()
        proc_env = engine.environment(engine_environment(env.base_env, self.spec.gpu_indexes), self.spec.key)
        proc_env.update(self.spec.env)  # the profile's NCCL_*/GLOO_*… settings
        if self._group is not None:
            proc_env = self._group.environment(proc_env)  # vllm serve: the group's RAY_ADDRESS
        launch = Launch(
            spec=self.spec,
            model_path=model_path,
            host=env.advertise_address,
            port=self.port,
            key_file=key_file,
            node_cores=env.cores,
            node_has_gpus=env.has_gpus,
            threads=len(self.cpus) or None,
            max_threads=env.max_threads,
            extra_args=tuple(extra or ()),
        )
        argv = engine.argv(build, launch)
        with self._engine_log(f"starting {' '.join(_redact(argv, self.spec.key))}") as logf:
            try:
                self._proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # outlives the agent; its own group to kill as one
                    cwd=self.dir,
                    env=proc_env,
                )
            except OSError as e:
                raise _Failed(f"cannot run {build.binary}: {e}") from e
        if self._group is not None:
            self._group.launched(self._proc.pid)  # before it dials its workers (a forwarder refuses others)
        self.pid = self._proc.pid
        self.started_at = time.time()
        if self.cpus:
            try:
                pin_process(self._proc.pid, self.cpus)
            except OSError as e:
                log.warning("replica %s: cannot pin pid %d to cores %s: %s", self.spec.id, self.pid, self.cpus, e)
        try:
            proc = psutil.Process(self._proc.pid)
            create_time, started = proc.create_time(), since_boot(proc)
        except psutil.Error:
            create_time, started = 0.0, None  # already gone: readiness sees the exit
        self._record = ReplicaRecord(
            id=self.spec.id, pid=self._proc.pid, create_time=create_time, since_boot=started, argv=argv,
            host=env.advertise_address,
            port=self.port, key=self.spec.key, spec=self.spec, started_at=self.started_at, cpus=self.cpus,
        )  # fmt: skip
        write_record(env.agent_state, self._record)
        log.info(
            "replica %s: %s pid %d on %s loading %s (cores %s)",
            self.spec.id,
            engine.label,
            self._proc.pid,
            host_port(env.advertise_address, self.port),
            model_path.name,
            format_cpus(self.cpus) or "unpinned",
        )
        self._set(ReplicaState.STARTING)

    async def _wait_ready(self, engine: Engine[Any]) -> bool:
        """Poll the health URL until 200 and the engine serves (True); False when the port was
        taken; raises _Failed otherwise."""
        limit = self.env.installed(engine.name).start_deadline_s
        deadline = self.env.clock() + limit
        while True:
            exited, code = self._exited()
            if exited:
                tail = self._tail()
                drop_record(self.env.agent_state, self.spec.id)
                if engine.port_taken(tail):
                    return False
                raise _Failed(_exit_message(engine, code, "before it was ready", tail, oom=self._oom(code)))
            health = await self._health(engine)
            if health == 200 and await engine.serving(self.env.session, self._base_url, self.spec.key):
                log.info(
                    "replica %s: ready on %s", self.spec.id, host_port(self.env.advertise_address, self.port)
                )
                self._set(ReplicaState.READY)
                return True
            if self.env.clock() > deadline:
                await self._kill()
                drop_record(self.env.agent_state, self.spec.id)
                why = engine.stuck if health == 200 else f"GET {engine.health_path} never answered 200"
                raise _Failed(
                    f"{engine.label} was not ready {limit:.0f} s after it started "
                    f"({why}); stopped. Its last lines:\n{self._tail()}"
                )
            await asyncio.sleep(self.env.probe_interval_s)

    async def _watch(self, engine: Engine[Any]) -> None:
        while True:
            await asyncio.sleep(self.env.watch_interval_s)
            if await asyncio.to_thread(rotate, self.log_path, max_bytes=self.env.log_max_bytes, keep=self.env.log_keep):
                self._log_offset = 0
            exited, code = self._exited()
            if exited:
                drop_record(self.env.agent_state, self.spec.id)
                raise _Failed(_exit_message(engine, code, "while serving", self._tail(), oom=self._oom(code)))

    def _oom(self, code: int | None) -> str | None:
        if code != -signal.SIGKILL or self.pid is None:
            return ""
        return oom_evidence(self.pid, self._oom_before)

    @property
    def _base_url(self) -> str:
        return f"http://{host_port(self.env.probe_host, self.port)}"

    async def _health(self, engine: Engine[Any]) -> int | None:
        url = f"{self._base_url}{engine.health_path}"
        try:
            async with self.env.session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                return resp.status
        except (aiohttp.ClientError, TimeoutError):
            return None

    def _exited(self) -> tuple[bool, int | None]:
        """Whether the engine is gone, and its return code when it was our child."""
        if self._proc is not None:
            code = self._proc.poll()
            return code is not None, code
        if self._record is not None:
            return live_process(self._record) is None, None
        return True, None

    def _tail(self) -> str:
        return tail_after(self.log_path, self._log_offset, TAIL_LINES)

    # --- endings ------------------------------------------------------------------------------

    async def _cancel_task(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _kill(self) -> None:
        """End the engine and its group, if it still runs; reap our own child; close a group
        member's tunnels. SIGKILL follows SIGTERM after the agent's grace, or the engine's
        (``Engine.stop_grace_s``) when shorter."""
        grace = self.env.stop_grace_s
        with contextlib.suppress(EngineError):  # an engine this agent does not know: the agent's grace
            own = engine_for(self.spec.engine).stop_grace_s
            grace = min(grace, own) if own is not None else grace
        if self._group is not None:
            await self._group.stop(grace)
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                await asyncio.to_thread(stop_process_group, proc.pid, grace_s=grace, reap=False)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(proc.wait, 5)
        elif self._record is not None and live_process(self._record) is not None:
            await asyncio.to_thread(stop_process_group, self._record.pid, grace_s=grace)

    async def _fail(self, err: str) -> None:
        log.error("replica %s failed: %s", self.spec.id, err)
        self.err = err
        self._release()
        self._set(ReplicaState.FAILED)

    def _release(self) -> None:
        self.env.cpus.release(self.spec.id)
        if self._model_path is not None:
            self.env.cache.release(self._model_path)

    def _set(self, state: ReplicaState) -> None:
        if state != self.state:
            self.state = state
            if state in (ReplicaState.READY, ReplicaState.FAILED, ReplicaState.STOPPED):
                self._settled.set()
            else:
                self._settled.clear()
            self.env.on_change()


def _redact(argv: list[str], key: str) -> list[str]:
    return ["***" if key and a == key else a for a in argv]


def new_key() -> str:
    """A random API key for an engine (for callers that make specs, such as tests)."""
    return secrets.token_urlsafe(24)
