"""Placement: which node runs the next replica of a model, in which profile, and why not elsewhere.

A pipeline in the Kubernetes-scheduler/Nomad shape, pure functions throughout::

    for each profile, highest priority first (Model.profiles_by_priority()):
        filters  (static rules; adding capacity does not help -> kind "filtered")
            node_ready      the node's heartbeats are arriving (state "ready")
            cordoned        an admin has not cordoned it
            node_selector   it carries every label the profile asks for
            engine          the profile's engine is installed there (EngineStatus state installed)
            gpu_class       it has a GPU of the profile's class (GPU profiles only)
        fits     (resources; freeing some would help -> kind "exhausted")
            memory          host memory (CPU profile) or that class's GPU memory (GPU profile),
                            minus min_memory_gb of the replicas already placed there
            cores           logical cores minus cpu_cores reserved by replicas placed there
        if any node survives: score and stop; else try the next profile

Survivors are scored to spread one model's replicas: fewest replicas of this model on the node,
then most free memory, then node id, so the same inputs always give the same node and the
explanation and the decision agree. Every (node, profile) rejection is a
:class:`~llmgw.control.views.Rejection` with a code and a reason that names the numbers
(``needs 2.0 GB memory, 1.4 of 7.8 GB free``), and :func:`summarize` counts them per reason as
Kubernetes does: ``0/3 nodes can run it: 1 not enough memory, 2 label llmgw.control-plane=true does
not match``. Filters run cheapest first; a node stops at its first failed check per profile.

Units: memory in GB (10^9 bytes), as ``Profile.min_memory_gb`` is; 0 reserves nothing.
What it does not do: preemption (evicting lower-priority replicas), per-card GPU packing (a
node's GPUs of one class are pooled), or ports.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from llmgw.control.catalog import Model, Profile
from llmgw.control.views import Rejection
from llmgw.protocol import EngineStatus, Inventory, ProvisionState

GB = 1e9


class Kind(StrEnum):
    """``filtered``: a static rule (state, label, engine, GPU class); ``exhausted``: a resource."""

    FILTERED = "filtered"
    EXHAUSTED = "exhausted"


@dataclass(frozen=True)
class NodeInfo:
    """What placement knows of a node (built from the store's NodeRow)."""

    id: str
    state: str
    inventory: Inventory
    cordoned: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    engines: dict[str, EngineStatus] = field(default_factory=dict)


@dataclass(frozen=True)
class Reservation:
    """A replica already placed: its node, model, and what its profile reserves (GB, cores, GPU)."""

    node: str
    model: str
    memory_gb: float
    cpu_cores: int
    gpu_class: str = ""


@dataclass(frozen=True)
class Usage:
    """What the replicas placed on one node reserve, summed."""

    memory_gb: float = 0.0
    gpu_memory_gb: dict[str, float] = field(default_factory=dict)
    cpu_cores: int = 0
    of_model: int = 0


@dataclass(frozen=True)
class Candidate:
    """One (node, profile) pair under evaluation, with the node's current usage."""

    node: NodeInfo
    profile: Profile
    usage: Usage


@dataclass(frozen=True)
class Miss:
    """A failed check: ``label`` is the summary's words (equal labels are counted together)."""

    reason: str
    label: str
    need: float | None = None
    free: float | None = None


@dataclass(frozen=True)
class Check:
    """A named stage: ``code`` is the stable reason key, ``fit`` a pure function (None = passes)."""

    code: str
    kind: Kind
    fit: Callable[[Candidate], Miss | None]


# --- filters ---


def node_ready(c: Candidate) -> Miss | None:
    """The node is ``ready`` (heartbeats arriving); a ``lost`` node takes nothing."""
    if c.node.state == "ready":
        return None
    return Miss(f"node is {c.node.state}", f"node {c.node.state}")


def not_cordoned(c: Candidate) -> Miss | None:
    """An admin has not cordoned the node."""
    return Miss("node is cordoned", "node cordoned") if c.node.cordoned else None


def node_selector(c: Candidate) -> Miss | None:
    """The node carries every ``key=value`` of the profile's ``node_selector`` (first miss by key)."""
    for key in sorted(c.profile.node_selector):
        want = c.profile.node_selector[key]
        if c.node.labels.get(key) != want:
            text = f"label {key}={want} does not match"
            return Miss(text, text)
    return None


def engine_installed(c: Candidate) -> Miss | None:
    """The profile's engine is ``installed`` on the node; otherwise the node's own detail says why."""
    engine = c.profile.engine.value
    status = c.node.engines.get(engine)
    if status is not None and status.state == ProvisionState.INSTALLED:
        return None
    label = f"engine {engine} not installed"
    if status is None:
        return Miss(f"{label} (not reported by the node)", label)
    detail = f": {status.detail}" if status.detail else ""
    return Miss(f"{label} ({status.state.value}{detail})", label)


def gpu_class(c: Candidate) -> Miss | None:
    """A GPU profile needs a GPU of its class on the node; a CPU profile (empty class) passes."""
    want = c.profile.gpu_class
    if not want:
        return None
    have = sorted({g.klass for g in c.node.inventory.gpus})
    if want in have:
        return None
    return Miss(f"no GPU of class {want} (has: {', '.join(have) or 'none'})", f"no GPU of class {want}")


# --- fits ---


def memory(c: Candidate) -> Miss | None:
    """Memory left after the replicas already placed: host memory for a CPU profile, the pooled
    memory of the node's GPUs of the profile's class for a GPU profile (GB)."""
    need = c.profile.min_memory_gb
    if need <= 0:
        return None
    if c.profile.gpu_class:
        total = (
            sum(g.memory_total_bytes for g in c.node.inventory.gpus if g.klass == c.profile.gpu_class) / GB
        )
        used = c.usage.gpu_memory_gb.get(c.profile.gpu_class, 0.0)
        what, label = "GPU memory", "not enough GPU memory"
    else:
        total = c.node.inventory.memory_total_bytes / GB
        used = c.usage.memory_gb
        what, label = "memory", "not enough memory"
    free = max(total - used, 0.0)
    if need <= free + 1e-9:
        return None
    return Miss(f"needs {need:.1f} GB {what}, {free:.1f} of {total:.1f} GB free", label, need, round(free, 3))


def cores(c: Candidate) -> Miss | None:
    """Logical cores left after the cores reserved by replicas already placed (0 reserves none)."""
    need = c.profile.cpu_cores
    if need <= 0:
        return None
    total = c.node.inventory.cores
    free = max(total - c.usage.cpu_cores, 0)
    if need <= free:
        return None
    return Miss(f"needs {need} cores, {free} of {total} free", "not enough cores", float(need), float(free))


#: The pipeline, cheapest first: filters, then fits.
PIPELINE: tuple[Check, ...] = (
    Check("node_not_ready", Kind.FILTERED, node_ready),
    Check("node_cordoned", Kind.FILTERED, not_cordoned),
    Check("selector_mismatch", Kind.FILTERED, node_selector),
    Check("engine_not_installed", Kind.FILTERED, engine_installed),
    Check("gpu_class_mismatch", Kind.FILTERED, gpu_class),
    Check("memory_exhausted", Kind.EXHAUSTED, memory),
    Check("cores_exhausted", Kind.EXHAUSTED, cores),
)


@dataclass(frozen=True)
class Verdict:
    """A rejection plus the summary label it is counted under."""

    rejection: Rejection
    label: str


@dataclass(frozen=True)
class Decision:
    """Placement's answer for one replica.

    Attributes:
        node, profile: where it goes; both None when it fits nowhere.
        verdicts: every (node, profile) rejection, in the order evaluated.
        summary: one line, ``placed on node-a (profile cpu)`` or ``0/3 nodes can run it: …``.
    """

    node: str | None
    profile: Profile | None
    verdicts: list[Verdict]
    summary: str
    nodes: int

    @property
    def placed(self) -> bool:
        """True when a node was chosen."""
        return self.node is not None

    @property
    def rejections(self) -> list[Rejection]:
        """The rejections alone, as the explain view serves them."""
        return [v.rejection for v in self.verdicts]


def usage_by_node(model: str, reservations: Iterable[Reservation]) -> dict[str, Usage]:
    """Sum the reservations per node; ``of_model`` counts replicas of ``model``."""
    out: dict[str, Usage] = {}
    for r in reservations:
        u = out.get(r.node, Usage())
        gpu = dict(u.gpu_memory_gb)
        mem = u.memory_gb
        if r.gpu_class:
            gpu[r.gpu_class] = gpu.get(r.gpu_class, 0.0) + r.memory_gb
        else:
            mem += r.memory_gb
        out[r.node] = Usage(mem, gpu, u.cpu_cores + r.cpu_cores, u.of_model + (r.model == model))
    return out


def check(candidate: Candidate, pipeline: Sequence[Check] = PIPELINE) -> Verdict | None:
    """Run ``candidate`` through the pipeline; the first failed check's verdict, or None (it fits)."""
    for stage in pipeline:
        miss = stage.fit(candidate)
        if miss is not None:
            rej = Rejection(
                node=candidate.node.id,
                profile=candidate.profile.name,
                kind=stage.kind.value,
                code=stage.code,
                reason=miss.reason,
                need=miss.need,
                free=miss.free,
            )
            return Verdict(rej, miss.label)
    return None


def _score(c: Candidate) -> tuple[int, float, str]:
    """Lower is better: fewest replicas of this model here, then most free memory, then node id."""
    if c.profile.gpu_class:
        total = (
            sum(g.memory_total_bytes for g in c.node.inventory.gpus if g.klass == c.profile.gpu_class) / GB
        )
        free = total - c.usage.gpu_memory_gb.get(c.profile.gpu_class, 0.0)
    else:
        free = c.node.inventory.memory_total_bytes / GB - c.usage.memory_gb
    return (c.usage.of_model, -free, c.node.id)


def place(model: Model, nodes: Sequence[NodeInfo], reservations: Iterable[Reservation]) -> Decision:
    """Choose a node and profile for one more replica of ``model``.

    Args:
        model: the catalog entry; its profiles are tried by priority.
        nodes: every known node (lost ones included: they are rejected with a reason).
        reservations: the replicas already placed, on any node and of any model.

    Returns:
        A :class:`Decision`; ``placed`` is False with every rejection when nothing fits.
    """
    usage = usage_by_node(model.name, reservations)
    verdicts: list[Verdict] = []
    for profile in model.profiles_by_priority():
        survivors: list[Candidate] = []
        for node in sorted(nodes, key=lambda n: n.id):
            cand = Candidate(node, profile, usage.get(node.id, Usage()))
            verdict = check(cand)
            if verdict is None:
                survivors.append(cand)
            else:
                verdicts.append(verdict)
        if survivors:
            best = min(survivors, key=_score)
            summary = f"placed on {best.node.id} (profile {profile.name})"
            return Decision(best.node.id, profile, verdicts, summary, len(nodes))
    return Decision(None, None, verdicts, summarize(verdicts, len(nodes)), len(nodes))


def summarize(verdicts: Sequence[Verdict], nodes: int) -> str:
    """The Kubernetes-style line: ``0/N nodes can run it: <count> <label>, …`` (sorted).

    Each node is counted once, under the verdict that got furthest: an ``exhausted`` one (the node
    passed every filter) over a ``filtered`` one, then the first evaluated (highest-priority profile).
    """
    if nodes == 0:
        return "0/0 nodes can run it: no node has registered; start an agent ('llmgw agent')"
    best: dict[str, Verdict] = {}
    for v in verdicts:
        cur = best.get(v.rejection.node)
        if cur is None or (cur.rejection.kind == Kind.FILTERED and v.rejection.kind == Kind.EXHAUSTED):
            best[v.rejection.node] = v
    counts = Counter(v.label for v in best.values())
    parts = sorted(f"{n} {label}" for label, n in counts.items())
    return f"0/{nodes} nodes can run it: " + ", ".join(parts)
