"""The admin API's OpenAPI 3.1 document, built from the pydantic views' JSON schemas.

Served at ``GET /api/v1/openapi.json``. The operations are listed here once, beside the shapes they
take and return, so the document cannot drift from :mod:`llmgw.views` and the catalog.

Each operation lists every status its route answers: its success status, the errors its handler
raises (``errors``), and those every route of its kind can answer, added by :func:`build_openapi`:
401 (no or wrong admin token) unless ``auth`` is off, 503 ``store_unavailable`` when it reads or
writes the store (``store``), and for a body 400 (not JSON, too deep, not the shape) and 413 (over
1 MiB). Path parameters come from the path's ``{name}`` parts, with their values where the route
takes only some (``{action}``: :data:`~llmgw.views.NODE_ACTIONS`). tests/unit/test_api_contract.py
checks all of it against the routes a control plane serves and the statuses they answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from llmgw import __version__, views
from llmgw.apikeys import KeyPatch, KeySpec
from llmgw.catalog import Model, Profile
from llmgw.views import NODE_ACTIONS


class ErrorBody(BaseModel):
    """``{"code", "message"}`` inside every error response's ``error``."""

    code: str
    message: str


class ErrorResponse(BaseModel):
    """Every admin API error: ``{"error": {"code", "message"}}``."""

    error: ErrorBody


class Health(BaseModel):
    """``GET /api/v1/health``: ``pid`` lets ``service restart`` tell its own control plane from
    another program answering on the same address."""

    status: str
    pid: int
    leader: bool = Field(False, description="whether this control plane leads (runs the reconcilers)")
    term: int = Field(0, description="the leadership term (fencing token) it knows; 0 before anyone led")
    database: str = Field("ok", description="'ok', or 'unreachable' while its store calls fail")


@dataclass(frozen=True)
class Op:
    """One operation: method, path, summary, request body shape, response shape (``list`` of it when
    ``many``), success status, and the error statuses its handler answers (those of every route of
    its kind are added by :func:`build_openapi`: 401 with ``auth``, 503 with ``store``, 400 and 413
    with a body, or with ``reads_body`` for a body that is optional)."""

    method: str
    path: str
    summary: str
    response: type[BaseModel] | None
    many: bool = False
    body: type[BaseModel] | None = None
    body_many: bool = False
    status: int = 200
    errors: tuple[int, ...] = ()
    query: tuple[str, ...] = ()
    auth: bool = True
    store: bool = True
    reads_body: bool = False


OPS: tuple[Op, ...] = (
    Op("get", "/api/v1/health", "Liveness; needs no token", Health, auth=False, store=False),
    Op("get", "/api/v1/openapi.json", "This document", None, store=False),
    Op("get", "/api/v1/models", "The catalog", views.ModelView, many=True),
    Op("post", "/api/v1/models", "Add a model", views.ModelView, body=Model, status=201, errors=(400, 409)),
    Op("get", "/api/v1/models/{name}", "One model (409: stored but unreadable)", views.ModelView, errors=(404, 409)),
    Op(
        "patch",
        "/api/v1/models/{name}",
        "Change a model (JSON merge patch of its spec)",
        views.ModelView,
        errors=(400, 404, 409),
    ),
    Op(
        "delete",
        "/api/v1/models/{name}",
        "Remove a model; its replicas stop",
        None,
        status=204,
        errors=(404, 409),
    ),
    Op(
        "put",
        "/api/v1/models/{name}/profiles",
        "Replace a model's profiles",
        views.ModelView,
        body=Profile,
        body_many=True,
        errors=(400, 404, 409),
    ),
    Op("get", "/api/v1/nodes", "Nodes, their engines' provisioning and resources", views.NodeView, many=True),
    Op(
        "get",
        "/api/v1/replicas",
        "Replicas, optionally of one model, each with this control plane's routing figures (routing)",
        views.ReplicaView,
        many=True,
        errors=(404, 409),
        query=("model",),
    ),
    Op(
        "post",
        "/api/v1/replicas/{id}/restart",
        "Replace a replica by a fresh one on the same node",
        views.ReplicaView,
        status=202,
        errors=(404, 409),
    ),
    Op(
        "get",
        "/api/v1/explain-placement",
        "Why a model is (not) placed",
        views.ExplainView,
        errors=(400, 404, 409),
        query=("model",),
    ),
    Op(
        "get",
        "/api/v1/replicas/{id}/logs",
        "A replica's engine log, read through its node's agent (last lines, or what follows offset)",
        views.LogView,
        errors=(400, 404, 409, 504),
        query=("lines", "offset"),
    ),
    Op("get", "/api/v1/models/{name}/resources", "What a replica needs per profile, and where one fits", None,
       errors=(404, 409)),
    Op("get", "/api/v1/models/{name}/autoscale", "A model's wanted, ready and draining replicas, its load, and "
       "the last autoscaling decisions with their reasons", views.AutoscaleView, errors=(404, 409)),
    Op("post", "/api/v1/nodes/{id}/{action}", "cordon, uncordon or drain a node (another action: 404)", views.NodeView,
       errors=(404, 409)),
    Op(
        "delete",
        "/api/v1/nodes/{id}",
        "Remove a node and revoke its agent's certificates (409 while replicas are placed there, "
        "unless force=true, which drains it first)",
        views.NodeRemovalView,
        errors=(404, 409),
        query=("force",),
    ),
    Op(
        "get",
        "/api/v1/revocations/{serial}",
        "Whether an agent certificate serial (hex) was revoked by a node's removal (404 when not)",
        views.RevocationView,
        errors=(404,),
    ),
    Op(
        "get",
        "/api/v1/cluster",
        "The control planes, which one leads, the term, database reachability, Patroni's members",
        views.ClusterView,
        store=False,
    ),
    Op("post", "/api/v1/keys", "Make a gateway API key; the secret is in this answer only", views.NewKeyView,
       body=KeySpec, status=201, errors=(400, 409)),
    Op("get", "/api/v1/keys", "The gateway API keys (never their secrets), their limits and usage", views.KeyView,
       many=True),
    Op("get", "/api/v1/keys/{name}", "One gateway API key (never its secret), its limits and usage", views.KeyView,
       errors=(404,)),
    Op("patch", "/api/v1/keys/{name}", "Change a key's limits (JSON merge patch; null removes a limit); "
       "every control plane applies it within a second", views.KeyView, body=KeyPatch, errors=(400, 404, 409)),
    Op("post", "/api/v1/keys/{name}/revoke", "Revoke a key: refused by every control plane within a second",
       views.KeyView, errors=(404, 409)),
    Op("post", "/api/v1/keys/{name}/rotate", "A new secret for a key; the old one stops working", views.NewKeyView,
       errors=(404, 409)),
    Op("get", "/api/v1/usage", "Usage per key, model and UTC day (since/until: 7d or YYYY-MM-DD)", views.UsageView,
       many=True, errors=(400,), query=("key", "model", "since", "until")),
    Op("get", "/api/v1/guard/status", "Each policy's judges: in the catalog, ready, judge time", None),
    Op("post", "/api/v1/guard/test", "Judge a text as the gateway would (409: guardrails are off)", None,
       errors=(400, 404, 409), reads_body=True),
    Op("post", "/api/v1/guard/judges/{name}/enable", "Fetch a judge into the mirror and the catalog (a job)", None,
       status=202, errors=(400, 409), reads_body=True),
)

_REF = "#/components/schemas/{model}"
_PATH_PARAM = re.compile(r"\{(\w+)\}")
#: The values a path parameter may take, where its route takes only some.
_PATH_VALUES: dict[str, tuple[str, ...]] = {"action": NODE_ACTIONS}


def _ref(model: type[BaseModel], many: bool) -> dict[str, Any]:
    ref = {"$ref": _REF.format(model=model.__name__)}
    return {"type": "array", "items": ref} if many else ref


def build_openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document as a dict (JSON-serialisable)."""
    shapes: list[type[BaseModel]] = [
        ErrorResponse,
        Health,
        Model,
        Profile,
        views.ModelView,
        views.NodeView,
        views.ReplicaView,
        views.ExplainView,
        views.NodeRemovalView,
        views.RevocationView,
        views.ClusterView,
        KeySpec,
        KeyPatch,
        views.KeyView,
        views.NewKeyView,
        views.UsageView,
    ]
    _, defs = models_json_schema([(m, "serialization") for m in shapes], ref_template=_REF)
    schemas: dict[str, Any] = dict(defs.get("$defs", {}))
    paths: dict[str, dict[str, Any]] = {}
    for op in OPS:
        params: list[dict[str, Any]] = [
            {"name": p, "in": "path", "required": True,
             "schema": {"type": "string", **({"enum": list(_PATH_VALUES[p])} if p in _PATH_VALUES else {})}}
            for p in _PATH_PARAM.findall(op.path)
        ]
        params += [
            {"name": q, "in": "query", "required": False, "schema": {"type": "string"}} for q in op.query
        ]
        ok: dict[str, Any] = {"description": "OK"}
        if op.response is not None:
            ok["content"] = {"application/json": {"schema": _ref(op.response, op.many)}}
        elif op.status != 204:
            ok["content"] = {"application/json": {"schema": {"type": "object"}}}
        responses: dict[str, Any] = {str(op.status): ok}
        err = {"content": {"application/json": {"schema": _ref(ErrorResponse, False)}}}
        body = op.body is not None or op.reads_body
        common = (*((401,) if op.auth else ()), *((400, 413) if body else ()), *((503,) if op.store else ()))
        for code in sorted({*op.errors, *common}):
            responses[str(code)] = {"description": "error", **err}
        entry: dict[str, Any] = {"summary": op.summary, "responses": responses}
        if params:
            entry["parameters"] = params
        if op.body is not None:
            entry["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _ref(op.body, op.body_many)}},
            }
        if not op.auth:
            entry["security"] = []
        paths.setdefault(op.path, {})[op.method] = entry
    return {
        "openapi": "3.1.0",
        "info": {"title": "llmgw admin API", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
