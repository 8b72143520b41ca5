"""What ``server init`` decides before it touches anything: the starter's and the judge's catalog
entries, how many judges, and how the cores are split. Pure functions, each rule with its reason.
How many judges and how the cores are split (``judge_for``, ``cpu_plan``) live in
:mod:`llmgw.guard.sizing`, which the control plane's judge keeper uses too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from llmgw.catalog import Engine, GuardModel, Model, Profile, Role, Scaling
from llmgw.guard.sizing import JUDGE_MEMORY_GB
from llmgw.names import CONTROL_PLANE_LABEL

# The starter: small enough to download in a minute and run on any CPU, real enough to answer a
# question. Q4_K_M is about 400 MB.
STARTER_NAME = "qwen2.5-0.5b-instruct"
STARTER_ALIAS = "qwen-0.5b"
STARTER_SOURCE = "hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf"
STARTER_VERSION = "starter"
STARTER_BYTES = 400_000_000  # about 400 MB: the Q4_K_M file's size, before it is downloaded

# The context a client may use on the starter (tokens). Each engine holds four times that, for
# four at once: max(16384, 4*ctx) on CPU, max(32768, 4*ctx) on a GPU.
STARTER_CONTEXT = 4096

# The guardrails' judge: Qwen3Guard-Gen 0.6B, which reads a prompt or an answer and says whether
# it is safe, controversial or unsafe, and why. Q8_0 is 0.8 GB and judges a short text in about
# two seconds on two CPU threads. It replaced Llama Guard 3 1B, which refused about one in two
# ordinary coding requests ("continue").
GUARD_MODEL_NAME = "qwen3guard-0.6b"
GUARD_MODEL_SOURCE = "hf:mradermacher/Qwen3Guard-Gen-0.6B-GGUF/Qwen3Guard-Gen-0.6B.Q8_0.gguf"
GUARD_MODEL_VERSION = "guard"

# localLabel marks the control plane's own node, so the starter model is served where it was
# asked for and does not wander to the first GPU node that joins later.
LOCAL_LABEL_KEY = CONTROL_PLANE_LABEL
LOCAL_LABEL_VALUE = "true"

# A starter's engine reserves its weights, its KV cache and llama-server's prompt cache
# (``--cache-ram 1024`` MiB, which the agent passes): 1 GB on top of the file, times 1.25 for the
# KV cache and compute buffers of a 16k context on a model this small.
_STARTER_OVERHEAD_GB = 1.0


@dataclass(frozen=True)
class StarterSpec:
    """The starter model: its catalog name, alias, source, a line about it, and its file size (bytes)."""

    name: str
    alias: str
    source: str
    about: str
    size_bytes: int

    def min_memory_gb(self) -> int:
        """Memory a replica reserves (GB): ``ceil(file × 1.25 + 1)``; 2 GB for the 400 MB starter."""
        return max(1, math.ceil(self.size_bytes / 1e9 * 1.25 + _STARTER_OVERHEAD_GB))


def model_name_from_file(file_name: str) -> str:
    """A catalog name from a weights file name: ``Gemma-3-270M-Q4_K_M.gguf`` → ``gemma-3-270m-q4_k_m``."""
    stem = re.sub(r"\.gguf$", "", file_name, flags=re.IGNORECASE).lower()
    stem = re.sub(r"[^a-z0-9._-]+", "-", stem).strip("-._")
    return stem[:63] or "starter"


def starter_spec(source: str, *, name: str = "", alias: str = "", size_bytes: int = 0) -> StarterSpec:
    """The starter for ``source``: Qwen2.5-0.5B-Instruct by default, else a model named after the file.

    ``name``/``alias`` override what is derived; ``size_bytes`` is the file's size when known (a
    ``file:`` source), else 400 MB.
    """
    if source == STARTER_SOURCE:
        return StarterSpec(
            name=name or STARTER_NAME,
            alias=STARTER_ALIAS if alias == "" else alias,
            source=source,
            about="Qwen2.5 0.5B Instruct, Q4_K_M, about 400 MB",
            size_bytes=size_bytes or STARTER_BYTES,
        )
    file_name = source.rstrip("/").rsplit("/", 1)[-1]
    return StarterSpec(
        name=name or model_name_from_file(file_name),
        alias=alias,
        source=source,
        about=f"{file_name}, carried in with --starter-source",
        size_bytes=size_bytes or STARTER_BYTES,
    )


def starter_model(
    spec: StarterSpec, ctx: int, cores: int, source: str, gpu_classes: list[str],
    *, pinned: bool, sha256: str = "", version: str = STARTER_VERSION,
) -> Model:
    """The starter's catalog entry.

    A GPU profile first (priority 200) for each class on this machine, and a CPU profile (100)
    always, both pinned to this machine by the label ``llmgw.control-plane=true`` when ``pinned``.
    ``ctx`` is the context a client may use; each engine holds four times that, for four at once.
    ``cores`` is the CPU profile's reservation from :func:`cpu_plan`; scaling 1..1.
    """
    pin = {LOCAL_LABEL_KEY: LOCAL_LABEL_VALUE} if pinned else {}
    profiles = [
        Profile(
            name=f"gpu-{klass}", engine=Engine.LLAMACPP, gpu_class=klass, priority=200,
            min_memory_gb=spec.min_memory_gb(), node_selector=dict(pin),
            args=["--ctx-size", str(max(32768, 4 * ctx))],
        )
        for klass in gpu_classes
    ]
    profiles.append(
        Profile(
            name="cpu", engine=Engine.LLAMACPP, priority=100, min_memory_gb=spec.min_memory_gb(),
            cpu_cores=cores, node_selector=dict(pin), args=["--ctx-size", str(max(16384, 4 * ctx))],
        )
    )
    return Model(
        name=spec.name,
        aliases=[spec.alias] if spec.alias else [],
        description=f"The model init put here so there is something to try: {spec.about}.",
        source=source,
        version=version,
        sha256=sha256,
        routing_profile="chat",
        context_length=ctx,
        max_output=1024,
        scaling=Scaling(min=1, max=1),
        profiles=profiles,
    )


def guard_model(
    source: str, replicas: int, cores: int, *, sha256: str = "", fmt: str = "qwen3guard", name: str = GUARD_MODEL_NAME
) -> Model:
    """The judge's catalog entry: CPU only, so it takes no card from the
    models people use, on whichever node has room; ``replicas`` copies of it.

    About 1.6 GB with its context, which stays so with no prompt cache: llama.cpp keeps up to
    8 GB of prompts by default, and a judge's, each a different text, are not asked again. With the
    cache one grew to 3.2 GB over a day of traffic; reserving 4 for that left a 7 GB machine room
    for only one of the two. Hence ``--cache-ram 0`` and 2 GB.
    """
    return Model(
        name=name,
        description="The guardrails' judge: reads prompts and answers for unsafe content. Not offered to clients.",
        source=source,
        version=GUARD_MODEL_VERSION,
        sha256=sha256,
        role=Role.GUARD,
        guard=GuardModel(format=fmt),
        # Every judged request waits on it, and with fail: closed a judge that is not there
        # refuses everything.
        scaling=Scaling(min=replicas, max=replicas),
        profiles=[
            Profile(
                name="cpu", engine=Engine.LLAMACPP, priority=100, min_memory_gb=JUDGE_MEMORY_GB,
                cpu_cores=cores, args=judge_args(fmt),
            )
        ],
    )


def judge_args(fmt: str) -> list[str]:
    """The judge engine's args: an 8192 context and no prompt cache (see :func:`guard_model`); a
    ``prompted`` judge also ``--swa-full``, without which a sliding-window model (gemma-3) reuses
    nothing of the fixed instruction between judgments (measured: ~850 ms re-prefill vs ~330 ms)."""
    args = ["--ctx-size", "8192", "--cache-ram", "0"]
    return [*args, "--swa-full"] if fmt == "prompted" else args


def judge_name(source: str, fmt: str) -> str:
    """The judge's catalog name: ``qwen3guard-0.6b`` for the default file or any Qwen3Guard, else
    ``judge-<file stem>`` (a gemma carried in as a ``prompted`` judge is not a Qwen3Guard, and must not
    clash with the same file served as the starter)."""
    if source == GUARD_MODEL_SOURCE or fmt in ("", "qwen3guard"):
        return GUARD_MODEL_NAME
    stem = model_name_from_file(source.rstrip("/").rsplit("/", 1)[-1])
    return f"judge-{stem}"[:63]


