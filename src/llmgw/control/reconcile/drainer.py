"""Scale-down without cutting a request: a replica chosen to go drains before it stops.

Who moves what, each leader pass (:meth:`~llmgw.control.reconcile.leader.Leader.reconcile_once`)
for every model, whoever lowered its count (the autoscaler's decision, or an operator's
``ctl model scale``, which lowers ``scaling.min``/``max``):

1. **Chosen**: when more replicas serve than are wanted, the newest go (the oldest are the
   likeliest to be ready and warm): each gets ``draining_since = now`` (a revision-checked write).
2. **Routed no more**: the routing table of every control plane leaves a draining replica out
   (:func:`~llmgw.control.gateway.table.build_routes`), within its rebuild (0.5 s at most).
3. **Stopped**: once :func:`drained` says so the leader deletes the row, and the agent stops the
   engine at its next heartbeat: when no control plane reports a request in flight on it in a load
   row written :data:`ROUTES_SETTLE_S` or more after the drain began (per replica where the gateway
   knows it, else the model's whole count), or after :data:`DRAIN_BOUND_S` whatever is in flight
   (a request longer than that is cut, as a restart would cut it).
4. **Called back**: when more are wanted again while one drains, the newest draining replica
   serves again (its engine is still up) before a new one is placed; not one whose profile,
   source or version changed since it was placed.

A ready replica whose profile, source or version changed (a new version rolled out with ``ctl
model set``, new profiles) drains the same way while its replacement is placed. Not drained:
replicas of a model removed from the catalog, on a lost node, not yet ready when their spec
changed, or failed; those stop in the pass that finds them.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.control.store import ReplicaRow
from llmgw.control.store.rows import READING, GatewayLoadRow

#: The longest a replica drains (s): a chat answer on a GPU ends well within it; the gateway's own
#: shutdown drain (``gateway.drain_s``) is 20 s by default.
DRAIN_BOUND_S = 30.0

#: Load rows written this long (s) after the drain began reflect routing tables without the replica
#: (a table is rebuilt within 0.5 s of a change, ``table.MAX_AGE_S``).
ROUTES_SETTLE_S = 1.0


def to_drain(active: Sequence[ReplicaRow], wanted: int) -> list[ReplicaRow]:
    """The replicas to drain so that ``wanted`` of ``active`` stay: the newest first."""
    extra = len(active) - wanted
    return sorted(active, key=lambda r: (r.created_at, r.id))[-extra:] if extra > 0 else []


def in_flight(r: ReplicaRow, rows: Sequence[GatewayLoadRow]) -> int:
    """Requests in flight on ``r`` by the gateways' rows given: per replica where a row knows its
    replicas, else the row's whole count for the model (an upper bound)."""
    total = 0
    for row in rows:
        if row.model != r.model:
            continue
        total += row.replicas.get(r.id, 0) if row.replicas else row.in_flight
    return total


def drained(r: ReplicaRow, rows: Sequence[GatewayLoadRow], now: float, bound_s: float = DRAIN_BOUND_S) -> bool:
    """Whether draining ``r`` may stop now (module docstring, step 3). ``rows``: the fresh load rows.

    Every control plane with fresh rows must have made a reading since the drain settled (its
    :data:`~llmgw.control.store.rows.READING` row): a reading that was late (a busy machine, a
    slow store) left no row at or after ``since + ROUTES_SETTLE_S``, which read as nothing in flight,
    and a replica was stopped under a stream (CI, 2026-12-05)."""
    since = r.draining_since
    if since is None:
        return False
    if now - since >= bound_s:
        return True
    if now - since < 2 * ROUTES_SETTLE_S:
        return False
    settled = [x for x in rows if x.at >= since + ROUTES_SETTLE_S]
    read = {x.control_plane for x in settled if x.model == READING}
    if any(x.control_plane not in read for x in rows):
        return False
    return in_flight(r, settled) == 0
