"""Placement's definition, kept as it was before :class:`~llmgw.control.placement.placer.Placer` got
its indexes: every node checked for every (model, profile), a node's verdict cached until its usage
changes. Slow on a large cluster (bench/placement.py: 1,000 replicas onto 500 nodes in 0.77-0.85 s
on a quiet machine, about ten times that on 5,000), but plain enough to read as the rule.

Nothing in the control plane uses it: the unit tests (tests/unit/test_placement_index.py) and
bench/placement.py place the same inputs with both and require the same decisions, word for word,
so a fast placer that drifts fails there. What both do the same way once each node has its verdict
(a group's members, counting a decision) is one base class,
:class:`~llmgw.control.placement.placer.GroupPlacing`: the two differ in how they get the verdicts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from llmgw.catalog import Model, Profile
from llmgw.control.placement.checks import (
    PIPELINE,
    Candidate,
    Check,
    Decision,
    GroupMiss,
    NodeInfo,
    Reservation,
    Usage,
    Verdict,
    check,
    pick_gpus,
)
from llmgw.control.placement.placer import GroupPlacing, Score, group_decision, placed_summary, score, summarize


class ReferencePlacer(GroupPlacing):
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
        self._cache: dict[tuple[str, str, str], dict[str, tuple[int, Verdict | Score]]] = {}

    def _evaluate(
        self, model: Model, profile: Profile, pipeline: Sequence[Check] = PIPELINE
    ) -> list[tuple[NodeInfo, Verdict | Score]]:
        """Every node's verdict (or score, when it passes) for ``profile``, from the cache when the
        node's usage has not changed since."""
        weights = f"{model.name}/{model.version}"
        cache = self._cache.setdefault((model.name, model.version, profile.name), {})
        out: list[tuple[NodeInfo, Verdict | Score]] = []
        for node in self.nodes:
            usage = self.usage[node.id]
            hit = cache.get(node.id)
            if hit is not None and hit[0] == usage.version:
                result = hit[1]
            else:
                cand = Candidate(node, profile, usage, model.name)
                verdict = check(cand, pipeline)
                result = verdict if verdict is not None else score(cand, weights)
                cache[node.id] = (usage.version, result)
            out.append((node, result))
        return out

    def place(self, model: Model) -> Decision:
        """Choose a node, profile and GPUs for one more replica of ``model`` (nothing is reserved:
        call :meth:`reserve` with the decision to count it). A group profile (``nodes`` above 1) is
        placed whole or not at all (:meth:`place_group`)."""
        verdicts: list[Verdict] = []
        groups: list[GroupMiss] = []
        for profile in model.profiles_by_priority():
            if profile.nodes > 1:
                fit = self.place_group(model, profile)
                verdicts.extend(fit.verdicts)
                if fit.miss is None:
                    return group_decision(profile, fit.members, verdicts, len(self.nodes))
                groups.append(fit.miss)
                continue
            best: Score | None = None
            for _, result in self._evaluate(model, profile):
                if isinstance(result, Verdict):
                    verdicts.append(result)
                elif best is None or result < best:
                    best = result
            if best is not None:
                chosen = next(n for n in self.nodes if n.id == best[3])
                cand = Candidate(chosen, profile, self.usage[chosen.id], model.name)
                indexes = pick_gpus(cand) if profile.gpu_class else ()
                summary = placed_summary(chosen, profile, f"{model.name}/{model.version}")
                return Decision(chosen.id, profile, verdicts, summary, len(self.nodes), indexes)
        n = len(self.nodes)
        return Decision(None, None, verdicts, summarize(verdicts, n, groups), n, groups=tuple(groups))
