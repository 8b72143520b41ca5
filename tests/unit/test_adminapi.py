"""Admin API in-process (aiohttp TestServer on loopback): auth, shapes, status codes, error bodies."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from llmgw.catalog import Model
from llmgw.control.api.admin import build_admin_app
from llmgw.control.api.guard import add_guard_routes
from llmgw.control.api.openapi import build_openapi
from llmgw.control.reconcile.leader import Leader
from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.ggufheader import GgufFacts
from llmgw.guard.config import GuardConfig
from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ProvisionState

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GB = 1_000_000_000

MODEL: dict[str, Any] = {
    "name": "chat",
    "aliases": ["default"],
    "source": "http://mirror:8081/chat/1/chat.gguf",
    "scaling": {"min": 1, "max": 1},
    "profiles": [{"name": "cpu", "min_memory_gb": 1, "cpu_cores": 2, "args": ["--ctx-size", "4096"]}],
}


@pytest.fixture
async def client(store: Store) -> AsyncIterator[TestClient[Any, Any]]:
    changes: list[int] = []
    app = build_admin_app(store, token=TOKEN, on_change=lambda: changes.append(1), clock=lambda: 1000.0)
    async with TestClient(TestServer(app)) as c:
        yield c


async def err(resp: Any, status: int) -> dict[str, str]:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message"}
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/v1/models"),
        ("POST", "/api/v1/models"),
        ("DELETE", "/api/v1/models/chat"),
        ("GET", "/api/v1/nodes"),
        ("DELETE", "/api/v1/nodes/node-a"),
        ("GET", "/api/v1/openapi.json"),
        ("GET", "/api/v1/explain-placement?model=chat"),
    ],
)
async def test_every_route_needs_the_token(client: TestClient[Any, Any], method: str, path: str) -> None:
    e = await err(await client.request(method, path), 401)
    assert "missing" in e["message"]
    e = await err(await client.request(method, path, headers={"Authorization": "Bearer nope"}), 401)
    assert e["code"] == "unauthorized"
    assert "wrong" in e["message"]


async def test_health_needs_no_token(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/api/v1/health")
    assert resp.status == 200
    assert await resp.json() == {"status": "ok", "pid": os.getpid()}


async def test_models_crud(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/api/v1/models", json=MODEL, headers=AUTH)
    assert resp.status == 201, await resp.text()
    view = await resp.json()
    assert (view["name"], view["scaling_min"], view["aliases"]) == ("chat", 1, ["default"])

    e = await err(await client.post("/api/v1/models", json=MODEL, headers=AUTH), 409)
    assert e["code"] == "conflict"
    assert "already exists" in e["message"]
    clash = {**MODEL, "name": "other", "aliases": ["default"]}
    e = await err(await client.post("/api/v1/models", json=clash, headers=AUTH), 409)
    assert "'default'" in e["message"]

    listed = await (await client.get("/api/v1/models", headers=AUTH)).json()
    assert [m["name"] for m in listed] == ["chat"]

    resp = await client.patch(
        "/api/v1/models/chat", json={"description": "hi", "scaling": {"max": 2}}, headers=AUTH
    )
    assert resp.status == 200, await resp.text()
    got = await (await client.get("/api/v1/models/chat", headers=AUTH)).json()
    assert got["spec"]["description"] == "hi"
    assert got["spec"]["scaling"] == {"min": 1, "max": 2}

    e = await err(await client.patch("/api/v1/models/chat", json={"name": "x"}, headers=AUTH), 400)
    assert e["message"].startswith("name:")

    profiles = [{"name": "gpu", "gpu_class": "h100-80gb", "priority": 200}, {"name": "cpu"}]
    resp = await client.put("/api/v1/models/chat/profiles", json=profiles, headers=AUTH)
    assert resp.status == 200, await resp.text()
    got = await (await client.get("/api/v1/models/chat", headers=AUTH)).json()
    assert [p["name"] for p in got["spec"]["profiles"]] == ["gpu", "cpu"]
    e = await err(await client.put("/api/v1/models/chat/profiles", json=[{"nme": "x"}], headers=AUTH), 400)
    assert "profiles.0" in e["message"]

    assert (await client.delete("/api/v1/models/chat", headers=AUTH)).status == 204
    await err(await client.delete("/api/v1/models/chat", headers=AUTH), 404)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**MODEL, "profiles": []}, "profiles"),
        ({k: v for k, v in MODEL.items() if k != "source"}, "source"),
        ({**MODEL, "name": "Bad Name"}, "name"),
        ({**MODEL, "colour": "red"}, "colour: unknown field"),
        # our own messages without pydantic's "Value error, " before them (a new user's finding)
        ({**MODEL, "scaling": {"min": 3, "max": 1}}, "scaling: scaling.min 3 is more than scaling.max 1"),
        ({**MODEL, "profiles": {"0": {"cpu_cores": 1}}},
         "profiles: Input should be a valid list (a model's profiles are set whole: 'llmgw ctl model set-profiles"),
        ({**MODEL, "profiles": [{"name": "cpu", "nodes": 0}]}, "profiles.0.nodes: Input should be greater than or equal to 1"),  # noqa: E501
        ({**MODEL, "profiles": [{"name": "cpu", "nodes": 17}]}, "profiles.0.nodes: Input should be less than or equal to 16"),  # noqa: E501
        ({**MODEL, "profiles": [{"name": "cpu", "env": {"LD_PRELOAD": "/x.so"}}]}, "profiles.0.env: LD_PRELOAD: only NCCL_*"),  # noqa: E501
        # a new user's finding (2026-12-04): the control plane read file:/etc/shadow as root to estimate
        # it (and quoted its first bytes), and every node then failed to download it, 6 tries each
        ({**MODEL, "source": "file:/etc/shadow"}, "source: 'file:/etc/shadow' is not a URL nodes can download"),
        ({**MODEL, "source": "hf:o/r/m.gguf"}, "source: 'hf:o/r/m.gguf' is not a URL nodes can download"),
        ({**MODEL, "source": "https://mirror.test/"}, "source: cannot turn 'https://mirror.test/' into a download: "
                                                      "the URL names no file"),
        # a new user's finding: the agent (root) fetched a source at the cloud's metadata address
        ({**MODEL, "source": "http://169.254.169.254/latest/x.gguf"},
         "source: 169.254.169.254 is a link-local address: nodes never download weights from a link-local address"),
        ({**MODEL, "source": "http://[fe80::1]:8081/m/1/x.gguf"}, "source: fe80::1 is a link-local address"),
        ({**MODEL, "source": "http://[::ffff:169.254.1.1]/x.gguf"}, "source: 169.254.1.1 is a link-local address"),
    ],
)
async def test_invalid_model_is_400_naming_the_field(
    client: TestClient[Any, Any], body: Any, field: str
) -> None:
    e = await err(await client.post("/api/v1/models", json=body, headers=AUTH), 400)
    assert e["code"] == "invalid_model"
    assert e["message"].startswith(field), e["message"]
    assert (await client.get("/api/v1/models", headers=AUTH)).status == 200
    assert await (await client.get("/api/v1/models", headers=AUTH)).json() == []  # nothing stored


async def test_a_patch_to_a_file_source_is_refused(client: TestClient[Any, Any]) -> None:
    assert (await client.post("/api/v1/models", json=MODEL, headers=AUTH)).status == 201
    e = await err(await client.patch("/api/v1/models/chat", json={"source": "file:/srv/m.gguf"}, headers=AUTH), 400)
    assert "put the weights in the mirror first ('llmgw mirror add FILE" in e["message"]
    view = await (await client.get("/api/v1/models/chat", headers=AUTH)).json()
    assert view["source"] == MODEL["source"]


async def test_a_model_stored_before_the_source_rule_stays_editable(store: Store, client: TestClient[Any, Any]) -> None:
    """The http(s) rule is checked when the source is written, not at every edit: a model stored with a
    file: source (before the rule) can still be scaled to 0, and its source changed to a URL."""
    store.add_model(Model.model_validate({**MODEL, "source": "file:/srv/m.gguf"}), now=1.0)
    resp = await client.patch("/api/v1/models/chat", json={"scaling": {"min": 0, "max": 1}}, headers=AUTH)
    assert resp.status == 200, await resp.text()
    resp = await client.patch("/api/v1/models/chat", json={"source": "http://mirror.test/m/1/m.gguf"}, headers=AUTH)
    assert resp.status == 200, await resp.text()


async def test_not_json_and_unknown_routes(client: TestClient[Any, Any]) -> None:
    e = await err(await client.post("/api/v1/models", data=b"{nope", headers=AUTH), 400)
    assert e["code"] == "invalid_json"
    await err(await client.get("/api/v1/models/nope", headers=AUTH), 404)
    e = await err(await client.get("/api/v1/nowhere", headers=AUTH), 404)
    assert e["code"] == "not_found"
    await err(await client.get("/api/v1/explain-placement?model=nope", headers=AUTH), 404)
    await err(await client.get("/api/v1/explain-placement", headers=AUTH), 400)
    await err(await client.post("/api/v1/replicas/nope/restart", headers=AUTH), 404)


async def test_nodes_replicas_explain_and_restart(client: TestClient[Any, Any], store: Store) -> None:
    inv = Inventory(cores=4, memory_total_bytes=8 * GB, memory_available_bytes=6 * GB)
    engines = [
        EngineStatus(
            engine="llamacpp", state=ProvisionState.INSTALLED, version="b1", detail="/bin/llama-server"
        ),
        EngineStatus(engine="vllm", state=ProvisionState.UNSUPPORTED, detail="no GPU"),
    ]
    store.upsert_node_heartbeat("node-a", Heartbeat(inventory=inv, engines=engines), 999.0)
    await client.post("/api/v1/models", json=MODEL, headers=AUTH)
    ex = await (await client.get("/api/v1/explain-placement?model=chat", headers=AUTH)).json()
    assert ex["placed"] is False
    assert "not evaluated yet" in ex["summary"]
    Leader(store, node_lost_after_s=30).reconcile_once(1000.0)

    nodes = await (await client.get("/api/v1/nodes", headers=AUTH)).json()
    (n,) = nodes
    assert (n["id"], n["state"], n["engines"]) == ("node-a", "ready", ["llamacpp"])
    assert n["provision"][1] == {"engine": "vllm", "version": "", "state": "unsupported", "detail": "no GPU"}
    assert n["resources"]["memory_reserved_bytes"] == GB
    assert n["resources"]["cores_reserved"] == 2

    reps = await (await client.get("/api/v1/replicas?model=chat", headers=AUTH)).json()
    (rep,) = reps
    assert (rep["node"], rep["profile"], rep["state"]) == ("node-a", "cpu", "pending")
    assert "key" not in rep
    unknown = await client.get("/api/v1/replicas?model=other", headers=AUTH)
    assert unknown.status == 404
    assert "no model 'other' in the catalog (known: chat)" in (await unknown.json())["error"]["message"]
    by_alias = await client.get("/api/v1/explain-placement?model=default", headers=AUTH)
    assert by_alias.status == 200
    assert (await by_alias.json())["model"] == "chat"
    assert len(await (await client.get("/api/v1/replicas?model=default", headers=AUTH)).json()) == 1

    ex = await (await client.get("/api/v1/explain-placement?model=chat", headers=AUTH)).json()
    assert ex["placed"] is True
    assert ex["summary"] == "1/1 replicas placed on node-a"
    assert ex["failed"] == []

    # placed, then its engine fails: the explanation (the leader's, from before) says so when read
    (row,) = store.list_replicas(model="chat")
    store.update_replica(
        replace(row, state="failed", err="llama-server exited with status 1\nerror: unknown model architecture")
    )
    ex = await (await client.get("/api/v1/explain-placement?model=chat", headers=AUTH)).json()
    assert ex["placed"] is True
    assert ex["failed"] == [{"replica": row.id, "node": "node-a", "error": "llama-server exited with status 1"}]

    resp = await client.post(f"/api/v1/replicas/{rep['id']}/restart", headers=AUTH)
    assert resp.status == 202
    new = await resp.json()
    assert new["id"] != rep["id"]
    assert (new["node"], new["restarts"], new["state"]) == ("node-a", 0, "pending")  # not a crash
    assert [r.id for r in store.list_replicas()] == [new["id"]]


async def test_openapi_document(client: TestClient[Any, Any]) -> None:
    doc = await (await client.get("/api/v1/openapi.json", headers=AUTH)).json()
    assert doc["openapi"].startswith("3.")
    assert {"NodeView", "ReplicaView", "ExplainView", "Model", "ErrorResponse"} <= set(
        doc["components"]["schemas"]
    )
    assert set(doc["paths"]["/api/v1/models/{name}"]) == {"get", "patch", "delete"}
    assert doc["paths"]["/api/v1/health"]["get"]["security"] == []


def test_every_admin_route_is_in_the_openapi_document(store: Store) -> None:
    """A route added without its operation in openapi.py fails here (guard routes included)."""
    app = build_admin_app(store, token=TOKEN)
    add_guard_routes(app, inspector=None, config=GuardConfig(), store=store, serve=None, db=OffLoop())
    documented = {(m.upper(), p) for p, ops in build_openapi()["paths"].items() for m in ops}
    routes = set()
    for r in app.router.routes():
        info = r.resource.get_info() if r.resource is not None else {}
        path = info.get("formatter") or info.get("path")
        if r.method not in ("HEAD", "*") and str(path).startswith("/api/"):
            routes.add((r.method, path))
    assert routes - documented == set()


async def test_a_cordon_answers_the_node_as_get_nodes_shows_it(client: TestClient[Any, Any], store: Store) -> None:
    """A new user's finding: ``ctl node cordon --json`` said ``memory_reserved_bytes: 0`` for a node
    whose ``ctl nodes --json`` said 600000000: the cordon's answer counted the catalog's profile
    (no ``min_memory_gb``), not the estimate placement reserves from the GGUF header. Both count
    the estimate now."""
    inv = Inventory(cores=4, memory_total_bytes=8 * GB, memory_available_bytes=6 * GB)
    engines = [EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")]
    store.upsert_node_heartbeat("node-a", Heartbeat(inventory=inv, engines=engines), 999.0)
    model = {"name": "est", "source": "http://m/est.gguf", "profiles": [{"name": "cpu"}]}  # no min_memory_gb
    assert (await client.post("/api/v1/models", json=model, headers=AUTH)).status == 201
    facts = GgufFacts(architecture="llama", file_size=400_000_000, block_count=16, head_count=8, head_count_kv=[8],
                      key_length=64, value_length=64, embedding_length=1024, context_length=4096)
    store.set_gguf_facts("http://m/est.gguf", body=facts.model_dump_json(), error="", now=999.0)
    Leader(store, node_lost_after_s=30).reconcile_once(1000.0)
    (listed,) = await (await client.get("/api/v1/nodes", headers=AUTH)).json()
    assert listed["resources"]["memory_reserved_bytes"] > 400_000_000  # the weights at least
    cordoned = await (await client.post("/api/v1/nodes/node-a/cordon", headers=AUTH)).json()
    assert cordoned["resources"] == listed["resources"]


async def test_a_cordon_and_a_drain_hold_against_a_beat_between_the_read_and_the_write(
    client: TestClient[Any, Any], store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI found it (the dashboard's cordon under load): the node's agent beat between the cordon's
    read and its write, and the operator got a 409 "changed since revision 8 was read"; a drain's
    delete at a replica's old revision removed nothing and said "drained". Here a real beat (a
    heartbeat written to the same store, moving the node's and its replica's revisions) lands right
    after each read of the node."""
    inv = Inventory(cores=4, memory_total_bytes=8 * GB, memory_available_bytes=6 * GB)
    engines = [EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")]
    hb = Heartbeat(inventory=inv, engines=engines)
    store.upsert_node_heartbeat("node-a", hb, 999.0)
    assert (await client.post("/api/v1/models", json=MODEL, headers=AUTH)).status == 201
    Leader(store, node_lost_after_s=30).reconcile_once(1000.0)
    (placed,) = store.list_replicas(node="node-a")
    read = store.get_node
    beats: list[int] = []

    def read_then_a_beat(node_id: str) -> Any:
        """The node as read; the first read of each action is followed by a beat."""
        row = read(node_id)
        monkeypatch.setattr(store, "get_node", read)  # the beat's own reads, and the action's next
        store.upsert_node_heartbeat(node_id, hb, 1001.0 + len(beats))
        store.update_replica(replace(store.get_replica(placed.id) or placed, err="a report"))
        beats.append(1)
        return row

    monkeypatch.setattr(store, "get_node", read_then_a_beat)
    resp = await client.post("/api/v1/nodes/node-a/cordon", headers=AUTH)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["cordoned"] is True
    assert beats == [1]
    assert read("node-a").cordoned  # type: ignore[union-attr]
    listing = store.list_replicas

    def list_then_a_report(**where: Any) -> Any:
        """The replicas as listed, then their agent's report moves the first one's revision."""
        rows = listing(**where)
        monkeypatch.setattr(store, "list_replicas", listing)
        store.update_replica(replace(store.get_replica(placed.id) or placed, err="another report"))
        return rows

    monkeypatch.setattr(store, "list_replicas", list_then_a_report)
    resp = await client.post("/api/v1/nodes/node-a/drain", headers=AUTH)
    assert resp.status == 200, await resp.text()
    assert store.list_replicas(node="node-a") == []
