"""The admin API's nodes: ``/api/v1/nodes`` and the revocation list of their certificates.

Routes (:data:`ROUTES`; :mod:`llmgw.control.api.admin` says how they are authorised and answered):
``GET /api/v1/nodes``, ``POST /api/v1/nodes/{id}/cordon|uncordon|drain``,
``DELETE /api/v1/nodes/{id}[?force=true]``, ``GET /api/v1/revocations/{serial}[?node=N&issued_at=T]``
(whether an agent certificate was revoked, or with its node and issue time whether the agent API
refuses it; 404 when not).

A drain cordons the node and deletes its replicas at once; the leader places them elsewhere at its
next pass (no overlap: drain stops before the new ones are ready).

``DELETE /api/v1/nodes/{id}`` removes a node and revokes the certificate serials its agent
presented (:meth:`~llmgw.control.store.sql.Store.remove_node`); 409 ``node_busy`` while replicas are
placed there, unless ``?force=true``, which drains it first (as above) in the same request.

Handlers read the shared state from ``request.app[ADMIN]``
(:class:`~llmgw.control.api.context.AdminContext`).
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from llmgw.catalog import Model
from llmgw.control.api.context import ADMIN, AdminContext, must_exist
from llmgw.control.api.context import json_response as _json
from llmgw.control.placement.checks import Reservation
from llmgw.control.placement.inputs import effective_model, parse_facts, reservations
from llmgw.control.store import NodeRow, ReplicaRow, Store
from llmgw.errors import Conflict, HttpError
from llmgw.protocol import Inventory
from llmgw.views import (
    NODE_ACTIONS,
    NodeRemovalView,
    NodeResourcesView,
    NodeView,
    ProvisionView,
    RevocationView,
)

log = logging.getLogger(__name__)

GB = 1e9


def node_view(node: NodeRow, replicas: list[ReplicaRow], models: dict[str, Model]) -> NodeView:
    """A node: its engines (installed ones), provisioning of each, and resources reserved/free.
    ``replicas``: the cluster's, or any subset holding those on this node (:func:`by_node`)."""
    mine = [x for x in replicas if x.node == node.id or any(m.node == node.id for m in x.members)]
    held = [r for r in reservations(mine, models) if r.node == node.id]  # a group's member share here only
    return NodeView(
        id=node.id,
        state=node.state,
        cordoned=node.cordoned,
        labels=node.labels,
        engines=sorted(e.engine for e in node.engines if e.state == "installed"),
        provision=[
            ProvisionView(engine=e.engine, version=e.version, state=e.state.value, detail=e.detail)
            for e in node.engines
        ],
        resources=_resources(node.inventory, held),
        gpus=node.inventory.gpus,
        last_seen=node.last_seen,
    )


def _resources(inv: Inventory, held: list[Reservation]) -> NodeResourcesView:
    """A node's cores and memory, and what the replicas placed on it reserve of them (``held``; a
    GPU profile's memory is on its cards, not the node's)."""
    return NodeResourcesView(
        cores=inv.cores,
        cores_reserved=sum(r.cpu_cores for r in held),
        memory_total_bytes=inv.memory_total_bytes,
        memory_reserved_bytes=int(sum(r.memory_gb for r in held if not r.gpu_class) * GB),
        memory_available_bytes=inv.memory_available_bytes,
    )


def by_node(replicas: list[ReplicaRow]) -> dict[str, list[ReplicaRow]]:
    """Node id -> the replicas on it, a group replica under each of its members' nodes (once each):
    one pass, so that listing N nodes is not N passes over every replica (5,000 nodes and 400
    replicas: ~3 s per ``GET /api/v1/nodes``, measured with bench/scale.py)."""
    out: dict[str, list[ReplicaRow]] = {}
    for x in replicas:
        for node in dict.fromkeys([x.node, *(m.node for m in x.members)]):
            out.setdefault(node, []).append(x)
    return out


def _models(store: Store) -> dict[str, Model]:
    """Every model as placement sees it (its memory estimated from the GGUF facts where the profile
    gives none), for the reservations a node view shows."""
    facts = parse_facts(store.list_gguf_facts())
    return {m.name: effective_model(m.model, facts) for m in store.list_models()}


def _list_nodes(store: Store) -> list[Any]:
    replicas = by_node(store.list_replicas())
    models = _models(store)
    return [node_view(n, replicas.get(n.id, []), models).model_dump(mode="json") for n in store.list_nodes()]


async def list_nodes(request: web.Request) -> web.Response:
    """``GET /api/v1/nodes``: every node with its engines and resources."""
    ctx = request.app[ADMIN]
    return _json(await ctx.db.read(_list_nodes, ctx.store))


async def must_node(ctx: AdminContext, node_id: str) -> NodeRow:
    """The node ``node_id``; else 404 ``node_not_found`` (:func:`~llmgw.control.api.context.must_exist`)."""
    return await must_exist(ctx.db, ctx.store.get_node, node_id, what="node",
                            listing="'llmgw ctl nodes' (GET /api/v1/nodes)")


async def _set_cordoned(ctx: AdminContext, node_id: str, cordoned: bool, *, tries: int = 5) -> NodeRow:
    """The node ``node_id`` after its ``cordoned`` flag is set; 404 when there is no such node.

    Every pulse of the node's agent moves its revision (:func:`~llmgw.control.store.sqlbeats.touch_node`:
    so that a leader's "lost" mark read before it fails), about once a second, so an admin's
    read-then-write raced it: a cordon from the dashboard failed with "changed since revision 8 was
    read" (CI, under load). The flag does not depend on what was read, so a write that raced is read
    and written again, ``tries`` times at most (then the :class:`~llmgw.errors.Conflict`, a 409)."""
    for _ in range(tries - 1):
        try:
            return await ctx.db.run(ctx.store.update_node, await must_node(ctx, node_id), cordoned=cordoned)
        except Conflict:
            continue  # a beat landed between the read and the write
    return await ctx.db.run(ctx.store.update_node, await must_node(ctx, node_id), cordoned=cordoned)


async def node_action(request: web.Request) -> web.Response:
    """``POST /api/v1/nodes/{id}/cordon|uncordon|drain``: the node's view after it."""
    ctx = request.app[ADMIN]
    store, db = ctx.store, ctx.db
    action = request.match_info["action"]
    node = await _set_cordoned(ctx, request.match_info["id"], action != "uncordon")
    if action == "drain":
        gone = await db.run(store.list_replicas, node=node.id)
        for r in gone:  # whatever its agent last reported (a beat moves its revision): it goes
            await db.run(store.delete_replica, r.id)
        # The leader's next pass reads the node and these models again (on any control plane).
        await db.run(lambda: store.note_changes(nodes=[node.id], models={r.model for r in gone}, now=ctx.clock()))
    ctx.changed()
    replicas = await db.read(store.list_replicas)
    models = await db.read(_models, store)  # estimated as GET /api/v1/nodes has them (it said 0 reserved)
    return _json(node_view(node, replicas, models).model_dump(mode="json"))


async def remove_node(request: web.Request) -> web.Response:
    """``DELETE /api/v1/nodes/{id}[?force=true]``: what was drained and which serials were revoked."""
    ctx = request.app[ADMIN]
    store, db = ctx.store, ctx.db
    node = await must_node(ctx, request.match_info["id"])
    force = request.query.get("force", "").lower() in ("1", "true", "yes")
    placed = await db.read(store.list_replicas, node=node.id)
    if placed and not force:
        ids = ", ".join(r.id for r in placed[:5]) + (", …" if len(placed) > 5 else "")
        raise HttpError(
            409, "node_busy",
            f"node '{node.id}' has {len(placed)} replica(s) placed on it ({ids}); drain it first "
            f"('llmgw ctl node drain {node.id}': they stop and are placed on other nodes where they fit) "
            "or remove it with --force, "
            "which drains it and then removes it",
        )
    # One transaction: the node, its replicas (drained: the leader places them elsewhere at its
    # next pass) and its serials go, and those serials are revoked.
    revoked = await db.run(store.remove_node, node.id, now=ctx.clock())
    ctx.changed()
    log.info("node %s removed (replicas drained: %d, certificates revoked: %s)", node.id, len(placed),
             ", ".join(revoked) or "none seen")
    view = NodeRemovalView(node=node.id, drained=[r.id for r in placed], revoked=revoked)
    return _json(view.model_dump(mode="json"))


async def revocation(request: web.Request) -> web.Response:
    """``GET /api/v1/revocations/{serial}[?node=N&issued_at=T]`` (hex, leading zeros ignored): when
    and for which node; with ``node`` and ``issued_at`` (unix seconds), as the agent API judges that
    node's certificate (revoked, or issued before the node's removal)."""
    ctx = request.app[ADMIN]
    serial = request.match_info["serial"].upper().lstrip("0") or "0"
    node, issued = request.query.get("node", ""), request.query.get("issued_at", "")
    try:
        issued_at = float(issued) if issued else None
    except ValueError:
        raise HttpError(400, "invalid_request", f"issued_at={issued[:40]!r} is not unix seconds") from None
    if node and issued_at is not None:  # as the agent API judges that node's certificate
        gone = await ctx.db.read(ctx.store.refused_cert, node, serial, issued_at)
    else:
        gone = await ctx.db.read(ctx.store.revoked, serial)
    if gone is None:
        raise HttpError(404, "not_revoked", f"certificate serial {serial} is not revoked")
    view = RevocationView(serial=serial, node=gone[0], revoked_at=gone[1])
    return _json(view.model_dump(mode="json"))


#: The nodes' routes.
ROUTES = [
    web.get("/api/v1/nodes", list_nodes),
    web.post("/api/v1/nodes/{id}/{action:" + "|".join(NODE_ACTIONS) + "}", node_action),
    web.delete("/api/v1/nodes/{id}", remove_node),
    web.get("/api/v1/revocations/{serial}", revocation),
]
