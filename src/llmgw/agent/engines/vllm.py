"""vLLM (``vllm serve``): where it is, whether this node can run it, and the argv of a replica.

vLLM needs an NVIDIA GPU: on a CPU-only node the engine is ``unsupported`` (placement then says so
for vLLM profiles). On an NVIDIA node it lives in its own virtualenv, pinned:
``<agent_state>/engines/vllm/<VLLM_VERSION>/venv`` (``pip install vllm==<VLLM_VERSION>``, run by
:class:`VllmProvisioner` in a background thread; PyPI publishes a SHA-256 per file and pip checks
it). ``engines.vllm.binary`` in agent.yaml points at another ``vllm`` executable instead.

Launch (:func:`build_argv`): ``vllm serve <model file> <profile args> --host H --port P
--served-model-name <model>``; the agent owns ``--host``, ``--port``, ``--api-key`` and
``--served-model-name`` (a profile's are dropped). The key goes in ``VLLM_API_KEY``, vLLM's own
variable for ``--api-key``, so it is not in the world-readable argv. Readiness is ``GET /health``
200: vLLM does not answer at all until its engine is up. It is stopped by
process group: its ``VLLM::EngineCore`` / ``Worker_TP*`` children otherwise outlive the API
process and hold the GPU (VL #55510). As the replica runner's engine: :data:`VLLM`.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmgw.agent.engines import vllm_group
from llmgw.agent.engines.base import Engine, GroupPart, Launch
from llmgw.protocol import EngineStatus, ProvisionState, ReplicaSpec

log = logging.getLogger(__name__)

ENGINE = "vllm"
VLLM_VERSION = "0.33.0"
"""The pinned vLLM (PyPI, 2026-11)."""

START_DEADLINE_S = 1200.0
"""vLLM start: weights, torch.compile (15–45 s first time), CUDA graphs (10–37 s) and ~30 s of
imports; "init engine took 14–90 s" for 8B models with warm caches (VL #11005, #20264). Minutes."""

PIP_TIMEOUT_S = 3600.0

NO_GPU = (
    "vLLM needs an NVIDIA GPU and this node has none; serve the model here with a llamacpp profile"
)
_OWNED = {"--host", "--port", "--api-key", "--served-model-name", "--uds"}


@dataclass(frozen=True)
class VllmServer:
    """A usable ``vllm`` executable (``version`` as installed, or ``""`` when unknown)."""

    binary: Path
    version: str = ""


NOT_INSTALLING = (
    "this node's GPUs are declared (discovery.inventory_file), not discovered, so vLLM is not installed "
    "automatically; set engines.vllm.binary in agent.yaml to a vllm you installed"
)


def venv_dir(agent_state: Path, version: str = VLLM_VERSION) -> Path:
    """``<agent_state>/engines/vllm/<version>/venv``."""
    return agent_state / "engines" / ENGINE / version / "venv"


def locate(agent_state: Path, configured: Path | None = None) -> VllmServer | None:
    """The configured ``vllm`` if given and executable, else the pinned venv's, else None."""
    for candidate in (configured, venv_dir(agent_state) / "bin" / "vllm"):
        if candidate is not None and candidate.is_file() and os.access(candidate, os.X_OK):
            return VllmServer(candidate.absolute(), "" if candidate == configured else VLLM_VERSION)
    return None


def drop_owned(args: Sequence[str]) -> list[str]:
    """Profile args without the agent-owned flags and their values."""
    kept: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a.split("=", 1)[0] in _OWNED:
            skip = "=" not in a
            continue
        kept.append(a)
    return kept


def build_argv(
    server: VllmServer, spec: ReplicaSpec, *, model_path: Path, host: str, port: int, extra: Sequence[str] = ()
) -> list[str]:
    """``[vllm, serve, model, *profile args, *extra, --host, H, --port, P, --served-model-name, <model>]``
    (``extra``: a group head's parallel sizes and Ray backend)."""
    return [
        str(server.binary),
        "serve",
        str(model_path),
        *drop_owned(spec.args),
        *extra,
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        spec.model,
    ]


def environment(base: dict[str, str], key: str) -> dict[str, str]:
    """``base`` plus ``VLLM_API_KEY`` (``--api-key``'s variable) and offline hub mode."""
    return {**base, "VLLM_API_KEY": key, "HF_HUB_OFFLINE": "1"}


class VllmProvisioner:
    """Reports vLLM's state on this node and installs the pinned venv once (NVIDIA nodes only).

    Args:
        agent_state: the agent's state dir.
        configured: ``engines.vllm.binary`` from agent.yaml, if any.
        python: the interpreter that creates the venv.
    """

    def __init__(self, agent_state: Path, *, configured: Path | None = None, python: str = sys.executable) -> None:
        self.agent_state = agent_state
        self.configured = configured
        self.python = python
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failure = ""

    def status(self, *, has_nvidia: bool, install: bool = True) -> tuple[EngineStatus, VllmServer | None]:
        """The status to report and the usable server; starts the install when due and ``install``
        (False: GPUs that were declared, not discovered — nothing is downloaded for them)."""
        found = locate(self.agent_state, self.configured)
        if found is not None:
            where = "from agent.yaml engines.vllm.binary" if found.binary == self.configured else "agent's venv"
            return (
                EngineStatus(
                    engine=ENGINE,
                    version=found.version,
                    state=ProvisionState.INSTALLED,
                    detail=f"{found.binary} ({where})",
                    binary=str(found.binary),
                ),
                found,
            )
        if self.configured is not None:
            return self._failed(f"agent.yaml: engines.vllm.binary '{self.configured}' is not an executable file"), None
        if not has_nvidia:
            return EngineStatus(engine=ENGINE, state=ProvisionState.UNSUPPORTED, detail=NO_GPU), None
        if not install:
            return EngineStatus(engine=ENGINE, state=ProvisionState.UNSUPPORTED, detail=NOT_INSTALLING), None
        with self._lock:
            if self._failure:
                return self._failed(self._failure), None
            if self._thread is None and install:
                self._thread = threading.Thread(target=self._install, name="vllm-provision", daemon=True)
                self._thread.start()
        return (
            EngineStatus(
                engine=ENGINE,
                version=VLLM_VERSION,
                state=ProvisionState.INSTALLING,
                detail=f"pip install vllm=={VLLM_VERSION} into {venv_dir(self.agent_state)}",
            ),
            None,
        )

    @staticmethod
    def _failed(detail: str) -> EngineStatus:
        return EngineStatus(engine=ENGINE, state=ProvisionState.FAILED, detail=detail)

    def _install(self) -> None:
        venv = venv_dir(self.agent_state)
        steps = [
            [self.python, "-m", "venv", str(venv)],
            [str(venv / "bin" / "pip"), "install", "--disable-pip-version-check", f"vllm=={VLLM_VERSION}"],
        ]
        for argv in steps:
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
            except (OSError, subprocess.SubprocessError) as e:
                self._fail(f"{' '.join(argv[:3])} failed: {e}")
                return
            if done.returncode != 0:
                last = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
                self._fail(f"{' '.join(argv[:4])} failed: {last[0]}")
                return
        log.info("vllm %s installed in %s", VLLM_VERSION, venv)

    def _fail(self, what: str) -> None:
        msg = (
            f"{what}; install vLLM {VLLM_VERSION} by hand (a virtualenv with 'pip install vllm=={VLLM_VERSION}') "
            "and set engines.vllm.binary in agent.yaml to its 'vllm'"
        )
        log.error("vllm: %s", msg)
        with self._lock:
            self._failure = msg


PORT_TAKEN = re.compile(r"address already in use", re.IGNORECASE)
"""uvicorn's bind error in vLLM's log when its port was taken before it bound."""


class VllmEngine(Engine[VllmServer]):
    """vLLM as the replica runner's engine: readiness is ``GET /health`` 200 alone (it does not
    answer before its engine is up); the key goes in ``VLLM_API_KEY`` (:func:`environment`)."""

    name = ENGINE
    label = "vllm"
    group_binary = vllm_group.RAY_BINARY  # ray, in vllm's venv: the feature ``ray``

    def argv(self, build: VllmServer, launch: Launch) -> list[str]:
        """:func:`build_argv` for the launch."""
        return build_argv(build, launch.spec, model_path=launch.model_path, host=launch.host, port=launch.port,
                          extra=launch.extra_args)

    def environment(self, base: dict[str, str], key: str) -> dict[str, str]:
        """:func:`environment`: the key and offline hub mode."""
        return environment(base, key)

    def port_taken(self, tail: str) -> bool:
        """Whether the log says :data:`PORT_TAKEN`."""
        return PORT_TAKEN.search(tail) is not None

    def group_part(self) -> GroupPart:
        """:class:`~llmgw.agent.engines.vllm_group.RayGroup`: a Ray cluster per group."""
        return vllm_group.RayGroup(self)


VLLM = VllmEngine()
"""The one vLLM engine (stateless; see :func:`llmgw.agent.engines.engine_for`)."""
