"""The admin API (``admin_listen``, ``127.0.0.1:9090`` by default): the catalog, nodes, replicas and
placement's explanations, as JSON.

Every ``/api/v1`` route needs ``Authorization: Bearer <admin token>`` (the token file beside
server.yaml, mode 0600) except ``GET /api/v1/health``. Errors are ``{"error": {"code", "message"}}``
with the matching status: 400 (a body that is not valid, the field named), 401 (no or wrong token),
404 (no such model/replica/route), 409 (a name or alias taken, or a write that lost a race), 500.

Routes (the OpenAPI document at ``/api/v1/openapi.json`` lists them with their shapes), one module
per resource, each with module-level handlers and a route table (``ROUTES``) that
:func:`build_admin_app` only assembles:

- :mod:`llmgw.control.api.models`: ``GET/POST /api/v1/models``, ``GET/PATCH/DELETE
  /api/v1/models/{name}``, ``PUT /api/v1/models/{name}/profiles``, ``GET
  /api/v1/models/{name}/resources``;
- :mod:`llmgw.control.api.nodes`: ``GET /api/v1/nodes``, ``POST
  /api/v1/nodes/{id}/cordon|uncordon|drain``, ``DELETE /api/v1/nodes/{id}[?force=true]``, ``GET
  /api/v1/revocations/{serial}``;
- :mod:`llmgw.control.api.replicas`: ``GET /api/v1/replicas?model=``, ``POST
  /api/v1/replicas/{id}/restart``, ``GET /api/v1/replicas/{id}/logs``, ``GET
  /api/v1/explain-placement?model=``;
- this module: ``GET /api/v1/health`` and ``GET /api/v1/openapi.json`` (:data:`ROUTES`).

The control plane adds the guard's, the cluster's, the keys' and ``/metrics`` routes to the same app
(:mod:`llmgw.control.api.guard`, :mod:`~llmgw.control.api.cluster`, :mod:`~llmgw.control.api.keys`,
:mod:`~llmgw.control.api.metrics`). Handlers read what they share (the store, the off-loop pool,
``on_change``...) from one :class:`~llmgw.control.api.context.AdminContext` kept on the app under
:data:`~llmgw.control.api.context.ADMIN`.

Bodies are read by :func:`llmgw.jsonbody.read_json` (at most 1 MiB and 64 levels deep, finite
numbers; else 400/413 in the error shape).

Writes call ``on_change`` so the leader runs a pass at once instead of at its next tick, and are
answered once ``settle`` returns (:func:`settled`).

Every store call and every view built over all nodes or replicas runs off the event loop
(``await db.run(...)``, :mod:`llmgw.control.store.offloop`): the loop also serves heartbeats and the
gateway, which waited seconds behind admin writes when store calls ran on it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from llmgw import jsonbody
from llmgw.bearer import bearer_is
from llmgw.control.api import models, nodes, replicas
from llmgw.control.api.context import ADMIN, AdminContext
from llmgw.control.api.context import json_response as _json
from llmgw.control.api.logbroker import LogBroker
from llmgw.control.api.openapi import build_openapi
from llmgw.control.gateway.balancer import ReplicaLoad
from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.errors import Conflict, StoreUnavailable
from llmgw.httperrors import error_json, error_middleware

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """401 ``unauthorized`` unless the request carries ``Authorization: Bearer <admin token>``
    (compared in constant time); ``/api/v1/health``, ``/metrics`` and ``/ui`` pass through."""
    # /metrics checks its own (control/api/metrics.py); the dashboard (/ui) its session (control/ui).
    if request.path in ("/api/v1/health", "/metrics", "/ui") or request.path.startswith("/ui/"):
        return await handler(request)
    token = request.config_dict[ADMIN].token  # config_dict: also under a sub-app (/ui)
    header = request.headers.get("Authorization", "")
    if not bearer_is(header, token):
        why = "missing" if not header else "wrong"
        return error_json(
            401,
            "unauthorized",
            f"the admin token is {why}; send 'Authorization: Bearer <token>' with the token from "
            "the admin-token file beside server.yaml",
        )
    return await handler(request)


@web.middleware
async def settled(request: web.Request, handler: Handler) -> web.StreamResponse:
    """After a successful write (not GET/HEAD, status < 400), await the context's ``settle``."""
    response = await handler(request)
    settle = request.config_dict[ADMIN].settle  # config_dict: also under a sub-app (/ui)
    if settle is not None and request.method not in ("GET", "HEAD") and response.status < 400:
        await settle()
    return response


async def health(request: web.Request) -> web.Response:
    """``GET /api/v1/health`` (no token): ``status``, ``pid`` and the context's ``health_fields``."""
    health_fields = request.app[ADMIN].health_fields
    return _json({"status": "ok", "pid": os.getpid(), **(health_fields() if health_fields else {})})


async def openapi(_: web.Request) -> web.Response:
    """``GET /api/v1/openapi.json``: :func:`~llmgw.control.api.openapi.build_openapi`."""
    return _json(build_openapi())


#: This module's own routes.
ROUTES = [
    web.get("/api/v1/health", health),
    web.get("/api/v1/openapi.json", openapi),
]


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
    closed_judges: Mapping[str, str] | None = None,
    loads: Callable[[], Mapping[str, ReplicaLoad]] | None = None,
) -> web.Application:
    """The admin API app: an :class:`~llmgw.control.api.context.AdminContext` from the arguments,
    the middlewares (errors, :func:`auth`, :func:`settled`) and every resource's ``ROUTES``.

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
        closed_judges: ``{judge model name: policy name}`` of server.yaml's ``fail: closed`` guard
            policies: such a model's ``scaling.min: 0`` is a 400 (it never scales to zero).
        loads: the control plane's gateway's per-replica figures by replica id
            (``gateway_pool(gateway).loads``), shown as each replica's ``routing`` in
            ``GET /api/v1/replicas``; None: no ``routing``.

    Raises:
        ValueError: ``token`` is empty.

    A store call that fails because the database is down or does not answer within the pool's
    deadline (:data:`~llmgw.control.store.offloop.STORE_DEADLINE_S`) is answered 503
    ``store_unavailable``, naming the database and what to check.
    """
    if not token:
        raise ValueError("the admin token is empty")
    own_pool = db is None
    pool = db or OffLoop()

    async def _close(_: web.Application) -> None:
        pool.close()

    errors = error_middleware(
        service="the control plane",
        known={StoreUnavailable: (503, "store_unavailable"), Conflict: (409, "conflict")},
    )
    app = web.Application(middlewares=[errors, auth, settled], client_max_size=jsonbody.MAX_BYTES)
    app[ADMIN] = AdminContext(
        store=store, db=pool, token=token, changed=on_change or (lambda: None), clock=clock, logs=logs,
        max_replicas_per_model=max_replicas_per_model, settle=settle, health_fields=health_fields,
        closed_judges=dict(closed_judges or {}),
        loads=loads,
    )
    if own_pool:
        app.on_cleanup.append(_close)
    for table in (ROUTES, models.ROUTES, nodes.ROUTES, replicas.ROUTES):
        app.add_routes(table)
    return app
