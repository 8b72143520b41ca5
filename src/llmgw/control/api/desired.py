"""What a node's agent must run: the replicas placed on it as :class:`~llmgw.protocol.ReplicaSpec`,
the ``desired`` list of its heartbeat reply (:mod:`llmgw.control.api.agent`), with each engine's own
arguments (a group member's role and peers, an embedding model's flags, the context)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llmgw.catalog import Model, Role, context_args, engine_traits
from llmgw.control.reconcile.specs import spec_hashes
from llmgw.control.store import ReplicaRow
from llmgw.protocol import GroupMember, GroupRole, ReplicaSpec


def desired_specs(node_id: str, replicas: Sequence[ReplicaRow], models: Mapping[str, Model]) -> list[ReplicaSpec]:
    """The replicas placed on ``node_id`` (``replicas``, of ``models`` by name), as the agent must
    run them (models gone are skipped).

    The heartbeat's read gives only the models that have a replica on the node (not the whole
    catalog: with 50 models and 100 heartbeats a second that was 5,000 catalog rows parsed a second)."""
    out = []
    hashes: dict[tuple[str, str], set[str]] = {}  # (model, profile) -> spec_hashes, once per heartbeat
    for r in replicas:
        model = models.get(r.model)
        if model is None:
            continue
        prof = next((p for p in model.profiles if p.name == r.profile), None)
        if prof is None:
            continue
        out.append(
            ReplicaSpec(
                id=r.id,
                model=model.name,
                version=model.version,
                profile=r.profile,
                engine=prof.engine.value,
                source_url=model.source,
                sha256=model.sha256,
                file_name=model.file_name,
                args=[*prof.args, *context_args(model, prof), *role_args(model.role, prof.engine.value, prof.args)],
                cpu_cores=prof.cpu_cores,
                key=r.key,
                env=dict(prof.env),
                draining=r.draining_since is not None or _outdated(r, model, hashes),
                **{"gpu_indexes": list(r.gpu_indexes), **group_fields(r, node_id, prof.engine.value)},
            )
        )
    return out


def group_fields(r: ReplicaRow, node_id: str, engine: str) -> dict[str, Any]:
    """A group replica's ``role``, ``members`` and ``gpu_indexes`` for ``node_id`` (nothing for a
    replica on one node).

    Only what the member's engine needs goes in, so its spec changes (and the agent restarts it)
    only when that changes: the head gets every worker's endpoint (it starts once all are there,
    and restarts when a worker comes back on another port); a llama.cpp worker gets no endpoints;
    a vLLM worker gets its head's Ray address (it joins that cluster), a vLLM head none (its workers
    join it; it counts them in Ray). No states: they change as members report."""
    if not r.members:
        return {}
    me = next((m for m in r.members if m.node == node_id), None)
    head = r.node == node_id
    # Which endpoints a member's engine waits for (the engine's traits say who dials whom): a
    # llama.cpp head dials its workers (rpc-server); a vLLM worker joins its head's Ray cluster.
    # Nothing else goes in, so no member's spec changes with its own report, nor a vLLM head's with
    # its workers joining (that would restart Ray).
    traits = engine_traits(engine)
    dials = traits is not None and traits.head_dials_workers
    wants = head if dials else not head
    members = []
    for m in r.members:
        shown = wants and ((m.rank > 0) if dials else (m.rank == 0))
        fields = {"node", "rank", "memory_gb", "gpu_indexes"} | ({"endpoint"} if shown else set())
        members.append(GroupMember.model_validate(m.model_dump(include=fields)))
    out: dict[str, Any] = {"role": GroupRole.HEAD if head else GroupRole.WORKER, "members": members}
    if me is not None and not head:
        out["gpu_indexes"] = list(me.gpu_indexes)
    return out


def role_args(role: Role, engine: str, args: Sequence[str]) -> list[str]:
    """Engine flags a model's role needs, beyond its profile's ``args``: an ``embedding`` model's
    engine serves embeddings, with the flags its engine's traits name
    (:attr:`llmgw.catalog.EngineTraits.embedding_args`: llama-server ``--embeddings --pooling mean``,
    vLLM ``--task embed``)."""
    traits = engine_traits(engine)
    if role != Role.EMBEDDING or traits is None:
        return []
    return traits.embedding_args(args)


def _outdated(r: ReplicaRow, model: Model, hashes: dict[tuple[str, str], set[str]]) -> bool:
    """Whether ``r`` was placed from a profile, source or version ``model`` no longer has: the leader
    drains it (ready) or replaces it (not yet) at its next pass, under a new id; until then its agent
    keeps what it runs (a beat answered between the change and that pass restarted the engine in place
    onto the new weights, cutting its streams). ``hashes``: the current ones by (model, profile), filled in."""
    if not r.spec_hash:
        return False
    if (r.model, r.profile) not in hashes:
        hashes[r.model, r.profile] = spec_hashes(model, r.profile)
    return r.spec_hash not in hashes[r.model, r.profile]
