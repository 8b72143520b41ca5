"""Placement's checks: the (node, profile) filters and fits that :mod:`llmgw.control.placement.placer`
runs every candidate through, cheapest first (:data:`PIPELINE`), and the shapes they share
(:class:`NodeInfo`, :class:`Reservation`, :class:`Usage`, :class:`Candidate`, :class:`Verdict`,
:class:`Decision`).

Each check is a pure function ``Candidate -> Miss | None``; a :class:`Miss` carries the reason with
its numbers (``needs 2.0 GB memory, 1.4 of 7.8 GB free``) and what would change it. The order and
what each check means are in the placer's docstring. Units: memory in GB (10^9 bytes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

from llmgw import gpuhealth
from llmgw.catalog import Profile, engine_traits
from llmgw.control.placement.groupmiss import GroupMiss as GroupMiss  # noqa: PLC0414 - re-exported (checks.GroupMiss)
from llmgw.protocol import GPU, EngineStatus, GroupMember, Inventory, ProvisionState
from llmgw.views import Rejection
from llmgw.words import counted

GB = 1e9

#: Memory used outside llmgw below this (GB) is not mentioned in a reason.
OUTSIDE_NOTE_GB = 0.05


class Kind(StrEnum):
    """``filtered``: a static rule (state, label, engine, GPU class); ``exhausted``: a resource."""

    FILTERED = "filtered"
    EXHAUSTED = "exhausted"


@dataclass(frozen=True)
class NodeInfo:
    """What placement knows of a node (built from the store's NodeRow). ``cached``: ``model/version``."""

    id: str
    state: str
    inventory: Inventory
    cordoned: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    engines: dict[str, EngineStatus] = field(default_factory=dict)
    cached: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Reservation:
    """A replica already placed: its node, model, what its profile reserves (GB, cores) and, for a
    GPU profile, its class and card indexes. ``replica`` names it in explanations."""

    node: str
    model: str
    memory_gb: float
    cpu_cores: int
    gpu_class: str = ""
    gpu_indexes: tuple[int, ...] = ()
    replica: str = ""


@dataclass(eq=False)
class AddLog:
    """Where a placer learns of the reservations added to its nodes' :class:`Usage`: ``nodes``, one
    node id per reservation in order (its indexes' change log), and ``holding``, model -> the nodes
    holding one of its replicas.

    Plain containers, so that a usage points at them and not at the placer: with a callback to the
    placer every placer was a reference cycle through its 5,000 usages, freed only by a full
    collection (33 dropped placers' worth, 165,000 ``Usage`` and ``NodeInfo``, counted alive a
    minute after one at 5,000 nodes while nodes were being lost)."""

    nodes: list[str] = field(default_factory=list)
    holding: dict[str, set[str]] = field(default_factory=dict)

    def added(self, node: str, r: Reservation) -> None:
        """Note one reservation added on ``node``."""
        self.nodes.append(node)
        self.holding.setdefault(r.model, set()).add(node)


@dataclass
class Usage:
    """What the replicas placed on one node reserve, summed (mutable: :class:`Placer` adds to it).
    With ``log``, each :meth:`add` is noted there under ``node``."""

    memory_gb: float = 0.0
    cpu_cores: int = 0
    gpus_taken: dict[int, str] = field(default_factory=dict)  # card index -> replica holding it
    by_model: Counter[str] = field(default_factory=Counter)
    held: list[Reservation] = field(default_factory=list)
    version: int = 0
    #: the placer's change log (its indexes refresh this node), noted after each :meth:`add`
    log: AddLog | None = field(default=None, repr=False, compare=False)
    node: str = ""

    def add(self, r: Reservation) -> None:
        """Count one more reservation on this node."""
        if r.gpu_class:
            for i in r.gpu_indexes:
                self.gpus_taken[i] = r.replica or r.model
        else:
            self.memory_gb += r.memory_gb
        self.cpu_cores += r.cpu_cores
        self.by_model[r.model] += 1
        self.held.append(r)
        self.version += 1
        if self.log is not None:
            self.log.added(self.node, r)


@dataclass(frozen=True)
class Candidate:
    """One (node, profile) pair under evaluation for ``model``, with the node's current usage."""

    node: NodeInfo
    profile: Profile
    usage: Usage
    model: str = ""


@dataclass(frozen=True)
class Miss:
    """A failed check: ``label`` is the summary's words (equal labels are counted together; one that
    starts with ``node`` is said of the node and counted on it, ``2 nodes cordoned``:
    :func:`~llmgw.control.placement.placer.counted_label`).

    ``need``/``free``/``total`` are GB or cores; ``gpu_index`` names the one card the reason is
    about (a card too small, or the card short of free memory)."""

    reason: str
    label: str
    need: float | None = None
    free: float | None = None
    held_by: tuple[str, ...] = ()
    gpu_index: int | None = None
    total: float | None = None


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
            return Miss(f"label {key}={want} does not match", f"node without the label {key}={want}")
    return None


def engine_installed(c: Candidate) -> Miss | None:
    """The profile's engine is ``installed`` on the node; otherwise the node's own detail says why."""
    engine = c.profile.engine.value
    status = c.node.engines.get(engine)
    if status is not None and status.state == ProvisionState.INSTALLED:
        return None
    label = f"node without engine {engine} installed"
    if status is None:
        return Miss(f"engine {engine} not installed (not reported by the node)", label)
    detail = f": {status.detail}" if status.detail else ""
    return Miss(f"engine {engine} not installed ({status.state.value}{detail})", label)


def group_capable(c: Candidate) -> Miss | None:
    """A group member's node runs the engine's distributed part: llama.cpp's ``rpc-server`` or
    vLLM's ``ray``, as its agent reports (:attr:`llmgw.catalog.EngineTraits.group_feature`)."""
    engine = c.profile.engine.value
    need = engine_traits(engine)
    status = c.node.engines.get(engine)
    if need is None or (status is not None and need.group_feature in status.features):
        return None
    return Miss(need.group_feature_missing, f"no {need.group_feature} for {engine}")


def gpu_class(c: Candidate) -> Miss | None:
    """A GPU profile needs a GPU of its class on the node; a CPU profile (empty class) passes."""
    want = c.profile.gpu_class
    if not want:
        return None
    have = sorted({g.klass for g in c.node.inventory.gpus})
    if want in have:
        return None
    return Miss(f"no GPU of class {want} (has: {', '.join(have) or 'none'})", f"node without a GPU of class {want}")


def gpu_discovery(c: Candidate) -> Miss | None:
    """A GPU profile on a node with cards reported with 0 GB memory (:mod:`llmgw.gpuhealth`) that
    could be of its class: when the measured cards of the class are too few for ``gpu_count``, those are
    the reason, named as a discovery problem with what to check (their class lost its memory part
    and their free memory is unknown, so "no GPU of class" or "0.0 of 0.0 GB free" would mislead)."""
    want = c.profile.gpu_class
    if not want:
        return None
    gpus = c.node.inventory.gpus
    if all(g.memory_total_bytes > 0 for g in gpus):  # the common case, checked first: this is hot
        return None
    # A card counts when it could be of the class: the same class, or the class without the
    # "-<n>gb" that an unknown memory drops ("rtx-4090" for "rtx-4090-24gb").
    bad = [g for g in gpuhealth.unmeasured(gpus) if want == g.klass or want.startswith(f"{g.klass}-")]
    if not bad:
        return None
    measured = [g for g in c.node.inventory.gpus if g.klass == want and g.memory_total_bytes > 0]
    if len(measured) >= c.profile.gpu_count:
        return None
    return Miss(
        f"{gpuhealth.describe(bad)}: a GPU discovery problem on this node; {gpuhealth.WHAT_TO_CHECK}",
        "GPU discovery problem",
        gpu_index=bad[0].index,
    )


def card_total_gb(g: GPU) -> float:
    """A card's total memory (GB)."""
    return g.memory_total_bytes / GB


def _indexes(gpus: Sequence[GPU]) -> str:
    return ", ".join(str(g.index) for g in gpus)


def gpu_count(c: Candidate) -> Miss | None:
    """GPU profiles: the node has at least ``gpu_count`` cards of the class (fewer never fit however
    many are freed; :func:`gpus` would say "0 of 1 free" and "free a GPU" would not help)."""
    klass = c.profile.gpu_class
    if not klass:
        return None
    have = sum(1 for g in c.node.inventory.gpus if g.klass == klass)
    want = c.profile.gpu_count
    if have >= want:
        return None
    return Miss(
        f"has {counted(have, f'{klass} card')}, the profile needs {want}: too small",
        "node with too few GPUs",
        float(want),
        total=float(have),
    )


def gpu_size(c: Candidate) -> Miss | None:
    """GPU profiles: at least ``gpu_count`` cards of the class whose total memory holds the
    per-card share ``min_memory_gb / gpu_count``. A card smaller than its share never fits however
    much is freed on it, so this is a filter: the reason says the card is too small, by index."""
    klass = c.profile.gpu_class
    if not klass or c.profile.min_memory_gb <= 0:
        return None
    want = c.profile.gpu_count
    per_card = c.profile.min_memory_gb / want
    big = sum(1 for g in c.node.inventory.gpus if g.klass == klass and per_card <= card_total_gb(g) + 1e-9)
    if big >= want:
        return None
    small = sorted(
        (g for g in c.node.inventory.gpus if g.klass == klass and per_card > card_total_gb(g) + 1e-9),
        key=lambda g: g.index,
    )
    if not small:
        return None
    largest = max(card_total_gb(g) for g in small)
    if len(small) == 1:
        text = f"card {small[0].index} has {largest:.1f} GB in all, needs {per_card:.1f}: too small"
    else:
        text = f"cards {_indexes(small)} have {largest:.1f} GB in all, need {per_card:.1f} each: too small"
    if want > 1:
        text += f" ({big} of the {want} {klass} cards the profile needs are big enough)"
    return Miss(
        text, "node with a GPU too small", round(per_card, 3), gpu_index=small[0].index, total=round(largest, 3)
    )


def memory_size(c: Candidate) -> Miss | None:
    """CPU profiles: the node's total memory holds ``min_memory_gb`` (a node smaller than that
    never fits however much is freed on it)."""
    need = c.profile.min_memory_gb
    if need <= 0 or c.profile.gpu_class:
        return None
    total = c.node.inventory.memory_total_bytes / GB
    if need <= total + 1e-9:
        return None
    return Miss(
        f"needs {need:.1f} GB memory, the node has {total:.1f} GB in all: too small",
        "node with too little memory",
        need,
        total=round(total, 3),
    )


def cores_size(c: Candidate) -> Miss | None:
    """The node's logical cores hold ``cpu_cores`` (a node with fewer never fits however many are
    freed on it, as :func:`memory_size` for memory; a group's ``cpu_cores`` are per member)."""
    need = c.profile.cpu_cores
    total = c.node.inventory.cores
    if need <= total:
        return None
    return Miss(
        f"needs {counted(need, 'core')}, the node has {total} in all: too small",
        "node with too few cores",
        float(need),
        total=float(total),
    )


# --- fits ---


def host_free_gb(inv: Inventory, usage: Usage) -> tuple[float, float, float]:
    """``(free, total, outside)`` host memory in GB: free = min(total - reserved, available);
    outside = observed used (total - available) beyond what llmgw replicas reserve."""
    total = inv.memory_total_bytes / GB
    available = inv.memory_available_bytes / GB
    outside = max(total - available - usage.memory_gb, 0.0)
    return max(min(total - usage.memory_gb, available), 0.0), total, outside


def memory(c: Candidate) -> Miss | None:
    """Host memory for a CPU profile: free after the replicas placed there and after memory used
    outside llmgw (GB). A GPU profile's memory is on its cards (:func:`gpus`)."""
    need = c.profile.min_memory_gb
    if need <= 0 or c.profile.gpu_class:
        return None
    return _host_short(c, need, f"needs {need:.1f} GB memory")


def _host_short(c: Candidate, need: float, what: str) -> Miss | None:
    """None when ``need`` GB of host memory is free on the node, else the miss: ``what``, then the
    free and total memory, the memory used outside llmgw when it is notable, and the replicas
    holding memory there."""
    free, total, outside = host_free_gb(c.node.inventory, c.usage)
    if need <= free + 1e-9:
        return None
    note = f" ({outside:.1f} GB used outside llmgw)" if outside >= OUTSIDE_NOTE_GB else ""
    return Miss(
        f"{what}, {free:.1f} of {total:.1f} GB free{note}",
        "not enough memory",
        need,
        round(free, 3),
        tuple(r.replica for r in c.usage.held if not r.gpu_class and r.memory_gb > 0),
    )


def cores(c: Candidate) -> Miss | None:
    """Logical cores left after the cores reserved by replicas already placed (0 reserves none)."""
    need = c.profile.cpu_cores
    if need <= 0:
        return None
    total = c.node.inventory.cores
    free = max(total - c.usage.cpu_cores, 0)
    if need <= free:
        return None
    held = tuple(r.replica for r in c.usage.held if r.cpu_cores > 0)
    return Miss(
        f"needs {counted(need, 'core')}, {free} of {total} free", "not enough cores", float(need), float(free), held
    )


def card_free_gb(g: GPU) -> float:
    """A card's free memory (GB): total minus what the node observed in use on it."""
    return max(g.memory_total_bytes - g.memory_used_bytes, 0) / GB


def pick_gpus(c: Candidate) -> tuple[int, ...]:
    """The lowest-indexed ``gpu_count`` free cards of the class with enough memory each; () if none."""
    per_card = c.profile.min_memory_gb / c.profile.gpu_count
    fit = [
        g.index
        for g in sorted(c.node.inventory.gpus, key=lambda g: g.index)
        if g.klass == c.profile.gpu_class
        and g.index not in c.usage.gpus_taken
        and per_card <= card_free_gb(g) + 1e-9
    ]
    return tuple(fit[: c.profile.gpu_count]) if len(fit) >= c.profile.gpu_count else ()


def gpus(c: Candidate) -> Miss | None:
    """GPU profiles: ``gpu_count`` whole cards of the class that no replica holds, each with
    ``min_memory_gb / gpu_count`` GB free (memory used on a card outside llmgw counts).

    Only cards big enough for the share are counted (:func:`gpu_size` rejected nodes without
    enough of them). When they are free but short of memory, the reason names the card that is
    short, by index: of the ``gpu_count`` cards with the most free memory, the lowest-indexed one
    below the share (``card 0 has 6.0 of 24.0 GB free, needs 20.0``), never "the best card",
    which may well have room."""
    klass = c.profile.gpu_class
    if not klass or pick_gpus(c):
        return None
    want = c.profile.gpu_count
    per_card = c.profile.min_memory_gb / want
    cards = [g for g in c.node.inventory.gpus if g.klass == klass and per_card <= card_total_gb(g) + 1e-9]
    untaken = [g for g in cards if g.index not in c.usage.gpus_taken]
    if len(untaken) < want:
        held = tuple(sorted(set(c.usage.gpus_taken.values())))
        return Miss(
            f"needs {want} GPU {klass}, {len(untaken)} of {len(cards)} free",
            "no free GPU",
            float(want),
            float(len(untaken)),
            held,
        )
    chosen = sorted(untaken, key=lambda g: (-card_free_gb(g), g.index))[:want]
    short = sorted((g for g in chosen if card_free_gb(g) + 1e-9 < per_card), key=lambda g: g.index)
    first = short[0]  # pick_gpus failed, so one of the best `want` cards is short
    parts = []
    for g in short:
        outside = g.memory_used_bytes / GB
        note = f" ({outside:.1f} GB used outside llmgw)" if outside >= OUTSIDE_NOTE_GB else ""
        needs = f", needs {per_card:.1f}" if g is first else ""
        parts.append(f"card {g.index} has {card_free_gb(g):.1f} of {card_total_gb(g):.1f} GB free{needs}{note}")
    if want > 1:
        parts.append(f"the profile takes {want} {klass} cards")
    return Miss(
        "; ".join(parts),
        "not enough GPU memory",
        round(per_card, 3),
        round(card_free_gb(first), 3),
        gpu_index=first.index,
        total=round(card_total_gb(first), 3),
    )


#: A CPU group member's least free host memory (GB): a node with less would get no layer of the
#: split (llama.cpp RPC gives each member a share of the model in proportion to its free memory).
MIN_MEMBER_GB = 0.1


def member_memory(c: Candidate) -> Miss | None:
    """CPU group profiles (``nodes`` above 1), instead of :func:`memory_size` and :func:`memory`:
    the group's ``min_memory_gb`` is split over its members by their free memory, so a node only
    needs *some* free memory (at least :data:`MIN_MEMBER_GB`) to be a candidate; whether the chosen
    members hold the whole need together is the placer's group step. GPU groups are checked by
    :func:`gpu_size` and :func:`gpus` with each member's share (:func:`member_profile`)."""
    if c.profile.min_memory_gb <= 0 or c.profile.gpu_class:
        return None
    return _host_short(c, MIN_MEMBER_GB, f"needs at least {MIN_MEMBER_GB:.1f} GB free for a share of the group")


def member_profile(p: Profile) -> Profile:
    """What one member of a group (``p.nodes`` above 1) is checked against.

    The split goes by the resource, not the engine: a GPU group's model splits evenly, each member
    needing ``gpu_count`` cards with ``min_memory_gb / (nodes * gpu_count)`` GB free each, which is
    the one-node GPU checks on a profile of ``min_memory_gb / nodes`` (vLLM runs one pipeline stage
    per node, which needs the even split; llama.cpp's ``--tensor-split`` follows whatever shares the
    members get, so a llama.cpp GPU group gets the same). A CPU group's split follows the members'
    free memory (:func:`member_memory`), so its profile is unchanged. Cores (``cpu_cores``) are per
    member."""
    if p.nodes <= 1 or not p.gpu_class:
        return p
    return p.model_copy(update={"min_memory_gb": p.min_memory_gb / p.nodes})


#: The pipeline, cheapest first: filters, then fits.
PIPELINE: tuple[Check, ...] = (
    Check("node_not_ready", Kind.FILTERED, node_ready),
    Check("node_cordoned", Kind.FILTERED, not_cordoned),
    Check("selector_mismatch", Kind.FILTERED, node_selector),
    Check("engine_not_installed", Kind.FILTERED, engine_installed),
    Check("gpu_discovery_problem", Kind.FILTERED, gpu_discovery),
    Check("gpu_class_mismatch", Kind.FILTERED, gpu_class),
    Check("gpu_count_too_small", Kind.FILTERED, gpu_count),
    Check("gpu_too_small", Kind.FILTERED, gpu_size),
    Check("memory_too_small", Kind.FILTERED, memory_size),
    Check("cores_too_small", Kind.FILTERED, cores_size),
    Check("memory_exhausted", Kind.EXHAUSTED, memory),
    Check("cores_exhausted", Kind.EXHAUSTED, cores),
    Check("gpu_exhausted", Kind.EXHAUSTED, gpus),
)


#: A group member's pipeline (:func:`member_profile`): :data:`PIPELINE` with the whole-need host
#: memory checks replaced by :func:`member_memory`.
GROUP_PIPELINE: tuple[Check, ...] = tuple(
    stage
    for s in PIPELINE
    if s.code != "memory_too_small"
    for stage in (
        (s, Check("group_engine_missing", Kind.FILTERED, group_capable)) if s.code == "engine_not_installed"
        else (Check("memory_exhausted", Kind.EXHAUSTED, member_memory),) if s.code == "memory_exhausted"
        else (s,)
    )
)

#: A group's candidate that passed every check but was left out because the group does not fit.
GROUP_CODE = "group_does_not_fit"

STAGE = {stage.code: i for i, stage in enumerate(PIPELINE)}
"""A check's position in :data:`PIPELINE`: how far a candidate got before it was rejected."""


@dataclass(frozen=True)
class Verdict:
    """A rejection plus the summary label it is counted under."""

    rejection: Rejection
    label: str


@dataclass(frozen=True)
class Decision:
    """Placement's answer for one replica.

    Attributes:
        node, profile: where it goes; both None when it fits nowhere. For a group (a profile's
            ``nodes`` above 1), ``node`` is the head, the member that serves the API.
        gpu_indexes: the cards it gets (GPU profiles; a group's: the head's), () otherwise.
        verdicts: every (node, profile) rejection, in the order evaluated: ``found``, or what
            it returns when it is a function (the placer lists them only when read).
        summary: one line, ``placed on node-a (profile cpu)`` or ``0/3 nodes can run it: …``.
        nodes: how many nodes were considered.
        members: a group's nodes, head first (rank 0) then the workers (rank 1…), each with its
            memory share (GB) and, for a GPU profile, its cards: what
            :attr:`llmgw.control.store.ReplicaRow.members` keeps. () for a one-node replica.
        groups: when nothing was placed, why each group profile found no set of nodes.
    """

    node: str | None
    profile: Profile | None
    found: list[Verdict] | Callable[[], list[Verdict]]
    summary: str
    nodes: int
    gpu_indexes: tuple[int, ...] = ()
    members: tuple[GroupMember, ...] = ()
    groups: tuple[GroupMiss, ...] = ()

    @property
    def placed(self) -> bool:
        """True when a node was chosen."""
        return self.node is not None

    @cached_property
    def verdicts(self) -> list[Verdict]:
        """Every rejection, in the order evaluated (``found``, listed on first read)."""
        return self.found() if callable(self.found) else self.found

    @property
    def rejections(self) -> list[Rejection]:
        """The rejections alone, as the explain view serves them."""
        return [v.rejection for v in self.verdicts]


def check(candidate: Candidate, pipeline: Sequence[Check] = PIPELINE) -> Verdict | None:
    """Run ``candidate`` through the pipeline; the first failed check's verdict, or None (it fits)."""
    for stage in pipeline:
        miss = stage.fit(candidate)
        if miss is not None:
            return verdict_of(candidate.node.id, candidate.profile.name, stage, miss)
    return None


def verdict_of(node: str, profile: str, stage: Check, miss: Miss) -> Verdict:
    """The verdict of ``stage`` failing with ``miss`` for (``node``, ``profile``)."""
    rej = Rejection(
        node=node,
        profile=profile,
        kind=stage.kind.value,
        code=stage.code,
        reason=miss.reason,
        need=miss.need,
        free=miss.free,
        held_by=list(miss.held_by),
        gpu_index=miss.gpu_index,
        total=miss.total,
    )
    return Verdict(rej, miss.label)
