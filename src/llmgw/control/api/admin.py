"""The admin API (``admin_listen``, ``127.0.0.1:9090`` by default): the catalog, nodes, replicas and
placement's explanations, as JSON.

Every ``/api/v1`` route needs ``Authorization: Bearer <admin token>`` (the token file beside
server.yaml, mode 0600) except ``GET /api/v1/health``. Errors are ``{"error": {"code", "message"}}``
with the matching status: 400 (a body that is not valid, the field named), 401 (no or wrong token),
404 (no such model/replica/route), 409 (a name or alias taken, or a write that lost a race), 500.

Routes (the OpenAPI document at ``/api/v1/openapi.json`` lists them with their shapes):
``GET/POST /api/v1/models``, ``GET/PATCH/DELETE /api/v1/models/{name}``,
``PUT /api/v1/models/{name}/profiles``, ``GET /api/v1/nodes``, ``GET /api/v1/replicas?model=``,
``POST /api/v1/replicas/{id}/restart``, ``GET /api/v1/explain-placement?model=``,
``GET /api/v1/models/{name}/resources`` (estimate, profiles, where one could run),
``POST /api/v1/nodes/{id}/cordon|uncordon|drain``, ``DELETE /api/v1/nodes/{id}[?force=true]``,
``GET /api/v1/revocations/{serial}`` (whether an agent certificate was revoked; 404 when not).

``GET /api/v1/replicas`` also lists each wanted-but-unplaced replica as state ``pending`` with no
node and placement's one-line summary in ``pending_reason``; at most ``max_replicas_per_model``
of them per model (server.yaml), so the answer's size follows what exists and the configured
limit, never a number in a request.

Bodies are read by :func:`llmgw.jsonbody.read_json` (at most 1 MiB and 64 levels deep, finite
numbers; else 400/413 in the error shape). ``scaling.min``/``max`` above ``max_replicas_per_model``
are refused with a 400. A stored model that cannot be read back is listed with ``broken`` set
(the reason); GET shows it, PATCH/PUT answer 409 ``model_broken``, DELETE removes it.

A drain cordons the node and deletes its replicas at once; the leader places them elsewhere at its
next pass (no overlap: drain stops before the new ones are ready).

``DELETE /api/v1/nodes/{id}`` removes a node and revokes the certificate serials its agent
presented (:meth:`~llmgw.control.store.sql.Store.remove_node`); 409 ``node_busy`` while replicas are
placed there, unless ``?force=true``, which drains it first (as above) in the same request.

``GET /api/v1/replicas/{id}/logs[?lines=N|offset=B]`` reads the engine's log through the node's
agent (:mod:`llmgw.control.api.logbroker`; on any control plane of an HA cluster, through the
shared store): 504 ``node_silent`` when the agent does not answer within 10 s, 404 ``no_log`` when
the node has none, 503 ``store_unavailable`` when the database does not take the request.

Writes call ``on_change`` so the leader runs a pass at once instead of at its next tick.

Every store call and every view built over all nodes or replicas runs off the event loop
(``await db.run(...)``, :mod:`llmgw.control.store.offloop`): the loop also serves heartbeats and the
gateway, which waited seconds behind admin writes when store calls ran on it.

Seam: the module is the routes (:func:`build_admin_app`) plus the pure builders that turn store
rows into views (:func:`model_view`, :func:`node_view`, :func:`replica_view`, :func:`pending_views`);
when it grows past its ~500 lines those builders are what moves out, to a module of their own.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from aiohttp import web
from pydantic import BaseModel, TypeAdapter, ValidationError

from llmgw import jsonbody
from llmgw.catalog import Model, Profile
from llmgw.control.api.logbroker import LogBroker
from llmgw.control.api.openapi import build_openapi
from llmgw.control.placement.inputs import effective_model, parse_facts, reservations
from llmgw.control.placement.resources import resources_view
from llmgw.control.reconcile.leader import new_replica_id
from llmgw.control.store import BrokenModel, ModelRow, NodeRow, ReplicaRow, Store
from llmgw.control.store.offloop import OffLoop
from llmgw.errors import Conflict, HttpError, StoreUnavailable, UnreachableError
from llmgw.httperrors import error_json, error_middleware
from llmgw.protocol import ReplicaState
from llmgw.views import (
    ExplainView,
    ModelView,
    NodeRemovalView,
    NodeResourcesView,
    NodeView,
    ProvisionView,
    ReplicaView,
    RevocationView,
)

log = logging.getLogger(__name__)

GB = 1e9
_PROFILES = TypeAdapter(list[Profile])
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(text=json.dumps(data), status=status)


def describe(err: ValidationError) -> str:
    """The first problem of a validation error, the field named: ``profiles.0.name: Field required``."""
    parts = []
    for e in err.errors()[:3]:
        where = ".".join(str(p) for p in e["loc"]) or "(body)"
        msg = "unknown field; remove it or check its spelling" if e["type"] == "extra_forbidden" else e["msg"]
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


# --- views ---


def model_view(row: ModelRow, replicas: list[ReplicaRow]) -> ModelView:
    """A catalog entry with its replicas counted."""
    m = row.model
    mine = [r for r in replicas if r.model == m.name]
    return ModelView(
        name=m.name,
        aliases=m.aliases,
        role=m.role.value,
        source=m.source,
        version=m.version,
        scaling_min=m.scaling.min,
        scaling_max=m.scaling.max,
        replicas=len(mine),
        replicas_ready=sum(r.state == ReplicaState.READY for r in mine),
        spec=m.model_dump(mode="json"),
    )


def node_view(node: NodeRow, replicas: list[ReplicaRow], models: dict[str, Model]) -> NodeView:
    """A node: its engines (installed ones), provisioning of each, and resources reserved/free."""
    mine = [x for x in replicas if x.node == node.id or any(m.node == node.id for m in x.members)]
    held = [r for r in reservations(mine, models) if r.node == node.id]  # a group's member share here only
    mem_reserved = int(sum(r.memory_gb for r in held if not r.gpu_class) * GB)
    cores_reserved = sum(r.cpu_cores for r in held)
    inv = node.inventory
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
        resources=NodeResourcesView(
            cores=inv.cores,
            cores_reserved=cores_reserved,
            memory_total_bytes=inv.memory_total_bytes,
            memory_reserved_bytes=mem_reserved,
            memory_available_bytes=inv.memory_available_bytes,
        ),
        gpus=inv.gpus,
        last_seen=node.last_seen,
    )


def broken_view(b: BrokenModel) -> ModelView:
    """A stored model row that cannot be read: its name and why, nothing else."""
    return ModelView(name=b.name, broken=b.reason)


def pending_views(
    models: list[ModelRow], replicas: list[ReplicaRow], store: Store, *, limit: int = 1000
) -> list[ReplicaView]:
    """One ``pending`` view per replica a model wants (``scaling.min``) that is placed nowhere,
    carrying placement's summary as ``pending_reason``; at most ``limit`` per model
    (``max_replicas_per_model``), whatever a stored ``scaling.min`` says."""
    out = []
    count: dict[str, int] = {}
    for r in replicas:
        count[r.model] = count.get(r.model, 0) + 1
    explanations = store.list_explanations()
    for row in models:
        missing = min(row.model.scaling.min, limit) - count.get(row.name, 0)
        ex = explanations.get(row.name)
        reason = ex.summary if ex is not None else "not evaluated yet"
        for i in range(max(missing, 0)):
            out.append(ReplicaView(id=f"{row.name}#pending-{i + 1}", model=row.name, state="pending",
                                   pending_reason=reason))
    return out


def replica_view(r: ReplicaRow) -> ReplicaView:
    """A replica without its key."""
    return ReplicaView(
        id=r.id,
        model=r.model,
        node=r.node,
        profile=r.profile,
        state=r.state,
        err=r.err,
        endpoint=r.endpoint,
        created_at=r.created_at,
        ready_at=r.ready_at,
        restarts=r.restarts,
        last_error=r.last_error,
        gpu_indexes=list(r.gpu_indexes),
        # The head's own entry carries no state (its state is the replica's): show it there too.
        members=[m.model_copy(update={"state": r.state}) if m.rank == 0 else m for m in r.members],
    )


def _merge(base: Any, patch: Any) -> Any:
    """RFC 7396 JSON merge patch: objects merge, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(base) if isinstance(base, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


def build_admin_app(
    store: Store,
    *,
    token: str,
    on_change: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.time,
    logs: LogBroker | None = None,
    max_replicas_per_model: int = 1000,
    db: OffLoop | None = None,
    settle: Callable[[], Awaitable[None]] | None = None,
    health_fields: Callable[[], dict[str, Any]] | None = None,
) -> web.Application:
    """The admin API app.

    Args:
        store: the state store.
        token: the admin bearer token (compared in constant time).
        on_change: called after every successful write (wakes the leader, refreshes routes).
        logs: reads engine logs through the agents (``GET /api/v1/replicas/{id}/logs``).
        clock: unix seconds.
        max_replicas_per_model: server.yaml's limit on ``scaling.min``/``max`` (a larger one is a 400).
        db: runs the store calls off the event loop; default: a pool of this app's own, closed
            with it.
        settle: awaited after every successful write before it is answered (the control plane
            waits there for its routing table, so the gateway knows a model once it is added).
        health_fields: more fields for ``GET /api/v1/health``, read from memory (the control plane
            adds ``leader``, ``term`` and ``database``: ``"ok"`` or ``"unreachable"``).

    A store call that fails because the database is down or does not answer within the pool's
    deadline (:data:`~llmgw.control.store.offloop.STORE_DEADLINE_S`) is answered 503
    ``store_unavailable``, naming the database and what to check.
    """
    if not token:
        raise ValueError("the admin token is empty")
    own_pool = db is None
    pool = db = db or OffLoop()

    async def _close(_: web.Application) -> None:
        pool.close()
    changed = on_change or (lambda: None)

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        # /metrics checks its own (control/api/metrics.py); the dashboard (/ui) its session (control/ui).
        if request.path in ("/api/v1/health", "/metrics", "/ui") or request.path.startswith("/ui/"):
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            why = "missing" if not header else "wrong"
            return error_json(
                401,
                "unauthorized",
                f"the admin token is {why}; send 'Authorization: Bearer <token>' with the token from "
                "the admin-token file beside server.yaml",
            )
        return await handler(request)

    errors = error_middleware(
        service="the control plane",
        known={StoreUnavailable: (503, "store_unavailable"), Conflict: (409, "conflict")},
    )

    def broken(name: str) -> BrokenModel | None:
        return next((b for b in store.list_broken_models() if b.name == name), None)

    async def must_model(name: str) -> ModelRow:
        """The model named ``name`` or carrying it as an alias; else 409 when its row is broken,
        404 naming the known ones otherwise."""
        return await db.read(_must_model, name)

    def _must_model(name: str) -> ModelRow:
        row = store.get_model(name)
        if row is not None:
            return row
        rows = store.list_models()
        for r in rows:
            if name in r.model.aliases:
                return r
        bad = broken(name)
        if bad is not None:
            raise HttpError(
                409, "model_broken",
                f"model '{name}' is stored but cannot be read ({bad.reason}); delete it with "
                f"'llmgw ctl model rm {name}' and add it again",
            )
        known = ", ".join(r.name for r in rows) or "none yet"
        raise HttpError(
            404, "model_not_found",
            f"no model '{name}' in the catalog (known: {known}); 'llmgw ctl models' lists them",
        )

    async def health(_: web.Request) -> web.Response:
        return _json({"status": "ok", "pid": os.getpid(), **(health_fields() if health_fields else {})})

    async def openapi(_: web.Request) -> web.Response:
        return _json(build_openapi())

    def _list_models() -> list[Any]:
        replicas = store.list_replicas()
        views = [model_view(r, replicas) for r in store.list_models()]
        views += [broken_view(b) for b in store.list_broken_models()]
        views.sort(key=lambda v: v.name)
        return [v.model_dump(mode="json") for v in views]

    async def list_models(_: web.Request) -> web.Response:
        return _json(await db.read(_list_models))

    def within_limit(model: Model) -> Model:
        top = max(model.scaling.min, model.scaling.max)
        if top > max_replicas_per_model:
            raise HttpError(
                400, "invalid_model",
                f"scaling: {top} replicas is more than this cluster's limit of {max_replicas_per_model} "
                "per model (max_replicas_per_model in server.yaml)",
            )
        return model

    async def add_model(request: web.Request) -> web.Response:
        try:
            model = within_limit(Model.model_validate(await jsonbody.read_json(request)))
        except ValidationError as e:
            raise HttpError(400, "invalid_model", describe(e)) from e
        row = await db.run(store.add_model, model, now=clock())
        changed()
        return _json(model_view(row, []).model_dump(mode="json"), status=201)

    async def get_model(request: web.Request) -> web.Response:
        bad = await db.read(broken, request.match_info["name"])
        if bad is not None:
            return _json(broken_view(bad).model_dump(mode="json"))
        row = await must_model(request.match_info["name"])
        return _json(model_view(row, await db.read(store.list_replicas, model=row.name)).model_dump(mode="json"))

    async def save(row: ModelRow, spec: Any) -> web.Response:
        try:
            model = within_limit(Model.model_validate(spec))
        except ValidationError as e:
            raise HttpError(400, "invalid_model", describe(e)) from e
        if model.name != row.name:
            raise HttpError(
                400,
                "invalid_model",
                f"name: a model cannot be renamed ('{row.name}' -> '{model.name}'); "
                "add it under the new name and delete the old one",
            )
        new = await db.run(store.update_model, model, revision=row.revision, now=clock())
        changed()
        return _json(model_view(new, await db.run(store.list_replicas, model=new.name)).model_dump(mode="json"))

    async def patch_model(request: web.Request) -> web.Response:
        row = await must_model(request.match_info["name"])
        patch = await jsonbody.read_json(request)
        if not isinstance(patch, dict):
            raise HttpError(
                400, "invalid_patch", "the body must be a JSON object (a JSON merge patch of the model)"
            )
        return await save(row, _merge(row.model.model_dump(mode="json"), patch))

    async def put_profiles(request: web.Request) -> web.Response:
        row = await must_model(request.match_info["name"])
        body = await jsonbody.read_json(request)
        if isinstance(body, dict) and "profiles" in body:
            body = body["profiles"]
        try:
            profiles = _PROFILES.validate_python(body)
        except ValidationError as e:
            raise HttpError(400, "invalid_profiles", "profiles." + describe(e)) from e
        spec = row.model.model_dump(mode="json")
        spec["profiles"] = [p.model_dump(mode="json") for p in profiles]
        return await save(row, spec)

    async def delete_model(request: web.Request) -> web.Response:
        asked = request.match_info["name"]
        name = asked if await db.read(broken, asked) is not None else (await must_model(asked)).name
        if not await db.run(store.delete_model, name):
            raise HttpError(404, "model_not_found", f"no model '{name}' in the catalog")
        changed()
        return web.Response(status=204)

    def _list_nodes() -> list[Any]:
        replicas = store.list_replicas()
        facts = parse_facts(store.list_gguf_facts())
        models = {m.name: effective_model(m.model, facts) for m in store.list_models()}
        return [node_view(n, replicas, models).model_dump(mode="json") for n in store.list_nodes()]

    async def list_nodes(_: web.Request) -> web.Response:
        return _json(await db.read(_list_nodes))

    async def list_replicas(request: web.Request) -> web.Response:
        asked = request.query.get("model") or None
        model = (await must_model(asked)).name if asked else None
        rows = await db.read(store.list_replicas, model=model)
        views = [replica_view(r) for r in rows]
        models = [m for m in await db.read(store.list_models) if model is None or m.name == model]
        views += await db.run(pending_views, models, rows, store, limit=max_replicas_per_model)
        return _json([v.model_dump(mode="json") for v in views])

    async def must_node(node_id: str) -> NodeRow:
        node = await db.read(store.get_node, node_id)
        if node is None:
            raise HttpError(404, "node_not_found", f"no node '{node_id}'; list them with GET /api/v1/nodes")
        return node

    async def node_action(request: web.Request) -> web.Response:
        action = request.match_info["action"]
        node = await must_node(request.match_info["id"])
        node = await db.run(store.update_node, node, cordoned=action != "uncordon")
        if action == "drain":
            for r in await db.run(store.list_replicas, node=node.id):
                await db.run(store.delete_replica, r.id, revision=r.revision)
        changed()
        replicas = await db.read(store.list_replicas)
        models = {m.name: m.model for m in await db.read(store.list_models)}
        return _json(node_view(node, replicas, models).model_dump(mode="json"))

    async def remove_node(request: web.Request) -> web.Response:
        node = await must_node(request.match_info["id"])
        force = request.query.get("force", "").lower() in ("1", "true", "yes")
        placed = await db.read(store.list_replicas, node=node.id)
        if placed and not force:
            ids = ", ".join(r.id for r in placed[:5]) + (", …" if len(placed) > 5 else "")
            raise HttpError(
                409, "node_busy",
                f"node '{node.id}' has {len(placed)} replica(s) placed on it ({ids}); drain it first "
                f"('llmgw ctl node drain {node.id}': they move elsewhere) or remove it with --force, "
                "which drains it and then removes it",
            )
        # One transaction: the node, its replicas (drained: the leader places them elsewhere at its
        # next pass) and its serials go, and those serials are revoked.
        revoked = await db.run(store.remove_node, node.id, now=clock())
        changed()
        log.info("node %s removed (replicas drained: %d, certificates revoked: %s)", node.id, len(placed),
                 ", ".join(revoked) or "none seen")
        view = NodeRemovalView(node=node.id, drained=[r.id for r in placed], revoked=revoked)
        return _json(view.model_dump(mode="json"))

    async def revocation(request: web.Request) -> web.Response:
        serial = request.match_info["serial"].upper().lstrip("0") or "0"
        gone = await db.read(store.revoked, serial)
        if gone is None:
            raise HttpError(404, "not_revoked", f"certificate serial {serial} is not revoked")
        view = RevocationView(serial=serial, node=gone[0], revoked_at=gone[1])
        return _json(view.model_dump(mode="json"))

    async def model_resources(request: web.Request) -> web.Response:
        row = await must_model(request.match_info["name"])

        def build() -> BaseModel:
            return resources_view(
                row.model,
                nodes=store.list_nodes(),
                replicas=store.list_replicas(),
                models={m.name: m.model for m in store.list_models()},
                stored_facts=store.list_gguf_facts(),
            )

        return _json((await db.run(build)).model_dump(mode="json"))

    async def replica_logs(request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        rep = await db.read(store.get_replica, rid)
        if rep is None:
            raise HttpError(404, "replica_not_found", f"no replica '{rid}'; 'llmgw ctl replicas' lists them")
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
            raise HttpError(404, "no_log", f"node {rep.node} has no engine log for replica '{rid}' (yet)")
        return _json({"replica": rid, "node": rep.node, "text": got.text, "offset": got.offset})

    async def restart_replica(request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        old = await db.read(store.get_replica, rid)
        if old is None:
            raise HttpError(
                404, "replica_not_found", f"no replica '{rid}'; list them with GET /api/v1/replicas"
            )
        now = clock()
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
        changed()
        return _json(replica_view(new).model_dump(mode="json"), status=202)

    async def explain(request: web.Request) -> web.Response:
        name = request.query.get("model", "")
        if not name:
            raise HttpError(400, "missing_model", "explain-placement needs ?model=NAME")
        row = await must_model(name)
        view = await db.read(store.get_explanation, row.name) or ExplainView(
            model=row.name,
            placed=False,
            wanted=row.model.scaling.min,
            summary="not evaluated yet: the leader looks at new models within a few seconds",
        )
        return _json(view.model_dump(mode="json"))

    @web.middleware
    async def settled(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        if settle is not None and request.method not in ("GET", "HEAD") and response.status < 400:
            await settle()
        return response

    app = web.Application(middlewares=[errors, auth, settled], client_max_size=jsonbody.MAX_BYTES)
    if own_pool:
        app.on_cleanup.append(_close)
    r = app.router
    r.add_get("/api/v1/health", health)
    r.add_get("/api/v1/openapi.json", openapi)
    r.add_get("/api/v1/models", list_models)
    r.add_post("/api/v1/models", add_model)
    r.add_get("/api/v1/models/{name}", get_model)
    r.add_patch("/api/v1/models/{name}", patch_model)
    r.add_delete("/api/v1/models/{name}", delete_model)
    r.add_put("/api/v1/models/{name}/profiles", put_profiles)
    r.add_get("/api/v1/nodes", list_nodes)
    r.add_get("/api/v1/replicas", list_replicas)
    r.add_post("/api/v1/replicas/{id}/restart", restart_replica)
    r.add_get("/api/v1/revocations/{serial}", revocation)
    r.add_get("/api/v1/replicas/{id}/logs", replica_logs)
    r.add_get("/api/v1/explain-placement", explain)
    r.add_get("/api/v1/models/{name}/resources", model_resources)
    r.add_post("/api/v1/nodes/{id}/{action:cordon|uncordon|drain}", node_action)
    r.add_delete("/api/v1/nodes/{id}", remove_node)
    return app
