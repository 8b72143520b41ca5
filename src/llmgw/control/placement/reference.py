"""Placement's definition, kept as it was before :class:`~llmgw.control.placement.placer.Placer` got
its indexes: every node checked for every (model, profile), a node's verdict cached until its usage
changes. Slow on a large cluster (bench/placement.py: 1,000 replicas onto 500 nodes in 0.77-0.85 s
on a quiet machine, about ten times that on 5,000), but plain enough to read as the rule.

Nothing in the control plane uses it: the unit tests (tests/unit/test_placement_index.py) and
bench/placement.py place the same inputs with both and require the same decisions, word for word,
so a fast placer that drifts fails there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from llmgw.catalog import Model, Profile
from llmgw.control.placement.checks import (
    GROUP_CODE,
    GROUP_PIPELINE,
    PIPELINE,
    Candidate,
    Check,
    Decision,
    GroupMiss,
    Kind,
    NodeInfo,
    Reservation,
    Usage,
    Verdict,
    check,
    member_profile,
    pick_gpus,
)
from llmgw.control.placement.placer import GroupFit, Score, count_labels, placed_summary, score, summarize
from llmgw.protocol import GroupMember
from llmgw.views import Rejection


class ReferencePlacer:
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
                if fit.miss is not None:
                    groups.append(fit.miss)
                    continue
                head, workers = fit.members[0], fit.members[1:]
                summary = (
                    f"placed as a group of {profile.nodes} on {head.node} (head), "
                    f"{', '.join(m.node for m in workers)} (profile {profile.name})"
                )
                return Decision(
                    head.node, profile, verdicts, summary, len(self.nodes), tuple(head.gpu_indexes), fit.members
                )
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
            self.usage.setdefault(r.node, Usage()).add(r)
        return out
