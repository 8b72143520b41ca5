"""llama.cpp's ``llama-server``: where the binary is, what version it is, and the argv of a replica.

Lookup order (the first that applies decides; a configured binary that is broken is *not*
silently replaced by another one):

1. ``engines.llamacpp.binary`` in agent.yaml: it must exist and be executable.
2. ``llama-server`` on ``PATH``.
3. The agent's own install: ``<agent_state>/engines/llamacpp/<version>/llama-server`` (or
   ``…/<version>/bin/llama-server``); the highest version wins, ``current`` when present.

``llama-server --version`` prints ``version: <build> (<sha>)`` (on stderr); ``--help`` tells which
flags this build knows, so defaults a build does not understand are not passed (an unknown flag
makes llama-server exit before it loads anything).

As the replica runner's engine (:data:`LLAMACPP`, see :mod:`llmgw.agent.engines.base`): ready is
``GET /health`` 200 *and* the task loop answering (:meth:`LlamaCppEngine.serving`); a taken port
shows as ``couldn't bind HTTP server socket`` (:data:`BIND_FAILED`).

Argv (see :func:`build_argv`): the agent owns ``-m``, ``--host``, ``--port`` and the API key, and
passes every sizing flag explicitly, because llama-server's defaults are traps:
``-np`` omitted means 4 slots sharing one unified KV pool; ``--cache-ram`` defaults to 8192 MiB of
host RAM per process on top of weights and KV; ``-t`` omitted means physical cores. The profile's
args win over the agent's defaults and ``--threads``, without a flag appearing twice.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from llmgw import catalog
from llmgw.agent.engines import llamacpp_group
from llmgw.agent.engines.base import Engine, GroupPart, Launch, engine_threads
from llmgw.config import AgentConfig
from llmgw.protocol import EngineStatus, ProvisionState, ReplicaSpec

ENGINE = "llamacpp"
BINARY_NAME = "llama-server"

NO_BINARY = (
    "no llama-server: set engines.llamacpp.binary in agent.yaml, put llama-server on PATH, "
    "or run 'llmgw server init --llama-server PATH'"
)

PROBE_TIMEOUT_S = 20.0
"""``--version``/``--help`` take milliseconds; a binary that hangs there is reported, not waited on."""

READY_PROBE_TIMEOUT_S = 5.0
"""The deep readiness probe (``GET /slots``, else a 1-token completion) goes through the engine's
task loop; a healthy one answers in milliseconds, a wedged one never (LC #27388)."""

DEFAULT_PARALLEL = catalog.DEFAULT_SLOTS
"""Slots (4). Given explicitly so each slot gets ``-c / 4`` tokens of its own: with ``-np`` omitted,
four slots share one unified pool and one long conversation can exhaust it for all (LC #23652)."""

DEFAULT_CTX_SIZE = catalog.DEFAULT_CTX_SIZE
"""KV cells (``--ctx-size``, 4096) when the profile gives none: llama-server's default (0) is the
model's training context, 32k–128k+ cells and gigabytes of KV; placement sizes for this one
(:func:`llmgw.catalog.default_context`). With
:data:`DEFAULT_PARALLEL` slots each gets 1024 tokens; profiles that need more say so."""

DEFAULT_CACHE_RAM_MIB = 1024
"""Host-RAM prompt cache cap (MiB). llama-server's default is 8192 MiB per process, invisible to
sizing by weights + KV: a 12B runner sat at 9.4 GB RSS after 25 h with it, 1.6 GB with 1024
(ollama #18264 / PR #18265). Profiles that gain nothing from it pass ``--cache-ram 0``."""

FIT_OFF = ("--fit", "off")
"""Passed unless the profile sets ``--fit``: with it on (llama-server's default since LC PR #16653) the
engine lowers any of ``-c``/``-ngl`` left unset to fit the free device memory it reads at start, so
the served context would depend on what else was on the GPU at that instant, not on placement's
estimate; with it off, ``-ngl`` left at ``auto`` means every layer (llama.cpp's
``llama_model::n_gpu_layers``: a negative count is all of them), what placement reserved memory for.
It also costs every start, a cold start from zero included: gemma-3-270m at ``--ctx-size 2048`` on
2 cores was ready in 1.04 s at 1.05 CPU-s with it on, in 0.63 s at 0.63 CPU-s with it off
(2026-12-05, 4 starts each)."""

# Flags that mean the same thing, each spelling llama-server accepts.
_SPELLINGS: dict[str, tuple[str, ...]] = {
    "model": ("-m", "--model"),
    "host": ("--host",),
    "port": ("--port",),
    "api-key": ("--api-key", "--api-key-file"),
    "ctx-size": ("-c", "--ctx-size"),
    "threads": ("-t", "--threads"),
    "threads-batch": ("-tb", "--threads-batch"),
    "parallel": ("-np", "--parallel"),
    "cache-ram": ("-cram", "--cache-ram"),
    "alias": ("-a", "--alias"),
    "webui": ("--no-webui", "--webui", "--ui", "--no-ui"),
    "device": ("-dev", "--device"),
    "metrics": ("--metrics",),
    "embeddings": ("--embedding", "--embeddings"),
    "batch-size": ("-b", "--batch-size"),
    "ubatch-size": ("-ub", "--ubatch-size"),
    "fit": ("-fit", "--fit"),
}
AGENT_OWNED = ("model", "host", "port", "api-key")
"""Flags only the agent sets: a profile's value is dropped (the agent must know where the engine
listens, which file it serves and which key guards it)."""

_VERSION = re.compile(r"version:\s*(\S+)(?:\s*\(([^)]*)\))?")


@dataclass(frozen=True)
class LlamaServer:
    """A usable llama-server build.

    Attributes:
        binary: absolute path of the executable.
        version: the build as ``--version`` prints it (``"1234"``, ``"0.5.0-dev"``).
        flags: every flag spelling ``--help`` lists (``"--api-key-file"``, ``"-np"``…); empty when
            ``--help`` said nothing, in which case every default is passed.
    """

    binary: Path
    version: str = ""
    flags: frozenset[str] = field(default_factory=frozenset)

    def knows(self, flag: str) -> bool:
        """Whether this build accepts ``flag`` (True when its ``--help`` could not be read)."""
        return not self.flags or flag in self.flags


Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def run_probe(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run a short probe (``--version``, ``--help``) with a timeout; never raises for a non-zero exit."""
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)


def parse_version(text: str) -> str:
    """The build from ``--version`` output: ``"version: 1234 (abcd)"`` → ``"1234"``; ``""`` if absent."""
    m = _VERSION.search(text)
    return m.group(1) if m else ""


def parse_help_flags(text: str) -> frozenset[str]:
    """Every ``-x``/``--xyz`` spelling at the start of a ``--help`` option line."""
    flags: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("-"):
            continue
        # "-np,   --parallel N     number of…": spellings are comma-separated, the description
        # starts after a run of spaces that follows no comma.
        head = re.split(r"\s{2,}", re.sub(r",\s+", ", ", line.strip()), maxsplit=1)[0]
        for part in head.split(","):
            token = part.strip().split(" ")[0]
            if token.startswith("-"):
                flags.add(token)
    return frozenset(flags)


def _is_executable(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def _version_key(p: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", p.name)) or (0,)


def own_installs(agent_state: Path) -> list[Path]:
    """llama-server binaries the agent installed, best first (``current``, then highest version)."""
    root = agent_state / "engines" / ENGINE
    if not root.is_dir():
        return []
    dirs = sorted((d for d in root.iterdir() if d.is_dir()), key=_version_key, reverse=True)
    dirs.sort(key=lambda d: d.name != "current")  # stable: current first, the rest by version
    found = []
    for d in dirs:
        for candidate in (d / BINARY_NAME, d / "bin" / BINARY_NAME):
            if _is_executable(candidate):
                found.append(candidate)
                break
    return found


def locate(cfg: AgentConfig, agent_state: Path, *, path_env: str | None = None) -> tuple[Path | None, str]:
    """Find llama-server in the lookup order; returns ``(binary, where)`` or ``(None, why not)``.

    ``path_env`` is the ``PATH`` to search (default: this process's).
    """
    configured = cfg.engines.llamacpp.binary
    if configured is not None:
        if not configured.exists():
            return None, (
                f"agent.yaml: engines.llamacpp.binary '{configured}' does not exist; "
                "set it to a llama-server binary or remove it"
            )
        if not _is_executable(configured):
            return None, (
                f"agent.yaml: engines.llamacpp.binary '{configured}' is not an executable file; "
                f"run 'chmod +x {configured}' or point it at a llama-server binary"
            )
        return configured.absolute(), "from agent.yaml engines.llamacpp.binary"
    on_path = shutil.which(BINARY_NAME, path=path_env)
    if on_path:
        return Path(on_path).absolute(), "on PATH"
    installs = own_installs(agent_state)
    if installs:
        return installs[0], "installed by the agent"
    return None, NO_BINARY


def probe(
    cfg: AgentConfig,
    agent_state: Path,
    *,
    path_env: str | None = None,
    runner: Runner = run_probe,
) -> tuple[EngineStatus, LlamaServer | None]:
    """Locate llama-server and check that it runs; the status to report and the usable build.

    Never raises: every problem is an ``EngineStatus(state=failed)`` whose detail says what to do.
    """
    binary, where = locate(cfg, agent_state, path_env=path_env)
    if binary is None:
        return EngineStatus(engine=ENGINE, state=ProvisionState.FAILED, detail=where), None
    try:
        done = runner([str(binary), "--version"])
    except (OSError, subprocess.SubprocessError) as e:
        return _broken(binary, f"does not run: {e}"), None
    out = f"{done.stdout}\n{done.stderr}"
    version = parse_version(out)
    if done.returncode != 0 and not version:
        last = out.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return _broken(binary, f"'--version' failed: {last[0]}"), None
    flags: frozenset[str] = frozenset()
    try:
        helped = runner([str(binary), "--help"])
        flags = parse_help_flags(f"{helped.stdout}\n{helped.stderr}")
    except (OSError, subprocess.SubprocessError):
        pass  # an old build without --help: pass every default and let its own error speak
    status = EngineStatus(
        engine=ENGINE,
        version=version,
        state=ProvisionState.INSTALLED,
        detail=f"{binary} ({where})",
        binary=str(binary),
    )
    return status, LlamaServer(binary=binary, version=version, flags=flags)


def _broken(binary: Path, what: str) -> EngineStatus:
    return EngineStatus(
        engine=ENGINE,
        state=ProvisionState.FAILED,
        binary=str(binary),
        detail=f"llama-server at {binary} {what}; replace it or set engines.llamacpp.binary in agent.yaml",
    )


def _flag_of(token: str) -> str:
    return token.split("=", 1)[0]


def sets(args: Iterable[str], name: str) -> bool:
    """Whether ``args`` set the flag ``name`` (a key of the spellings table) in any spelling."""
    spellings = _SPELLINGS[name]
    return any(_flag_of(a) in spellings for a in args)


def int_value(args: Sequence[str], name: str, default: int) -> int:
    """The integer ``args`` give the flag ``name`` (``-c 8192``, ``--ctx-size=8192``; the last one
    counts), else ``default`` (also for a value that is not an integer: llama-server refuses it)."""
    spellings = _SPELLINGS[name]
    found = default
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if flag not in spellings:
            continue
        text = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        with contextlib.suppress(ValueError):
            found = int(text)
    return found


def slot_tokens(args: Sequence[str]) -> int:
    """The context of one slot with ``args``: ``--ctx-size`` over ``--parallel``, with the defaults
    this module adds (:data:`DEFAULT_CTX_SIZE`, :data:`DEFAULT_PARALLEL`)."""
    ctx = int_value(args, "ctx-size", DEFAULT_CTX_SIZE)
    return max(1, ctx // max(1, int_value(args, "parallel", DEFAULT_PARALLEL)))


def drop_owned(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Profile args without the agent-owned flags (and their values); returns ``(kept, dropped)``."""
    owned = {s for name in AGENT_OWNED for s in _SPELLINGS[name]}
    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if _flag_of(a) in owned:
            dropped.append(a)
            if "=" not in a and i + 1 < len(args):
                dropped.append(args[i + 1])
                i += 1
        else:
            kept.append(a)
        i += 1
    return kept, dropped


def build_argv(
    server: LlamaServer,
    spec: ReplicaSpec,
    *,
    model_path: Path,
    host: str,
    port: int,
    node_cores: int,
    node_has_gpus: bool,
    key: str = "",
    key_file: Path | None = None,
    threads: int | None = None,
    max_threads: int | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The llama-server argv of one replica (``extra``: the agent's own flags for this launch, a
    group head's ``--rpc …``, after the profile's).

    ``[binary, -m, model, *profile args, --host, --port, --threads t, --threads-batch t, key, *defaults]``
    where ``t`` is ``threads`` (the cores the replica is pinned to), else ``spec.cpu_cores``, else
    (0) the node's logical cores, and at most ``max_threads`` when given (the agent's
    ``engines.max_threads``). The key goes by
    ``--api-key-file`` when ``key_file`` is given and the build knows it (argv is readable by every
    user in ``/proc``), else ``--api-key``. Defaults (``--ctx-size 4096``, ``--parallel 4``, ``--cache-ram 1024``,
    ``--alias <model>``, ``--no-webui``, ``--metrics``, ``--fit off`` (:data:`FIT_OFF`), ``--device none``
    for a CPU replica on a node with GPUs, so a "CPU" profile does not quietly take VRAM, and for an embedding
    model ``--batch-size``/``--ubatch-size`` of one slot's context) are added only when the
    profile does not set them in any spelling and the build knows the flag. ``--threads`` likewise
    yields to the profile's. Agent-owned flags in the profile are dropped (see :data:`AGENT_OWNED`).
    """
    profile, _ = drop_owned(spec.args)
    threads = engine_threads(pinned=threads, reserved=spec.cpu_cores, node_cores=node_cores, max_threads=max_threads)
    argv = [str(server.binary), "-m", str(model_path), *profile, *extra, "--host", host, "--port", str(port)]
    if not sets(profile, "threads"):
        argv += ["--threads", str(threads)]
        if not sets(profile, "threads-batch"):
            argv += ["--threads-batch", str(threads)]
    if key_file is not None and server.knows("--api-key-file"):
        argv += ["--api-key-file", str(key_file)]
    elif key:
        argv += ["--api-key", key]
    defaults: list[tuple[str, list[str]]] = [
        ("ctx-size", ["--ctx-size", str(DEFAULT_CTX_SIZE)]),
        ("parallel", ["--parallel", str(DEFAULT_PARALLEL)]),
        ("cache-ram", ["--cache-ram", str(DEFAULT_CACHE_RAM_MIB)]),
        ("alias", ["--alias", spec.model]),
        ("webui", ["--no-webui"]),
        ("metrics", ["--metrics"]),
        ("fit", list(FIT_OFF)),
    ]
    if node_has_gpus and not spec.gpu_indexes and "--rpc" not in extra:  # a head's devices are its workers
        defaults.append(("device", ["--device", "none"]))
    if sets(profile, "embeddings"):
        # An embedding's input must fit one micro-batch (512 by default): any input past 512 tokens was
        # a 500 "input (602 tokens) is too large to process" (a new user's finding). A slot's context
        # is the longest input there is room for anyway.
        n = str(slot_tokens(profile))
        defaults += [("batch-size", ["--batch-size", n]), ("ubatch-size", ["--ubatch-size", n])]
    for name, flag in defaults:
        if not sets(profile, name) and server.knows(flag[0]):
            argv += flag
    return argv


def free_port(host: str) -> int:
    """A port free on ``host`` now: bind port 0, read it, close.

    Another program may take it before the engine binds; the runner then sees llama-server's
    ``couldn't bind HTTP server socket`` and tries another (the race is rare and cheap).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


BIND_FAILED = re.compile(r"couldn't bind HTTP server socket|address already in use", re.IGNORECASE)
"""llama-server's log when its port is taken (it exits 1 within a second, before loading)."""


class LlamaCppEngine(Engine[LlamaServer]):
    """llama-server as the replica runner's engine.

    llama-server listens before it loads and answers ``/health`` 503 ``Loading model`` until the
    model is in, then 200; ``/v1/models`` is *not* readiness (200 during load). A wedged server
    still says ok on ``/health`` (LC #27388), so :meth:`serving` also asks its task loop. The key
    goes by ``--api-key-file`` when the build knows it (see :func:`build_argv`).
    """

    name = ENGINE
    label = BINARY_NAME
    group_binary = llamacpp_group.RPC_BINARY  # rpc-server, of the same build: the feature ``rpc``
    # On SIGTERM llama-server stops generating at once and exits in 0.08 s when idle, but with a stream
    # open it never exits by itself: it holds the connection, silent, until SIGKILL (measured
    # 2026-12-05). The agent's 10 s left a stream on a drained replica, or on a removed model, silent
    # for 10 s before its error event, where the docs promise one at once (an operator's finding).
    stop_grace_s = 1.0
    stuck = (
        "GET /health answered 200 but its task loop never answered GET /slots or a 1-token "
        "completion: the server is stuck"
    )

    def argv(self, build: LlamaServer, launch: Launch) -> list[str]:
        """:func:`build_argv` for the launch."""
        return build_argv(
            build, launch.spec, model_path=launch.model_path, host=launch.host, port=launch.port,
            node_cores=launch.node_cores, node_has_gpus=launch.node_has_gpus,
            key=launch.spec.key, key_file=launch.key_file, threads=launch.threads, max_threads=launch.max_threads,
            extra=launch.extra_args,
        )  # fmt: skip

    def port_taken(self, tail: str) -> bool:
        """Whether the log says :data:`BIND_FAILED` (llama-server exits 1 then, before loading)."""
        return BIND_FAILED.search(tail) is not None

    async def serving(self, session: aiohttp.ClientSession, base_url: str, key: str) -> bool:
        """Whether the task loop answers: ``GET /slots``, or a 1-token completion when the build
        serves no ``/slots`` (``--no-slots``: 501); each within :data:`READY_PROBE_TIMEOUT_S`.
        ``/health`` alone never touches the loop."""
        headers = {"Authorization": f"Bearer {key}"}
        timeout = aiohttp.ClientTimeout(total=READY_PROBE_TIMEOUT_S)
        try:
            async with session.get(f"{base_url}/slots", headers=headers, timeout=timeout) as resp:
                if resp.status == 200:
                    return True
                if resp.status not in (404, 501):
                    return False
            body = {"prompt": "a", "n_predict": 1, "cache_prompt": False}
            async with session.post(f"{base_url}/completion", json=body, headers=headers, timeout=timeout) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    def group_part(self) -> GroupPart:
        """:class:`~llmgw.agent.engines.llamacpp_group.RpcGroup`: rpc-server workers, a head that dials them."""
        return llamacpp_group.RpcGroup(self)


LLAMACPP = LlamaCppEngine()
"""The one llama.cpp engine (stateless; see :func:`llmgw.agent.engines.engine_for`)."""
