"""The API handlers stand alone: each is a module-level function listed in its module's ``ROUTES``,
and runs on a bare aiohttp app that carries only its context (in-process TestServer on loopback, a
real store)."""

from __future__ import annotations

from types import ModuleType

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.control.api import admin, agent, cluster, guard, keys, metrics, models, nodes, replicas
from llmgw.control.api.context import ADMIN, AdminContext
from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.httperrors import error_middleware

MODULES = [admin, models, nodes, replicas, keys, guard, cluster, metrics, agent]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_route_is_a_named_module_level_handler(module: ModuleType) -> None:
    assert module.ROUTES
    for route in module.ROUTES:
        handler = route.handler
        assert handler.__qualname__ == handler.__name__, f"{route}: a nested handler"
        assert getattr(module, handler.__name__) is handler, f"{route}: not importable from {module.__name__}"
        assert handler.__doc__, f"{module.__name__}.{handler.__name__} has no docstring"


async def test_a_handler_runs_on_a_bare_app_with_its_context(store: Store) -> None:
    db = OffLoop()
    try:
        app = web.Application(middlewares=[error_middleware(service="a test")])
        app[ADMIN] = AdminContext(store=store, db=db, token="t", changed=lambda: None, clock=lambda: 1000.0)
        app.router.add_get("/models", models.list_models)
        app.router.add_get("/revocations/{serial}", nodes.revocation)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/models")
            assert resp.status == 200
            assert await resp.json() == []
            resp = await client.get("/revocations/00ab")
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "not_revoked"
    finally:
        db.close()
