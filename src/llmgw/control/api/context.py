"""What the admin API's handlers share: one :class:`AdminContext` kept on the app under :data:`ADMIN`.

:func:`~llmgw.control.api.admin.build_admin_app` builds the context from its arguments and puts it
on the app; each resource's module (:mod:`~llmgw.control.api.models`, :mod:`~llmgw.control.api.nodes`,
:mod:`~llmgw.control.api.replicas`) holds module-level handlers that read it with
``request.app[ADMIN]`` (:func:`admin_context`), and a route table (``ROUTES``) the builder adds.
A handler is therefore importable, named in a traceback, and testable alone: put an
``AdminContext`` on a bare ``web.Application`` and add the one route.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from llmgw.control.api.logbroker import LogBroker
from llmgw.control.gateway.balancer import ReplicaLoad
from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.errors import HttpError


@dataclass(frozen=True)
class AdminContext:
    """The admin API's shared state (what its handlers were closures over before).

    Attributes:
        store: the state store; every call goes through ``db`` (off the event loop).
        db: runs store calls on a thread pool, with its deadline (503 ``store_unavailable`` past it).
        token: the admin bearer token (compared in constant time by the builder's middleware).
        changed: called after every successful write (wakes the leader, refreshes routes).
        clock: unix seconds.
        logs: reads engine logs through the agents; None: ``/replicas/{id}/logs`` answers 409.
        max_replicas_per_model: server.yaml's limit on ``scaling.min``/``max`` (larger is a 400),
            and on the ``pending`` replicas listed per model.
        settle: awaited after every successful write before it is answered; None: not waited.
        health_fields: more fields for ``GET /api/v1/health``, read from memory; None: none.
        closed_judges: ``{judge model: policy}`` of the ``fail: closed`` guard policies (never scaled to zero).
        loads: this control plane's gateway's view of each replica it has sent to, by replica id
            (``gateway_pool(app).loads``: slots, in flight, queued, picks), read from memory for
            ``GET /api/v1/replicas``' ``routing``; None (an admin API without a gateway): no
            ``routing``.
    """

    store: Store
    db: OffLoop
    token: str
    changed: Callable[[], None]
    clock: Callable[[], float]
    logs: LogBroker | None = None
    max_replicas_per_model: int = 1000
    settle: Callable[[], Awaitable[None]] | None = None
    health_fields: Callable[[], dict[str, Any]] | None = None
    closed_judges: dict[str, str] = field(default_factory=dict)
    loads: Callable[[], Mapping[str, ReplicaLoad]] | None = None


#: Where the admin app keeps its :class:`AdminContext`.
ADMIN: web.AppKey[AdminContext] = web.AppKey("admin", AdminContext)


def admin_context(request: web.Request) -> AdminContext:
    """The :class:`AdminContext` of the app serving ``request`` (KeyError when it has none)."""
    return request.app[ADMIN]


def json_response(data: Any, status: int = 200) -> web.Response:
    """``data`` as a JSON answer (``json.dumps``: the admin API's bodies byte for byte)."""
    return web.json_response(text=json.dumps(data), status=status)


T = TypeVar("T")


async def must_exist(db: OffLoop, get: Callable[[str], T | None], key: str, *, what: str, listing: str) -> T:
    """``get(key)`` (a store read, off the loop); when it finds nothing, 404 ``{what}_not_found``
    saying ``no {what} 'key'; list them with {listing}`` (the command that lists them, and the path).

    Raises:
        HttpError: 404 as above; the store read's errors as :meth:`OffLoop.read`.
    """
    found = await db.read(get, key)
    if found is None:
        raise HttpError(404, f"{what}_not_found", f"no {what} '{key}'; list them with {listing}")
    return found
