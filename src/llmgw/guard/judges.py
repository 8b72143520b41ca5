"""The judges llmgw knows by name: where their weights are, whether they need a GPU, and the
catalog entry and serve request for each.

Naming one of these in a policy is all it takes to have it: the judge keeper
(:mod:`llmgw.control.reconcile.judgekeeper`) serves it when the catalog lacks it, and ``llmgw ctl guard judge
enable NAME`` does it by hand. A judge not in this table needs ``--repo``/``--file``.

The 0.6B's file is the one ``server init`` serves by default. The 4B and 8B files follow the same
uploader's naming (``mradermacher/Qwen3Guard-Gen-{4B,8B}-GGUF``, Q8_0); they were not fetched here.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.catalog import Engine, GuardModel, Model, Profile, Role, Scaling

#: The judge init installs, and the one the keeper names when a policy asks for a GPU judge on a cluster without GPUs.
DEFAULT_JUDGE = "qwen3guard-0.6b"


@dataclass(frozen=True)
class ServeRequest:
    """Fetch ``repo``/``file`` into the mirror and add it to the catalog as guard model ``name``.

    Attributes:
        gpu_class: the GPU class its one profile asks for ("" for CPU).
        replicas: copies; ``cores`` each on CPU.
        memory_gb: memory a replica reserves (on the card for a GPU profile).
        by: who asked (logged, shown in the catalog's history).
        if_absent: when the catalog gets a model of that name meanwhile (init, an operator), keep
            theirs and add nothing.
    """

    name: str
    repo: str
    file: str
    format: str = "qwen3guard"
    gpu_class: str = ""
    replicas: int = 1
    cores: int = 0
    memory_gb: float = 2
    args: tuple[str, ...] = ("--ctx-size", "8192", "--cache-ram", "0")
    by: str = ""
    if_absent: bool = False

    @property
    def source(self) -> str:
        """The ``hf:`` source of the weights."""
        return f"hf:{self.repo}/{self.file}"

    def model(self, url: str, sha256: str = "") -> Model:
        """The catalog entry for the weights at ``url`` (the mirror's)."""
        profile = Profile(
            name=f"gpu-{self.gpu_class}" if self.gpu_class else "cpu",
            engine=Engine.LLAMACPP,
            gpu_class=self.gpu_class,
            priority=200 if self.gpu_class else 100,
            min_memory_gb=self.memory_gb,
            cpu_cores=0 if self.gpu_class else self.cores,
            args=list(self.args),
        )
        return Model(
            name=self.name,
            description="A guardrails' judge: reads prompts and answers for unsafe content. Not offered to clients.",
            source=url,
            version="guard",
            sha256=sha256,
            role=Role.GUARD,
            guard=GuardModel(format=self.format),
            scaling=Scaling(min=self.replicas, max=self.replicas),
            profiles=[profile],
        )


@dataclass(frozen=True)
class KnownJudge:
    """A judge llmgw can fetch by name; ``gpu`` when it runs on the roomiest GPU class only."""

    name: str
    repo: str
    file: str
    gpu: bool
    memory_gb: float
    format: str = "qwen3guard"

    def serve_request(self, *, replicas: int = 1, cores: int = 0, gpu_class: str = "") -> ServeRequest:
        """The request that serves this judge: ``replicas`` × ``cores`` on CPU, or one on ``gpu_class``."""
        return ServeRequest(
            name=self.name, repo=self.repo, file=self.file, format=self.format,
            gpu_class=gpu_class if self.gpu else "", replicas=1 if self.gpu else replicas,
            cores=0 if self.gpu else cores, memory_gb=self.memory_gb,
        )


KNOWN_JUDGES: dict[str, KnownJudge] = {
    j.name: j
    for j in (
        KnownJudge(DEFAULT_JUDGE, "mradermacher/Qwen3Guard-Gen-0.6B-GGUF", "Qwen3Guard-Gen-0.6B.Q8_0.gguf", False, 2),
        KnownJudge("qwen3guard-4b", "mradermacher/Qwen3Guard-Gen-4B-GGUF", "Qwen3Guard-Gen-4B.Q8_0.gguf", True, 8),
        KnownJudge("qwen3guard-8b", "mradermacher/Qwen3Guard-Gen-8B-GGUF", "Qwen3Guard-Gen-8B.Q8_0.gguf", True, 12),
    )
}


def known_judge(name: str) -> KnownJudge | None:
    """The known judge called ``name``, or None."""
    return KNOWN_JUDGES.get(name)
