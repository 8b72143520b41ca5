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
from llmgw.control.store.rows import ReplicaRow
from llmgw.httperrors import error_middleware
from llmgw.protocol import LogReply

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


class _NoLog:
    """Stands in for the log broker: the node answers that it has no log for the replica (the
    agent's side of it is tested in tests/unit/test_logs_ha.py)."""

    async def read(self, node: str, replica_id: str, **_: object) -> LogReply:
        return LogReply(id="x", replica_id=replica_id, found=False)


async def test_the_log_of_a_replica_that_failed_before_its_engine_started_says_why_there_is_none(
    store: Store,
) -> None:
    """A replica whose weights could not be fetched never ran an engine: 'ctl logs' said "no engine
    log (yet)", as if one would come (an operator's finding); it says why there is none."""
    store.add_replica(ReplicaRow(id="m-1", model="m", node="n1", profile="cpu", key="k", state="failed",
                                 err="fetching http://mirror/m/1/nope.gguf: answered 404 Not Found\nmore"))
    store.add_replica(ReplicaRow(id="m-2", model="m", node="n1", profile="cpu", key="k", state="starting"))
    db = OffLoop()
    try:
        app = web.Application(middlewares=[error_middleware(service="a test")])
        app[ADMIN] = AdminContext(store=store, db=db, token="t", changed=lambda: None, clock=lambda: 1000.0,
                                  logs=_NoLog())  # type: ignore[arg-type]
        app.router.add_get("/replicas/{id}/logs", replicas.replica_logs)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/replicas/m-1/logs")
            assert resp.status == 404
            assert (await resp.json())["error"]["message"] == (
                "replica 'm-1' on n1 failed before its engine started, so there is no engine log: "
                "fetching http://mirror/m/1/nope.gguf: answered 404 Not Found"
            )
            resp = await client.get("/replicas/m-2/logs")
            assert (await resp.json())["error"]["message"] == "node n1 has no engine log for replica 'm-2' (yet)"
    finally:
        db.close()
