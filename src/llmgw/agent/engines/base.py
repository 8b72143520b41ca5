"""The engine seam: what the replica runner asks of an inference engine (:class:`Engine`).

The runner (:mod:`llmgw.agent.replicas.runner`) owns everything engines share: the port, the API key
file, the scrubbed environment (:func:`engine_environment`), the process group, the log, the
record, the ``/health`` poll, the deadlines and the exit report. What differs between engines is
asked of the :class:`Engine` of the replica's ``spec.engine`` (the registry is
:func:`llmgw.agent.engines.engine_for`):

- :meth:`Engine.argv`: the command line of one replica (:class:`Launch` says where and what);
- :meth:`Engine.environment`: variables the engine reads instead of flags (vLLM's key);
- :attr:`Engine.health_path` and :meth:`Engine.serving`: readiness is ``GET <health_path>`` 200
  *and* ``serving`` (llama-server: its task loop answers, LC #27388; vLLM: nothing more, it does
  not answer at all before its engine is up);
- :meth:`Engine.port_taken`: the log of an engine that exited before ready says its port was
  taken in between (the runner then tries another port);
- :meth:`Engine.cause`: the log line that says why it failed, carried first in ``err``;
- :meth:`Engine.usable`: the build the node found (:class:`Installed`), or why the engine cannot
  run here; the start deadline comes with it;
- :meth:`Engine.group_part` and :meth:`Engine.group_features`: what the engine does as a member of a
  replica spread over several nodes (its worker process, the head's extra flags and readiness, the
  head's address it reports; :class:`GroupPart`), and what the node reports it can do so
  (``EngineStatus.features``). The runner drives a group member through :class:`GroupPart` and
  offers it :class:`GroupHost`; it never asks which engine it runs.

An engine is stateless: one instance per engine serves every replica; its build (binary, version,
flags) is the ``S`` value that :meth:`usable` returns and :meth:`argv` takes. A group member's
state (its worker process, tunnels, Ray) lives in the :class:`GroupPart` the engine makes for it.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar, Generic, Protocol, TypeVar

import aiohttp

from llmgw import catalog
from llmgw.errors import EngineError, GroupError
from llmgw.protocol import ReplicaSpec, ReplicaState

SCRUBBED_ENV_PREFIXES = ("LLAMA_ARG_",)
SCRUBBED_ENV = frozenset({"LLAMA_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"})

_CAUSES = re.compile(
    r"error loading model: .*|error while handling argument.*|couldn't bind HTTP server socket.*"
    r"|failed to allocate .*|out of memory.*|failed to create_context.*|GGML_ASSERT.*|failed to load model.*",
)
"""llama-server's words for why it stopped (a bad file, a bad flag, a taken port, memory), and
the generic ``out of memory`` that CUDA's errors share."""


class Build(Protocol):
    """A usable build of an engine on this node: at least the executable it runs."""

    @property
    def binary(self) -> Path:
        """Absolute path of the engine's executable."""
        ...


S = TypeVar("S", bound=Build)


@dataclass(frozen=True)
class Installed(Generic[S]):
    """What this node has of one engine.

    Attributes:
        build: the usable build, or None.
        problem: why there is none (the engine's provisioning detail, which says what to do).
        start_deadline_s: seconds a replica of this engine may take from launch to ready.
    """

    build: S | None
    problem: str
    start_deadline_s: float


@dataclass(frozen=True)
class Launch:
    """Where and what one replica serves, for :meth:`Engine.argv`.

    Attributes:
        spec: the replica (profile args, model name, key, cores, GPUs).
        model_path: the weights in the node cache.
        host, port: where the engine listens (the runner picked the port free just now).
        key_file: a 0600 file holding ``spec.key`` (keeps the key out of the world-readable argv).
        node_cores: the node's logical cores; node_has_gpus: whether the node has GPUs.
        threads: the cores the replica is pinned to, or None when it is not pinned.
        extra_args: flags the agent adds for this launch (a group head's ``--rpc …``).
        max_threads: the agent's ``engines.max_threads`` (at most that many compute threads), or None.
    """

    spec: ReplicaSpec
    model_path: Path
    host: str
    port: int
    key_file: Path
    node_cores: int
    node_has_gpus: bool
    threads: int | None = None
    extra_args: tuple[str, ...] = ()
    max_threads: int | None = None


def engine_threads(*, pinned: int | None, reserved: int, node_cores: int, max_threads: int | None) -> int:
    """The compute threads the agent gives an engine process (llama-server's ``--threads``, a group
    worker's rpc-server ``--threads``) where its profile sets none: the cores it is ``pinned`` to, else
    the cores its profile ``reserved`` (``cpu_cores``, when above 0), else the node's (at least 1), and
    at most ``max_threads`` (agent.yaml's ``engines.max_threads``) when that is set."""
    threads = pinned or (reserved if reserved > 0 else max(node_cores, 1))
    return threads if max_threads is None else min(threads, max_threads)


def engine_environment(base: Mapping[str, str], gpu_indexes: list[int]) -> dict[str, str]:
    """Every engine's environment: ``base`` without llama.cpp's flag variables and secrets.

    Every llama-server flag has a ``LLAMA_ARG_*`` variable, and an inherited one changes the engine
    without showing in its argv (a cache limit reached an engine only through the parent's
    environment: rwlove/home-ops PR #13936). GPU replicas see only their GPUs, in PCI bus order
    (CUDA's default order is "fastest first", nvidia-smi's is PCI). :meth:`Engine.environment`
    adds the engine's own variables to this.
    """
    env = {k: v for k, v in base.items() if k not in SCRUBBED_ENV and not k.startswith(SCRUBBED_ENV_PREFIXES)}
    if gpu_indexes:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpu_indexes)
    return env


def headline(tail: str) -> str:
    """The first line of an engine log that says why it failed (the engine's own words), or ``""``."""
    for line in tail.splitlines():
        m = _CAUSES.search(line)
        if m:
            return m.group(0).strip()
    return ""


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GroupEnv(Protocol):
    """What a group part reads of the node's runner settings (the replica runner's ``RunnerEnv``
    is one; see it for each field's meaning and units). Read-only here."""

    @property
    def advertise_address(self) -> str:
        """Where the node's engines bind."""
        ...

    @property
    def cores(self) -> int:
        """The node's logical cores."""
        ...

    @property
    def max_threads(self) -> int | None:
        """The most compute threads an engine runs (the agent's ``engines.max_threads``), or None."""
        ...

    @property
    def base_env(self) -> Mapping[str, str]:
        """The environment engines inherit before scrubbing."""
        ...

    @property
    def tls(self) -> tuple[Path, Path, Path] | None:
        """This agent's ``(ca, cert, key)`` PEM paths, None where no group can run."""
        ...

    @property
    def on_change(self) -> Callable[[], None]:
        """Called to send a heartbeat early."""
        ...

    @property
    def probe_interval_s(self) -> float:
        """Seconds between readiness polls."""
        ...

    @property
    def watch_interval_s(self) -> float:
        """Seconds between checks that a process still runs."""
        ...

    @property
    def clock(self) -> Callable[[], float]:
        """Monotonic seconds."""
        ...

    @property
    def port_picker(self) -> Callable[[str], int]:
        """Picks a free port on an address."""
        ...

    @property
    def probe_host(self) -> str:
        """The address the node's own processes are reached on (loopback for a wildcard)."""
        ...

    def installed(self, engine: str) -> Installed[Any]:
        """What this node has of ``engine``: its build or why none, and its start deadline."""
        ...


class GroupHost(Protocol):
    """The replica runner as a :class:`GroupPart` sees it: the spec, the node's settings, the
    replica's directory and log, and the state and process it reports."""

    spec: ReplicaSpec
    dir: Path
    pid: int | None
    started_at: float | None

    @property
    def env(self) -> GroupEnv:
        """The node's runner settings."""
        ...

    def set_state(self, state: ReplicaState) -> None:
        """Move the replica to ``state`` (the loop reports it at the next heartbeat)."""
        ...

    def engine_log(self, starting: str) -> AbstractContextManager[IO[bytes]]:
        """The replica's engine log, open for appending, after a ``--- llmgw agent: <starting>``
        line; a failure quotes what follows it (:meth:`tail`)."""
        ...

    def tail(self) -> str:
        """The engine log's last lines since the latest :meth:`engine_log`."""
        ...

    async def fetch_weights(self) -> Path:
        """``fetching``: the weights into the node cache (held for this replica); their path."""
        ...


class GroupPart(ABC):
    """What one replica's engine does as a member of a group, for one runner (stateful: its worker
    process, tunnels or cluster live here from start to :meth:`stop`).

    The runner asks, by the member's role: a worker :meth:`run_worker` (its whole life: the
    engine's worker process, ``ready`` while it runs); a head :meth:`head_args` before it launches
    the engine as for one node, then :meth:`environment` for the engine's variables and
    :meth:`launched` with its pid. :attr:`endpoint` and :attr:`group_endpoint` go into the member's
    status; :meth:`stop` ends whatever the part started. Failures raise
    :class:`~llmgw.errors.GroupError` (or another :class:`~llmgw.errors.LlmgwError`) whose message
    becomes the replica's ``err``.
    """

    @property
    def endpoint(self) -> str:
        """The endpoint a worker reports instead of the engine's port (``host:port``), ``""`` for none."""
        return ""

    @property
    def group_endpoint(self) -> str:
        """An address the head reports for its workers (``ReplicaStatus.group_endpoint``), ``""`` for none."""
        return ""

    @abstractmethod
    async def run_worker(self, host: GroupHost) -> None:
        """Run a worker member until its process ends (then raise, with its last lines)."""

    @abstractmethod
    async def head_args(self, host: GroupHost, build: Any, model_path: Path) -> list[str]:
        """The head's extra engine flags, once the group can start (``starting`` until then)."""

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """The head engine's environment, with what the group adds to it."""
        return env

    def launched(self, pid: int) -> None:  # noqa: B027 (optional hook: most parts need nothing)
        """The head engine runs as ``pid`` (before it dials anything)."""

    @abstractmethod
    async def stop(self, grace_s: float) -> None:
        """End what this part started (idempotent); a process gets ``grace_s`` between SIGTERM and SIGKILL."""


class Engine(ABC, Generic[S]):
    """One inference engine as the replica runner drives it (see the module docstring).

    Class attributes:
        name: the profile's ``engine`` (``"llamacpp"``, ``"vllm"``).
        label: the engine in messages (``"llama-server"``).
        health_path: polled while starting; 200 means up (and then :meth:`serving` is asked).
        stuck: why a replica whose health answered 200 never became ready (the deadline message).
        group_binary: the program a group member runs beside the engine's binary, in the same
            directory (its presence is :meth:`group_features`); "" for an engine without groups.
        stop_grace_s: the most seconds between SIGTERM and SIGKILL this engine is worth waiting
            (the agent's own grace when shorter); None: the agent's.
    """

    name: ClassVar[str]
    label: ClassVar[str]
    health_path: ClassVar[str] = "/health"
    stuck: ClassVar[str] = "GET /health answered 200 but the engine never became ready"
    group_binary: ClassVar[str] = ""
    stop_grace_s: ClassVar[float | None] = None

    def usable(self, installed: Installed[S]) -> S:
        """The build to launch.

        Raises:
            EngineError: the node has none; the message carries ``installed.problem``.
        """
        if installed.build is None:
            raise EngineError(f"{self.label} is not usable on this node: {installed.problem}")
        return installed.build

    @abstractmethod
    def argv(self, build: S, launch: Launch) -> list[str]:
        """The command line of one replica; the agent owns host, port, model and key."""

    def environment(self, base: dict[str, str], key: str) -> dict[str, str]:
        """``base`` (already scrubbed, :func:`engine_environment`) plus the engine's own variables."""
        return base

    @abstractmethod
    def port_taken(self, tail: str) -> bool:
        """Whether the log ``tail`` of an engine that exited before ready says its port was taken."""

    async def serving(self, session: aiohttp.ClientSession, base_url: str, key: str) -> bool:
        """Whether an engine whose health answered 200 serves (``base_url``: ``http://host:port``).

        The default trusts the health answer."""
        return True

    def cause(self, tail: str) -> str:
        """The line of the log ``tail`` that says why the engine failed, or ``""``."""
        return headline(tail)

    def group_part(self) -> GroupPart:
        """A new :class:`GroupPart` for one replica of this engine spread over several nodes.

        Raises:
            GroupError: this engine runs no groups here.
        """
        raise GroupError(f"a {self.name} group member is not supported by this agent")

    def group_features(self, build: S) -> list[str]:
        """What ``build`` can do beside serving alone, as the node reports it
        (``EngineStatus.features``; placement needs a group's feature on every member): the
        engine's group feature (:attr:`llmgw.catalog.EngineTraits.group_feature`) when
        :attr:`group_binary` stands beside the build's binary, else none."""
        traits = catalog.engine_traits(self.name)
        if traits is None or not self.group_binary or not (build.binary.parent / self.group_binary).is_file():
            return []
        return [traits.group_feature]
