"""The leader's reconcile loop: node liveness, replica placement, and placement's explanations.

Exactly one control plane is the leader and runs this loop (DESIGN.md, "State and leadership").
With SQLite the process that owns the file is the leader; PostgreSQL leadership (a session advisory
lock) is not built yet, so run one control plane per database until it is.

Each pass (:meth:`Leader.reconcile_once`), in this order:

1. **Nodes**: a ``ready`` node whose last heartbeat is older than ``node_lost_after_s`` becomes
   ``lost`` (silence counts from this leader's first pass at the earliest, so restarting the control
   plane after a long outage loses no node whose agent reports again within ``node_lost_after_s``).
   First, so that the rest of the pass does not count or place on a dead node.
2. **Orphans**: replicas of models no longer in the catalog, and replicas on ``lost`` nodes or on
   nodes never seen, are deleted; the agents stop what is no longer desired at their next heartbeat.
   Before placement, so the capacity they held is free again.
3. **Models**, by name: count the model's replicas; remove the newest above ``scaling.max``; place
   new ones until ``scaling.min`` (each placement sees the reservations of the ones before it, so
   two replicas spread over two nodes); store the :class:`~llmgw.control.views.ExplainView` for
   every model, placed or not, so ``explain-placement`` always answers from the last pass.

Every write is optimistic (revision checked); a row that changed under the pass is left for the
next pass, which re-reads everything fresh. A new replica is ``pending`` with a fresh id
(``<model>-<6 hex>``) and key until its node reports it.

What it does not guarantee: a node that flaps past ``node_lost_after_s`` loses its replicas and gets
new ones (new ids and keys, so engines restart); replicas are not moved to a better node once
placed; failed replicas are kept (their error is the news) and not re-placed elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw.control import placement
from llmgw.control.catalog import Model
from llmgw.control.store import Conflict, ModelRow, NodeRow, ReplicaRow, Store
from llmgw.control.views import ExplainView

log = logging.getLogger(__name__)

#: Seconds between passes when nothing wakes the loop; an admin change or a heartbeat that changed
#: something wakes it at once (events, not timers, decide how fast a model gets placed).
DEFAULT_INTERVAL_S = 2.0


def node_info(row: NodeRow) -> placement.NodeInfo:
    """Placement's view of a stored node."""
    return placement.NodeInfo(
        id=row.id,
        state=row.state,
        inventory=row.inventory,
        cordoned=row.cordoned,
        labels=dict(row.labels),
        engines={e.engine: e for e in row.engines},
    )


def reservations(replicas: list[ReplicaRow], models: dict[str, Model]) -> list[placement.Reservation]:
    """What each replica reserves on its node, from its model's profile (unknown profile: nothing)."""
    out = []
    for r in replicas:
        model = models.get(r.model)
        prof = next((p for p in model.profiles if p.name == r.profile), None) if model else None
        if prof is None:
            out.append(placement.Reservation(r.node, r.model, 0.0, 0))
            continue
        out.append(placement.Reservation(r.node, r.model, prof.min_memory_gb, prof.cpu_cores, prof.gpu_class))
    return out


def new_replica_id(model: str) -> str:
    """``<model>-<6 hex>``: short enough to read in logs, random enough not to repeat."""
    return f"{model}-{secrets.token_hex(3)}"


@dataclass
class PassResult:
    """What one pass did (for logs and tests)."""

    lost: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    explanations: dict[str, ExplainView] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        """True when nodes or replicas changed."""
        return bool(self.lost or self.created or self.removed)


class Leader:
    """Runs :meth:`reconcile_once` every ``interval_s`` or when :meth:`wake` is called.

    Args:
        store: the state store.
        node_lost_after_s: ``ServerConfig.node_lost_after_s``.
        clock: unix seconds (injected so tests need not sleep).
        interval_s: seconds between passes when nothing wakes the loop.
        on_change: called after a pass that created, removed or lost something (the routing
            table refreshes on it).
    """

    def __init__(
        self,
        store: Store,
        *,
        node_lost_after_s: float,
        clock: Callable[[], float] = time.time,
        interval_s: float = DEFAULT_INTERVAL_S,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.node_lost_after_s = node_lost_after_s
        self.clock = clock
        self.interval_s = interval_s
        self.on_change = on_change
        self._wake = asyncio.Event()
        self._first_pass: float | None = None

    def wake(self) -> None:
        """Ask for a pass now (an admin change, a heartbeat that changed a node)."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Reconcile until ``stop`` is set. A failed pass is logged and the next one runs."""
        while not stop.is_set():
            self._wake.clear()
            try:
                self.reconcile_once(self.clock())
            except Exception:
                log.exception("reconcile pass failed; the next pass retries")
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED), self.interval_s
                )
            for w in waiters:
                w.cancel()

    def reconcile_once(self, now: float) -> PassResult:
        """One pass, as the module docstring describes; returns what it did."""
        result = PassResult()
        if self._first_pass is None:
            self._first_pass = now
        nodes = self._mark_lost(now, result)
        models = {m.name: m for m in self.store.list_models()}
        live = {n.id for n in nodes if n.state == "ready"}
        replicas = self._remove_orphans(models, live, result)
        infos = [node_info(n) for n in nodes]
        specs = {k: v.model for k, v in models.items()}
        for name in sorted(models):
            replicas = self._reconcile_model(
                models[name], nodes=infos, replicas=replicas, models=specs, now=now, result=result
            )
        if result.changed and self.on_change is not None:
            self.on_change()
        return result

    def _mark_lost(self, now: float, result: PassResult) -> list[NodeRow]:
        nodes = []
        for node in self.store.list_nodes():
            # Silence is counted from this leader's first pass at the earliest: a control plane that
            # was down (restart, upgrade) did not hear heartbeats, and must not stop every engine
            # of every node at its first pass; agents get node_lost_after_s to report again.
            silent_since = max(node.last_seen, self._first_pass or node.last_seen)
            if node.state == "ready" and now - silent_since > self.node_lost_after_s:
                try:
                    lost = self.store.update_node(node, state="lost")
                except Conflict:
                    nodes.append(node)  # a heartbeat arrived meanwhile: it is alive
                    continue
                result.lost.append(node.id)
                log.warning("node %s lost: no heartbeat for %.0f s", node.id, now - node.last_seen)
                node = lost  # noqa: PLW2901 - the row as now stored
            nodes.append(node)
        return nodes

    def _remove_orphans(
        self, models: dict[str, ModelRow], live: set[str], result: PassResult
    ) -> list[ReplicaRow]:
        kept = []
        for r in self.store.list_replicas():
            if r.model in models and r.node in live:
                kept.append(r)
                continue
            if self.store.delete_replica(r.id, revision=r.revision):
                result.removed.append(r.id)
            else:
                kept.append(r)  # changed under us; the next pass sees it fresh
        for stale in set(self.store.list_explanations()) - set(models):
            self.store.delete_explanation(stale)
        return kept

    def _reconcile_model(
        self,
        row: ModelRow,
        *,
        nodes: list[placement.NodeInfo],
        replicas: list[ReplicaRow],
        models: dict[str, Model],
        now: float,
        result: PassResult,
    ) -> list[ReplicaRow]:
        model = row.model
        mine = [r for r in replicas if r.model == model.name]
        # Above max: the newest go first (the oldest are the likeliest to be ready).
        for extra in sorted(mine, key=lambda r: (r.created_at, r.id))[model.scaling.max :]:
            if self.store.delete_replica(extra.id, revision=extra.revision):
                result.removed.append(extra.id)
                replicas = [r for r in replicas if r.id != extra.id]
                mine = [r for r in mine if r.id != extra.id]
        decision: placement.Decision | None = None
        while len(mine) < model.scaling.min:
            decision = placement.place(model, nodes, reservations(replicas, models))
            if decision.node is None or decision.profile is None:
                break
            new = self.store.add_replica(
                ReplicaRow(
                    id=new_replica_id(model.name),
                    model=model.name,
                    node=decision.node,
                    profile=decision.profile.name,
                    key=secrets.token_urlsafe(24),
                    created_at=now,
                    updated_at=now,
                )
            )
            log.info("placed %s on %s (profile %s)", new.id, new.node, new.profile)
            result.created.append(new.id)
            replicas = [*replicas, new]
            mine.append(new)
        view = self._explain(
            model, mine=mine, nodes=nodes, replicas=replicas, models=models, decision=decision, now=now
        )
        self.store.set_explanation(view, now=now)
        result.explanations[model.name] = view
        return replicas

    @staticmethod
    def _explain(
        model: Model,
        *,
        mine: list[ReplicaRow],
        nodes: list[placement.NodeInfo],
        replicas: list[ReplicaRow],
        models: dict[str, Model],
        decision: placement.Decision | None,
        now: float,
    ) -> ExplainView:
        """The explanation: the last placement attempt's, else a dry run of one more replica
        (with the model's own replicas not counted against it) so it always lists the rejections."""
        wanted = model.scaling.min
        placed = len(mine) >= wanted
        if decision is None:
            others = [r for r in replicas if r.model != model.name]
            decision = placement.place(model, nodes, reservations(others, models))
        if placed:
            where = ", ".join(sorted({r.node for r in mine})) or "no node (scaling.min is 0)"
            summary = f"{len(mine)}/{wanted} replicas placed on {where}"
        else:
            summary = decision.summary if not decision.placed else f"{len(mine)}/{wanted} replicas placed"
        return ExplainView(
            model=model.name,
            placed=placed,
            wanted=wanted,
            replicas=len(mine),
            summary=summary,
            rejections=decision.rejections,
            evaluated_at=now,
        )
