"""What the placer takes, built from store rows: nodes, reservations and the GGUF-estimated models.

Shared by the leader's pass (:mod:`llmgw.control.reconcile.leader`), a model's resources
(:mod:`llmgw.control.placement.resources`) and the admin API's restart, so each sees the cluster the
same way: a profile without ``min_memory_gb`` reserves its GGUF estimate (weights + KV + overhead,
:mod:`llmgw.control.placement.estimate`) once the header is known, and nothing before.
"""

from __future__ import annotations

from llmgw.catalog import Model, Profile, context_args, default_context
from llmgw.control.placement import checks
from llmgw.control.placement import estimate as est
from llmgw.control.store import NodeRow, ReplicaRow


def node_info(row: NodeRow) -> checks.NodeInfo:
    """Placement's view of a stored node."""
    return checks.NodeInfo(
        id=row.id,
        state=row.state,
        inventory=row.inventory,
        cordoned=row.cordoned,
        labels=dict(row.labels),
        engines={e.engine: e for e in row.engines},
        cached=frozenset(row.cached),
    )


def parse_facts(stored: dict[str, tuple[str, str, float]]) -> dict[str, est.GgufFacts]:
    """The readable GGUF facts of the store, by source."""
    return {src: est.GgufFacts.model_validate_json(body) for src, (body, _, _) in stored.items() if body}


def profile_estimate(facts: est.GgufFacts, model: Model, profile: Profile) -> est.Estimate:
    """The memory a replica of ``model`` on ``profile`` needs (:func:`~llmgw.control.placement.estimate.estimate`),
    with the engine args the agent will be given: the profile's, the catalog's context
    (:func:`~llmgw.catalog.context_args`), and where neither sets one the context the engine then
    runs with (:func:`~llmgw.catalog.default_context`)."""
    args = [*profile.args, *context_args(model, profile)]
    return est.estimate(facts, args, context_length=model.context_length or default_context(profile))


def effective_model(model: Model, facts: dict[str, est.GgufFacts]) -> Model:
    """``model`` with each profile's ``min_memory_gb`` filled from its GGUF estimate where it was 0
    and the header is known (GB, rounded up to 0.01)."""
    f = facts.get(model.source)
    if f is None or all(p.min_memory_gb > 0 for p in model.profiles):
        return model
    profiles = []
    for p in model.profiles:
        if p.min_memory_gb <= 0:
            gb = profile_estimate(f, model, p).total_gb
            p = p.model_copy(update={"min_memory_gb": -(-gb * 100 // 1) / 100})  # noqa: PLW2901
        profiles.append(p)
    return model.model_copy(update={"profiles": profiles})


def reservations(replicas: list[ReplicaRow], models: dict[str, Model]) -> list[checks.Reservation]:
    """What each replica reserves on its node, from its model's profile (unknown profile: nothing,
    but it still counts as one of the model's replicas there). Pass effective models
    (:func:`effective_model`) so estimated memory counts.

    A group replica (``members``, head first) reserves on every member: the profile's cores and GPU
    class, the member's cards, and its share of the profile's ``min_memory_gb`` in the proportions
    placement gave the members (their ``memory_gb``; evenly when those are all 0, as for a group
    placed before its GGUF estimate was known), so a profile whose memory changed since is counted
    at its new size, as a one-node replica is."""
    out = []
    for r in replicas:
        model = models.get(r.model)
        prof = next((p for p in model.profiles if p.name == r.profile), None) if model else None
        if r.members:
            placed = sum(m.memory_gb for m in r.members)
            for m in r.members:
                if prof is None:
                    out.append(checks.Reservation(m.node, r.model, 0.0, 0, replica=r.id))
                    continue
                part = m.memory_gb / placed if placed > 0 else 1 / len(r.members)
                out.append(
                    checks.Reservation(
                        m.node,
                        r.model,
                        round(prof.min_memory_gb * part, 3),
                        prof.cpu_cores,
                        prof.gpu_class,
                        tuple(m.gpu_indexes),
                        r.id,
                    )
                )
            continue
        if prof is None:
            out.append(checks.Reservation(r.node, r.model, 0.0, 0, replica=r.id))
            continue
        out.append(
            checks.Reservation(
                r.node, r.model, prof.min_memory_gb, prof.cpu_cores, prof.gpu_class, r.gpu_indexes, r.id
            )
        )
    return out
