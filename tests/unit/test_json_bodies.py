"""Deeply nested or oversized JSON bodies get a JSON 400/413 in each API's error
shape, never a plain-text 500 and a traceback: gateway, admin API (with its guard routes) and agent
API (real mTLS), all over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from aiohttp import web

from llmgw import tlsconf
from llmgw.control.api.admin import build_admin_app
from llmgw.control.api.agent import build_agent_app
from llmgw.control.api.guard import add_guard_routes
from llmgw.control.gateway.app import build_gateway_app
from llmgw.control.store import default_url, open_store
from llmgw.control.store.offloop import OffLoop
from llmgw.errors import JsonBodyError
from llmgw.guard.config import GuardConfig
from llmgw.jsonbody import loads, nesting_depth
from llmgw.routing import Route, StaticRouter
from tests.helpers.gateway import ServerThread

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

DEEP = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJECT = b'{"a":' * 50_000 + b"1" + b"}" * 50_000


@dataclass
class Apis:
    admin: str
    agent: str
    gateway: str
    agent_ctx: httpx.Client


@pytest.fixture(scope="module")
def apis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Apis]:
    tmp = tmp_path_factory.mktemp("json")
    store = open_store(default_url("", tmp / "j.db"))  # module scope: one store for the module's tests
    ca = tlsconf.CA.create()
    ca.write(tmp)
    cert, key = ca.issue_server(["127.0.0.1"]).write(tmp, "server")
    ccert, ckey = ca.issue_client("node-1").write(tmp, "agent")
    servers = ServerThread()
    admin_app = build_admin_app(store, token=TOKEN)
    add_guard_routes(admin_app, inspector=None, config=GuardConfig(), store=store, serve=None, db=OffLoop())
    admin = servers.serve(admin_app)
    gateway = servers.serve(build_gateway_app(
        StaticRouter(routes={"m": Route("m", ())}), keys={"k"}, allow_loopback_without_key=True
    ))

    async def agent_site() -> int:
        runner = web.AppRunner(build_agent_app(store), shutdown_timeout=0.1)
        await runner.setup()
        ctx = tlsconf.server_context(tmp / "ca.pem", cert, key)
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx).start()
        servers._runners.append(runner)
        port: int = runner.addresses[-1][1]
        return port

    agent = servers.run(agent_site())
    with httpx.Client(verify=tlsconf.client_context(tmp / "ca.pem", ccert, ckey), timeout=60) as client:
        yield Apis(f"http://127.0.0.1:{admin}", f"https://127.0.0.1:{agent}", f"http://127.0.0.1:{gateway}", client)
    servers.close()
    store.close()


def admin_error(r: httpx.Response, status: int) -> dict[str, str]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message"}
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("body", [DEEP, DEEP_OBJECT])
@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/api/v1/models"), ("PATCH", "/api/v1/models/x"), ("PUT", "/api/v1/models/x/profiles")],
)
def test_admin_api_deep_json_is_a_json_400(apis: Apis, method: str, path: str, body: bytes) -> None:
    if method != "POST":  # the model must exist for PATCH/PUT to read the body
        httpx.post(apis.admin + "/api/v1/models", headers=AUTH, json={
            "name": "x", "source": "http://m/x.gguf", "profiles": [{"name": "cpu"}]})
    r = httpx.request(method, apis.admin + path, content=body, headers=AUTH, timeout=60)
    e = admin_error(r, 400)
    assert e["code"] == "json_too_deep"
    assert "more than 64 levels" in e["message"]


def test_admin_guard_test_route_deep_json_is_a_json_400(apis: Apis) -> None:
    r = httpx.post(apis.admin + "/api/v1/guard/test", content=DEEP, headers=AUTH, timeout=60)
    assert admin_error(r, 400)["code"] == "invalid_request"


def test_admin_api_body_over_1_mib_is_a_json_413(apis: Apis) -> None:
    big = json.dumps({"name": "x", "description": "a" * (2 * 1024 * 1024)}).encode()
    r = httpx.post(apis.admin + "/api/v1/models", content=big, headers=AUTH, timeout=60)
    assert r.status_code == 413
    assert r.json()["error"]["code"] in ("body_too_large", "http_error")


@pytest.mark.parametrize("body", [DEEP, DEEP_OBJECT])
def test_gateway_deep_json_is_an_openai_400(apis: Apis, body: bytes) -> None:
    r = httpx.post(apis.gateway + "/v1/chat/completions", content=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "json_too_deep"
    assert err["type"] == "invalid_request_error"
    assert "more than 64 levels" in err["message"]


def test_gateway_infinite_numbers_are_an_openai_400(apis: Apis) -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}'
    r = httpx.post(apis.gateway + "/v1/chat/completions", content=raw, timeout=60)
    assert r.status_code == 400, r.text
    assert "too large for a 64-bit float" in r.json()["error"]["message"]


@pytest.mark.parametrize("body", [DEEP, DEEP_OBJECT, b'{"inventory": {"cores": 1e400}}'])
def test_agent_api_deep_or_infinite_json_is_a_json_400(apis: Apis, body: bytes) -> None:
    r = apis.agent_ctx.post(apis.agent + "/agent/v1/heartbeat", content=body)
    e = admin_error(r, 400)
    assert e["code"] in ("json_too_deep", "invalid_json")


def test_agent_api_body_over_1_mib_is_a_json_413(apis: Apis) -> None:
    big = json.dumps({"inventory": {}, "agent_version": "a" * (2 * 1024 * 1024)}).encode()
    r = apis.agent_ctx.post(apis.agent + "/agent/v1/heartbeat", content=big)
    assert admin_error(r, 413)["code"] == "body_too_large"


# --- the helper itself ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "depth"),
    [(b"1", 0), (b"[]", 1), (b'{"a": [1, {"b": "[[[[[["}]}', 3), (b'["\\"[[["]', 1), (b"[[],[[],[[]]]]", 4)],
)
def test_nesting_depth_ignores_brackets_in_strings(raw: bytes, depth: int) -> None:
    assert nesting_depth(raw) == depth


def test_depth_64_passes_and_65_is_refused() -> None:
    assert loads(b"[" * 64 + b"]" * 64) is not None
    with pytest.raises(JsonBodyError) as e:
        loads(b"[" * 65 + b"]" * 65)
    assert (e.value.status, e.value.code) == (400, "json_too_deep")


def test_a_megabyte_of_brackets_is_refused_quickly() -> None:
    """Not a speed assertion: a bound that only an O(n^2) or recursive count would miss."""
    t0 = time.monotonic()
    for raw in (b"[" * 1_000_000, b"[]" * 500_000 + b"[" * 70):
        with pytest.raises(JsonBodyError):
            loads(raw)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("raw", [b"NaN", b"[Infinity]", b"-Infinity", b"1e400", b"9" * 5000, b"\xff"])
def test_what_is_not_json_or_not_finite_is_invalid_json(raw: bytes) -> None:
    with pytest.raises(JsonBodyError) as e:
        loads(raw)
    assert e.value.code == "invalid_json"


def test_plain_json_parses() -> None:
    assert loads('{"a": [1.5, "x"]}') == {"a": [1.5, "x"]}


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"scaling": {"min": 1, "target": NaN}}', "scaling.target: NaN is not a JSON number"),
        (b'{"messages": [{"n": 1}, {"n": 1e400}]}', "messages[1].n: the number 1e400 is too large"),
        (b"Infinity", "the body: Infinity is not a JSON number"),
    ],
)
def test_a_non_finite_number_is_refused_naming_its_field(raw: bytes, says: str) -> None:
    with pytest.raises(JsonBodyError) as e:
        loads(raw)
    assert e.value.status == 400
    assert e.value.message.startswith("the body is not valid JSON: " + says), e.value.message
