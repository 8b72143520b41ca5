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
  run here; the start deadline comes with it.

An engine is stateless: one instance per engine serves every replica; its build (binary, version,
flags) is the ``S`` value that :meth:`usable` returns and :meth:`argv` takes.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generic, Protocol, TypeVar

import aiohttp

from llmgw.errors import EngineError
from llmgw.protocol import ReplicaSpec

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


class Engine(ABC, Generic[S]):
    """One inference engine as the replica runner drives it (see the module docstring).

    Class attributes:
        name: the profile's ``engine`` (``"llamacpp"``, ``"vllm"``).
        label: the engine in messages (``"llama-server"``).
        health_path: polled while starting; 200 means up (and then :meth:`serving` is asked).
        stuck: why a replica whose health answered 200 never became ready (the deadline message).
    """

    name: ClassVar[str]
    label: ClassVar[str]
    health_path: ClassVar[str] = "/health"
    stuck: ClassVar[str] = "GET /health answered 200 but the engine never became ready"

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
