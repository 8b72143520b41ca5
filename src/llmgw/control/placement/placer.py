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
            gpu_size        GPU profiles: ``gpu_count`` cards of the class whose *total* memory
                            holds min_memory_gb / gpu_count (freeing cannot make a card bigger)
            memory_size     CPU profiles: the node's total memory holds min_memory_gb
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

The checks themselves, and the shapes placement shares, are in
:mod:`llmgw.control.placement.checks`; this module scores the survivors and keeps the snapshot
(:class:`Placer`).

Every (node, profile) rejection is a :class:`~llmgw.views.Rejection` with a code and a
reason that names the numbers (``needs 2.0 GB memory, 1.4 of 7.8 GB free``); a node stops at its
first failed check per profile, cheapest first. :mod:`llmgw.control.placement.explain` turns them into the
Kubernetes-style summary and the "would fit if" list.

Speed: :class:`Placer` keeps per-node usage and caches each node's verdict per (model, profile)
until a reservation lands on that node, so placing many replicas re-checks one node per placement
(bench/placement.py: 1,000 replicas onto 500 nodes, figures in its docstring).

Units: memory in GB (10^9 bytes), as ``Profile.min_memory_gb`` is; 0 reserves nothing.
What it does not do: preemption (evicting lower-priority replicas) or ports.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from llmgw.catalog import Model
from llmgw.control.placement.checks import (
    STAGE,
    Candidate,
    Decision,
    NodeInfo,
    Reservation,
    Usage,
    Verdict,
    card_free_gb,
    check,
    host_free_gb,
    pick_gpus,
)


def _free_for_score(c: Candidate) -> float:
    if c.profile.gpu_class:
        cards = [
            card_free_gb(g)
            for g in c.node.inventory.gpus
            if g.klass == c.profile.gpu_class and g.index not in c.usage.gpus_taken
        ]
        return max(cards, default=0.0)
    return host_free_gb(c.node.inventory, c.usage)[0]


def score(c: Candidate, weights: str) -> tuple[int, int, float, str]:
    """Lower is better: fewest replicas of this model here, then holds ``weights`` (``model/version``)
    in its cache, then most free memory, then node id."""
    return (c.usage.by_model[c.model], 0 if weights in c.node.cached else 1, -_free_for_score(c), c.node.id)


class Placer:
    """Places replicas one after another over one snapshot of nodes and reservations.

    Each node's verdict for a (model, profile) is cached with the node's usage version and reused
    until a reservation lands on that node (:meth:`reserve`), so a run of placements re-checks
    only the node that changed.

    Args:
        nodes: every known node (lost ones included: they are rejected with a reason).
        reservations: the replicas already placed, on any node and of any model.
    """

    def __init__(self, nodes: Sequence[NodeInfo], reservations: Iterable[Reservation]) -> None:
        self.nodes = sorted(nodes, key=lambda n: n.id)
        self.usage: dict[str, Usage] = {n.id: Usage() for n in self.nodes}
        for r in reservations:
            self.usage.setdefault(r.node, Usage()).add(r)
        # (model, version, profile name) -> node id -> (usage version, verdict or score); one Placer
        # serves one snapshot, in which a profile's contents do not change
        self._cache: dict[tuple[str, str, str], dict[str, tuple[int, Verdict | tuple[int, int, float, str]]]] = {}

    def place(self, model: Model) -> Decision:
        """Choose a node, profile and GPUs for one more replica of ``model`` (nothing is reserved:
        call :meth:`reserve` with the decision to count it)."""
        weights = f"{model.name}/{model.version}"
        verdicts: list[Verdict] = []
        for profile in model.profiles_by_priority():
            cache = self._cache.setdefault((model.name, model.version, profile.name), {})
            best: tuple[int, int, float, str] | None = None
            for node in self.nodes:
                usage = self.usage[node.id]
                hit = cache.get(node.id)
                if hit is not None and hit[0] == usage.version:
                    result = hit[1]
                else:
                    cand = Candidate(node, profile, usage, model.name)
                    verdict = check(cand)
                    result = verdict if verdict is not None else score(cand, weights)
                    cache[node.id] = (usage.version, result)
                if isinstance(result, Verdict):
                    verdicts.append(result)
                elif best is None or result < best:
                    best = result
            if best is not None:
                chosen = next(n for n in self.nodes if n.id == best[3])
                cand = Candidate(chosen, profile, self.usage[chosen.id], model.name)
                indexes = pick_gpus(cand) if profile.gpu_class else ()
                summary = f"placed on {chosen.id} (profile {profile.name})"
                return Decision(chosen.id, profile, verdicts, summary, len(self.nodes), indexes)
        return Decision(None, None, verdicts, summarize(verdicts, len(self.nodes)), len(self.nodes))

    def reserve(self, model: Model, decision: Decision, replica: str = "") -> Reservation:
        """Count ``decision`` (a placed one) as a reservation from now on; returns it."""
        if decision.node is None or decision.profile is None:
            raise ValueError("only a placed decision can be reserved")
        p = decision.profile
        r = Reservation(
            decision.node,
            model.name,
            p.min_memory_gb,
            p.cpu_cores,
            p.gpu_class,
            decision.gpu_indexes,
            replica,
        )
        self.usage.setdefault(r.node, Usage()).add(r)
        return r


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


def summarize(verdicts: Sequence[Verdict], nodes: int) -> str:
    """The Kubernetes-style line: ``0/N nodes can run it: <count> <label>, …`` (sorted).

    Each node is counted once, under the verdict that got furthest down :data:`PIPELINE` (an
    ``exhausted`` one, which passed every filter, over a ``filtered`` one; a card too small over a
    GPU class missing), then the first evaluated (highest-priority profile).
    """
    if nodes == 0:
        return "0/0 nodes can run it: no node has registered; start an agent ('llmgw agent')"
    best: dict[str, Verdict] = {}
    for v in verdicts:
        cur = best.get(v.rejection.node)
        if cur is None or STAGE.get(v.rejection.code, 0) > STAGE.get(cur.rejection.code, 0):
            best[v.rejection.node] = v
    counts = Counter(v.label for v in best.values())
    parts = sorted(f"{n} {label}" for label, n in counts.items())
    return f"0/{nodes} nodes can run it: " + ", ".join(parts)
