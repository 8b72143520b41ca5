"""The admin API's catalog: ``/api/v1/models`` and each model's profiles and resources.

Routes (:data:`ROUTES`; :mod:`llmgw.control.api.admin` says how they are authorised and answered):
``GET/POST /api/v1/models``, ``GET/PATCH/DELETE /api/v1/models/{name}``,
``PUT /api/v1/models/{name}/profiles``, ``GET /api/v1/models/{name}/resources`` (estimate,
profiles, where one could run), ``GET /api/v1/models/{name}/autoscale`` (wanted, ready, load and
the last decisions: :mod:`llmgw.control.reconcile.autoscale`).

A model is found by its name or one of its aliases (:func:`must_model`). ``scaling.min``/``max``
above ``max_replicas_per_model`` are refused with a 400. A stored model that cannot be read back is
listed with ``broken`` set (the reason); GET shows it, PATCH/PUT answer 409 ``model_broken``, DELETE
removes it. Handlers read the shared state from ``request.app[ADMIN]``
(:class:`~llmgw.control.api.context.AdminContext`).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from pydantic import BaseModel, TypeAdapter, ValidationError

from llmgw import jsonbody
from llmgw.catalog import Model, Profile, scaling_target
from llmgw.control.api.context import ADMIN, AdminContext
from llmgw.control.api.context import json_response as _json
from llmgw.control.placement.resources import resources_view
from llmgw.control.reconcile.autoscale import FRESH_S, HISTORY_S, serving, wanted_replicas
from llmgw.control.store import BrokenModel, ModelRow, ReplicaRow, Store
from llmgw.control.store.rows import DecisionRow
from llmgw.errors import HttpError, SourceError
from llmgw.protocol import ReplicaState
from llmgw.sourcecheck import LINK_LOCAL_FIX, link_local, to_download
from llmgw.views import AutoscaleView, DecisionView, HistoryPoint, ModelView

_PROFILES = TypeAdapter(list[Profile])


def describe(err: ValidationError) -> str:
    """The first problem of a validation error, the field named: ``profiles.0.name: Field required``."""
    parts = []
    for e in err.errors()[:3]:
        where = ".".join(str(p) for p in e["loc"]) or "(body)"
        msg = "unknown field; remove it or check its spelling" if e["type"] == "extra_forbidden" else e["msg"]
        if e["type"] == "list_type" and where == "profiles":
            msg += " (a model's profiles are set whole: 'llmgw ctl model set-profiles NAME -f profiles.yaml')"
        parts.append(f"{where}: {msg.removeprefix('Value error, ')}")  # pydantic's prefix to our own messages
    return "; ".join(parts)


def model_view(row: ModelRow, replicas: list[ReplicaRow], last: Mapping[str, DecisionRow] | None = None) -> ModelView:
    """A catalog entry with its replicas counted and wanted (``last``: the models' last autoscaling
    decisions; None: ``scaling.min`` is shown as wanted)."""
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
        replicas_failed=sum(r.state == ReplicaState.FAILED for r in mine),
        replicas_wanted=wanted_replicas(m, last or {}, sum(r.draining_since is None for r in mine)),
        spec=m.model_dump(mode="json"),
    )


def broken_view(b: BrokenModel) -> ModelView:
    """A stored model row that cannot be read: its name and why, nothing else."""
    return ModelView(name=b.name, broken=b.reason)


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


def broken(store: Store, name: str) -> BrokenModel | None:
    """On a store thread: the stored row named ``name`` that cannot be read, if it is one."""
    return next((b for b in store.list_broken_models() if b.name == name), None)


async def must_model(ctx: AdminContext, name: str) -> ModelRow:
    """The model named ``name`` or carrying it as an alias; else 409 when its row is broken,
    404 naming the known ones otherwise."""
    return await ctx.db.read(_must_model, ctx.store, name)


def _must_model(store: Store, name: str) -> ModelRow:
    row = store.get_model(name)
    if row is not None:
        return row
    rows = store.list_models()
    for r in rows:
        if name in r.model.aliases:
            return r
    bad = broken(store, name)
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


def _list_models(store: Store) -> list[Any]:
    replicas, last = store.list_replicas(), store.last_decisions()
    views = [model_view(r, replicas, last) for r in store.list_models()]
    views += [broken_view(b) for b in store.list_broken_models()]
    views.sort(key=lambda v: v.name)
    return [v.model_dump(mode="json") for v in views]


async def list_models(request: web.Request) -> web.Response:
    """``GET /api/v1/models``: every model (broken ones too), by name."""
    ctx = request.app[ADMIN]
    return _json(await ctx.db.read(_list_models, ctx.store))


def within_limit(ctx: AdminContext, model: Model) -> Model:
    """``model``, or 400 ``invalid_model`` when its scaling exceeds ``max_replicas_per_model``, or
    when it judges a ``fail: closed`` guard policy and its ``scaling.min`` is 0."""
    max_replicas_per_model = ctx.max_replicas_per_model
    top = max(model.scaling.min, model.scaling.max)
    if top > max_replicas_per_model:
        raise HttpError(
            400, "invalid_model",
            f"scaling: {top} replicas is more than this cluster's limit of {max_replicas_per_model} "
            "per model (max_replicas_per_model in server.yaml)",
        )
    policy = next((ctx.closed_judges[n] for n in (model.name, *model.aliases) if n in ctx.closed_judges), None)
    if policy is not None and model.scaling.min == 0:
        raise HttpError(
            400, "invalid_model",
            f"scaling.min: 0 is refused for '{model.name}': it judges the guard policy '{policy}', which "
            "fails closed (every request it guards would be refused while a judge starts from zero); "
            "set scaling.min to 1 or more",
        )
    return model


def downloadable(model: Model) -> Model:
    """``model`` when nodes can download its ``source``: an ``http://`` or ``https://`` URL (normally
    the mirror's, which ``llmgw mirror ls`` shows). A node's cache fetches the source over HTTP, so a
    ``file:`` path or an ``hf:`` name in the catalog leaves every replica failing to download; and the
    control plane would read a ``file:`` path itself (as its user, root on some installs) to estimate it.

    Raises:
        HttpError: 400 ``invalid_model`` naming the source and the way to bring the file in, or what
            is wrong with the URL (:func:`llmgw.sourcecheck.to_download`: no host, no file).
    """
    scheme = model.source.strip().partition(":")[0].lower()
    if scheme in ("http", "https"):
        try:
            to_download(model.source, env={})  # the URL's host and file named (no I/O for http)
        except SourceError as e:
            raise HttpError(400, "invalid_model", f"source: {e}") from e
        host = urllib.parse.urlsplit(model.source.strip()).hostname or ""
        if (ip := link_local(host)) is not None:
            raise HttpError(400, "invalid_model", f"source: {ip} is a link-local address: {LINK_LOCAL_FIX}")
        return model
    raise HttpError(
        400,
        "invalid_model",
        f"source: '{model.source[:200]}' is not a URL nodes can download (http:// or https://, normally the "
        "mirror's); put the weights in the mirror first ('llmgw mirror add FILE --model M --version V' for a "
        "file, the mirror's POST /api/v1/fetch for hf: and https:// sources) and use the URL 'llmgw mirror ls' "
        "shows",
    )


async def add_model(request: web.Request) -> web.Response:
    """``POST /api/v1/models`` (a :class:`~llmgw.catalog.Model`): 201 with its view."""
    ctx = request.app[ADMIN]
    try:
        model = downloadable(within_limit(ctx, Model.model_validate(await jsonbody.read_json(request))))
    except ValidationError as e:
        raise HttpError(400, "invalid_model", describe(e)) from e
    row = await ctx.db.run(ctx.store.add_model, model, now=ctx.clock())
    ctx.changed()
    return _json(model_view(row, []).model_dump(mode="json"), status=201)


async def get_model(request: web.Request) -> web.Response:
    """``GET /api/v1/models/{name}`` (a name or an alias; a broken row is shown as such)."""
    ctx = request.app[ADMIN]
    store, db = ctx.store, ctx.db
    bad = await db.read(broken, store, request.match_info["name"])
    if bad is not None:
        return _json(broken_view(bad).model_dump(mode="json"))
    row = await must_model(ctx, request.match_info["name"])
    replicas, last = await db.read(lambda: (store.list_replicas(model=row.name), store.last_decisions()))
    return _json(model_view(row, replicas, last).model_dump(mode="json"))


async def save(ctx: AdminContext, row: ModelRow, spec: Any) -> web.Response:
    """Store ``spec`` over ``row`` (its revision checked: 409 when it lost a race); the model's view."""
    store, db = ctx.store, ctx.db
    try:
        model = within_limit(ctx, Model.model_validate(spec))
    except ValidationError as e:
        raise HttpError(400, "invalid_model", describe(e)) from e
    if model.source != row.model.source:  # a model stored before the rule stays editable
        downloadable(model)
    if model.name != row.name:
        raise HttpError(
            400,
            "invalid_model",
            f"name: a model cannot be renamed ('{row.name}' -> '{model.name}'); "
            "add it under the new name and delete the old one",
        )
    new = await db.run(store.update_model, model, revision=row.revision, now=ctx.clock())
    ctx.changed()
    return _json(model_view(new, await db.run(store.list_replicas, model=new.name)).model_dump(mode="json"))


async def patch_model(request: web.Request) -> web.Response:
    """``PATCH /api/v1/models/{name}``: a JSON merge patch (RFC 7396) of the model."""
    ctx = request.app[ADMIN]
    row = await must_model(ctx, request.match_info["name"])
    patch = await jsonbody.read_json(request)
    if not isinstance(patch, dict):
        raise HttpError(
            400, "invalid_patch", "the body must be a JSON object (a JSON merge patch of the model)"
        )
    return await save(ctx, row, _merge(row.model.model_dump(mode="json"), patch))


async def put_profiles(request: web.Request) -> web.Response:
    """``PUT /api/v1/models/{name}/profiles``: a list of profiles, or ``{"profiles": [...]}``."""
    ctx = request.app[ADMIN]
    row = await must_model(ctx, request.match_info["name"])
    body = await jsonbody.read_json(request)
    if isinstance(body, dict) and "profiles" in body:
        body = body["profiles"]
    try:
        profiles = _PROFILES.validate_python(body)
    except ValidationError as e:
        raise HttpError(400, "invalid_profiles", "profiles." + describe(e)) from e
    spec = row.model.model_dump(mode="json")
    spec["profiles"] = [p.model_dump(mode="json") for p in profiles]
    return await save(ctx, row, spec)


async def delete_model(request: web.Request) -> web.Response:
    """``DELETE /api/v1/models/{name}``: 204 (a broken row too)."""
    ctx = request.app[ADMIN]
    store, db = ctx.store, ctx.db
    asked = request.match_info["name"]
    name = asked if await db.read(broken, store, asked) is not None else (await must_model(ctx, asked)).name
    if not await db.run(store.delete_model, name):
        raise HttpError(404, "model_not_found", f"no model '{name}' in the catalog")
    ctx.changed()
    return web.Response(status=204)


async def model_resources(request: web.Request) -> web.Response:
    """``GET /api/v1/models/{name}/resources``: the estimate, profiles and where one could run."""
    ctx = request.app[ADMIN]
    store = ctx.store
    row = await must_model(ctx, request.match_info["name"])

    def build() -> BaseModel:
        return resources_view(
            row.model,
            nodes=store.list_nodes(),
            replicas=store.list_replicas(),
            models={m.name: m.model for m in store.list_models()},
            stored_facts=store.list_gguf_facts(),
        )

    return _json((await ctx.db.run(build)).model_dump(mode="json"))


def _autoscale_view(store: Store, row: ModelRow, now: float) -> AutoscaleView:
    m = row.model
    mine = store.list_replicas(model=m.name)
    decisions = store.list_decisions(m.name)
    load = [x for x in store.read_gateway_load(since=now - FRESH_S) if x.model == m.name]
    draining = sum(r.draining_since is not None for r in mine)
    return AutoscaleView(
        model=m.name, autoscaled=m.scaling.autoscaled, min=m.scaling.min, max=m.scaling.max,
        target=scaling_target(m),
        wanted=wanted_replicas(m, {m.name: decisions[0]} if decisions else {}, len(mine) - draining),
        ready=sum(serving(r) for r in mine), draining=draining,
        in_flight=sum(x.in_flight for x in load), queued=sum(x.queued for x in load),
        decisions=[DecisionView(at=d.at, from_n=d.from_n, to_n=d.to_n, reason=d.reason, panic=d.panic)
                   for d in decisions],
        history=[HistoryPoint(at=h.at, wanted=h.wanted, ready=h.ready, load=h.load)
                 for h in store.list_history(m.name, since=now - HISTORY_S)],
    )


async def model_autoscale(request: web.Request) -> web.Response:
    """``GET /api/v1/models/{name}/autoscale``: wanted, ready, draining, load and the last decisions."""
    ctx = request.app[ADMIN]
    row = await must_model(ctx, request.match_info["name"])
    view = await ctx.db.read(_autoscale_view, ctx.store, row, ctx.clock())
    return _json(view.model_dump(mode="json"))


#: The catalog's routes (same-path routes next to each other: aiohttp joins them in one resource).
ROUTES = [
    web.get("/api/v1/models", list_models),
    web.post("/api/v1/models", add_model),
    web.get("/api/v1/models/{name}", get_model),
    web.patch("/api/v1/models/{name}", patch_model),
    web.delete("/api/v1/models/{name}", delete_model),
    web.put("/api/v1/models/{name}/profiles", put_profiles),
    web.get("/api/v1/models/{name}/resources", model_resources),
    web.get("/api/v1/models/{name}/autoscale", model_autoscale),
]
