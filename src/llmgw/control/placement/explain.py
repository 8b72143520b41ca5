"""What would make a replica fit: placement's rejections turned into things an operator can do.

:func:`would_fit_if` reads a :class:`~llmgw.control.placement.placer.Decision` that placed nothing and
answers with short lines, most useful first:

* **exhausted** nodes (they passed every rule, a resource is short), the smallest shortfall first:
  ``free 0.6 GB on node-b by stopping replica chat-1a2b3c (chat, 1.0 GB)`` when one replica there
  holds enough, ``free 0.6 GB on node-b (2.0 GB there is used outside llmgw)`` when another program
  holds it, ``free a h100-80gb GPU on gpu-a by stopping replica big-0f0f0f``,
  ``free 14.0 GB on card 0 of gpu-a (18.0 GB there is used outside llmgw)`` (the card that is
  short, by index; never a negative amount); never a replica of the model explained (stopping one
  of its own leaves it as short): where only those hold what is short, one line names the nodes
  and says to add one (``add a node with room for another replica of chat: on node-b its own
  replicas hold what is short, and stopping one of them would not help``);
* **groups** (a profile's ``nodes`` above 1), first: ``a node with at least 14.2 GB free joins (or
  one of the candidates frees 4.4 GB)`` when the best candidates lack memory together (the last
  member's need, and what one of the best candidates would have to free), ``1 more node joins
  (the cluster has 2; this profile needs 3)`` when the cluster is smaller than the group; the nodes that
  are not candidates get their per-node lines below;
* **filtered** only, one line per distinct rule: ``add a node with GPU class h100-80gb``,
  ``label a node llmgw.zone=eu (agent.yaml labels)``, ``install engine vllm on a node``,
  ``uncordon node-c ('llmgw ctl node uncordon node-c')``, ``bring node-d back: its agent is not reporting``;
  a card or node smaller than what the profile needs (memory, cores or cards in all) is *too small*, never
  "free …" (no amount of freeing helps), the nodes too small for one need on one line (``node-a and
  node-b are too small (2 cores each, needs 64): add a node with at least 64 cores``); a card
  reported with 0 GB memory is a discovery problem to fix on the node.

Preemption is never done for the operator: these are suggestions (Kubernetes' "preemption: …"
verdict, in words). At most :data:`MAX_SUGGESTIONS` lines.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from llmgw.catalog import Model
from llmgw.control.placement import checks
from llmgw.control.placement import placer as pl
from llmgw.control.placement.groupmiss import gb_up
from llmgw.views import ExplainView, Rejection
from llmgw.words import counted, names

MAX_SUGGESTIONS = 5


def _freeable(rej: Rejection, usage: checks.Usage, node: checks.NodeInfo, others: list[checks.Reservation]) -> float:
    """How much of ``rej``'s resource on its node ``others`` (the replicas there of other models than
    the one explained) hold, plus what is used outside llmgw (GB, cores, or GPU cards): all that
    stopping or freeing could give one more of its replicas (stopping one of its own leaves it as
    short as before)."""
    if rej.code == "memory_exhausted":
        return sum(r.memory_gb for r in others if not r.gpu_class) + checks.host_free_gb(node.inventory, usage)[2]
    if rej.code == "cores_exhausted":
        return float(sum(r.cpu_cores for r in others))
    if rej.code == "gpu_exhausted" and rej.gpu_index is None:  # no free card: cards held by others
        return float(sum(len(r.gpu_indexes) for r in others if r.gpu_class))
    return float("inf")  # a card short of memory: what uses it is outside llmgw, never a replica


def _exhausted_line(  # noqa: PLR0911 - one answer per resource and cause, flat is clearer
    v: checks.Verdict, placer: pl.Placer, model: Model, nodes: dict[str, checks.NodeInfo]
) -> tuple[float, str] | None:
    """The line for one exhausted node, with the shortfall it is sorted by; ``(short, "")`` when only
    ``model``'s own replicas could free it (:func:`_own_line` says so once for all such nodes)."""
    rej = v.rejection
    usage = placer.usage.get(rej.node, checks.Usage())
    node = nodes.get(rej.node)
    if rej.need is None or rej.free is None or node is None:
        return None
    short = rej.need - rej.free
    if short <= 1e-9:  # nothing to free: never suggest a negative or zero amount
        return None
    others = [r for r in usage.held if r.model != model.name]  # never stop one of its own
    if _freeable(rej, usage, node, others) < short - 1e-9:
        return short, ""
    if rej.code == "memory_exhausted":
        holders = sorted(
            (r for r in others if not r.gpu_class and r.memory_gb >= short - 1e-9),
            key=lambda r: (r.memory_gb, r.replica),
        )
        if holders:
            r = holders[0]
            return short, (
                f"free {short:.1f} GB on {rej.node} by stopping replica {r.replica} ({r.model}, {r.memory_gb:.1f} GB)"
            )
        outside = checks.host_free_gb(node.inventory, usage)[2]
        if outside >= short:
            return short, f"free {short:.1f} GB on {rej.node} ({outside:.1f} GB there is used outside llmgw)"
        return short, f"free {short:.1f} GB memory on {rej.node}"
    if rej.code == "cores_exhausted":
        holders = sorted((r for r in others if r.cpu_cores >= short), key=lambda r: (r.cpu_cores, r.replica))
        cores = counted(round(short), "core")
        if holders:
            r = holders[0]
            return short, f"free {cores} on {rej.node} by stopping replica {r.replica} ({r.model})"
        return short, f"free {cores} on {rej.node}"
    if rej.code == "gpu_exhausted":
        prof = next((p for p in model.profiles if p.name == rej.profile), None)
        klass = prof.gpu_class if prof else "GPU"
        if v.label == "no free GPU":
            # _freeable above: other models hold at least one card here
            gpu_holders = sorted(r.replica or r.model for r in others if r.gpu_class and r.gpu_indexes)
            return short + 1000, f"free a {klass} GPU on {rej.node} by stopping replica {gpu_holders[0]}"
        if rej.gpu_index is None or short <= 0:
            return None
        card = next((g for g in node.inventory.gpus if g.index == rej.gpu_index), None)
        used = card.memory_used_bytes / checks.GB if card is not None else 0.0
        note = f" ({used:.1f} GB there is used outside llmgw)" if used >= checks.OUTSIDE_NOTE_GB else ""
        return short + 1000, f"free {short:.1f} GB on card {rej.gpu_index} of {rej.node}{note}"
    return None


def _share_line(v: checks.Verdict, placer: pl.Placer, model: Model) -> str | None:
    """For a node short of cores only because ``model``'s own replicas hold them: the smaller
    ``cpu_cores`` at which one more replica would share them (the cores free there and those its
    replicas hold, split evenly), or None when even 1 core each would not do (a new user's finding:
    the starter reserved a single machine's cores, so autoscaling it placed nothing and the lines said
    only "add a node")."""
    rej = v.rejection
    if rej.need is None or rej.free is None:
        return None
    own = [r for r in placer.usage.get(rej.node, checks.Usage()).held if r.model == model.name]
    pool = rej.free + sum(r.cpu_cores for r in own)
    each = math.floor(pool / (len(own) + 1) + 1e-9)
    if not 1 <= each < rej.need:
        return None
    return (f"or give profile {rej.profile} of {model.name} cpu_cores {each} ('llmgw ctl model set-profiles'): "
            f"{len(own) + 1} replicas would share the {counted(round(pool), 'core')} they may use on {rej.node}")


def _own_line(model: Model, blocked: list[str]) -> str:
    """One line for the nodes where only ``model``'s own replicas hold what one more would need."""
    return (
        f"add a node with room for another replica of {model.name}: on {names(blocked)} its own replicas "
        "hold what is short, and stopping one of them would not help"
    )


def _filtered_line(v: checks.Verdict, model: Model) -> str:  # noqa: PLR0911 - one answer per rule, flat is clearer
    rej = v.rejection
    prof = next((p for p in model.profiles if p.name == rej.profile), None)
    if rej.code == "gpu_class_mismatch" and prof is not None:
        return f"add a node with GPU class {prof.gpu_class}"
    if rej.code == "selector_mismatch" and prof is not None:
        missing = [f"{k}={val}" for k, val in sorted(prof.node_selector.items())]
        return f"label a node {', '.join(missing)} (agent.yaml labels)"
    if rej.code == "engine_not_installed" and prof is not None:
        return f"install engine {prof.engine.value} on a node"
    if rej.code == "node_cordoned":
        return f"uncordon {rej.node} ('llmgw ctl node uncordon {rej.node}')"
    if rej.code == "node_not_ready":
        return f"bring {rej.node} back: its agent is not reporting"
    if rej.code == "gpu_discovery_problem":
        return f"fix GPU discovery on {rej.node}: {rej.reason}"
    if rej.code == "gpu_too_small" and rej.need is not None and rej.total is not None:
        return (
            f"card {rej.gpu_index} of {rej.node} is too small ({rej.total:.1f} GB, needs {rej.need:.1f}): "
            "no amount of freeing helps; add a node with bigger cards, or raise the profile's gpu_count "
            "to split the model over more cards"
        )
    return rej.reason


#: The filters that reject a node smaller than the profile in all (no freeing helps), said once per
#: profile need for every node they reject: ``node-a and node-b are too small (2 cores each, needs 64)``.
TOO_SMALL = ("memory_too_small", "cores_too_small", "gpu_count_too_small")


def _unit(rej: Rejection, model: Model) -> str:
    """What a too-small rejection counts: ``GB memory``, ``core`` or ``<class> card``."""
    if rej.code == "memory_too_small":
        return "GB memory"
    if rej.code == "gpu_count_too_small":
        prof = next((p for p in model.profiles if p.name == rej.profile), None)
        return f"{prof.gpu_class} card" if prof and prof.gpu_class else "GPU card"
    return "core"


def _amount(unit: str, lo: float, hi: float | None = None) -> str:
    """``2.0 GB memory``, ``2 cores``, ``1 h100-80gb card``; with ``hi``: ``2.0 to 8.0 GB memory``,
    ``2 to 4 cores``."""
    if unit == "GB memory":
        return f"{lo:.1f} GB memory" if hi is None else f"{lo:.1f} to {hi:.1f} GB memory"
    return counted(round(lo), unit) if hi is None else f"{lo:.0f} to {hi:.0f} {unit}s"


def _too_small_line(unit: str, need: float, hits: list[tuple[str, float]]) -> str:
    """The nodes ``hits`` (``(node, total)``) too small for ``need`` (counted in ``unit``) in one line."""
    memory = unit == "GB memory"
    want = f"{need:.1f}" if memory else f"{need:.0f}"
    add = f"add a node with at least {need:.1f} GB" if memory else f"add a node with at least {_amount(unit, need)}"
    totals = sorted({t for _, t in hits})
    if len(hits) == 1:
        return f"{hits[0][0]} is too small ({_amount(unit, totals[0])} in all, needs {want}): {add}"
    has = f"{_amount(unit, totals[0])} each" if len(totals) == 1 else _amount(unit, totals[0], totals[-1])
    return f"{names([n for n, _ in hits])} are too small ({has}, needs {want}): {add}"


def _group_lines(g: checks.GroupMiss, model: Model) -> list[str]:
    """A group profile's own suggestions, before the per-node ones (which say how to make more
    nodes candidates: uncordon, install an engine, free cores…)."""
    out = []
    if g.last_need_gb is not None and g.short_gb > 1e-9:
        out.append(
            f"a node with at least {gb_up(g.last_need_gb)} GB free joins "
            f"(or one of the candidates frees {gb_up(g.short_gb)} GB)"
        )
    if g.cluster < g.size:
        which = "this profile" if len(model.profiles) == 1 else f"profile {g.profile}"
        more = g.size - g.cluster
        out.append(f"{more} more {'node joins' if more == 1 else 'nodes join'} (the cluster has {g.cluster}; "
                   f"{which} needs {g.size})")
    return out


def would_fit_if(decision: checks.Decision, placer: pl.Placer, model: Model) -> list[str]:
    """What would let one more replica of ``model`` fit (empty when it was placed)."""
    if decision.placed:
        return []
    if decision.nodes == 0:
        return ["start an agent on a machine ('llmgw agent'); no node has registered"]
    out: list[str] = [line for g in decision.groups for line in _group_lines(g, model)]
    exhausted: list[tuple[float, str]] = []
    nodes = {n.id: n for n in reversed(placer.nodes)}  # the first of equal ids wins, as a scan would
    blocked: set[str] = set()  # nodes where only the model's own replicas hold what is short
    helped: set[str] = set()  # nodes with a line (for another profile, say): that one is said
    shares: list[str] = []  # for blocked nodes short of cores: a smaller cpu_cores that would share them
    for v in decision.verdicts:
        line = _exhausted_line(v, placer, model, nodes) if v.rejection.kind == checks.Kind.EXHAUSTED else None
        if line is not None:
            (helped if line[1] else blocked).add(v.rejection.node)
            if line[1]:
                exhausted.append(line)
            elif v.rejection.code == "cores_exhausted":
                share = _share_line(v, placer, model)
                if share is not None and share not in shares:
                    shares.append(share)
    for _, text in sorted(exhausted):
        if text not in out:
            out.append(text)
    if blocked - helped:
        out.append(_own_line(model, sorted(blocked - helped)))
        out.extend(shares)
    for text in _filtered_lines(decision.verdicts, model):
        if text not in out:
            out.append(text)
    return out[:MAX_SUGGESTIONS]


def _filtered_lines(verdicts: Sequence[checks.Verdict], model: Model) -> list[str]:
    """One line per distinct rule, in the order first met; the nodes too small for one need are one
    line (:func:`_too_small_line`) where the first of them was met."""
    order: list[str | tuple[str, float]] = []
    small: dict[tuple[str, float], list[tuple[str, float]]] = {}  # (code, need) -> [(node, total)]
    for v in verdicts:
        rej = v.rejection
        if rej.kind != checks.Kind.FILTERED:
            continue
        if rej.code in TOO_SMALL and rej.need is not None and rej.total is not None:
            key = (_unit(rej, model), rej.need)
            if key not in small:
                small[key] = []
                order.append(key)
            if all(n != rej.node for n, _ in small[key]):  # a node rejected for two profiles alike
                small[key].append((rej.node, rej.total))
        else:
            order.append(_filtered_line(v, model))
    return [x if isinstance(x, str) else _too_small_line(*x, small[x]) for x in order]


def explain_view(
    model: Model,
    *,
    decision: checks.Decision,
    placer: pl.Placer,
    replicas: Sequence[tuple[str, str]],
    now: float,
    wanted: int | None = None,
    newest: tuple[str, str] | None = None,
    draining: Collection[str] = (),
) -> ExplainView:
    """The view ``GET /api/v1/explain-placement`` serves.

    Args:
        model: the catalog entry (with estimated memory filled in where the profile had none).
        decision: the last placement attempt, or a dry run of one more replica.
        placer: the placer the decision came from (its usage names the replicas to stop).
        replicas: ``(id, node)`` of the model's replicas placed now.
        now: unix seconds.
        wanted: the replicas wanted (an autoscaled model's decided count); None: ``scaling.min``.
        newest: the newest replica this leader placed and its placement's summary
            (:func:`~.placer.placed_summary`), for the ``newest replica:`` line (:func:`newest_line`).
        draining: the model's draining replicas (not in ``replicas``).
    """
    wanted = model.scaling.min if wanted is None else wanted
    placed = len(replicas) >= wanted
    # None wanted now (scaling.min 0, no load): placed, but say whether one would start from zero (a
    # new user's model that fits nowhere read "placed (0/0 replicas)" and nothing else).
    idle_unfit = placed and wanted == 0 and not decision.placed
    if placed:
        where = ", ".join(sorted({node for _, node in replicas})) or (
            "no node (scaling.max is 0: switched off, no replica may run; raise it to serve it)"
            if model.scaling.max == 0 else "no node (scaling.min is 0)"  # max 0 read as placed (a new user's finding)
        )
        summary = f"{len(replicas)}/{wanted} replicas placed on {where}"
        if idle_unfit:
            summary += f"; a replica would not fit when one is wanted: {decision.summary}"
    elif decision.placed:
        summary = f"{len(replicas)}/{wanted} replicas placed"
    else:
        summary = decision.summary
    return ExplainView(
        model=model.name,
        placed=placed,
        wanted=wanted,
        replicas=len(replicas),
        summary=summary,
        rejections=decision.rejections,
        evaluated_at=now,
        nodes=decision.nodes,
        profiles=[p.name for p in model.profiles_by_priority()],
        would_fit_if=would_fit_if(decision, placer, model) if not placed or idle_unfit else [],
        last_placed=newest_line(newest, {rid for rid, _ in replicas}, draining),
    )


def newest_line(newest: tuple[str, str] | None, placed: Collection[str], draining: Collection[str]) -> str:
    """What the ``newest replica:`` line says of ``newest`` (``(replica id, placement summary)``): the
    summary while the replica is among ``placed``, else the summary with ``; that replica is draining``
    or ``; that replica is gone`` (stopped, its node lost or drained), so the line never describes a
    replica the placed count no longer has; "" when this leader placed none."""
    if newest is None:
        return ""
    replica, summary = newest
    if replica in placed:
        return summary
    return f"{summary}; that replica is {'draining' if replica in draining else 'gone'}"
