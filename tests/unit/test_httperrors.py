"""The shared HTTP error edge (:mod:`llmgw.httperrors`): both wire shapes, and the middleware on a
real aiohttp app served over real HTTP."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx
import pytest
from aiohttp import web

from llmgw import jsonbody
from llmgw.errors import Conflict, HttpError, Revoked
from llmgw.httperrors import (
    error_json,
    error_middleware,
    openai_error_body,
    openai_error_event,
    openai_error_json,
)
from tests.helpers.gateway import ServerThread


def test_error_json_is_code_and_message_only() -> None:
    r = error_json(409, "model_exists", "taken", headers={"Retry-After": "2"})
    assert r.status == 409
    assert r.content_type == "application/json"
    assert r.headers["Retry-After"] == "2"
    assert r.text is not None
    assert json.loads(r.text) == {"error": {"code": "model_exists", "message": "taken"}}


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "invalid_request_error"),
        (429, "rate_limit_error"),
        (502, "api_error"),
        (503, "api_error"),
    ],
)
def test_openai_body_types_follow_the_status(status: int, kind: str) -> None:
    assert openai_error_body(status, "c", "m") == {
        "error": {"message": "m", "type": kind, "param": None, "code": "c"}
    }


def test_openai_json_adds_extra_fields_and_bearer_on_401() -> None:
    r = openai_error_json(400, "content_policy_violation", "no", extra={"policy": "default"})
    assert r.text is not None
    assert json.loads(r.text)["error"] == {
        "message": "no", "type": "invalid_request_error", "param": None,
        "code": "content_policy_violation", "policy": "default",
    }
    assert "WWW-Authenticate" not in r.headers
    assert openai_error_json(401, "invalid_api_key", "key?").headers["WWW-Authenticate"] == "Bearer"


def test_openai_event_ends_the_stream_well_formed() -> None:
    raw = openai_error_event(503, "shutting_down", "bye", extra={"direction": "out"})
    first, done, tail = raw.split(b"\n\n")
    assert first.startswith(b"data: ")
    assert json.loads(first[len(b"data: "):])["error"] == {
        "message": "bye", "type": "api_error", "param": None, "code": "shutting_down", "direction": "out",
    }
    assert (done, tail) == (b"data: [DONE]", b"")


@pytest.fixture
def url() -> Iterator[str]:
    async def refuse(_: web.Request) -> web.Response:
        raise HttpError(429, "busy", "come back later", headers={"Retry-After": "3"})

    async def body(request: web.Request) -> web.Response:
        return web.json_response(await jsonbody.read_json(request))

    async def conflict(_: web.Request) -> web.Response:
        raise Revoked("0A", "n1", 1.0)  # a Conflict subclass: matched by the Conflict entry

    async def boom(_: web.Request) -> web.Response:
        raise RuntimeError("secret detail")

    async def moved(_: web.Request) -> web.Response:
        raise web.HTTPFound("/refuse")

    app = web.Application(middlewares=[error_middleware(service="the test API", known={Conflict: (409, "conflict")})])
    app.router.add_get("/refuse", refuse)
    app.router.add_post("/body", body)
    app.router.add_get("/conflict", conflict)
    app.router.add_get("/boom", boom)
    app.router.add_get("/moved", moved)
    servers = ServerThread()
    yield f"http://127.0.0.1:{servers.serve(app)}"
    servers.close()


def error_of(r: httpx.Response, status: int) -> dict[str, str]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message"}
    return body["error"]  # type: ignore[no-any-return]


def test_http_error_keeps_its_status_code_message_and_headers(url: str) -> None:
    r = httpx.get(url + "/refuse")
    assert error_of(r, 429) == {"code": "busy", "message": "come back later"}
    assert r.headers["Retry-After"] == "3"


def test_a_json_body_error_is_answered_in_the_shape(url: str) -> None:
    deep = b"[" * 100 + b"]" * 100
    assert error_of(httpx.post(url + "/body", content=deep), 400)["code"] == "json_too_deep"
    assert httpx.post(url + "/body", content=b'{"a": 1}').json() == {"a": 1}


def test_aiohttp_refusals_are_named(url: str) -> None:
    assert error_of(httpx.get(url + "/nowhere"), 404) == {"code": "not_found", "message": "GET /nowhere: Not Found"}
    assert error_of(httpx.delete(url + "/refuse"), 405)["code"] == "method_not_allowed"


def test_a_redirect_passes_through(url: str) -> None:
    r = httpx.get(url + "/moved")
    assert r.status_code == 302
    assert r.headers["Location"] == "/refuse"


def test_a_known_error_gets_its_status(url: str) -> None:
    e = error_of(httpx.get(url + "/conflict"), 409)
    assert e == {"code": "conflict", "message": "certificate serial 0A of node 'n1' is revoked"}


def test_anything_else_is_a_logged_500_without_detail(url: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="llmgw.httperrors"):
        e = error_of(httpx.get(url + "/boom"), 500)
    assert e == {"code": "internal", "message": "the test API failed on this request; see its log"}
    assert "secret" not in e["message"]
    (record,) = [r for r in caplog.records if r.name == "llmgw.httperrors"]
    assert "GET /boom" in record.getMessage()
    assert record.exc_info is not None
    assert "secret detail" in str(record.exc_info[1])
