"""Placement: which node runs the next replica of a model, in which profile, on which GPUs, and why
not elsewhere.

A pipeline in the Kubernetes-scheduler/Nomad shape, pure functions throughout::

    for each profile, highest priority first (Model.profiles_by_priority()):
        filters  (static rules; adding capacity does not help -> kind "filtered")
            node_ready      the node's heartbeats are arriving (state "ready")
            cordoned        an admin has not cordoned it
            node_selector   it carries every label the profile asks for
            engine          the profile's engine is installed there (EngineStatus state installed)
            gpu_discovery   GPU profiles: not enough measured cards of the class while the node has
                            cards reported with 0 GB memory (a discovery problem, named as one)
            gpu_class       it has a GPU of the profile's class (GPU profiles only)
            gpu_count       GPU profiles: at least ``gpu_count`` cards of the class
            gpu_size        GPU profiles: ``gpu_count`` cards of the class whose *total* memory
                            holds min_memory_gb / gpu_count (freeing cannot make a card bigger)
            memory_size     CPU profiles: the node's total memory holds min_memory_gb
            cores_size      the node's logical cores hold cpu_cores (per member for a group)
        fits     (resources; freeing some would help -> kind "exhausted")
            memory          host memory, CPU profiles: min(total - reserved, available), so memory
                            used outside llmgw (observed: total - available - reserved) counts
            cores           logical cores minus cpu_cores reserved by replicas placed there
            gpus            GPU profiles: ``gpu_count`` cards of the class that no replica holds,
                            each with min_memory_gb / gpu_count free (card total - observed used);
                            the reason names the card that is short by index, never "the best card"
        if any node survives: score and stop; else try the next profile

Survivors are scored (lower wins): fewest replicas of this model on the node (spread), then nodes
that already hold the weights in their cache (no download), then most free memory, then node id,
so the same inputs always give the same node and the explanation and the decision agree. Each
chosen GPU replica gets specific card indexes (the lowest free ones that fit), so two replicas
never share a card.

Groups (a profile's ``nodes`` above 1: one replica over several nodes, a head that serves the API
and workers) are placed whole or not at all (:meth:`Placer.place_group`): every node is checked as a
*member* (the same filters; cores per member; a member's share of the memory instead of the whole
need), the best-scored candidates form the group when together they hold the need (else the
candidates with the most free memory), and the memory is split by the resource, not the engine: by
each member's free memory on CPUs, evenly on GPUs (vLLM's pipeline stages need the even split,
llama.cpp's ``--tensor-split`` follows any shares; :func:`~llmgw.control.placement.checks.member_profile`).
The decision carries the members, head first; :meth:`Placer.reserve` counts every member. When no set fits, the summary
speaks of the set: ``0/3 nodes can run it as a group of 3: 2 of 3 nodes found: the third needs
14.2 GB, best remaining node has 9.8 GB free``.

The checks themselves, and the shapes placement shares, are in
:mod:`llmgw.control.placement.checks`; this module scores the survivors and keeps the snapshot
(:class:`Placer`).

Every (node, profile) rejection is a :class:`~llmgw.views.Rejection` with a code and a
reason that names the numbers (``needs 2.0 GB memory, 1.4 of 7.8 GB free``); a node stops at its
first failed check per profile, cheapest first. :mod:`llmgw.control.placement.explain` turns them into the
Kubernetes-style summary and the "would fit if" list.

Speed: :class:`Placer` keeps per-node usage and, per profile, an index
(:mod:`llmgw.control.placement.index`: filters once per node class, fits per node refreshed when a
reservation lands there, the passing nodes sorted by free memory), so a placement scores a handful
of nodes, and a placed decision's verdicts are listed only when read. The answer is the full
scan's, checked against :mod:`llmgw.control.placement.reference` (the placer as it was) by
tests/unit/test_placement_index.py and bench/placement.py; figures in the index's docstring.

Units: memory in GB (10^9 bytes), as ``Profile.min_memory_gb`` is; 0 reserves nothing.
What it does not do: preemption (evicting lower-priority replicas) or ports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from llmgw.catalog import Model, Profile
from llmgw.control.placement.checks import (
    GROUP_CODE,
    GROUP_PIPELINE,
    PIPELINE,
    STAGE,
    AddLog,
    Candidate,
    Check,
    Decision,
    GroupMiss,
    Kind,
    NodeInfo,
    Reservation,
    Usage,
    Verdict,
    member_profile,
    pick_gpus,
)
from llmgw.control.placement.index import ProfileIndex, free_for_score, fresh_class, node_class
from llmgw.protocol import GroupMember
from llmgw.views import Rejection
from llmgw.words import counted

#: A passing node's :func:`score`: lower wins.
Score = tuple[int, int, float, str]


def score(c: Candidate, weights: str) -> Score:
    """Lower is better: fewest replicas of this model here, then holds ``weights`` (``model/version``)
    in its cache, then most free memory, then node id."""
    return (c.usage.by_model[c.model], 0 if weights in c.node.cached else 1, -free_for_score(c), c.node.id)


def placed_summary(node: NodeInfo, profile: Profile, weights: str) -> str:
    """The decision's line for a replica placed on ``node``: ``placed on node-b (profile cpu)``, and
    ``; weights m/1 in its cache`` when the node's cache holds ``weights`` (``model/version``, as the
    agent reports it): :func:`score` ranks such a node before any that would download them (spread
    first), so a start from zero, or any scale-up, costs the engine start only."""
    cached = f"; weights {weights} in its cache" if weights in node.cached else ""
    return f"placed on {node.id} (profile {profile.name}{cached})"


@dataclass(frozen=True)
class GroupFit:
    """:meth:`Placer.place_group`'s answer: the members (head first) or, when no set of nodes fits,
    ``miss``; ``verdicts``: the rejections of the nodes that are not candidates, then (when it does
    not fit) one per candidate."""

    members: tuple[GroupMember, ...]
    verdicts: list[Verdict]
    miss: GroupMiss | None = None


class GroupPlacing(ABC):
    """What both placers (:class:`Placer` and the full scan it is checked against,
    :class:`~llmgw.control.placement.reference.ReferencePlacer`) do the same way once every node has
    its verdict or score: a group replica's members (:meth:`place_group`) and counting a decision
    (:meth:`reserve`). A subclass keeps :attr:`nodes` (sorted by id) and :attr:`usage` (node id ->
    what is reserved there) and says how it gets each node's verdict (:meth:`_evaluate`).
    """

    nodes: list[NodeInfo]
    usage: dict[str, Usage]

    @abstractmethod
    def _evaluate(
        self, model: Model, profile: Profile, pipeline: Sequence[Check] = PIPELINE
    ) -> list[tuple[NodeInfo, Verdict | Score]]:
        """Every node's verdict (or score, when it passes) for ``profile``, in node order."""

    def _count(self, r: Reservation) -> None:
        """Add ``r`` to its node's usage (made when the node has none)."""
        self.usage.setdefault(r.node, Usage()).add(r)

    def _check_reservable(self) -> None:  # noqa: B027 (optional hook: only a dry-run placer refuses)
        """Raise ValueError when this placer may not reserve (every placer may but a dry run)."""

    def place_group(self, model: Model, profile: Profile) -> GroupFit:
        """Choose the members of one group replica of ``model`` with ``profile`` (``nodes`` above 1),
        all of them or none (gang placement: nothing is reserved here, and :meth:`reserve` counts
        every member at once).

        Rules, in order:

        1. Every node goes through :data:`~llmgw.control.placement.checks.GROUP_PIPELINE` with the
           member's profile (:func:`~llmgw.control.placement.checks.member_profile`): the same
           filters as a one-node replica, cores per member, and, instead of the whole need on one
           node, a member's share: a GPU member needs ``gpu_count`` cards with ``min_memory_gb /
           (nodes * gpu_count)`` GB free each (GPU groups split evenly, whatever the engine); a CPU
           member some free host memory (the layers split by each member's free memory). Nodes
           that pass are the *candidates*; the others keep their rejection, as for one node.
        2. Candidates are ranked by the one-node :func:`score` (fewest replicas of this model, then
           cached weights, then most free memory, then id), so spread and cached weights count as
           for one-node replicas. The best ``nodes`` of them are the group, when together they hold
           ``min_memory_gb`` (CPU; a GPU member already holds its share). Otherwise the ``nodes``
           candidates with the most free memory, when they hold it.
        3. The head (rank 0) is the member with the most free memory (ties: id), then the workers
           by the same order. A CPU member's share is ``min_memory_gb * free / sum(free)`` over the
           members (never more than its free memory); a GPU member's is ``min_memory_gb / nodes``,
           on the lowest free cards that fit (:func:`pick_gpus`). Shares are GB rounded to 0.001.

        When no set fits, :attr:`GroupFit.miss` says why (too few candidates, or not enough memory
        over the best ones) and each candidate gets an ``exhausted`` rejection
        (:data:`~llmgw.control.placement.checks.GROUP_CODE`) saying it could be a member but the
        group does not fit.
        """
        member = member_profile(profile)
        size = profile.nodes
        verdicts: list[Verdict] = []
        cands: list[tuple[Score, NodeInfo]] = []
        for node, result in self._evaluate(model, member, GROUP_PIPELINE):
            if isinstance(result, Verdict):
                verdicts.append(result)
            else:
                cands.append((result, node))
        cands.sort(key=lambda c: c[0])
        free = {n.id: -s[2] for s, n in cands}
        need = 0.0 if profile.gpu_class else profile.min_memory_gb
        if len(cands) >= size:
            richest = sorted(cands, key=lambda c: (-free[c[1].id], c[0]))
            for ranked in (cands, richest):
                chosen = [n for _, n in ranked[:size]]
                if need <= sum(free[n.id] for n in chosen) + 1e-9:
                    return GroupFit(self._members(model, profile, member, chosen, free), verdicts)
            by_free = [free[n.id] for _, n in richest]
            miss = GroupMiss(
                profile.name,
                size,
                len(self.nodes),
                len(cands),
                need,
                last_need_gb=need - sum(by_free[: size - 1]),
                best_free_gb=by_free[size - 1],
                others=count_labels(verdicts),
            )
        else:
            miss = GroupMiss(profile.name, size, len(self.nodes), len(cands), need, others=count_labels(verdicts),
                             found_free_gb=sum(free.values()))
        clause = miss.clause(others=False)
        for _, node in sorted(cands, key=lambda c: c[1].id):
            if profile.gpu_class:
                cards = pick_gpus(Candidate(node, member, self.usage[node.id], model.name))
                detail = f"cards {', '.join(map(str, cards))} free"
                has: float | None = None
            else:
                has = round(free[node.id], 3)
                detail = f"{has:.1f} GB free"
            rej = Rejection(
                node=node.id,
                profile=profile.name,
                kind=Kind.EXHAUSTED.value,
                code=GROUP_CODE,
                reason=f"could be a member ({detail}), but the group of {size} does not fit: {clause}",
                free=has,
            )
            verdicts.append(Verdict(rej, "group does not fit"))
        return GroupFit((), verdicts, miss)

    def _members(
        self, model: Model, profile: Profile, member: Profile, chosen: list[NodeInfo], free: dict[str, float]
    ) -> tuple[GroupMember, ...]:
        ordered = sorted(chosen, key=lambda n: (-free[n.id], n.id))
        total = sum(free[n.id] for n in ordered)
        out = []
        for rank, node in enumerate(ordered):
            if profile.gpu_class:
                share = profile.min_memory_gb / profile.nodes
                cards = pick_gpus(Candidate(node, member, self.usage[node.id], model.name))
            else:
                need = profile.min_memory_gb
                share = need * free[node.id] / total if total > 0 else need / profile.nodes
                cards = ()
            out.append(GroupMember(node=node.id, rank=rank, memory_gb=round(share, 3), gpu_indexes=list(cards)))
        return tuple(out)

    def reserve(self, model: Model, decision: Decision, replica: str = "") -> Reservation:
        """Count ``decision`` (a placed one) as a reservation from now on; returns it (a group's:
        the head's). A group reserves on every member at once (:meth:`reserve_members`)."""
        return self.reserve_members(model, decision, replica)[0]

    def reserve_members(self, model: Model, decision: Decision, replica: str = "") -> list[Reservation]:
        """Count ``decision`` (a placed one) from now on: one reservation per member of a group
        (its memory share, the profile's cores, its cards), head first, or the one node's."""
        if decision.node is None or decision.profile is None:
            raise ValueError("only a placed decision can be reserved")
        self._check_reservable()
        p = decision.profile
        if decision.members:
            out = [
                Reservation(m.node, model.name, m.memory_gb, p.cpu_cores, p.gpu_class, tuple(m.gpu_indexes), replica)
                for m in decision.members
            ]
        else:
            out = [
                Reservation(
                    decision.node, model.name, p.min_memory_gb, p.cpu_cores, p.gpu_class, decision.gpu_indexes, replica
                )
            ]
        for r in out:
            self._count(r)
        return out


def group_decision(
    profile: Profile, members: tuple[GroupMember, ...], found: list[Verdict] | Callable[[], list[Verdict]], nodes: int
) -> Decision:
    """The decision for a group placed on ``members`` (head first; :meth:`GroupPlacing.place_group`)
    out of ``nodes``: the head's node and cards, every member, and the line
    ``placed as a group of 2 on node-b (head), node-a (profile cpu)``."""
    head, workers = members[0], members[1:]
    summary = (
        f"placed as a group of {profile.nodes} on {head.node} (head), "
        f"{', '.join(m.node for m in workers)} (profile {profile.name})"
    )
    return Decision(head.node, profile, found, summary, nodes, tuple(head.gpu_indexes), members)


class Placer(GroupPlacing):
    """Places replicas one after another over one snapshot of nodes and reservations.

    Each profile gets a :class:`~llmgw.control.placement.index.ProfileIndex` the first time it is
    placed (shared by every model with an equal profile): the filters' outcome per node class, the
    fits per node refreshed when a reservation lands there (:meth:`reserve`, or ``Usage.add`` on
    :attr:`usage`), and the passing nodes by free memory, so a placement scores a few nodes and
    gets the same answer as scoring all of them (:mod:`llmgw.control.placement.reference`).

    Args:
        nodes: every known node (lost ones included: they are rejected with a reason); ids unique.
        reservations: the replicas already placed, on any node and of any model.
    """

    def __init__(self, nodes: Sequence[NodeInfo], reservations: Iterable[Reservation]) -> None:
        self.nodes = sorted(nodes, key=lambda n: n.id)
        self._by_id: dict[str, NodeInfo] = {}
        for n in self.nodes:
            self._by_id.setdefault(n.id, n)
        self._adds = AddLog()  # what each Usage.add notes, for this placer
        self._log = self._adds.nodes  # node ids, one per reservation added since the start
        self._holding = self._adds.holding  # model -> nodes holding one of its replicas
        self.usage: dict[str, Usage] = {n.id: Usage(log=self._adds, node=n.id) for n in self.nodes}
        self._elsewhere: set[str] = set()  # nodes not in ``nodes`` holding a reservation (no AddLog)
        for r in reservations:
            self._count(r)
        self._caching: dict[str, set[str]] = {}  # model/version -> nodes holding those weights
        for n in self.nodes:
            for w in n.cached:
                self._caching.setdefault(w, set()).add(n.id)
        self._classes: tuple[list[Hashable], list[Hashable]] | None = None  # node_class, fresh_class
        # (profile as JSON, pipeline) -> its index; one Placer serves one snapshot, in which a
        # profile's contents do not change
        self._indexes: dict[tuple[str, int], ProfileIndex] = {}
        self._keys: dict[int, tuple[Profile, str]] = {}  # id(profile) -> (profile, its JSON)
        self._dry_of: str | None = None  # set on a without() placer: the model left out

    def _count(self, r: Reservation) -> None:
        """Add ``r`` to its node's usage; a node this placer does not know gets a usage without the
        add log, and is remembered in ``_elsewhere`` (:meth:`without` looks there)."""
        usage = self.usage.get(r.node)
        if usage is None:
            usage = self.usage[r.node] = Usage()
            self._elsewhere.add(r.node)
        usage.add(r)

    def without(self, model: str) -> Placer:
        """A dry-run placer: the same nodes and every reservation except ``model``'s, to ask where
        one more replica would go if the model's own did not count (the leader's explanation of a
        model that has all its replicas).

        It shares this placer's node classes, filters' outcomes and the fits of every node that
        holds none of ``model``'s replicas, so it costs those few nodes, not the cluster. Read it
        (place, explain) and drop it: it reserves nothing (:meth:`reserve_members` raises), and
        its :attr:`usage` shares this placer's objects, so do not add to them.
        """
        for idx in self._indexes.values():
            idx.sync(self._log)
        dry = Placer.__new__(Placer)
        dry.nodes, dry._by_id, dry._caching, dry._classes = self.nodes, self._by_id, self._caching, self._classes
        dry._adds = AddLog(holding={m: set(ns) for m, ns in self._holding.items() if m != model})
        dry._log, dry._holding, dry._keys, dry._dry_of = dry._adds.nodes, dry._adds.holding, dict(self._keys), model
        dry.usage = dict(self.usage)
        dry._elsewhere = self._elsewhere
        # The model's holders, from the add log and the unknown nodes, not a walk over every usage
        # (200 models explained at 5,000 nodes: 0.16 s of a 0.8 s full pass).
        candidates = self._holding.get(model, set()) | self._elsewhere
        touched = sorted(k for k in candidates if model in self.usage[k].by_model)
        for node_id in touched:
            known = node_id in self._by_id
            fresh = Usage(log=dry._adds, node=node_id) if known else Usage()
            for r in self.usage[node_id].held:
                if r.model != model:
                    fresh.add(r)
            dry.usage[node_id] = fresh
            if known:
                dry._log.append(node_id)
        dry._indexes = {key: idx.copy(dry.usage) for key, idx in self._indexes.items()}
        return dry

    def node(self, node_id: str) -> NodeInfo | None:
        """The node with this id (the first, sorted, if two share it), or None."""
        return self._by_id.get(node_id)

    def _index(self, profile: Profile, pipeline: Sequence[Check] = PIPELINE) -> ProfileIndex:
        """``profile``'s index, brought up to date with the reservations made since."""
        known = self._keys.get(id(profile))
        if known is None or known[0] is not profile:
            known = (profile, profile.model_dump_json())
            self._keys[id(profile)] = known
        key = (known[1], id(pipeline))
        idx = self._indexes.get(key)
        if idx is None:
            if self._classes is None:
                static = [node_class(n) for n in self.nodes]
                self._classes = static, [fresh_class(n, k) for n, k in zip(self.nodes, static, strict=True)]
            idx = ProfileIndex(profile, pipeline, self.nodes, self.usage, *self._classes)
            idx.seen = len(self._log)
            self._indexes[key] = idx
        idx.sync(self._log)
        return idx

    def _evaluate(
        self, model: Model, profile: Profile, pipeline: Sequence[Check] = PIPELINE
    ) -> list[tuple[NodeInfo, Verdict | Score]]:
        """Every node's verdict (or score, when it passes) for ``profile``, in node order."""
        weights = f"{model.name}/{model.version}"
        idx = self._index(profile, pipeline)
        out: list[tuple[NodeInfo, Verdict | Score]] = []
        for pos, node in enumerate(self.nodes):
            j = idx.slot.get(node.id) if idx.static[pos] is None else None
            if j is None:
                out.append((node, idx.static_verdict(pos)))
                continue
            key, verdict = idx.keys[j], idx.fits[j]
            if key is None:
                out.append((node, verdict))  # type: ignore[arg-type]  # failed: a verdict
            else:
                cached = 0 if weights in node.cached else 1
                out.append((node, (self.usage[node.id].by_model[model.name], cached, key[0], node.id)))
        return out

    def place(self, model: Model) -> Decision:
        """Choose a node, profile and GPUs for one more replica of ``model`` (nothing is reserved:
        call :meth:`reserve` with the decision to count it). A group profile (``nodes`` above 1) is
        placed whole or not at all (:meth:`place_group`).

        The decision's verdicts are listed when first read, as they stood at this call."""
        parts: list[list[Verdict] | tuple[ProfileIndex, tuple[Verdict | None, ...]]] = []
        groups: list[GroupMiss] = []
        weights = f"{model.name}/{model.version}"
        special = self._holding.get(model.name, set()) | self._caching.get(weights, set())
        for profile in model.profiles_by_priority():
            if profile.nodes > 1:
                fit = self.place_group(model, profile)
                parts.append(fit.verdicts)
                if fit.miss is None:
                    return group_decision(profile, fit.members, _lister(parts), len(self.nodes))
                groups.append(fit.miss)
                continue
            idx = self._index(profile)
            best = idx.best(model.name, weights, special)
            parts.append((idx, idx.snapshot()))
            if best is not None:
                chosen = self._by_id[best[3]]
                cand = Candidate(chosen, profile, self.usage[chosen.id], model.name)
                indexes = pick_gpus(cand) if profile.gpu_class else ()
                summary = placed_summary(chosen, profile, weights)
                return Decision(chosen.id, profile, _lister(parts), summary, len(self.nodes), indexes)
        n = len(self.nodes)
        verdicts = _lister(parts)()
        return Decision(None, None, verdicts, summarize(verdicts, n, groups), n, groups=tuple(groups))

    def _check_reservable(self) -> None:
        """A dry-run placer (:meth:`without`) reserves nothing."""
        if self._dry_of is not None:
            raise ValueError(
                f"a dry-run placer (without {self._dry_of}) reserves nothing; reserve on the placer it came from"
            )

    # --- keeping one placer over several passes (the leader's dirty passes) ---

    def hold(self, reservations: Iterable[Reservation]) -> None:
        """Count ``reservations`` (replicas placed by someone else since this placer was built)."""
        for r in reservations:
            self._count(r)

    def release(self, replicas: Iterable[tuple[str, str]]) -> None:
        """Stop counting the reservations of ``(node id, replica id)`` pairs (replicas deleted or
        changed since); the node's fits are checked again. A pair not held is ignored."""
        gone: dict[str, set[str]] = {}
        for node_id, replica in replicas:
            gone.setdefault(node_id, set()).add(replica)
        for node_id, ids in gone.items():
            old = self.usage.get(node_id)
            if old is None or not any(r.replica in ids for r in old.held):
                continue
            known = node_id in self._by_id
            fresh = Usage(log=self._adds, node=node_id) if known else Usage()
            self.usage[node_id] = fresh
            for model in old.by_model:
                self._holding.get(model, set()).discard(node_id)
            for r in old.held:
                if r.replica not in ids:
                    fresh.add(r)  # logs the node (known) and holds the model again
            if known and not fresh.held:
                self._log.append(node_id)

    def update_node(self, node: NodeInfo) -> bool:
        """Take ``node``'s new row where only what the fits read moved (cores, available memory,
        cards' used memory, cached weights); False, changing nothing, when the node is new or what
        its filters read (:func:`~llmgw.control.placement.index.node_class`) changed: build a new
        placer then."""
        old = self._by_id.get(node.id)
        if old is None:
            return False
        klass = node_class(node)
        if klass != node_class(old):
            return False
        pos = bisect_left(self.nodes, node.id, key=lambda n: n.id)
        self.nodes[pos] = self._by_id[node.id] = node
        for w in old.cached - node.cached:
            self._caching.get(w, set()).discard(node.id)
        for w in node.cached - old.cached:
            self._caching.setdefault(w, set()).add(node.id)
        if self._classes is not None:
            self._classes[1][pos] = fresh_class(node, klass)
        self._log.append(node.id)
        return True


def _lister(
    parts: list[list[Verdict] | tuple[ProfileIndex, tuple[Verdict | None, ...]]],
) -> Callable[[], list[Verdict]]:
    """A function listing the verdicts of ``parts`` in order (a group's list as it is, a profile's
    index at its snapshot)."""
    frozen = tuple(parts)

    def listed() -> list[Verdict]:
        out: list[Verdict] = []
        for part in frozen:
            if isinstance(part, list):
                out.extend(part)
            else:
                out.extend(part[0].verdicts(part[1]))
        return out

    return listed


def place(model: Model, nodes: Sequence[NodeInfo], reservations: Iterable[Reservation]) -> Decision:
    """Choose a node and profile for one more replica of ``model``.

    Args:
        model: the catalog entry; its profiles are tried by priority.
        nodes: every known node (lost ones included: they are rejected with a reason).
        reservations: the replicas already placed, on any node and of any model.

    Returns:
        A :class:`Decision`; ``placed`` is False with every rejection when nothing fits.
    """
    return Placer(nodes, reservations).place(model)


def count_labels(verdicts: Sequence[Verdict]) -> str:
    """``<count> <label>, …`` (sorted), each node counted once, under the verdict that got furthest
    down :data:`PIPELINE` (an ``exhausted`` one, which passed every filter, over a ``filtered`` one;
    a card too small over a GPU class missing), then the first evaluated (highest-priority profile)."""
    best: dict[str, Verdict] = {}
    for v in verdicts:
        cur = best.get(v.rejection.node)
        if cur is None or STAGE.get(v.rejection.code, 0) > STAGE.get(cur.rejection.code, 0):
            best[v.rejection.node] = v
    counts = Counter(v.label for v in best.values())
    return ", ".join(sorted(counted_label(n, label) for label, n in counts.items()))


def counted_label(n: int, label: str) -> str:
    """``n`` nodes under one label: a label about the node (``node cordoned``, ``node without the
    label zone=eu``) gets the count on its noun (``2 nodes cordoned``); a resource's (``not enough
    memory``) is counted as Kubernetes counts (``2 not enough memory``)."""
    if label.startswith("node "):
        return f"{counted(n, 'node')} {label.removeprefix('node ')}"
    return f"{n} {label}"


def summarize(verdicts: Sequence[Verdict], nodes: int, groups: Sequence[GroupMiss] = ()) -> str:
    """The Kubernetes-style line: ``0/N nodes can run it: <count> <label>, …`` (sorted; each node
    counted once, :func:`count_labels`): ``0/3 nodes can run it: 1 not enough memory, 2 nodes without
    the label zone=eu``.

    A group profile (``nodes`` above 1) speaks of its candidate set instead (:meth:`GroupMiss.clause`):
    ``0/3 nodes can run it as a group of 3: 2 of 3 nodes found: the third needs 14.2 GB, best
    remaining node has 9.8 GB free`` when it is the model's only profile; with other profiles, the
    one-node count first, then ``as a group of 3 (profile cpu): …`` per group profile, by priority,
    separated by ``; ``.
    """
    if nodes == 0:
        return "0/0 nodes can run it: no node has registered; start an agent ('llmgw agent')"
    names = {g.profile for g in groups}
    single = [v for v in verdicts if v.rejection.profile not in names]
    if not groups:
        return f"0/{nodes} nodes can run it: " + count_labels(single)
    if len(groups) == 1 and not single:
        return f"0/{nodes} nodes can run it as a group of {groups[0].size}: {groups[0].clause()}"
    parts = [count_labels(single)] if single else []
    parts += [f"as a group of {g.size} (profile {g.profile}): {g.clause()}" for g in groups]
    return f"0/{nodes} nodes can run it: " + "; ".join(parts)
