"""The model catalog: what a model is, how it may be served (profiles), and how many replicas.

docs/operating.md ("Adding a model") shows the fields as model.yaml spells them.
These are the catalog's own objects; storage rows and API views are separate classes.

What may enter the catalog (every entry point validates these classes: the admin API, the guard
API, ``server init``, and the store when it reads a row back):

* names, aliases and versions follow :mod:`llmgw.names`; ``node_selector`` keys are label keys
  (rows already stored with other aliases/versions still load: :data:`STORED`);
* every number is finite and bounded (:data:`MAX_MEMORY_GB` and the other ``MAX_`` constants):
  ``1e400`` or ``NaN`` is refused, never stored (a non-finite float serialises as ``null`` and
  the row could not be read back);
* ``scaling.min``/``max`` are strict integers (``2.0`` and ``"2"`` are refused) of at most
  :data:`MAX_REPLICAS_HARD`; the control plane's own, lower limit is ``max_replicas_per_model``
  in server.yaml (checked by the admin API);
* ``routing`` is ``cache-aware`` or ``round-robin``; ``queue.size`` a strict integer 0-:data:`MAX_QUEUE`,
  ``queue.wait_s`` a finite number of seconds, more than 0 and at most :data:`MAX_QUEUE_WAIT_S`;
* a profile's ``args`` carry no flag from :mod:`llmgw.engineargs` (paths, agent-owned
  flags, network fetches, tools).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from llmgw.engineargs import refused_args
from llmgw.names import check_labels, check_name, check_unique, valid_name

MAX_REPLICAS_HARD = 100_000
"""The most ``scaling.min``/``max`` can ever be; server.yaml's ``max_replicas_per_model`` (default
1,000) is the limit in force and may not exceed this."""
MAX_MEMORY_GB = 1_000_000.0
"""A replica's reservation at most (GB): a petabyte, far past any node, finite."""
MAX_CORES = 65_536
MAX_GPUS = 1_024
MAX_GROUP_NODES = 16  # nodes one replica may span (a head and up to 15 workers)
MAX_TOKENS = 1_000_000_000
"""``context_length``/``max_output`` at most: a billion tokens."""
MAX_PRIORITY = 1_000_000
MAX_ARGS = 256
MAX_QUEUE = 10_000
"""``queue.size`` at most: requests waiting at the gateway per model (and per control plane)."""
MAX_QUEUE_WAIT_S = 600.0
"""``queue.wait_s`` at most (s): the gateway's longest wait for a slot, the upstream timeout's default."""
"""Engine args per profile at most, each at most 4,096 characters."""

STORED = {"stored": True}
"""Validation context for a row read back from the store: aliases, versions and selector keys
written before :mod:`llmgw.names` existed still load (a write must then fix them); everything
else, numbers and args included, is checked as on the way in."""


def _stored(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("stored"))


_Text = Annotated[str, StringConstraints(max_length=4096)]
_ShortText = Annotated[str, StringConstraints(max_length=253)]
# Only the communication libraries' own settings: a profile must not set LD_PRELOAD or PATH for an engine.
_ENV_NAME = re.compile(r"^(NCCL|GLOO|UCX|VLLM)_[A-Z0-9_]{1,64}$")


class Role(StrEnum):
    """What a model is for: ``chat`` is offered to clients (``/v1/chat/completions``, ``/v1/completions``);
    ``embedding`` too, on ``/v1/embeddings`` (its engine runs with embeddings on); ``guard`` judges, and is
    not offered."""

    CHAT = "chat"
    GUARD = "guard"
    EMBEDDING = "embedding"


class Engine(StrEnum):
    """The engines a profile can ask for."""

    LLAMACPP = "llamacpp"
    VLLM = "vllm"


def _llamacpp_embedding_args(args: Sequence[str]) -> list[str]:
    """llama-server: ``--embeddings`` and, unless the profile sets one, ``--pooling mean`` (its
    default for decoder models like gemma-3 is ``none``, which it refuses on ``/v1/embeddings``:
    "Pooling type 'none' is not OAI compatible")."""
    out = [] if "--embeddings" in args or "--embedding" in args else ["--embeddings"]
    return out + ([] if "--pooling" in args else ["--pooling", "mean"])


def _vllm_embedding_args(args: Sequence[str]) -> list[str]:
    """vLLM: ``--task embed`` unless the profile sets a task."""
    return [] if "--task" in args else ["--task", "embed"]


@dataclass(frozen=True)
class EngineTraits:
    """What the control plane (and init) need to know of an engine, beside its name; the agent's
    side of each engine (argv, readiness, its group processes) is ``llmgw.agent.engines``, which
    reads :attr:`group_feature` from here so both sides name it alike.

    Attributes:
        group_feature: what a node reports beside the engine (``EngineStatus.features``) when it
            can be a member of a group replica: llama.cpp's ``rpc`` (an ``rpc-server`` beside
            ``llama-server``), vLLM's ``ray`` (``ray`` beside ``vllm``).
        group_feature_missing: placement's reason for a node without it, with what to do.
        head_dials_workers: which group members wait for the others' endpoints. True: the head
            dials its workers (llama.cpp: ``llama-server --rpc`` needs every worker's tunnel), so the
            head's spec carries the workers' endpoints. False: the workers join their head
            (vLLM: ``ray start --address``), so a worker's spec carries the head's Ray address.
        embedding_args: the flags an ``embedding`` model's engine needs beyond the profile's ``args``
            (given them, so a flag the profile sets is not repeated).
        waited_by_init: ``llmgw server init`` waits for this engine on a node it sets up (llama.cpp:
            the agent installs it within seconds); False for one that installs for minutes after
            and may not run there at all (vLLM), which is no reason to stop init.
    """

    group_feature: str
    group_feature_missing: str
    head_dials_workers: bool
    embedding_args: Callable[[Sequence[str]], list[str]]
    waited_by_init: bool


ENGINE_TRAITS: dict[Engine, EngineTraits] = {
    Engine.LLAMACPP: EngineTraits(
        group_feature="rpc",
        group_feature_missing="llama.cpp here has no rpc-server beside llama-server (build it with -DGGML_RPC=ON)",
        head_dials_workers=True,
        embedding_args=_llamacpp_embedding_args,
        waited_by_init=True,
    ),
    Engine.VLLM: EngineTraits(
        group_feature="ray",
        group_feature_missing='vLLM here has no ray beside vllm (pip install "ray[default]" into its venv)',
        head_dials_workers=False,
        embedding_args=_vllm_embedding_args,
        waited_by_init=False,
    ),
}
"""Every engine's traits (:class:`EngineTraits`): the one table the control plane asks instead of
comparing engine names."""


def engine_traits(engine: str) -> EngineTraits | None:
    """The traits of the engine named ``engine`` (a profile's ``engine`` value), None for a name
    that is no :class:`Engine` (an older or newer node's report)."""
    try:
        return ENGINE_TRAITS[Engine(engine)]
    except ValueError:
        return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


_Replicas = Annotated[int, Field(strict=True, ge=0, le=MAX_REPLICAS_HARD)]

MAX_TARGET = 10_000.0
"""``scaling.target`` at most (requests in flight per replica): far past any engine's slots."""
MAX_WINDOW_S = 86_400.0
"""An autoscaling window or delay at most (seconds): a day. A window of ``1e9`` s is a typo, and
the leader keeps a sample per second of the stable window in memory."""

_AUTOSCALE_FIELDS = ("target", "stable_window_s", "panic_window_s", "scale_down_after_s", "scale_to_zero_after_s")

_Target = Annotated[float, Field(strict=True, gt=0, le=MAX_TARGET)]
_Window = Annotated[float, Field(strict=True, ge=1.0, le=MAX_WINDOW_S)]


class Scaling(_Strict):
    """How many replicas: at least ``min``, at most ``max`` (``min <= max``).

    Strict integers: ``2.0`` and ``"2"`` are refused (a count is never a fraction, and a float
    such as ``1e9`` must not slip in as a count); at most :data:`MAX_REPLICAS_HARD`.

    With ``max > min`` the leader autoscales (:mod:`llmgw.control.reconcile.autoscale`, Knative's
    KPA rule): ``target`` is the requests in flight (queued at the gateway included) one replica
    should carry (None: the engine's slots, :func:`scaling_target`); ``stable_window_s`` (60 s)
    averages the load for the steady count, ``panic_window_s`` (6 s) catches a burst (load at
    twice the ready capacity: scale up at once, never down for a stable window);
    ``scale_down_after_s`` (300 s) of lower demand before a replica goes, and
    ``scale_to_zero_after_s`` (600 s) without any request before the last one goes (``min: 0``).
    Windows are finite seconds in [1, :data:`MAX_WINDOW_S`]; ``target`` in (0, :data:`MAX_TARGET`].
    """

    min: _Replicas = 1
    max: _Replicas = 1
    target: _Target | None = None
    stable_window_s: _Window = 60.0
    panic_window_s: _Window = 6.0
    scale_down_after_s: _Window = 300.0
    scale_to_zero_after_s: _Window = 600.0

    @model_validator(mode="after")
    def _order(self) -> Scaling:
        if self.min > self.max:
            raise ValueError(f"scaling.min {self.min} is more than scaling.max {self.max}")
        if self.panic_window_s > self.stable_window_s:
            raise ValueError(
                f"scaling.panic_window_s {self.panic_window_s:g} is longer than scaling.stable_window_s "
                f"{self.stable_window_s:g}; the panic window is the short one (Knative: 6 s of 60 s)"
            )
        return self

    @model_serializer(mode="wrap")
    def _lean(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """``min`` and ``max`` always; the autoscaling fields only where set away from their defaults,
        so a catalog without autoscaling reads (and is stored) as before them."""
        out: dict[str, object] = handler(self)
        for name in _AUTOSCALE_FIELDS:
            if name in out and getattr(self, name) == Scaling.model_fields[name].default:
                del out[name]
        return out

    @property
    def autoscaled(self) -> bool:
        """Whether the leader decides the count between ``min`` and ``max`` (``max > min``); else
        exactly ``min`` replicas, as before autoscaling existed."""
        return self.max > self.min


def scale_to(n: int, *, cur_min: int, cur_max: int) -> dict[str, int]:
    """The ``scaling`` patch that keeps ``n`` replicas (``ctl model scale``, the dashboard's scale):
    a model that does not autoscale (``min == max``) stays fixed, at ``n``; one that autoscales gets
    ``min = n`` and keeps its ``max``, raised to ``n`` when below. Replicas above the new count drain
    before they stop (:mod:`llmgw.control.reconcile.drainer`)."""
    return {"min": n, "max": max(n, cur_max) if cur_max > cur_min else n}


DEFAULT_SLOTS = 4
"""A replica's slots when its profile names none: the agent starts llama-server with ``--parallel 4``
(``DEFAULT_PARALLEL`` in :mod:`llmgw.agent.engines.llamacpp`)."""

DEFAULT_CTX_SIZE = 4096
"""KV cells (llama.cpp's ``--ctx-size``) a replica gets when neither its profile's args nor the model's
``context_length`` set one: the agent starts llama-server with ``--ctx-size 4096``
(:mod:`llmgw.agent.engines.llamacpp` takes it from here), not with the model's training context."""

_SLOT_FLAGS = {"--parallel", "-np", "--max-num-seqs"}


def default_context(profile: Profile) -> int:
    """The context (tokens) a replica on ``profile`` runs with when neither the profile's args nor the
    catalog's ``context_length`` set one, for placement's estimate to size the KV cache as the engine
    will: :data:`DEFAULT_CTX_SIZE` for llama.cpp (what the agent passes), 0 for vLLM (the model's own,
    which it takes by default). Before, placement sized a llama.cpp replica for the GGUF's training
    context (Llama-3.1-8B: 131,072 cells, 16 GiB of KV) while the engine ran with 4,096 (0.5 GiB)."""
    return DEFAULT_CTX_SIZE if profile.engine == Engine.LLAMACPP else 0


def scaling_target(model: Model) -> float:
    """Requests in flight one replica should carry (``scaling.target``): the catalog's when set,
    else the slots of its highest-priority profile (``--parallel N``/``-np N`` for llama.cpp,
    ``--max-num-seqs N`` for vLLM, in its ``args``), else :data:`DEFAULT_SLOTS`."""
    if model.scaling.target is not None:
        return model.scaling.target
    profiles = model.profiles_by_priority()
    return float(profile_slots(profiles[0]) if profiles else DEFAULT_SLOTS)


def profile_slots(profile: Profile) -> int:
    """Requests a replica on ``profile`` runs at once: ``--parallel N``/``-np N`` (llama.cpp) or
    ``--max-num-seqs N`` (vLLM) in its ``args``, else :data:`DEFAULT_SLOTS`."""
    args = profile.args
    for i, a in enumerate(args):
        flag, eq, inline = a.partition("=")
        if flag in _SLOT_FLAGS:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            if value.isdigit() and int(value) > 0:
                return int(value)
    return DEFAULT_SLOTS


#: The flags that set an engine's context, by engine name.
_CONTEXT_FLAGS = {"llamacpp": ("-c", "--ctx-size"), "vllm": ("--max-model-len",)}


def context_args(model: Model, profile: Profile) -> list[str]:
    """The engine flags that give each request the catalog's ``context_length`` (tokens) when
    ``profile`` sets no context of its own: llama.cpp ``--ctx-size context_length × slots`` (its
    context is shared by its slots, :func:`profile_slots`; init's starter writes the same in its
    profiles), vLLM ``--max-model-len context_length``; [] when ``context_length`` is 0 or the
    profile sets one. Before, a model's ``context_length`` reached no engine: llama-server ran with
    the agent's 4096 cells, 1024 a request, whatever the catalog said (a new user's finding)."""
    n = model.context_length
    flags = _CONTEXT_FLAGS.get(profile.engine.value, ())
    if n <= 0 or not flags or any(a.partition("=")[0] in flags for a in profile.args):
        return []
    if profile.engine == Engine.LLAMACPP:
        # '-np -1' (llama-server's auto) and --kv-unified share one pool: any request may use all of it
        # (counted as 4 slots, a 512-token context let a 1,524-token prompt in: a new user's finding)
        unified = _unified_kv(profile.args)
        return ["--ctx-size", str(n if unified else n * profile_slots(profile))]
    return ["--max-model-len", str(n)]


def _unified_kv(args: Sequence[str]) -> bool:
    """Whether llama.cpp ``args`` give its slots one shared KV pool: ``--kv-unified``/``-kvu``, or
    ``--parallel -1`` (auto, which turns it on)."""
    for i, a in enumerate(args):
        flag, eq, inline = a.partition("=")
        if flag in ("--kv-unified", "-kvu"):
            return True
        if flag in ("--parallel", "-np") and (inline if eq else (args[i + 1] if i + 1 < len(args) else "")) == "-1":
            return True
    return False


RoutingPolicy = Literal["cache-aware", "round-robin"]
"""How the gateway picks a model's replica (:mod:`llmgw.control.gateway.balancer`): ``cache-aware``
sends requests that share a prefix to the same replica while its load is within a bound, else the
least-loaded one; ``round-robin`` rotates over the replicas with a free slot."""


class Queue(_Strict):
    """A model's waiting room at the gateway, per control plane (:mod:`llmgw.control.gateway.queue`).

    Attributes:
        size: requests that may wait for a slot at once; one more gets 429 ``model_busy`` with
            ``Retry-After`` at once. 0: no queue, a 429 as soon as every slot is busy. A strict
            integer (``2.0`` and ``"2"`` are refused), at most :data:`MAX_QUEUE`.
        wait_s: the longest a request waits for a slot (s), more than 0 and at most
            :data:`MAX_QUEUE_WAIT_S`; a request that cannot be served within it gets the 429 at once.
    """

    size: Annotated[int, Field(strict=True, ge=0, le=MAX_QUEUE)] = 64
    wait_s: Annotated[float, Field(strict=True, gt=0, le=MAX_QUEUE_WAIT_S)] = 30.0


class Profile(_Strict):
    """One way to serve a model: an engine, the resources it needs, and the engine's args.

    Attributes:
        priority: higher is tried first (init's starter: GPU profiles 200, CPU 100).
        min_memory_gb: memory a replica reserves on the node (GB, 10^9 bytes); on a GPU profile, on the card.
        cpu_cores: cores reserved (0: no reservation, the engine shares the node's cores).
        gpu_class: the class a node's GPU must have (``h100-80gb``); empty for a CPU profile.
        gpu_count: whole GPUs of that class a replica takes (exclusively; ``min_memory_gb`` is split
            evenly over them). Ignored on a CPU profile.
        node_selector: labels the node must carry, all of them.
        args: extra engine arguments (``["--ctx-size", "16384"]``).
        nodes: how many nodes one replica spans (default 1). Above 1 a replica is a *group*: a
            head that serves the API and ``nodes - 1`` workers, placed all or nothing; llama.cpp
            splits the layers over them by each node's free memory (``rpc-server`` on the
            workers, ``llama-server --rpc`` on the head), vLLM runs one pipeline stage per node
            on a Ray cluster (``--pipeline-parallel-size nodes``, ``--tensor-parallel-size
            gpu_count``). ``min_memory_gb`` is then the whole group's need, split over the members.
        env: environment for the engine on every member (NCCL/Gloo settings for a vLLM group:
            ``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``, ``NCCL_IB_HCA``...).
    """

    name: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    engine: Engine = Engine.LLAMACPP
    gpu_class: _ShortText = ""
    gpu_count: Annotated[int, Field(ge=1, le=MAX_GPUS)] = 1
    priority: Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 100
    min_memory_gb: Annotated[float, Field(ge=0, le=MAX_MEMORY_GB)] = 0
    cpu_cores: Annotated[int, Field(ge=0, le=MAX_CORES)] = 0
    node_selector: dict[str, _ShortText] = Field(default_factory=dict)
    args: Annotated[list[_Text], Field(max_length=MAX_ARGS)] = Field(default_factory=list)
    nodes: Annotated[int, Field(ge=1, le=MAX_GROUP_NODES)] = 1
    env: dict[str, _ShortText] = Field(default_factory=dict, max_length=64)

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        bad = sorted(k for k in v if not _ENV_NAME.fullmatch(k))
        if bad:
            raise ValueError(
                f"{', '.join(bad)}: only NCCL_*, GLOO_*, UCX_* and VLLM_* variables (upper case) may be set "
                "for an engine"
            )
        return v

    @field_validator("node_selector")
    @classmethod
    def _selector_keys(cls, v: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        if not _stored(info):
            check_labels(v)
        return v

    @model_validator(mode="after")
    def _args_allowed(self) -> Profile:
        refused = refused_args(self.engine.value, self.args)
        if refused is not None:
            flag, reason = refused
            raise ValueError(f"args: '{flag}' is not allowed in a profile: {reason}")
        return self


class GuardModel(_Strict):
    """A guard model's judge format: ``qwen3guard``, ``llamaguard3`` or ``prompted``."""

    format: _ShortText = "qwen3guard"


class Model(_Strict):
    """A catalog entry.

    Attributes:
        source: where the weights come from (normally the mirror's URL of the file).
        sha256: the file's digest, which a node checks after its download; empty to trust the mirror's header.
        context_length: the context a client may use (tokens).
        max_output: the most tokens a client may ask for in one answer.
        routing: how the gateway picks a replica (:data:`RoutingPolicy`), ``cache-aware`` by default.
        queue: the gateway's queue for this model (:class:`Queue`).

    ``routing`` and ``queue`` are read by the gateway only: changing them restarts no replica (the
    spec hash covers the profile, source, version and digest:
    :func:`llmgw.control.reconcile.leader.spec_hash`).
    """

    name: Annotated[str, valid_name("model name")]
    aliases: Annotated[list[str], Field(max_length=64)] = Field(default_factory=list)
    description: _Text = ""
    source: Annotated[str, StringConstraints(max_length=2048)]
    version: str = "1"
    sha256: Annotated[str, StringConstraints(max_length=64)] = ""
    role: Role = Role.CHAT
    guard: GuardModel | None = None
    routing_profile: Annotated[str, StringConstraints(max_length=128)] = ""
    context_length: Annotated[int, Field(ge=0, le=MAX_TOKENS)] = 0
    max_output: Annotated[int, Field(ge=0, le=MAX_TOKENS)] = 0
    scaling: Scaling = Field(default_factory=Scaling)
    routing: RoutingPolicy = "cache-aware"
    queue: Queue = Field(default_factory=Queue)
    profiles: Annotated[list[Profile], Field(min_length=1, max_length=64)]

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: list[str], info: ValidationInfo) -> list[str]:
        return v if _stored(info) else [check_name(a, "alias") for a in v]

    @field_validator("version", mode="before")
    @classmethod
    def _version_text(cls, v: object) -> object:
        # model.yaml's `version: 2` is a YAML number: say what to write, not "should be a valid string".
        if isinstance(v, int | float) and not isinstance(v, bool):
            raise ValueError(f'{v} is a number; a version is text: quote it (version: "{v}")')  # noqa: TRY004 - pydantic reports ValueError only
        return v

    @field_validator("version")
    @classmethod
    def _version(cls, v: str, info: ValidationInfo) -> str:
        return v if _stored(info) else check_name(v, "version")

    @model_validator(mode="after")
    def _profiles_unique(self) -> Model:
        check_unique([p.name for p in self.profiles], "profiles")
        if self.name in self.aliases:
            raise ValueError(f"aliases: '{self.name}' is the model's own name")
        return self

    def profiles_by_priority(self) -> list[Profile]:
        """Profiles in the order placement tries them: highest priority first, then as listed."""
        return sorted(self.profiles, key=lambda p: -p.priority)

    @property
    def file_name(self) -> str:
        """The weights' file name: the last part of ``source``."""
        return self.source.rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0]
