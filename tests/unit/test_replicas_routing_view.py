"""``GET /api/v1/replicas``' ``routing`` from the ``loads`` seam, on a bare app with a real store
(in-process TestServer on loopback). The figures a real gateway produces on real engines:
tests/e2e/test_replicas_routing.py."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.catalog import Model, Profile, Scaling
from llmgw.control.api import replicas
from llmgw.control.api.context import ADMIN, AdminContext
from llmgw.control.gateway.balancer import ReplicaLoad
from llmgw.control.store import ReplicaRow, Store
from llmgw.control.store.offloop import OffLoop
from llmgw.httperrors import error_middleware
from llmgw.views import ReplicaRouting

PICKS = {"affinity": 7, "overflow": 2, "least_load": 1, "round_robin": 0}


def test_routing_view_of_a_load() -> None:
    load = ReplicaLoad("r1", "chat", slots=4, slots_known=True, in_flight=3, service_s=1.23456,
                       picks=dict(PICKS), queued=5)
    assert replicas.routing_view(load) == ReplicaRouting(
        slots=4, in_flight=3, queued=5, affinity_hits=7, picks=PICKS, service_s=1.2346
    )
    # The balancer's placeholder 1 before /props answered is no measurement: null.
    unread = ReplicaLoad("r1", "chat", slots=1, slots_known=False, in_flight=1, service_s=0.0, picks=dict(PICKS))
    assert replicas.routing_view(unread).slots is None
    never = replicas.routing_view(None)
    assert never == ReplicaRouting(slots=None, in_flight=0, queued=0, affinity_hits=0, picks={}, service_s=0.0)
    assert never.scope == "this_control_plane"


async def _listed(store: Store, loads: Mapping[str, ReplicaLoad] | None) -> list[dict[str, object]]:
    db = OffLoop()
    try:
        app = web.Application(middlewares=[error_middleware(service="a test")])
        app[ADMIN] = AdminContext(store=store, db=db, token="t", changed=lambda: None, clock=lambda: 1000.0,
                                  loads=(lambda: loads) if loads is not None else None)
        app.router.add_get("/replicas", replicas.list_replicas)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/replicas")
            assert resp.status == 200, await resp.text()
            got: list[dict[str, object]] = await resp.json()
            return got
    finally:
        db.close()


async def test_listing_carries_the_seams_figures(store: Store) -> None:
    store.add_model(Model(name="chat", source="http://m/chat.gguf", profiles=[Profile(name="cpu")],
                          scaling=Scaling(min=3, max=3)), now=1.0)
    for rid in ("chat-a", "chat-b"):
        store.add_replica(ReplicaRow(id=rid, model="chat", node="n", profile="cpu", key="k", state="ready",
                                     endpoint="10.0.0.5:7000"))
    sent = ReplicaLoad("chat-a", "chat", slots=2, slots_known=True, in_flight=1, service_s=0.5,
                       picks=dict(PICKS), queued=4, tokens_per_s=24.567)
    by_id = {r["id"]: r["routing"] for r in await _listed(store, {"chat-a": sent})}
    assert by_id["chat-a"] == {"scope": "this_control_plane", "slots": 2, "in_flight": 1, "queued": 4,
                               "affinity_hits": 7, "picks": PICKS, "service_s": 0.5, "tokens_per_s": 24.57}
    # Not sent to yet by this gateway: zeros and slots unknown.
    assert by_id["chat-b"] == {"scope": "this_control_plane", "slots": None, "in_flight": 0, "queued": 0,
                               "affinity_hits": 0, "picks": {}, "service_s": 0.0, "tokens_per_s": 0.0}
    assert by_id["chat#pending-1"] is None  # placed nowhere: nothing routes to it
    # An admin API without a gateway says nothing about routing.
    assert {r["id"]: r["routing"] for r in await _listed(store, None)} == dict.fromkeys(by_id)
