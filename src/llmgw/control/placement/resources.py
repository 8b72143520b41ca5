"""``GET /api/v1/models/{name}/resources``: what one replica of a model needs, per profile, and
which nodes could take one now.

Pure functions over store rows: the memory of a profile is its ``min_memory_gb`` when set, else the
GGUF estimate (:mod:`llmgw.control.placement.estimate`) when the header has been read, else unknown (0,
reserving nothing). Each node's verdict is placement's own check (:func:`placement.check`) against
the replicas placed now, the model's own included, so "fits" means "one more would fit there".

A group profile (``nodes`` above 1) is checked per node as a *member* (its share of the memory,
:func:`~llmgw.control.placement.checks.member_profile`), so "fits" there means "could be one of the
group's nodes"; ``group`` says where one more group would go, or why no set of nodes fits
(placement's own :meth:`~llmgw.control.placement.placer.Placer.place_group`).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from llmgw.catalog import Model
from llmgw.control.placement import checks
from llmgw.control.placement import estimate as est
from llmgw.control.placement import placer as pl
from llmgw.control.placement.inputs import effective_model, node_info, parse_facts, profile_estimate, reservations
from llmgw.control.store import NodeRow, ReplicaRow


class NodeFit(BaseModel):
    """One node for one profile: ``fits``, or the rejection's kind and reason."""

    node: str
    fits: bool
    kind: str = ""
    reason: str = ""


class ProfileResources(BaseModel):
    """One profile: what a replica reserves and where one more could run."""

    name: str
    priority: int
    engine: str
    gpu_class: str = ""
    gpu_count: int = 1
    cpu_cores: int = 0
    memory_gb: float = 0.0
    memory_from: str  # "min_memory_gb", "estimate" or "unknown"
    ctx: int = 0
    weights_gb: float = 0.0
    kv_gb: float = 0.0
    overhead_gb: float = 0.0
    group_size: int = 1  # Profile.nodes: how many nodes one replica spans
    group: str = ""  # group profiles: "fits on a (head), b, c" or why no set of nodes fits
    nodes: list[NodeFit] = Field(default_factory=list)


class ModelResourcesView(BaseModel):
    """The model's GGUF facts (or why there are none) and each profile in placement order."""

    model: str
    source: str
    facts: est.GgufFacts | None = None
    facts_error: str = ""
    profiles: list[ProfileResources] = Field(default_factory=list)


def resources_view(
    model: Model,
    *,
    nodes: list[NodeRow],
    replicas: list[ReplicaRow],
    models: dict[str, Model],
    stored_facts: dict[str, tuple[str, str, float]],
) -> ModelResourcesView:
    """Build the view (see the module docstring); ``models`` is the whole catalog by name."""
    facts = parse_facts(stored_facts)
    eff = {k: effective_model(m, facts) for k, m in models.items()}
    placer = pl.Placer([node_info(n) for n in nodes], reservations(replicas, eff))
    f = facts.get(model.source)
    out = []
    for p in effective_model(model, facts).profiles_by_priority():
        raw = next(x for x in model.profiles if x.name == p.name)
        item = ProfileResources(
            name=p.name,
            priority=p.priority,
            engine=p.engine.value,
            gpu_class=p.gpu_class,
            gpu_count=p.gpu_count,
            cpu_cores=p.cpu_cores,
            memory_gb=p.min_memory_gb,
            memory_from="min_memory_gb" if raw.min_memory_gb > 0 else ("estimate" if f else "unknown"),
        )
        if f is not None:
            e = profile_estimate(f, model, p)
            item.ctx, item.weights_gb = e.ctx, round(e.weights / est.GB, 3)
            item.kv_gb, item.overhead_gb = round(e.kv / est.GB, 3), round(e.overhead / est.GB, 3)
        member, pipeline = checks.member_profile(p), checks.PIPELINE
        if p.nodes > 1:
            item.group_size, pipeline = p.nodes, checks.GROUP_PIPELINE
            fit = placer.place_group(model, p)
            if fit.miss is None:
                names = [m.node for m in fit.members]
                item.group = f"fits on {names[0]} (head), {', '.join(names[1:])}"
            else:
                item.group = fit.miss.clause()
        for node in placer.nodes:
            v = checks.check(checks.Candidate(node, member, placer.usage[node.id], model.name), pipeline)
            if v is None:
                item.nodes.append(NodeFit(node=node.id, fits=True))
            else:
                item.nodes.append(NodeFit(node=node.id, fits=False, kind=v.rejection.kind, reason=v.rejection.reason))
        out.append(item)
    _, error, _ = stored_facts.get(model.source, ("", "", 0.0))
    return ModelResourcesView(model=model.name, source=model.source, facts=f, facts_error=error, profiles=out)
