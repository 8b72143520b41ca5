"""The gateway over real HTTP on 127.0.0.1: keys, models, errors, relays, and the official openai client.

Fake llama-servers (``tests.helpers.gateway``) stand in for engines; the gateway gets a StaticRouter.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import psutil
import pytest

from llmgw.control.api.metrics import ControlPlaneMetrics
from llmgw.control.gateway.app import build_gateway_app, is_loopback
from llmgw.control.gateway.inspect import Exchange, Refusal, StreamInspector
from llmgw.control.gateway.sse import ModelRewriter
from llmgw.routing import Route, StaticRouter, Upstream
from tests.helpers.gateway import ServerThread, completion, fake_llama, stream_events
from tests.helpers.net import free_port

KEY = "sk-good"


@dataclass
class _StopAtFrom:
    """A stream inspector that refuses once it has seen the word ' from' (a guard stand-in)."""

    async def chunk(self, data: bytes) -> bytes | Refusal:
        return Refusal("answer blocked by policy 'demo'") if b" from" in data else data

    async def end(self) -> bytes | Refusal:
        return b""


class _Guard:
    """Refuses prompts saying 'forbidden'; inspects streams whose prompt says 'guard-stream'."""

    async def prompt(self, route: Route, request: dict[str, Any]) -> Refusal | None:
        if request["messages"][-1]["content"] == "forbidden":
            return Refusal("prompt blocked by policy 'demo'")
        return None

    async def answer(self, route: Route, request: dict[str, Any], response: dict[str, Any]) -> Refusal | None:
        return None

    def stream(self, route: Route, request: dict[str, Any]) -> StreamInspector | None:
        return _StopAtFrom() if request["messages"][-1]["content"] == "guard-stream" else None


@dataclass
class Env:
    url: str
    open_url: str
    endpoints: list[str]
    secrets: list[str]
    notes: list[str]
    exchanges: list[Exchange] = field(default_factory=list)

    def post(self, body: Any, key: str | None = KEY, url: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f"{url or self.url}/v1/chat/completions", content=content, headers=headers)

    def assert_no_internals(self, text: str) -> None:
        for secret in self.endpoints + self.secrets:
            assert secret not in text


def _chat(model: str, text: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    servers = ServerThread()
    notes: list[str] = []
    a = servers.serve(fake_llama("replica-a", "key-a", notes))
    b = servers.serve(fake_llama("replica-b", "key-b"))
    c = servers.serve(fake_llama("replica-c", "key-c", model_path="/srv/node/cache/c.gguf"))
    ua = Upstream("r-a", f"127.0.0.1:{a}", "key-a")
    ub = Upstream("r-b", f"127.0.0.1:{b}", "key-b")
    dead = Upstream("r-dead", f"127.0.0.1:{free_port()}", "key-dead")
    dead2 = Upstream("r-dead2", f"127.0.0.1:{free_port()}", "key-dead2")
    router = StaticRouter(
        routes={
            "gemma": Route("gemma", (ua,), created=1700000000, aliases=("g",)),
            "pair": Route("pair", (ua, ub), routing="round-robin"),
            "failover": Route("failover", (dead, ub)),
            "alldead": Route("alldead", (dead, dead2)),
            "badkey": Route("badkey", (Upstream("r-x", ua.endpoint, "wrong-key"),)),
            "pathy": Route("pathy", (Upstream("r-c", f"127.0.0.1:{c}", "key-c"),)),
            "down": Route("down", (), unavailable="no replica is ready: 1 starting on node-1"),
            "nowhere": Route("nowhere", (), unavailable="0/2 nodes can run it: 2 nodes too small", unplaceable=True),
            "capped": Route("capped", (ua,), max_output=16),
        },
        aliases={"g": "gemma"},
    )
    exchanges: list[Exchange] = []
    gateway = build_gateway_app(
        router, keys={KEY, ""}, allow_loopback_without_key=False, inspector=_Guard(), observe=exchanges.append
    )
    port = servers.serve(gateway, handler_cancellation=True)
    open_port = servers.serve(build_gateway_app(router, keys={KEY}, allow_loopback_without_key=True))
    yield Env(
        url=f"http://127.0.0.1:{port}",
        open_url=f"http://127.0.0.1:{open_port}",
        endpoints=[u.endpoint for u in (ua, ub, dead, dead2)],
        secrets=["key-a", "key-b", "key-c", "key-dead", "wrong-key", ".gguf"],
        notes=notes,
        exchanges=exchanges,
    )
    servers.close()


# -- keys ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Bearer nope"}, 401),
        ({"Authorization": "Bearer"}, 401),  # the empty key in `keys` must not open the door
        ({"Authorization": f"Basic {KEY}"}, 401),
        ({"Authorization": f"Bearer {KEY}"}, 200),
        ({"Authorization": f"bearer {KEY}"}, 200),
    ],
)
def test_key_is_required(env: Env, headers: dict[str, str], status: int) -> None:
    r = httpx.get(f"{env.url}/v1/models", headers=headers)
    assert r.status_code == status
    if status == 401:
        assert r.json() == {
            "error": {
                "message": r.json()["error"]["message"],
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }


def test_loopback_without_key_when_allowed(env: Env) -> None:
    assert httpx.get(f"{env.open_url}/v1/models").status_code == 200
    assert env.post(_chat("g"), key=None, url=env.open_url).status_code == 200
    assert env.post(_chat("g"), key=KEY, url=env.open_url).status_code == 200
    # an empty credential is no credential (curl -H "Authorization: Bearer $UNSET")
    r = httpx.get(f"{env.open_url}/v1/models", headers={"Authorization": "Bearer"})
    assert r.status_code == 200
    assert env.post(_chat("g"), key=None).status_code == 401


@pytest.mark.parametrize("header", ["Bearer none", "Bearer sk-revoked", f"Bearer {KEY}x", f"Basic {KEY}"])
def test_a_wrong_key_from_loopback_is_refused(env: Env, header: str) -> None:
    """No key from loopback is fine there, a wrong one is not (it may be a revoked one)."""
    r = httpx.get(f"{env.open_url}/v1/models", headers={"Authorization": header})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    message = r.json()["error"]["message"]
    if header.startswith("Basic"):  # a valid key in another scheme: the scheme is what is wrong (a new user's finding)
        assert message.startswith("The Authorization header must be 'Bearer <key>' (this one has another "
                                  "scheme, or none); "), message
        assert KEY not in message
    else:
        assert message.startswith("Incorrect API key provided (unknown, revoked or expired); "), message
    assert message.endswith("from this machine you may also send no key at all"), message
    r = httpx.post(
        f"{env.open_url}/v1/chat/completions", json=_chat("g"), headers={"Authorization": header}
    )
    assert r.status_code == 401


@pytest.mark.parametrize("header", [(b"authorization", b"Bearer \xff\xfe"), (b"x-api-key", b"caf\xe9")])
def test_a_key_that_is_not_utf8_is_a_wrong_key(env: Env, header: tuple[bytes, bytes]) -> None:
    """A new user's finding: a key of bytes that are not UTF-8 (aiohttp hands them on as lone
    surrogates) got a 500 and an ERROR traceback in the log, and was not counted as refused. It is a
    wrong key: 401 ``invalid_api_key``, from loopback and from afar, on the list and on a chat."""
    for base in (env.url, env.open_url):
        r = httpx.get(f"{base}/v1/models", headers=[header])
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{base}/v1/chat/completions", json=_chat("g"), headers=[header])
        assert r.status_code == 401, r.text


@pytest.mark.parametrize("x_key", ["none", f"{KEY}x"])
def test_a_wrong_x_api_key_from_loopback_is_refused(env: Env, x_key: str) -> None:
    """A new user's report: a wrong key sent as ``x-api-key`` (Anthropic's clients' header) from
    loopback was ignored, as if no key had been sent. It is refused like a wrong bearer key."""
    r = httpx.get(f"{env.open_url}/v1/models", headers={"x-api-key": x_key})
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{env.open_url}/v1/models", headers={"x-api-key": x_key, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 401, r.text
    assert httpx.get(f"{env.open_url}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{env.url}/v1/models", headers={"x-api-key": KEY}).status_code == 200


@pytest.mark.parametrize(
    ("remote", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.9.8.7", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("192.0.2.2", False),
        ("::ffff:10.0.0.1", False),
        ("1270::1", False),
        ("", False),
        (None, False),
    ],
)
def test_is_loopback(remote: str | None, loopback: bool) -> None:
    assert is_loopback(remote) is loopback


def _non_loopback_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    return None


def test_remote_client_needs_key_even_when_loopback_is_open() -> None:
    address = _non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    servers = ServerThread()
    try:
        port = servers.serve(
            build_gateway_app(StaticRouter(), keys={KEY}, allow_loopback_without_key=True), host=address
        )
        assert httpx.get(f"http://{address}:{port}/v1/models").status_code == 401
        r = httpx.get(f"http://{address}:{port}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
    finally:
        servers.close()


# -- models and errors -----------------------------------------------------------------------------


def test_models_list_shape(env: Env) -> None:
    r = httpx.get(f"{env.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [
        "alldead",
        "badkey",
        "capped",
        "down",
        "failover",
        "gemma",
        "nowhere",
        "pair",
        "pathy",
    ]
    assert body["data"][5] == {"id": "gemma", "object": "model", "created": 1700000000, "owned_by": "llmgw"}


def test_unknown_model_404_names_known_ones(env: Env) -> None:
    r = env.post(_chat("nope"))
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found"
    assert err["type"] == "invalid_request_error"
    assert (
        err["message"]
        == "model 'nope' does not exist; known models: alldead, badkey, capped, down, failover, gemma (alias g), "
        "nowhere, pair, pathy"
    )
    # names are lowercase: a name or alias typed otherwise is pointed at (an operator typed 'TB' for 'tb')
    for typed, meant in (("Gemma", "gemma"), ("G", "g")):
        r = env.post(_chat(typed))
        assert r.status_code == 404
        assert r.json()["error"]["message"].startswith(
            f"model '{typed}' does not exist (names are lowercase: '{meant}'); known models: alldead,")


def test_unavailable_503_with_reason(env: Env) -> None:
    r = env.post(_chat("down"))
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "model_unavailable"
    assert "no replica is ready: 1 starting on node-1" in err["message"]
    assert r.headers["Retry-After"] == "5"  # a second new user's finding: it had none
    r = env.post(_chat("nowhere"))
    assert (r.status_code, r.json()["error"]["code"]) == (503, "model_unavailable")
    assert "Retry-After" not in r.headers  # placement says no node can run it: a retry would not help


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"[1, 2]", "invalid_request"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "missing_model"),
        (json.dumps({"model": "g"}).encode(), "invalid_messages"),
    ],
)
def test_bad_body_400(env: Env, body: bytes, code: str) -> None:
    r = env.post(body)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == code
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("messages", "said"),
    [(None, "'messages' is required"), ("hi", "not a string"), ([], "not an empty list")],
)
def test_messages_of_the_wrong_type_say_what_was_sent(env: Env, messages: Any, said: str) -> None:
    """A string where the list goes is not reported as missing (a new user's report)."""
    body = {"model": "g"} if messages is None else {"model": "g", "messages": messages}
    r = env.post(body)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_messages"
    assert said in r.json()["error"]["message"]


def test_unknown_path_and_method_are_openai_errors(env: Env) -> None:
    """Each with its exchange (an access line and a metric, kind ``other``): they had none (a new user's
    finding: the README says one access line per request)."""
    auth = {"Authorization": f"Bearer {KEY}", "x-request-id": "r-404"}
    r = httpx.post(f"{env.url}/v1/images/generations", headers=auth)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{env.url}/v1/chat/completions", headers={"x-request-id": "r-405"})
    assert r.status_code == 405
    assert r.json()["error"]["code"] == "method_not_allowed"
    got = _recorded(env, lambda e: e.request_id in ("r-404", "r-405"), 2)
    assert sorted((e.request_id, e.kind, e.status, e.code) for e in got) == [
        ("r-404", "other", 404, "not_found"), ("r-405", "other", 405, "method_not_allowed")]


def test_healthz_needs_no_key(env: Env) -> None:
    assert httpx.get(f"{env.url}/healthz").json() == {"status": "ok"}


# -- proxy -----------------------------------------------------------------------------------------


def test_alias_resolves_and_answer_keeps_the_clients_name(env: Env) -> None:
    r = env.post(_chat("g"))
    assert r.status_code == 200
    assert r.json() == completion("g", "replica-a")
    assert r.headers["x-llmgw-replica"] == "r-a"
    assert float(r.headers["x-llmgw-overhead-ms"]) >= 0


def test_stream_is_relayed_byte_exact(env: Env) -> None:
    with httpx.stream(
        "POST",
        f"{env.url}/v1/chat/completions",
        json=_chat("gemma", stream=True),
        headers={"Authorization": f"Bearer {KEY}"},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        assert r.headers["x-llmgw-replica"] == "r-a"
        got = b"".join(r.iter_raw())
    assert got == b"".join(stream_events("gemma", "replica-a"))


def test_model_path_of_the_engine_never_reaches_the_client(env: Env) -> None:
    plain = env.post(_chat("pathy"))
    assert plain.json()["model"] == "pathy"
    r = env.post(_chat("pathy", stream=True))
    assert ".gguf" not in r.text
    events = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e and "[DONE]" not in e]
    assert len(events) == 6
    assert {e["model"] for e in events} == {"pathy"}
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "Hello from replica-c!"


@pytest.mark.parametrize(
    ("chunks", "out"),
    [
        ([b'data: {"model":"/a/b.gguf","x":1}\n\n'], b'data: {"model":"gm","x":1}\n\n'),
        ([b'data: {"mod', b'el": "/a/b', b'.gguf"}\r\n\r\n'], b'data: {"model":"gm"}\r\n\r\n'),
        ([b'data: {"model":"a\\"b"}\n', b"\ndata: [DONE]\n\n"], b'data: {"model":"gm"}\n\ndata: [DONE]\n\n'),
        ([b'data: {"model":"x"}'], b'data: {"model":"gm"}'),  # no newline at the end: sent at the end
    ],
)
def test_model_rewriter(chunks: list[bytes], out: bytes) -> None:
    rw = ModelRewriter("gm")
    assert b"".join([*(rw.feed(c) for c in chunks), rw.tail()]) == out


def test_round_robin_over_replicas(env: Env) -> None:
    seen = {env.post(_chat("pair")).headers["x-llmgw-replica"] for _ in range(4)}
    assert seen == {"r-a", "r-b"}


def test_refused_connection_fails_over_to_the_next_replica(env: Env) -> None:
    for _ in range(2):  # whichever replica round-robin starts with
        r = env.post(_chat("failover"))
        assert r.status_code == 200
        assert r.headers["x-llmgw-replica"] == "r-b"


def test_no_replica_answers_502_without_addresses(env: Env) -> None:
    r = env.post(_chat("alldead"))
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unreachable"
    env.assert_no_internals(r.text)


def test_replica_error_passes_through_scrubbed(env: Env) -> None:
    r = env.post(_chat("gemma", "fail"))
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "slot failed at <replica>"
    assert r.json()["error"]["code"] == "server_error"  # llama-server's type; its numeric code is not OpenAI's
    env.assert_no_internals(r.text)


def test_replica_refusing_our_key_is_a_502_not_the_clients_401(env: Env) -> None:
    r = env.post(_chat("badkey"))
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_auth"
    env.assert_no_internals(r.text)


def test_replica_dying_mid_request_is_a_502(env: Env) -> None:
    r = env.post(_chat("gemma", "cut"))
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_failed"
    assert "closed the connection before answering; retry" in r.json()["error"]["message"]
    env.assert_no_internals(r.text)


def test_replica_dying_mid_stream_ends_with_an_error_event(env: Env) -> None:
    env.exchanges.clear()
    r = env.post(_chat("gemma", "cut-stream", stream=True))
    assert r.status_code == 200
    events = [line for line in r.text.split("\n\n") if line]
    assert events[:2] == [e.decode().strip() for e in stream_events("gemma", "replica-a")[:2]]
    assert events[-1] == "data: [DONE]"  # well-formed to the end
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["error"]["code"] == "upstream_failed"
    # part of the answer went out: not "before answering" (a new user's drained replica said so)
    assert "closed the connection in the middle of its answer; retry" in last["error"]["message"]
    env.assert_no_internals(r.text)
    # a 200 in llmgw_gateway_requests_total, so counted apart: an operator's rollout cut streams that
    # showed nowhere but the access log (the 5xx alert never fired)
    (ex,) = _recorded(env, lambda e: e.stream, 1)
    metrics = ControlPlaneMetrics()
    metrics.observe(ex)
    assert (ex.status, ex.code) == (200, "upstream_failed")
    assert 'llmgw_gateway_streams_broken_total{code="upstream_failed",model="gemma"} 1.0' in (
        metrics.exposition().decode())


def test_client_going_away_closes_the_replica_stream(env: Env) -> None:
    env.notes.clear()
    with httpx.stream(
        "POST",
        f"{env.url}/v1/chat/completions",
        json=_chat("gemma", "slow-stream", stream=True),
        headers={"Authorization": f"Bearer {KEY}"},
    ) as r:
        next(r.iter_raw())
    deadline = time.monotonic() + 5
    while not env.notes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert env.notes == ["aborted"]


# -- what reaches the engine -----------------------------------------------------------------------


def _forwarded(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    forwarded: dict[str, Any] = json.loads(r.json()["choices"][0]["message"]["content"])
    return forwarded


@pytest.mark.parametrize(
    "extra",
    [
        {"max_tokens": -1},
        {"max_tokens": 0},
        {"max_tokens": 100000},
        {"max_completion_tokens": 100000},
        {"n_predict": 100000},
        {"max_tokens": 8, "n_predict": -1},
        {"n_predict": 100000, "slot_id": 0, "id_slot": 0, "cache_prompt": False, "grammar": "root ::= x*"},
    ],
)
def test_engine_specific_fields_and_unbounded_limits_never_reach_the_engine(
    env: Env, extra: dict[str, Any]
) -> None:
    """``max_tokens: -1`` or llama-server's own ``n_predict`` used to bypass max_output (16)."""
    got = _forwarded(env.post(_chat("capped", "echo-body", temperature=0.5, **extra)))
    asked = extra.get("max_tokens", extra.get("max_completion_tokens", 0))
    assert got["max_tokens"] == (asked if 0 < asked <= 16 else 16)
    assert got.get("max_completion_tokens", got["max_tokens"]) == got["max_tokens"]
    assert got["temperature"] == 0.5
    assert set(got) <= {"model", "messages", "max_tokens", "max_completion_tokens", "temperature"}


def test_dropped_fields_are_named_in_a_header(env: Env) -> None:
    r = env.post(_chat("capped", "echo-body", n_predict=5, top_k=3, stop=["x"]))
    assert r.headers["x-llmgw-dropped"] == "n_predict, top_k"
    assert _forwarded(r)["stop"] == ["x"]
    assert "x-llmgw-dropped" not in env.post(_chat("capped", "echo-body")).headers


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "'n'"),
        ({"max_tokens": "100"}, "'max_tokens'"),
        ({"max_tokens": 1.5}, "'max_tokens'"),
        ({"max_completion_tokens": True}, "'max_completion_tokens'"),
        ({"stream": "yes"}, "'stream'"),
        ({"top_logprobs": 1000}, "'top_logprobs'"),
    ],
)
def test_fields_the_engine_would_misread_are_refused(env: Env, extra: dict[str, Any], param: str) -> None:
    r = env.post(_chat("capped", "echo-body", **extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert param in r.json()["error"]["message"]


def test_client_going_away_closes_the_replica_request(env: Env) -> None:
    """With a stand-in engine: a non-streamed request abandoned by its client is
    cancelled upstream (the real llama-server case is in tests/e2e/test_gateway_engine.py)."""
    env.notes.clear()
    env.exchanges.clear()
    body = json.dumps(_chat("gemma", "slow-plain")).encode()
    host, port = env.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nX-Request-Id: abandoned-plain\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # leave only once the engine has the request: a fixed 0.2 s could end before the gateway
        # forwarded it, and the cancelled handler never reached the engine
        deadline = time.monotonic() + 5
        while not env.notes:
            assert time.monotonic() < deadline, "the engine did not get the request within 5 s"
            time.sleep(0.02)
    deadline = time.monotonic() + 5
    while len(env.notes) < 2:
        assert time.monotonic() < deadline, f"the engine did not see its client leave within 5 s: {env.notes}"
        time.sleep(0.02)
    assert env.notes == ["generating", "aborted"]
    # its own exchange: the previous test's last one (a 400) can be recorded after the clear above
    (left,) = _recorded(env, lambda e: e.request_id == "abandoned-plain", 1)
    assert left.status == 499
    # charged, estimated: its prompt ('slow-plain', 10 characters / 4) and what was decoded meanwhile (it
    # was charged nothing: a client timing out used the engine past its limits, a new user's finding)
    assert left.usage is not None
    assert (left.usage["prompt_tokens"], left.usage["estimated"]) == (2, True), left.usage


def test_a_client_that_closes_on_done_was_answered(env: Env) -> None:
    """A new user's finding: ``llmgw chat`` reads a stream to ``data: [DONE]`` and closes, and when
    the replica had not ended its response by then the gateway counted the whole answer as a 499
    ``client_closed`` (3 of 13 chats in the access log and the metrics). Once the stream's last event
    has gone out, the client's close is an answered request: 200, with its usage."""
    env.exchanges.clear()
    body = _chat("gemma", "linger-after-done", stream=True, stream_options={"include_usage": True})
    headers = {"Authorization": f"Bearer {KEY}", "x-request-id": "closes-on-done"}
    t0 = time.monotonic()
    with httpx.stream("POST", f"{env.url}/v1/chat/completions", json=body, headers=headers, timeout=10) as r:
        assert r.status_code == 200
        lines = []
        for line in r.iter_lines():  # as llmgw chat and the openai client: stop at [DONE], close
            lines.append(line)
            if line == "data: [DONE]":
                break
    assert time.monotonic() - t0 < 1.5, "the client did not leave before the replica ended its response"
    assert lines[-1] == "data: [DONE]"
    [ex] = _recorded(env, lambda e: e.request_id == "closes-on-done", 1)
    assert (ex.status, ex.code) == (200, ""), ex
    assert ex.usage == {"completion_tokens": 4, "prompt_tokens": 5, "total_tokens": 9}


# -- seams -----------------------------------------------------------------------------------------


def test_inspector_refuses_a_prompt(env: Env) -> None:
    r = env.post(_chat("gemma", "forbidden"))
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "content_policy_violation"


def test_stream_inspector_stops_a_stream(env: Env) -> None:
    r = env.post(_chat("gemma", "guard-stream", stream=True))
    assert r.status_code == 200
    assert "Hello" in r.text
    assert " from" not in r.text
    assert "answer blocked by policy 'demo'" in r.text


def _recorded(env: Env, mine: Callable[[Exchange], bool], count: int, within_s: float = 5.0) -> list[Exchange]:
    """The ``count`` exchanges ``mine`` picks, once the gateway's loop has handed them to ``observe``.

    ``observe`` runs on the loop just after the handler returns, so the client can hold its answer
    before the exchange is in the list (the last of two requests was missing in a CI run)."""
    deadline = time.monotonic() + within_s
    while len(found := [e for e in list(env.exchanges) if mine(e)]) < count:
        assert time.monotonic() < deadline, f"{len(found)} of {count} exchanges recorded within {within_s} s"
        time.sleep(0.01)
    return found


def test_observe_gets_one_exchange_per_request(env: Env) -> None:
    env.exchanges.clear()
    env.post(_chat("g"))
    env.post(_chat("down"))
    # (an earlier test's abandoned stream may be recorded late, as "gemma")
    ok, down = _recorded(env, lambda e: e.requested in ("g", "down"), 2)
    assert (ok.requested, ok.model, ok.replica, ok.status, ok.stream) == ("g", "gemma", "r-a", 200, False)
    assert ok.usage == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert ok.overhead_ms >= 0
    assert ok.upstream_ms > 0
    assert (down.model, down.replica, down.status, down.code) == ("down", "", 503, "model_unavailable")
    assert ok.key == down.key != ""
    assert len(ok.request_id) == 24
    assert ok.request_id != down.request_id


def test_time_to_first_token_is_the_first_event_not_the_headers(env: Env) -> None:
    """A replica sends a stream's headers at once and its first token 0.3 s later: the exchange's
    ``ttft_ms`` (``llmgw_gateway_ttft_seconds``, the access log's ``ttft_ms``) counts to the first
    token. It counted to the headers (3-16 ms while the first token took 0.2-1.6 s: a new user's
    report)."""
    env.exchanges.clear()
    r = env.post(_chat("gemma", "think-first", stream=True))
    assert r.status_code == 200, r.text
    assert r.text.endswith("data: [DONE]\n\n")
    [ex] = _recorded(env, lambda e: e.requested == "gemma" and e.stream, 1)
    assert 300 <= ex.ttft_ms < 300 + ex.upstream_ms, (ex.ttft_ms, ex.upstream_ms)


# -- the official client ---------------------------------------------------------------------------


def test_openai_client_works_unchanged(env: Env) -> None:
    client = openai.OpenAI(base_url=f"{env.url}/v1", api_key=KEY, max_retries=0)
    assert "gemma" in [m.id for m in client.models.list()]
    answer = client.chat.completions.create(model="g", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content == "Hello from replica-a!"
    assert answer.model == "g"
    stream = client.chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == "Hello from replica-a!"
    client.close()


def test_openai_client_errors(env: Env) -> None:
    client = openai.OpenAI(base_url=f"{env.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="known models"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.APIError, match="closed the connection"):
        for _ in client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "cut-stream"}], stream=True
        ):
            pass
    client.close()
    bad = openai.OpenAI(base_url=f"{env.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    bad.close()


@pytest.mark.parametrize("model", [5, ["gemma"], {"name": "gemma"}, True])
def test_a_model_that_is_not_a_string_says_so(env: Env, model: object) -> None:
    """``"model": 5`` was answered "'model' is required" (code missing_model): it is there, of the wrong
    type (a new user's finding)."""
    r = env.post({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_request"
    assert err["message"].startswith("'model' must be a string (a model name from GET /v1/models), not "), err
