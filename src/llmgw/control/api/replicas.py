"""The admin API's replicas: ``/api/v1/replicas``, a restart, an engine's log, and placement's
explanation of a model (``/api/v1/explain-placement``).

Routes (:data:`ROUTES`; :mod:`llmgw.control.api.admin` says how they are authorised and answered):
``GET /api/v1/replicas?model=``, ``POST /api/v1/replicas/{id}/restart``,
``GET /api/v1/replicas/{id}/logs[?lines=N|offset=B]``, ``GET /api/v1/explain-placement?model=``.

``GET /api/v1/replicas`` also lists each wanted-but-unplaced replica as state ``pending`` with no
node and placement's one-line summary in ``pending_reason``; at most ``max_replicas_per_model``
of them per model (server.yaml), so the answer's size follows what exists and the configured
limit, never a number in a request.

``GET /api/v1/replicas/{id}/logs`` reads the engine's log through the node's agent
(:mod:`llmgw.control.api.logbroker`; on any control plane of an HA cluster, through the shared
store): 504 ``node_silent`` when the agent does not answer within 10 s, 404 ``no_log`` when the node
has none, 503 ``store_unavailable`` when the database does not take the request.

Each listed replica carries ``routing`` (:class:`~llmgw.views.ReplicaRouting`): slots, in flight,
queued and picks by reason as THIS control plane's gateway sees them (``scope``:
``"this_control_plane"``; each control plane routes on its own). A replica its gateway has not sent
to yet: zeros and ``slots`` null; a pending replica, or an admin API without a gateway: null.

Handlers read the shared state from ``request.app[ADMIN]``
(:class:`~llmgw.control.api.context.AdminContext`).
"""

from __future__ import annotations

import secrets
from dataclasses import replace

from aiohttp import web

from llmgw.control.api.context import ADMIN, AdminContext, must_exist
from llmgw.control.api.context import json_response as _json
from llmgw.control.api.models import must_model
from llmgw.control.gateway.balancer import AFFINITY, ReplicaLoad
from llmgw.control.reconcile.autoscale import wanted_replicas
from llmgw.control.reconcile.specs import new_replica_id
from llmgw.control.store import ModelRow, ReplicaRow, Store
from llmgw.errors import Conflict, HttpError, UnreachableError
from llmgw.protocol import ReplicaState
from llmgw.views import ExplainView, FailedReplica, ReplicaRouting, ReplicaView


def pending_views(
    models: list[ModelRow], replicas: list[ReplicaRow], store: Store, *, limit: int = 1000
) -> list[ReplicaView]:
    """One ``pending`` view per replica a model wants (``scaling.min``, or an autoscaled model's
    decided count) that is placed nowhere (draining replicas not counted),
    carrying placement's summary as ``pending_reason``; at most ``limit`` per model
    (``max_replicas_per_model``), whatever a stored ``scaling.min`` says."""
    out = []
    count: dict[str, int] = {}
    for r in replicas:
        if r.draining_since is None:
            count[r.model] = count.get(r.model, 0) + 1
    explanations = store.list_explanations()
    last = store.last_decisions()
    for row in models:
        missing = min(wanted_replicas(row.model, last), limit) - count.get(row.name, 0)
        ex = explanations.get(row.name)
        reason = ex.summary if ex is not None else "not evaluated yet"
        for i in range(max(missing, 0)):
            out.append(ReplicaView(id=f"{row.name}#pending-{i + 1}", model=row.name, state="pending",
                                   pending_reason=reason))
    return out


def routing_view(load: ReplicaLoad | None) -> ReplicaRouting:
    """What the gateway's balancer knows of one replica as the API shows it; None (never sent to):
    zeros, ``slots`` None. ``slots`` is None too while the engine's count is not read yet (the
    balancer's placeholder 1 is not a measurement)."""
    if load is None:
        return ReplicaRouting()
    return ReplicaRouting(
        slots=load.slots if load.slots_known else None,
        in_flight=load.in_flight,
        queued=load.queued,
        affinity_hits=load.picks.get(AFFINITY, 0),
        picks=dict(load.picks),
        service_s=round(load.service_s, 4),
        tokens_per_s=round(load.tokens_per_s, 2),
    )


def replica_view(r: ReplicaRow, load: ReplicaLoad | None = None, *, routed: bool = False) -> ReplicaView:
    """A replica without its key; with ``routed``, its ``routing`` from ``load`` (the gateway's
    :class:`~llmgw.control.gateway.balancer.ReplicaLoad` of it, None when never sent to)."""
    view = ReplicaView.model_validate(r, from_attributes=True)  # its fields by name: the view has no key
    # The head's own entry carries no state (its state is the replica's): show it there too.
    view.members = [m.model_copy(update={"state": r.state}) if m.rank == 0 else m for m in r.members]
    view.routing = routing_view(load) if routed else None
    return view


async def list_replicas(request: web.Request) -> web.Response:
    """``GET /api/v1/replicas[?model=]``: placed replicas, then the pending ones."""
    ctx = request.app[ADMIN]
    store, db = ctx.store, ctx.db
    asked = request.query.get("model") or None
    model = (await must_model(ctx, asked)).name if asked else None
    rows = await db.read(store.list_replicas, model=model)
    loads = ctx.loads() if ctx.loads is not None else None
    views = [replica_view(r, loads.get(r.id) if loads else None, routed=loads is not None) for r in rows]
    models = [m for m in await db.read(store.list_models) if model is None or m.name == model]
    views += await db.run(pending_views, models, rows, store, limit=ctx.max_replicas_per_model)
    return _json([v.model_dump(mode="json") for v in views])


async def must_replica(ctx: AdminContext, rid: str, *, command: str = "logs") -> ReplicaRow:
    """The replica ``rid``; else 404 ``replica_not_found`` naming the command that lists them
    (:func:`~llmgw.control.api.context.must_exist`), or, when ``rid`` is a model's name, its
    replicas (``ctl logs MODEL`` said only "no replica 'MODEL'": an operator's finding; ``command``
    is the ``ctl`` command the hint names)."""
    found = await ctx.db.read(ctx.store.get_replica, rid)
    if found is not None:
        return found
    model = await ctx.db.read(ctx.store.get_model, rid)
    if model is not None:
        ids = [r.id for r in await ctx.db.read(lambda: ctx.store.list_replicas(model=model.name))]
        mine = (f"its replicas: {', '.join(ids[:10])}{', …' if len(ids) > 10 else ''} ('llmgw ctl {command} {ids[0]}')"
                if ids else "it has no replica now")
        raise HttpError(404, "replica_not_found", f"'{rid}' is a model, not a replica; {mine}")
    return await must_exist(ctx.db, ctx.store.get_replica, rid, what="replica",
                            listing="'llmgw ctl replicas' (GET /api/v1/replicas)")


async def replica_logs(request: web.Request) -> web.Response:
    """``GET /api/v1/replicas/{id}/logs[?lines=N|offset=B]``: the engine's log, through its agent."""
    ctx = request.app[ADMIN]
    logs = ctx.logs
    rid = request.match_info["id"]
    rep = await must_replica(ctx, rid)
    if not rep.node or logs is None:
        raise HttpError(409, "not_placed", f"replica '{rid}' runs on no node, so it has no engine log")
    try:
        lines = int(request.query.get("lines", "100"))
        offset = int(request.query["offset"]) if "offset" in request.query else None
    except ValueError as e:
        raise HttpError(400, "invalid_query", "lines and offset must be whole numbers") from e
    try:
        got = await logs.read(rep.node, rid, lines=lines, offset=offset)
    except UnreachableError as e:
        raise HttpError(504, "node_silent", str(e)) from e
    if not got.found:
        err = (rep.err or rep.last_error).strip().splitlines()
        if rep.state == ReplicaState.FAILED and err:  # it failed before any engine ran (its weights, say)
            raise HttpError(404, "no_log", f"replica '{rid}' on {rep.node} failed before its engine started, so "
                            f"there is no engine log: {err[0][:FAILED_ERR_CHARS]}")
        raise HttpError(404, "no_log", f"node {rep.node} has no engine log for replica '{rid}' (yet)")
    return _json({"replica": rid, "node": rep.node, "text": got.text, "offset": got.offset})


async def restart_replica(request: web.Request) -> web.Response:
    """``POST /api/v1/replicas/{id}/restart``: 202 with the replacement's view."""
    ctx = request.app[ADMIN]
    store, db = ctx.store, ctx.db
    rid = request.match_info["id"]
    old = await must_replica(ctx, rid, command="restart")
    now = ctx.clock()
    # A restart is a replacement: the agent stops the id that is no longer desired and starts
    # the new one (new key too), on the same node and profile, so nothing else moves. It is
    # not a crash: ``restarts`` (what the crash backoff counts) is carried over unchanged.
    new = replace(
        old,
        id=new_replica_id(old.model),
        key=secrets.token_urlsafe(24),
        state=ReplicaState.PENDING.value,
        err="",
        endpoint="",
        revision=1,
        created_at=now,
        updated_at=now,
        ready_at=None,
        restarts=old.restarts,
    )
    if not await db.run(store.delete_replica, old.id, revision=old.revision):
        raise Conflict(f"replica '{rid}' changed while restarting; try again")
    await db.run(store.add_replica, new)
    await db.run(lambda: store.note_changes(nodes=[new.node], models=[new.model], now=now))  # the leader's next pass
    ctx.changed()
    return _json(replica_view(new).model_dump(mode="json"), status=202)


async def explain(request: web.Request) -> web.Response:
    """``GET /api/v1/explain-placement?model=NAME``: the leader's last explanation for the model."""
    ctx = request.app[ADMIN]
    name = request.query.get("model", "")
    if not name:
        raise HttpError(400, "missing_model", "explain-placement needs ?model=NAME")
    row = await must_model(ctx, name)
    # The explanation is the leader's, from its last pass; whether a placed replica's engine failed
    # since is the store's now (the node reports it), so it is read here: both in one off-loop call.
    stored, replicas = await ctx.db.read(
        lambda: (ctx.store.get_explanation(row.name), ctx.store.list_replicas(model=row.name))
    )
    view = stored or ExplainView(
        model=row.name,
        placed=False,
        wanted=row.model.scaling.min,
        summary="not evaluated yet: the leader looks at new models within a few seconds",
    )
    view.failed = [failed_replica(r) for r in replicas if r.state == ReplicaState.FAILED]
    return _json(view.model_dump(mode="json"))


#: Characters of a failed engine's error an explanation quotes (its first line; the log has the rest).
FAILED_ERR_CHARS = 200


def failed_replica(row: ReplicaRow) -> FailedReplica:
    """The view of a replica whose engine failed, its error cut to the first line."""
    err = (row.err or row.last_error).strip().splitlines()
    return FailedReplica(replica=row.id, node=row.node, error=err[0][:FAILED_ERR_CHARS] if err else "no error reported")


#: The replicas' routes.
ROUTES = [
    web.get("/api/v1/replicas", list_replicas),
    web.post("/api/v1/replicas/{id}/restart", restart_replica),
    web.get("/api/v1/replicas/{id}/logs", replica_logs),
    web.get("/api/v1/explain-placement", explain),
]
