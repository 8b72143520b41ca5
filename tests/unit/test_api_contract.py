"""The admin API's contract with its OpenAPI document, 405s, and malformed requests, on a real control
plane (``serve`` in-process, SQLite; the agent listener over mTLS).

- Every route the control plane serves under ``/api/`` is in the document and the document lists
  no route that does not exist; each operation names its path parameters (``{action}`` with its
  values); and every status a route answered to hostile or wrong requests (no token, unknown names,
  an empty, malformed or 2 MiB body, bad query values) is one its operation documents.
- A 405, on the admin API (its dashboard too) and on the gateway, carries ``Allow`` (RFC 9110), listing the methods the
  path takes.
- A request with a 10 KB header line gets a 400 and one log line without a traceback, on every
  listener (admin, gateway, agent, and a mirror's two), and no part of the header is logged.
"""

from __future__ import annotations

import asyncio
import io
import logging
import re
import ssl
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest

from llmgw.config import load_server_config
from llmgw.control.api.logbroker import LogBroker
from llmgw.control.api.metrics import ControlPlaneMetrics
from llmgw.control.api.openapi import build_openapi
from llmgw.control.gateway.callers import Callers
from llmgw.control.gateway.keys import GatewayKeys
from llmgw.control.server import _admin_app
from llmgw.control.store import open_store
from llmgw.control.store.offloop import OffLoop
from tests.helpers.control import TOKEN, Install, make_install, serving
from tests.helpers.mirrors import Mirror

AUTH = {"Authorization": f"Bearer {TOKEN}"}
_PARAM = re.compile(r"\{(\w+)(?::[^}]*)?\}")
#: What each path parameter is filled with: names that exist nowhere (the node action: a real one).
FILL = {"name": "no-such-thing", "id": "no-such-thing", "serial": "0ABC", "action": "cordon"}


def _served_routes(inst: Install) -> set[tuple[str, str]]:
    """(METHOD, path template) of every ``/api/`` route of the admin app, built as ``serve`` builds it."""
    config = load_server_config(inst.config)
    store = open_store(f"sqlite:///{inst.root / 'routes.db'}")
    db = OffLoop()

    async def settle() -> None:
        return None

    app = _admin_app(store, TOKEN, lambda: None, config, None, LogBroker(), db, settle,
                     cast(Any, None), ControlPlaneMetrics(), inst.paths, Callers(GatewayKeys(None)), dict)
    routes = set()
    for r in app.router.routes():
        info = r.resource.get_info() if r.resource is not None else {}
        path = str(info.get("formatter") or info.get("path"))
        if r.method not in ("HEAD", "*") and path.startswith("/api/"):
            routes.add((r.method, path))
    db.close()
    store.close()
    return routes


def test_every_served_route_and_its_path_parameters_are_in_the_document(tmp_path: Path) -> None:
    inst = make_install(tmp_path)
    doc = build_openapi()
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    served = _served_routes(inst)
    assert served - documented == set(), "routes missing from openapi.py"
    assert documented - served == set(), "operations in openapi.py that no route serves"
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            named = {p["name"] for p in op.get("parameters", ()) if p["in"] == "path"}
            assert named == set(_PARAM.findall(path)), f"{method.upper()} {path}: path parameters"
    action = next(p for p in doc["paths"]["/api/v1/nodes/{id}/{action}"]["post"]["parameters"]
                  if p["name"] == "action")
    assert action["schema"]["enum"] == ["cordon", "uncordon", "drain"]


def _requests(method: str, op: dict[str, Any]) -> list[tuple[dict[str, str], bytes | None, str]]:
    """(headers, body, query) to try on one operation: no token, and with the token an empty, a
    malformed and a 2 MiB body (body operations), bad query values (query operations)."""
    tries: list[tuple[dict[str, str], bytes | None, str]] = []
    if op.get("security") != []:
        tries.append(({}, None, ""))
    if "requestBody" in op:
        tries += [(AUTH, b"{}", ""), (AUTH, b"[", ""), (AUTH, b'{"x": "' + b"a" * (2 << 20) + b'"}', "")]
    else:
        tries.append((AUTH, None, ""))
    queries = [p["name"] for p in op.get("parameters", ()) if p["in"] == "query"]
    if queries:
        tries.append((AUTH, None, "&".join(f"{q}=-1x" for q in queries)))
    return tries


async def test_every_status_a_route_answers_is_documented(tmp_path: Path) -> None:
    """Two passes: names that exist nowhere (every method), then a model and a key that exist (the
    methods that change nothing but what the bad bodies would)."""
    inst = make_install(tmp_path)
    doc = build_openapi()
    undocumented: list[str] = []
    model = {"name": "chat", "source": "http://m/chat.gguf", "profiles": [{"name": "cpu"}]}
    async with serving(inst), aiohttp.ClientSession() as s:
        for fill, methods in ((FILL, {"get", "post", "put", "patch", "delete"}),
                              ({**FILL, "name": "chat"}, {"get", "put", "patch"}),
                              ({**FILL, "name": "team"}, {"get", "put", "patch"})):
            if fill["name"] == "chat":
                async with s.post(inst.admin + "/api/v1/models", json=model, headers=AUTH) as r:
                    assert r.status == 201, await r.text()
                async with s.post(inst.admin + "/api/v1/keys", json={"name": "team"}, headers=AUTH) as r:
                    assert r.status == 201, await r.text()
            await _probe(s, inst, doc, fill, methods, undocumented)
        # guardrails off: a well-formed test is refused
        async with s.post(inst.admin + "/api/v1/guard/test", json={"text": "hi"}, headers=AUTH) as r:
            if str(r.status) not in doc["paths"]["/api/v1/guard/test"]["post"]["responses"]:
                undocumented.append(f"POST /api/v1/guard/test (a text): {r.status}")
    assert undocumented == [], "\n".join(undocumented)


async def _probe(s: aiohttp.ClientSession, inst: Install, doc: dict[str, Any], fill: dict[str, str],
                 methods: set[str], undocumented: list[str]) -> None:
    """Send :func:`_requests` to every operation of ``methods``, path parameters from ``fill``; add
    each answer whose status the operation does not document to ``undocumented``."""
    for template, ops in doc["paths"].items():
        path = _PARAM.sub(lambda m: fill[m.group(1)], template)
        for method, op in ops.items():
            if method not in methods:
                continue
            for headers, body, query in _requests(method, op):
                url = inst.admin + path + ("?" + query if query else "")
                data = io.BytesIO(body) if body is not None else None
                async with s.request(method.upper(), url, headers=headers, data=data) as r:
                    await r.read()
                    if str(r.status) not in op["responses"]:
                        undocumented.append(f"{method.upper()} {path}{'?' + query if query else ''} "
                                            f"({'token' if headers else 'no token'}, body "
                                            f"{len(body) if body is not None else '-'}): {r.status}")


async def test_405_carries_allow_on_the_admin_api_and_the_gateway(tmp_path: Path) -> None:
    inst = make_install(tmp_path)
    gw = f"http://127.0.0.1:{inst.ports['gateway']}"
    doc = build_openapi()
    async with serving(inst), aiohttp.ClientSession() as s:
        for template, ops in doc["paths"].items():
            path = _PARAM.sub(lambda m: FILL[m.group(1)], template)
            wrong = next(m for m in ("PUT", "PATCH", "DELETE", "POST") if m.lower() not in ops)
            async with s.request(wrong, inst.admin + path, headers=AUTH) as r:
                assert r.status == 405, (wrong, template)
                assert "Allow" in r.headers, f"{wrong} {template}: 405 without Allow"
                allowed = {m.strip() for m in r.headers["Allow"].split(",")} - {"HEAD"}
                assert allowed == {m.upper() for m in ops}, template
        async with s.put(inst.admin + "/ui/login") as r:  # the dashboard, on the admin listener
            assert r.status == 405
            assert {m.strip() for m in r.headers.get("Allow", "").split(",")} == {"GET", "HEAD", "POST"}
        for method, path, allow in (("GET", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET"),
                                    ("POST", "/v1/models/gemma", "GET"), ("PUT", "/v1/embeddings", "POST"),
                                    ("POST", "/healthz", "GET, HEAD")):
            async with s.request(method, gw + path) as r:
                assert r.status == 405, (method, path, await r.text())
                assert r.headers.get("Allow") == allow, (method, path)
                assert (await r.json())["error"]["code"] == "method_not_allowed"


async def _raw(host: str, port: int, request: bytes, ctx: ssl.SSLContext | None = None) -> bytes:
    reader, writer = await asyncio.open_connection(host, port, ssl=ctx)
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(4096), 10)
    writer.close()
    return answer


async def test_an_over_long_header_is_a_400_and_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    inst = make_install(tmp_path)
    secret = "Bearer sk-llmgw-" + "s3cret" * 1700  # 10 KB: over aiohttp's 8190-byte field limit
    request = f"GET /api/v1/health HTTP/1.1\r\nHost: x\r\nAuthorization: {secret}\r\n\r\n".encode()
    async with serving(inst), Mirror(tmp_path / "mirror") as mirror:
        caplog.clear()
        answers = [
            await _raw("127.0.0.1", inst.ports["admin"], request),
            await _raw("127.0.0.1", inst.ports["gateway"], request),
            await _raw("127.0.0.1", inst.ports["agent"], request, inst.agent_ctx("node-1")),
            await _raw("127.0.0.1", mirror.server.api_port, request),
            await _raw("127.0.0.1", mirror.server.bytes_port, request),
        ]
        await asyncio.sleep(0.2)
        records = [r for r in caplog.records if r.name in ("aiohttp.server", "llmgw.http")]  # not access lines
    for a in answers:
        status_line = a.split(b"\r\n")[0]
        assert status_line.startswith(b"HTTP/1."), a[:200]
        assert b" 400 " in status_line, a[:200]
    assert [r.exc_info for r in caplog.records if r.exc_info] == [], "a traceback was logged"
    assert len(records) == len(answers), [r.getMessage() for r in records]
    for r in records:
        assert r.levelno == logging.WARNING
        assert "8190" in r.getMessage()
        assert "127.0.0.1" in r.getMessage()
    assert "s3cret" not in caplog.text
