"""The placer's index of one profile over one snapshot of nodes: which nodes its filters reject (and
why), which pass every check now, and those ordered by free memory, so one placement looks at a
handful of nodes instead of all of them.

Mechanism (:class:`ProfileIndex`), built the first time a profile is placed and kept for the
:class:`~llmgw.control.placement.placer.Placer`'s life:

1. **Filters once per node class.** The ``filtered`` stages of a pipeline (state, cordon, labels,
   engine, GPU class and size, host memory size, cores in all) read the node and the profile, never
   the usage, so their outcome is fixed for the snapshot. Nodes are grouped by :func:`node_class`, the fields
   those stages read (Nomad's *computed node class*, which memoizes feasibility per class); each
   class is checked once through the real check functions and its nodes share the outcome.
   A rejected node's :class:`~llmgw.control.placement.checks.Verdict` is built only when someone
   reads the decision's verdicts (most placements are never explained).
2. **Fits per feasible node, refreshed on change.** The ``exhausted`` stages (memory, cores, GPUs)
   run on each node that passed the filters, with the real check functions, and again only when a
   reservation lands on that node (the placer's change log, fed by :meth:`Usage.add
   <llmgw.control.placement.checks.Usage.add>`). Nodes that hold no replica yet share the outcome
   per :func:`fresh_class` (the node class plus cores, available memory and cards' used memory).
3. **Passing nodes by free memory.** The nodes that pass every check are kept sorted by ``(-free,
   id)``: the last two parts of the placer's score. A node that holds none of the model's replicas
   and not its weights scores ``(0, 1, -free, id)``, so the best of those is the first such node in
   that order; the few nodes that hold a replica or the weights are scored one by one. The best of
   both is exactly the node the full scan would pick (no limit on nodes scored is needed, and none
   is applied: the result is the full scan's, only cheaper).

A profile's index is shared by every model whose profile has the same contents (verdicts do not
depend on the model; spread and cached weights, which do, are in the score). A placed decision
keeps a tuple of the fits' verdicts per profile (a snapshot) and lists its rejections only when
read, filters' rejections built then (most placements are never explained).

Why this and not a limit on nodes scored (Nomad's limit iterator scores a few feasible nodes, about
log2 of the cluster when spread counts; kube-scheduler's ``percentageOfNodesToScore`` defaults to
50 % of 100 nodes down to 10 % of 5,000, at least 5 %): either changes where replicas go
(bench/placement.py's 5,000-node case places m001 on the nodes caching its weights, cpu-0001,
-0021, ..., which a scan stopping early could miss) and what the explanation counts, and both must
stay the full scan's, word for word. With the indexes the full
scan's answer costs a few nodes per placement anyway.

Figures (bench/placement.py, medians of 7 rounds; 2 cores shared with other work, so each with
the 1-minute load average beside it):

* ``place_1000_on_500_s``: 1.98 before (load 3-4); indexed 0.054 (load 1.7), 0.077 (2.8),
  0.118 (8).
* ``place_1000_on_5000_s``: 27.0 and 31.6 before (one run each, load 2-4); indexed 0.231 (load
  1.7), 0.244 (2.8), 0.359 (8).
* ``explain_500`` 25.2 -> 20.0 ms and ``explain_5000`` 600 -> 400 ms (load 1.7): the explanation
  builds every rejection (10,000 at 5,000 nodes, two profiles), as before.

Before: the placer as it was (:mod:`llmgw.control.placement.reference`, 0.77-0.85 s on 500 nodes
on a quiet machine); its cProfile: 61 full checks per placement (each model re-checked every node,
the cache being per model) and a walk over every node per placement to rebuild the verdict list.

What it assumes: the pipeline's ``filtered`` stages come first and read no usage (true of
:data:`~llmgw.control.placement.checks.PIPELINE` and ``GROUP_PIPELINE``; :func:`split` stops at the
first ``exhausted`` stage, so a later filter would still be run per node); usage changes only
through ``Usage.add``; node ids are unique (the store's key).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Hashable, Sequence

from llmgw.catalog import Profile
from llmgw.control.placement.checks import (
    Candidate,
    Check,
    Kind,
    Miss,
    NodeInfo,
    Usage,
    Verdict,
    card_free_gb,
    check,
    host_free_gb,
    verdict_of,
)

#: A filter's rejection shared by the nodes of one class: the stage and its miss.
Filtered = tuple[Check, Miss]

_NO_USAGE = Usage()


def node_class(n: NodeInfo) -> Hashable:
    """The fields the ``filtered`` checks read, as one hashable key: nodes with equal keys get the
    same filter outcome (the node id aside). Left out: the id, cached weights, available memory,
    each card's used memory (read only by the fits and the score). The cores are in: the
    ``cores_too_small`` filter reads the node's total."""
    inv = n.inventory
    return (
        n.state,
        n.cordoned,
        frozenset(n.labels.items()),
        frozenset((k, e.engine, e.state, e.detail, tuple(e.features)) for k, e in n.engines.items()),
        inv.memory_total_bytes,
        inv.cores,
        tuple((g.index, g.name, g.klass, g.memory_total_bytes) for g in inv.gpus),
    )


def fresh_class(n: NodeInfo, klass: Hashable) -> Hashable:
    """:func:`node_class` (``klass``) plus what the fits and the score read of a node that holds
    no replica yet (cores, available memory, each card's used memory): nodes with equal keys and
    no reservation get the same fits' outcome and free memory."""
    inv = n.inventory
    return (klass, inv.cores, inv.memory_available_bytes, tuple(g.memory_used_bytes for g in inv.gpus))


def split(pipeline: Sequence[Check]) -> tuple[tuple[Check, ...], tuple[Check, ...]]:
    """The leading ``filtered`` stages (once per node class) and the rest (per node and usage)."""
    k = next((i for i, s in enumerate(pipeline) if s.kind != Kind.FILTERED), len(pipeline))
    return tuple(pipeline[:k]), tuple(pipeline[k:])


def free_for_score(c: Candidate) -> float:
    """The free memory the score ranks by (GB): a GPU profile's best untaken card of its class
    (total minus observed use), else the host's free memory (:func:`host_free_gb`)."""
    if c.profile.gpu_class:
        cards = [
            card_free_gb(g)
            for g in c.node.inventory.gpus
            if g.klass == c.profile.gpu_class and g.index not in c.usage.gpus_taken
        ]
        return max(cards, default=0.0)
    return host_free_gb(c.node.inventory, c.usage)[0]


class ProfileIndex:
    """One profile (and pipeline) over the placer's nodes; see the module docstring.

    Args:
        profile: the profile checked (its name goes into every rejection).
        pipeline: the stages, filters first.
        nodes: the placer's nodes, sorted by id (the order verdicts are listed in).
        usage: the placer's usage by node id (read, never written).
        classes: :func:`node_class` of each node, by position.
        fresh: :func:`fresh_class` of each node, by position.
    """

    def __init__(
        self,
        profile: Profile,
        pipeline: Sequence[Check],
        nodes: Sequence[NodeInfo],
        usage: dict[str, Usage],
        classes: Sequence[Hashable],
        fresh: Sequence[Hashable],
    ) -> None:
        self.profile, self.nodes, self.usage = profile, nodes, usage
        static, self.fit_stages = split(pipeline)
        outcome: dict[Hashable, Filtered | None] = {}
        self.static: list[Filtered | None] = []
        for node, klass in zip(nodes, classes, strict=True):
            if klass not in outcome:
                outcome[klass] = _first_miss(Candidate(node, profile, _NO_USAGE), static)
            self.static.append(outcome[klass])
        self._static_verdicts: dict[int, Verdict] = {}
        self._filtered: list[int] | None = None  # positions rejected by a filter (verdicts())
        #: positions (in ``nodes``) of the nodes that pass every filter, and node id -> slot there
        self.feasible = [i for i, s in enumerate(self.static) if s is None]
        self.slot = {nodes[i].id: j for j, i in enumerate(self.feasible)}
        #: per slot: the fits' verdict (None: it passes now) and, when it passes, its (-free, id)
        self.fits: list[Verdict | None] = [None] * len(self.feasible)
        self.keys: list[tuple[float, str] | None] = [None] * len(self.feasible)
        #: the passing nodes' keys, ascending: most free memory first, then id
        self.order: list[tuple[float, str]] = []
        self.seen = 0  # how much of the placer's change log this index has applied
        shared: dict[Hashable, tuple[Filtered | None, float]] = {}  # fresh class -> fits' outcome, free
        for j, pos in enumerate(self.feasible):
            node = nodes[pos]
            if usage[node.id].version:  # holds replicas: its own fits
                self.fits[j], self.keys[j] = self._fit(j)
                continue
            out = shared.get(fresh[pos])
            if out is None:
                cand = Candidate(node, profile, usage[node.id])
                out = shared[fresh[pos]] = (_first_miss(cand, self.fit_stages), free_for_score(cand))
            if out[0] is None:
                self.keys[j] = (-out[1], node.id)
            else:
                self.fits[j] = verdict_of(node.id, profile.name, *out[0])
        self.order = sorted(k for k in self.keys if k is not None)

    def _fit(self, j: int) -> tuple[Verdict | None, tuple[float, str] | None]:
        node = self.nodes[self.feasible[j]]
        cand = Candidate(node, self.profile, self.usage[node.id])
        v = check(cand, self.fit_stages)
        return v, (None if v is not None else (-free_for_score(cand), node.id))

    def sync(self, log: Sequence[str]) -> None:
        """Apply the placer's change log (node ids whose usage changed) from where it was left:
        each such node's fits again, and its place in :attr:`order`."""
        if len(log) == self.seen:
            return
        for node_id in dict.fromkeys(log[self.seen :]):
            j = self.slot.get(node_id)
            if j is None:
                continue
            old = self.keys[j]
            if old is not None:
                del self.order[bisect_left(self.order, old)]
            self.fits[j], key = self._fit(j)
            self.keys[j] = key
            if key is not None:
                insort(self.order, key)
        self.seen = len(log)

    def copy(self, usage: dict[str, Usage]) -> ProfileIndex:
        """This index over ``usage`` (a dry run's): the filters' outcome and verdicts shared, the
        fits copied as they are now; the nodes whose usage differs must come through the new
        placer's change log (from position 0)."""
        out = ProfileIndex.__new__(ProfileIndex)
        out.__dict__.update(self.__dict__)
        out.usage, out.seen = usage, 0
        out.fits, out.keys, out.order = list(self.fits), list(self.keys), list(self.order)
        return out

    def best(self, model: str, weights: str, special: set[str]) -> tuple[int, int, float, str] | None:
        """The lowest score among the nodes passing now (the placer's :func:`score`), or None.

        ``special``: the nodes holding a replica of ``model`` or ``weights`` in their cache; all
        others score ``(0, 1, -free, id)``."""
        best: tuple[int, int, float, str] | None = None
        for node_id in special:
            j = self.slot.get(node_id)
            if j is None or (key := self.keys[j]) is None:
                continue
            node = self.nodes[self.feasible[j]]
            s = (self.usage[node_id].by_model[model], 0 if weights in node.cached else 1, key[0], node_id)
            if best is None or s < best:
                best = s
        for neg_free, node_id in self.order:
            if node_id not in special:
                s = (0, 1, neg_free, node_id)
                if best is None or s < best:
                    best = s
                break
        return best

    def static_verdict(self, pos: int) -> Verdict:
        """The filter's verdict for the node at ``pos`` (built once, on first read)."""
        v = self._static_verdicts.get(pos)
        if v is None:
            stage, miss = self.static[pos]  # type: ignore[misc]
            v = verdict_of(self.nodes[pos].id, self.profile.name, stage, miss)
            self._static_verdicts[pos] = v
        return v

    def snapshot(self) -> tuple[Verdict | None, ...]:
        """The fits' verdicts now, per slot: what :meth:`verdicts` lists later, unchanged by later
        reservations."""
        return tuple(self.fits)

    def verdicts(self, snap: tuple[Verdict | None, ...]) -> list[Verdict]:
        """Every rejection at the time of ``snap``, in node order (filters' and fits' interleaved).

        Built from the rejected positions only, merged in node order: a placed decision's list
        over 5,000 nodes that nearly all pass costs those few, not a walk over every node (the
        walk was half of a pass placing 200 new models at 2,000 nodes)."""
        feasible = self.feasible
        fits = [(feasible[j], v) for j, v in enumerate(snap) if v is not None]
        if len(feasible) == len(self.static):
            return [v for _, v in fits]
        if self._filtered is None:  # fixed for the snapshot: listed once, shared with copies made after
            self._filtered = [pos for pos, s in enumerate(self.static) if s is not None]
        filtered = [(pos, self.static_verdict(pos)) for pos in self._filtered]
        if not fits:
            return [v for _, v in filtered]
        return [v for _, v in sorted(fits + filtered, key=lambda pv: pv[0])]


def _first_miss(c: Candidate, stages: Sequence[Check]) -> Filtered | None:
    for stage in stages:
        miss = stage.fit(c)
        if miss is not None:
            return stage, miss
    return None
