"""The admin API's side of autoscaling, on SQLite and PostgreSQL (the ``store`` fixture): bad
``scaling`` fields are a 400 naming the field, a judge of a ``fail: closed`` policy may not have
``scaling.min: 0`` (the policy named), and ``GET /api/v1/models/{name}/autoscale`` answers from the
store's decisions and load rows (the SQL of migration 10 on both backends)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from llmgw.control.api.admin import build_admin_app
from llmgw.control.store import Store
from llmgw.control.store.rows import DecisionRow, GatewayLoadRow, ReplicaRow
from llmgw.guard.config import GuardConfig, closed_judges

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NOW = 1000.0


def _model(name: str = "chat", **scaling: Any) -> dict[str, Any]:
    return {"name": name, "source": "http://m/x.gguf", "scaling": {"min": 1, "max": 3, **scaling},
            "profiles": [{"name": "cpu", "min_memory_gb": 1, "args": ["--parallel", "2"]}]}


@pytest.fixture
async def client(store: Store) -> AsyncIterator[TestClient[Any, Any]]:
    guard = GuardConfig.model_validate({"policies": [
        {"name": "safety", "judge": ["judge-a", "judge-b"], "fail": "closed"},
        {"name": "lenient", "judge": "judge-c", "fail": "open"},
    ]})
    app = build_admin_app(store, token=TOKEN, clock=lambda: NOW, closed_judges=closed_judges(guard))
    async with TestClient(TestServer(app)) as c:
        yield c


@pytest.mark.parametrize(
    ("scaling", "field", "says"),
    [
        ({"target": 0}, "scaling.target", "greater than 0"),
        ({"target": -2.5}, "scaling.target", "greater than 0"),
        ({"target": "2"}, "scaling.target", "valid number"),
        ({"target": float("nan")}, "scaling.target", "NaN is not a JSON number; send a finite number"),
        ({"target": float("inf")}, "scaling.target", "Infinity is not a JSON number"),
        ({"stable_window_s": float("-inf")}, "scaling.stable_window_s", "-Infinity is not a JSON number"),
        ({"stable_window_s": 1e9}, "scaling.stable_window_s", "less than or equal to 86400"),
        ({"panic_window_s": 1e9}, "scaling.panic_window_s", "less than or equal to 86400"),
        ({"scale_down_after_s": -1}, "scaling.scale_down_after_s", "greater than or equal to 1"),
        ({"scale_to_zero_after_s": 1e9}, "scaling.scale_to_zero_after_s", "less than or equal to 86400"),
    ],
)
async def test_bad_scaling_fields_are_a_400_naming_the_field(
    client: TestClient[Any, Any], scaling: dict[str, Any], field: str, says: str
) -> None:
    r = await client.post("/api/v1/models", json=_model(**scaling), headers=AUTH)
    assert r.status == 400, await r.text()
    msg = (await r.json())["error"]["message"]
    assert msg.removeprefix("the body is not valid JSON: ").startswith(f"{field}: "), msg
    assert says in msg, msg
    r = await client.post("/api/v1/models", json=_model(), headers=AUTH)
    assert r.status == 201
    r = await client.patch("/api/v1/models/chat", json={"scaling": scaling}, headers=AUTH)
    assert r.status == 400
    assert (await r.json())["error"]["message"].removeprefix("the body is not valid JSON: ").startswith(f"{field}: ")


async def test_a_fail_closed_judge_never_scales_to_zero(client: TestClient[Any, Any]) -> None:
    r = await client.post("/api/v1/models", json=_model("judge-b", min=0), headers=AUTH)
    assert r.status == 400
    assert (await r.json())["error"]["message"] == (
        "scaling.min: 0 is refused for 'judge-b': it judges the guard policy 'safety', which fails closed "
        "(every request it guards would be refused while a judge starts from zero); set scaling.min to 1 or more"
    )
    r = await client.post("/api/v1/models", json=_model("judge-b", min=1), headers=AUTH)
    assert r.status == 201
    r = await client.patch("/api/v1/models/judge-b", json={"scaling": {"min": 0}}, headers=AUTH)
    assert r.status == 400
    r = await client.post("/api/v1/models", json=_model("judge-c", min=0), headers=AUTH)  # fail: open
    assert r.status == 201


async def test_autoscale_view_from_the_store(client: TestClient[Any, Any], store: Store) -> None:
    r = await client.post("/api/v1/models", json=_model(min=1, max=3), headers=AUTH)
    assert r.status == 201
    assert (await r.json())["spec"]["scaling"] == {"min": 1, "max": 3}  # defaults not written out
    r = await client.get("/api/v1/models/chat/autoscale", headers=AUTH)
    view = await r.json()
    assert (view["autoscaled"], view["wanted"], view["target"], view["decisions"]) == (True, 1, 2.0, [])
    store.add_decision(DecisionRow("chat", NOW - 5, 1, 3, "scaled 1 → 3: 5.0 in flight per replica", True))
    store.write_gateway_load("cp-a", [GatewayLoadRow("cp-a", "chat", 4, 2, NOW - 1, {"r1": 4})], now=NOW - 1)
    store.write_gateway_load("cp-b", [GatewayLoadRow("cp-b", "chat", 1, 0, NOW - 10)], now=NOW - 10)  # stale
    store.add_replica(ReplicaRow(id="chat-a", model="chat", node="n", profile="cpu", key="k", state="ready",
                                 endpoint="h:1", created_at=NOW))
    store.add_replica(ReplicaRow(id="chat-b", model="chat", node="n", profile="cpu", key="k", state="ready",
                                 endpoint="h:2", created_at=NOW, draining_since=NOW - 1))
    view = await (await client.get("/api/v1/models/chat/autoscale", headers=AUTH)).json()
    assert {k: view[k] for k in ("wanted", "ready", "draining", "in_flight", "queued")} == {
        "wanted": 3, "ready": 1, "draining": 1, "in_flight": 4, "queued": 2}
    assert view["decisions"][0]["reason"] == "scaled 1 → 3: 5.0 in flight per replica"
    models = await (await client.get("/api/v1/models", headers=AUTH)).json()
    assert models[0]["replicas_wanted"] == 3
    r = await client.get("/api/v1/models/nope/autoscale", headers=AUTH)
    assert r.status == 404
