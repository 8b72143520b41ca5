"""The guard in the gateway over real HTTP: fake engines, a fake judge (an aiohttp app speaking
llama-server's ``/apply-template`` and ``/v1/chat/completions``), the real gateway and the
official ``openai`` client.

The fake judge answers in Qwen3Guard's shape and decides by the judged text: ``bomb`` Unsafe
(Violent), ``edgy`` Controversial, ``slowjudge`` after 1.5 s, ``garbage`` something unreadable,
``judge500`` a 500, ``cutjudge`` a closed connection, ``threelines`` a 3-line Safe answer to a
prompt check; anything else Safe. The engine replica ``bomb`` answers "Hello from bomb!", so its
answers are judged Unsafe on the way out.

Cases from other gateways' bug reports are named in the tests: the out-check skipped on
``stream: true``; a blocked stream that is not valid SSE; over budget not covered by fail-open; a
transport error counted as Safe; a 3-line answer to a prompt check.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from llmgw import client
from llmgw.apikeys import key_digest
from llmgw.control.gateway.app import build_gateway_app
from llmgw.control.gateway.callers import Callers
from llmgw.control.gateway.guard import GuardInspector, HeldStream
from llmgw.control.gateway.inspect import Exchange
from llmgw.control.gateway.keys import GatewayKeys
from llmgw.control.store.rows import ApiKeyRow
from llmgw.errors import ApiError
from llmgw.guard.config import Controversial, Direction, FailMode, GuardConfig, Policy, key_id
from llmgw.guard.judge import JudgeClient, JudgeRoute
from llmgw.routing import Route, StaticRouter, Upstream
from tests.helpers.gateway import JUDGE_KEY, FakeJudge, ServerThread, fake_llama
from tests.helpers.net import free_port

KEY = "sk-guard"
POLICIES = [
    Policy(name="team", judge="judge", keys=[key_id("sk-team")], fail=FailMode.OPEN, models=["chat"]),
    Policy(name="strict", judge="judge", controversial=Controversial.BLOCK, models=["chat", "evil"]),
    Policy(name="warned", judge="judge", controversial=Controversial.WARN, models=["warned"]),
    Policy(name="in-only", judge="judge", check=[Direction.IN], models=["inonly"]),
    Policy(name="open-dead", judge="dead-judge", fail=FailMode.OPEN, models=["opendead", "openevil"]),
    Policy(name="open-live", judge="judge", fail=FailMode.OPEN, budget_s=0.5, models=["openlive", "openbomb"]),
    Policy(name="closed-dead", judge="dead-judge", models=["closeddead"]),
    Policy(name="budget", judge="judge", budget_s=0.5, models=["budget", "slowout"]),
    Policy(name="fallback", judge=["nowhere", "unready", "judge"], models=["fallback"]),
    Policy(name="chatml", judge="chatml-judge", models=["chatml"]),
    Policy(name="nojudge", judge=["nowhere", "unready"], models=["nojudge"]),
    Policy(name="ghost", judge=["nowhere", "nothere"], models=["ghost"]),
]


@dataclass
class Env:
    url: str
    judge: FakeJudge
    guard: GuardInspector
    internals: list[str]

    def post(self, model: str, text: str = "hi", key: str = KEY, **extra: Any) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": text}], **extra}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def clean(self, text: str) -> None:
        for s in self.internals:
            assert s not in text


#: Every exchange the module's gateway hands its ``observe`` (what metrics, usage and limits get).
EXCHANGES: list[Exchange] = []


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    servers = ServerThread()
    judge = FakeJudge()
    jport = servers.serve(judge.app())
    cport = servers.serve(FakeJudge(chatml=True).app())
    a = servers.serve(fake_llama("replica-a", "key-a"))
    b = servers.serve(fake_llama("bomb", "key-b"))
    s = servers.serve(fake_llama("slowjudge", "key-s"))  # its answer takes the judge 1.5 s
    ua = Upstream("r-a", f"127.0.0.1:{a}", "key-a")
    ub = Upstream("r-bomb", f"127.0.0.1:{b}", "key-b")
    names = ["chat", "warned", "inonly", "opendead", "openlive", "closeddead", "budget", "fallback", "chatml"]
    names += ["nojudge", "ghost"]
    routes = {n: Route(n, (ua,)) for n in names}
    routes |= {n: Route(n, (ub,)) for n in ("evil", "openbomb", "openevil")}
    routes["slowout"] = Route("slowout", (Upstream("r-slow", f"127.0.0.1:{s}", "key-s"),))
    judges = {
        "judge": JudgeRoute("judge", "qwen3guard", (Upstream("j-1", f"127.0.0.1:{jport}", JUDGE_KEY),)),
        "chatml-judge": JudgeRoute("chatml-judge", "qwen3guard", (Upstream("j-c", f"127.0.0.1:{cport}", JUDGE_KEY),)),
        "dead-judge": JudgeRoute("dead-judge", "qwen3guard", (Upstream("j-d", f"127.0.0.1:{free_port()}", JUDGE_KEY),)),
        "unready": JudgeRoute("unready", "qwen3guard", (), "no replica is ready yet (starting)"),
    }
    guard = GuardInspector(GuardConfig(policies=POLICIES), JudgeClient(judges.get))
    app = build_gateway_app(
        StaticRouter(routes=routes), keys={KEY, "sk-team"}, allow_loopback_without_key=False, inspector=guard,
        observe=EXCHANGES.append,
    )
    port = servers.serve(app)
    yield Env(
        f"http://127.0.0.1:{port}", judge, guard,
        internals=[str(jport), str(cport), JUDGE_KEY, "10.0.0.9", "key-a", "key-b", "key-s", "Safety:"],
    )
    servers.run(guard.client.close())
    servers.close()


# -- in and out, plain and streamed ------------------------------------------------------------------


def test_safe_request_is_served_with_verdict_headers(env: Env) -> None:
    r = env.post("chat")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Hello from replica-a!"
    h = r.headers
    assert h["x-llmgw-guard-in"] == "safe"
    assert h["x-llmgw-guard-out"] == "safe"
    assert h["x-llmgw-guard-in-categories"] == ""
    assert float(h["x-llmgw-guard-in-ms"]) >= 0
    assert float(h["x-llmgw-guard-out-ms"]) >= 0
    assert h["x-llmgw-guard-policy"] == "strict"


@pytest.mark.parametrize("stream", [False, True])
def test_blocked_prompt_is_400_before_any_engine(env: Env, stream: bool) -> None:
    EXCHANGES.clear()
    r = env.post("chat", "how to build a bomb", stream=stream)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "content_blocked"
    assert err["type"] == "invalid_request_error"
    assert err["direction"] == "in"
    assert err["categories"] == ["Violent"]
    assert err["policy"] == "strict"
    assert "x-llmgw-replica" not in r.headers  # no engine was asked
    assert r.headers["x-llmgw-guard-in"] == "unsafe"
    env.clean(r.text)
    # its overhead (the access log's, llmgw_gateway_overhead_seconds) includes the judging: it was 0.000
    deadline = time.monotonic() + 5
    while not (mine := [e for e in EXCHANGES if e.requested == "chat" and e.status == 400]):
        assert time.monotonic() < deadline, "no exchange recorded"
        time.sleep(0.01)
    assert mine[-1].overhead_ms >= float(r.headers["x-llmgw-guard-in-ms"]) > 0


def test_blocked_prompt_with_the_openai_client(env: Env) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        env.client().chat.completions.create(model="chat", messages=[{"role": "user", "content": "bomb"}])
    assert e.value.code == "content_blocked"
    assert isinstance(e.value.body, dict)
    assert e.value.body["direction"] == "in"


def test_blocked_answer_not_streamed(env: Env) -> None:
    r = env.post("evil")
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["direction"], err["categories"]) == ("content_blocked", "out", ["Violent"])
    assert "Hello from bomb" not in r.text
    assert r.headers["x-llmgw-guard-in"] == "safe"
    assert r.headers["x-llmgw-guard-out"] == "unsafe"
    env.clean(r.text)


def test_blocked_stream_is_valid_sse_ending_content_filter(env: Env) -> None:
    """Bug reports: out-check skipped with stream: true; a blocked stream that is not valid SSE; a
    blocked stream counted as a plain 200 (access log ``code=-``, no guard block in metrics or usage:
    a new user's finding)."""
    EXCHANGES.clear()
    r = env.post("evil", stream=True)
    assert r.status_code == 200
    assert r.headers["x-llmgw-guard-out"] == "held"
    assert "bomb" not in r.text.replace("llmgw-guard", "")  # nothing of the answer got out
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["object"] == "chat.completion.chunk"
    assert final["choices"][0]["finish_reason"] == "content_filter"
    assert final["llmgw_guard"] == {"direction": "out", "categories": ["Violent"], "policy": "strict"}
    assert ": llmgw-guard out=unsafe categories=Violent" in r.text
    env.clean(r.text)
    deadline = time.monotonic() + 5
    while not (mine := [e for e in EXCHANGES if e.requested == "evil" and e.stream]):
        assert time.monotonic() < deadline, "no exchange recorded"
        time.sleep(0.01)
    assert (mine[-1].status, mine[-1].code, mine[-1].blocked) == (200, "content_blocked", True)


def test_blocked_stream_with_the_openai_client(env: Env) -> None:
    chunks = list(
        env.client().chat.completions.create(
            model="evil", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "content_filter"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""


def test_llmgw_chat_says_a_blocked_stream_was_blocked(env: Env) -> None:
    """``llmgw chat`` streams (client.stream_chat): a blocked answer printed an empty line and exited 0
    (a new user's finding). It raises the plain answer's 400 ``content_blocked``, with the policy and
    categories the stream's last chunk carries."""
    with pytest.raises(ApiError) as err:
        list(client.stream_chat(env.url, KEY, "evil", "hi"))
    assert (err.value.status, err.value.code) == (400, "content_blocked")
    assert "the answer was blocked by policy 'strict' (Violent)" in str(err.value)
    assert list(client.stream_chat(env.url, KEY, "chat", "hi"))  # a safe one still streams


def test_safe_stream_is_held_then_sent_whole(env: Env) -> None:
    chunks = list(
        env.client().chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello from replica-a!"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert env.judge.asked[-1] == "Hello from replica-a!"  # the answer was judged, the stream's text


MATRIX = [
    # (model, prompt, stream, status, direction blocked or "")
    ("chat", "hi", False, 200, ""),
    ("chat", "hi", True, 200, ""),
    ("chat", "bomb", False, 400, "in"),
    ("chat", "bomb", True, 400, "in"),
    ("evil", "hi", False, 400, "out"),
    ("evil", "hi", True, 200, "out"),  # the stream's end says content_filter
    ("inonly", "bomb", True, 400, "in"),
]


@pytest.mark.parametrize(("model", "prompt", "stream", "status", "blocked"), MATRIX)
def test_every_endpoint_stream_or_not_in_and_out(
    env: Env, model: str, prompt: str, stream: bool, status: int, blocked: str
) -> None:
    r = env.post(model, prompt, stream=stream)
    assert r.status_code == status
    if status == 400:
        assert r.json()["error"]["direction"] == blocked
    elif blocked == "out":
        assert '"finish_reason": "content_filter"' in r.text
    else:
        assert "replica-a" in r.text


def test_in_only_policy_does_not_judge_the_answer(env: Env) -> None:
    n = len(env.judge.asked)
    r = env.post("inonly", stream=True)
    assert r.status_code == 200
    assert "replica-a" in r.text
    assert len(env.judge.asked) == n + 1
    assert "x-llmgw-guard-out" not in r.headers


# -- controversial -------------------------------------------------------------------------------------


def test_controversial_blocks_or_warns_as_the_policy_says(env: Env) -> None:
    r = env.post("chat", "something edgy")
    assert r.status_code == 400
    assert r.json()["error"]["categories"] == ["Unethical Acts"]
    r = env.post("warned", "something edgy")
    assert r.status_code == 200
    assert r.headers["x-llmgw-guard-in"] == "controversial"


# -- no verdict ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["garbage", "judge500", "cutjudge"])
def test_no_verdict_fail_closed_is_503(env: Env, prompt: str) -> None:
    """Bug report: a judge transport error counted as Safe."""
    r = env.post("chat", prompt)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "judge_unavailable"
    assert err["direction"] == "in"
    assert "x-llmgw-replica" not in r.headers
    env.clean(r.text)


@pytest.mark.parametrize("model", ["closeddead", "nojudge"])
def test_judge_down_or_missing_fail_closed_is_503(env: Env, model: str) -> None:
    r = env.post(model)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "judge_unavailable"
    assert "nowhere" not in r.text  # which judges are missing is for logs and guard judge status
    env.clean(r.text)


def test_a_policy_whose_judges_are_not_in_the_catalog_says_no_retry_helps(env: Env) -> None:
    """A new user's finding: a policy naming a judge that does not exist answered every request
    "its judge is unavailable; retry in 5 s" with ``Retry-After: 5``, which can never help. It says
    the judges are not in the catalog and what the operator does, without Retry-After; a judge that
    exists but has no ready replica still says when to retry."""
    r = env.post("ghost")
    assert (r.status_code, r.json()["error"]["code"]) == (503, "judge_unavailable")
    assert "Retry-After" not in r.headers
    said = r.json()["error"]["message"]
    assert "none of its judges is in the catalog as a guard model; the operator adds one" in said
    assert "nowhere" not in r.text
    r = env.post("nojudge")  # "unready" is in the catalog, at no ready replica
    assert (r.status_code, r.headers["Retry-After"]) == (503, "5")
    env.clean(r.text)


def test_over_budget_fail_closed_is_503(env: Env) -> None:
    r = env.post("budget", "slowjudge")
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "judge_unavailable"
    assert float(r.headers["x-llmgw-guard-in-ms"]) < 1200


@pytest.mark.parametrize("stream", [False, True])
def test_fail_open_serves_marked_unjudged(env: Env, stream: bool) -> None:
    before = dict(env.guard.stats.unjudged)
    r = env.post("opendead", stream=stream)
    assert r.status_code == 200
    assert "replica-a" in r.text
    assert r.headers["x-llmgw-guard-in"] == "unjudged"
    if stream:
        assert ": llmgw-guard out=unjudged" in r.text
    else:
        assert r.headers["x-llmgw-guard-out"] == "unjudged"
    assert env.guard.stats.unjudged["in"] == before.get("in", 0) + 1
    assert env.guard.stats.unjudged["out"] == before.get("out", 0) + 1


def test_over_budget_is_covered_by_fail_open(env: Env) -> None:
    """Bug report: a judge over its budget not covered by fail-open."""
    r = env.post("openlive", "slowjudge")
    assert r.status_code == 200
    assert r.headers["x-llmgw-guard-in"] == "unjudged"


@pytest.mark.parametrize("stream", [False, True])
def test_a_parsed_block_blocks_under_fail_open(env: Env, stream: bool) -> None:
    r = env.post("openlive", "bomb", stream=stream)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "content_blocked"
    r = env.post("openbomb", stream=stream)
    if stream:
        assert '"finish_reason": "content_filter"' in r.text
    else:
        assert r.status_code == 400
        assert r.json()["error"]["direction"] == "out"


def test_a_stream_whose_answer_cannot_be_judged_ends_with_an_error_event(env: Env) -> None:
    r = env.post("closeddead", stream=True)
    assert r.status_code == 503  # the prompt already could not be judged
    assert r.json()["error"]["code"] == "judge_unavailable"


def test_a_stream_whose_out_judgment_times_out_ends_with_an_error_event_and_done(env: Env) -> None:
    """The error event used to be the stream's last line, with no ``data: [DONE]`` after it."""
    r = env.post("slowout", stream=True)
    assert r.status_code == 200  # the prompt was judged safe; the answer's judgment ran out of budget
    assert r.headers["x-llmgw-guard-out"] == "held"
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert (err["code"], err["direction"], err["policy"]) == ("judge_unavailable", "out", "budget")
    assert "slowjudge" not in r.text.replace("llmgw-guard", "")  # nothing unjudged got out
    assert len(events) == 2
    env.clean(r.text)
    # the replica generated the whole answer: it is charged (usage, limits) though no byte of it was
    # sent (a regression once the first-byte time moved to the first body write)
    deadline = time.monotonic() + 5
    while not (mine := [e for e in EXCHANGES if e.requested == "slowout" and e.stream]):
        assert time.monotonic() < deadline, "no exchange recorded"
        time.sleep(0.01)
    assert mine[-1].usage is not None
    assert mine[-1].usage["completion_tokens"] > 0


def test_a_stream_whose_out_judgment_times_out_with_the_openai_client(env: Env) -> None:
    with pytest.raises(openai.APIError) as e:
        list(env.client().chat.completions.create(
            model="slowout", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert "could not judge the answer" in e.value.message


def test_three_line_answer_to_a_prompt_check_is_read(env: Env) -> None:
    r = env.post("chat", "threelines")
    assert r.status_code == 200
    assert r.headers["x-llmgw-guard-in"] == "safe"


# -- choosing the judge ---------------------------------------------------------------------------------


def test_first_available_judge_serves(env: Env) -> None:
    r = env.post("fallback")
    assert r.status_code == 200
    assert r.headers["x-llmgw-guard-in"] == "safe"


def test_a_judge_whose_template_fell_back_is_failed(env: Env) -> None:
    r = env.post("chatml")
    assert r.status_code == 503
    assert "j-c" in env.guard.client.template_failed
    assert env.guard.client.template_checked["j-c"] is False
    assert env.guard.client.template_checked["j-1"] is True
    templates = env.judge.templates
    env.post("chat")
    assert env.judge.templates == templates  # checked once per replica


def test_policy_by_key(env: Env) -> None:
    """The team's key has its own policy (fail open), others get 'strict'; the key is the team's
    however it is sent: as ``x-api-key`` it escaped the policy (a new user's finding: a guard bypass)."""
    r = env.post("chat", key="sk-team")
    assert r.headers["x-llmgw-guard-policy"] == "team"
    r = env.post("chat")
    assert r.headers["x-llmgw-guard-policy"] == "strict"
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    for key in ("sk-team", KEY):
        r = httpx.post(f"{env.url}/v1/chat/completions", json=body, headers={"x-api-key": key})
        assert r.status_code == 200, r.text
        assert r.headers["x-llmgw-guard-policy"] == ("team" if key == "sk-team" else "strict")


def test_a_policy_naming_a_stored_key_holds_across_its_rotation() -> None:
    """Over real HTTP, with the real gateway's key table: a policy with ``key_names: [ivy]`` judges
    the stored key ivy's requests, before and after its secret is rotated (a policy listing its id
    stopped applying to the new secret: a new user's finding); a keys-file key is not ivy, and
    ``key_names: [keys-file]`` names the keys file's keys."""
    servers = ServerThread()
    try:
        jport = servers.serve(FakeJudge().app())
        a = servers.serve(fake_llama("replica-a", "key-a"))
        judge = JudgeRoute("judge", "qwen3guard", (Upstream("j-1", f"127.0.0.1:{jport}", JUDGE_KEY),))
        policy = Policy(name="ivys", judge="judge", check=[Direction.IN], key_names=["ivy"])
        files = Policy(name="files", judge="judge", check=[Direction.IN], key_names=["keys-file"])
        guard = GuardInspector(GuardConfig(policies=[policy, files]), JudgeClient({"judge": judge}.get))
        callers = Callers(GatewayKeys(None, initial={"sk-file"}))
        callers.set_rows([ApiKeyRow("ivy", "sk-ivy-1", key_digest("sk-ivy-1"), revision=1)])
        route = Route("chat", (Upstream("r-a", f"127.0.0.1:{a}", "key-a"),))
        app = build_gateway_app(StaticRouter(routes={"chat": route}), keys=callers.file_keys,
                                allow_loopback_without_key=False, inspector=guard, callers=callers)
        url = f"http://127.0.0.1:{servers.serve(app)}/v1/chat/completions"
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}

        def policy_of(key: str) -> str:
            r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return r.headers.get("x-llmgw-guard-policy", "")

        assert policy_of("sk-ivy-1") == "ivys"
        assert policy_of("sk-file") == "files"  # the keys file's keys, by the name the access log gives them
        callers.set_rows([ApiKeyRow("ivy", "sk-ivy-2", key_digest("sk-ivy-2"), revision=2)])  # rotated
        assert policy_of("sk-ivy-2") == "ivys"
        servers.run(guard.client.close())
    finally:
        servers.close()


def test_stats(env: Env) -> None:
    s = env.guard.stats.as_dict()
    assert s["verdicts"]["in safe"] > 0
    assert s["blocked"]["in"] > 0
    assert s["blocked"]["out"] > 0
    assert s["judge_ms"]["judge"]["p50"] <= s["judge_ms"]["judge"]["p95"]
    assert {"unparseable", "down", "timeout", "missing", "template"} <= set(s["errors"])
    # The dashboard's counts by category and its recent verdicts: the verdict, never the text.
    assert s["categories"]["in Violent"] > 0
    assert s["categories"]["out Violent"] > 0
    recent = s["recent"]
    assert recent
    assert set(recent[0]) == {"at", "direction", "policy", "model", "verdict", "categories", "judge", "ms", "blocked"}
    assert any(v["blocked"] and list(v["categories"]) == ["Violent"] for v in recent)


def test_held_stream_collects_text_from_events() -> None:
    async def run() -> str:
        guard = GuardInspector(GuardConfig(), JudgeClient(lambda _n: None))
        h = HeldStream(guard, Policy(name="p", judge="j"), "m", "q")
        await h.chunk(b'data: {"id":"x","choices":[{"delta":{"content":"a"}}]}\n\n')
        await h.chunk(b'data: {"choices":[{"delta":{"reasoning_content":"r",'
                      b'"tool_calls":[{"function":{"arguments":"{}"}}]}}]}\n\ndata: [DONE]\n\n')
        return "".join(h.parts) + "|" + str(h.meta["id"])

    assert asyncio.run(run()) == "ar{}|x"


def test_a_blocked_completions_stream_ends_in_the_completions_shape() -> None:
    """A ``/v1/completions`` stream (``object: text_completion``, ``choices[].text``: llama-server's
    events) that the out-check blocks ended with a chat chunk (``delta``, ``chat.completion.chunk``),
    which a completions client cannot read. It ends with a ``text_completion`` event, the stream's
    own id, an empty ``text`` and ``finish_reason: content_filter``."""
    servers = ServerThread()
    jport = servers.serve(FakeJudge().app())
    judge = JudgeRoute("judge", "qwen3guard", (Upstream("j-1", f"127.0.0.1:{jport}", JUDGE_KEY),))
    guard = GuardInspector(GuardConfig(policies=POLICIES), JudgeClient({"judge": judge}.get))
    strict = next(p for p in POLICIES if p.name == "strict")

    async def run() -> bytes:
        h = HeldStream(guard, strict, "evil", "hi")
        for text in ("Here is ", "a bomb"):
            event = {"id": "cmpl-7", "object": "text_completion", "created": 1, "model": "evil",
                     "choices": [{"index": 0, "text": text, "finish_reason": None}]}
            await h.chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
        await h.chunk(b"data: [DONE]\n\n")
        out = await h.end()
        assert isinstance(out, bytes), out
        return out

    try:
        out = servers.run(run())
    finally:
        servers.run(guard.client.close())
        servers.close()
    events = [line[6:] for line in out.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert (final["id"], final["object"], final["model"]) == ("cmpl-7", "text_completion", "evil")
    assert final["choices"] == [{"index": 0, "text": "", "finish_reason": "content_filter"}]
    assert "bomb" not in out.decode()


def test_a_prompted_judge_flags_in_two_steps_and_closes_as_soon_as_it_is_safe() -> None:
    """The prompted format over real HTTP: the verdict word first (the engine stops at its newline),
    the categories in a second request only for a flag. This fake answers as llama-server does
    (a few characters an event), once without repeating the prefill, once repeating it."""
    asked: list[list[dict[str, str]]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        asked.append(body["messages"])
        assert body["stop"] == ["\n"]
        prefill = body["messages"][-1]["content"]
        text = body["messages"][1]["content"]
        if prefill == "Safety:":
            answer = " Unsafe" if "bomb" in text else " Safe"
        else:
            assert prefill == "Safety: Unsafe\nCategories:"
            answer = prefill + " Violent, PII"
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(0, len(answer), 3):
            event = {"choices": [{"delta": {"content": answer[i:i + 3]}}]}
            await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await out.write(b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
        return out

    async def template(_: web.Request) -> web.Response:
        return web.json_response({"prompt": "<BEGIN UNSAFE CONTENT CATEGORIES>"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/apply-template", template)
    servers = ServerThread()
    port = servers.serve(app)
    client = JudgeClient({"p": JudgeRoute("p", "prompted", (Upstream("p-1", f"127.0.0.1:{port}", "k"),))}.get)
    try:
        flagged = servers.run(client.judge(["p"], Direction.IN, "a bomb", budget_s=5))
        assert len(asked) == 2
        assert asked[1][:-1] == asked[0][:-1]  # the same prompt, so the slot has it cached
        safe = servers.run(client.judge(["p"], Direction.IN, "hello", budget_s=5))
        assert len(asked) == 3  # Safe: one step
    finally:
        servers.run(client.close())
        servers.close()
    assert (flagged.verdict.safety.value, flagged.verdict.categories) == ("unsafe", ("Violent", "PII"))
    assert flagged.raw == "Safety: Unsafe\nCategories: Violent, PII"
    assert (safe.verdict.safety.value, safe.raw) == ("safe", "Safety: Safe")


def test_a_judge_at_zero_replicas_is_asked_for_by_the_requests_it_missed() -> None:
    """A new user's finding: a judge scaled to zero (``scaling.min: 0``) under ``fail: open`` never
    started again: the requests were served unjudged and nothing counted them as demand for the
    judge, so the autoscaler kept it at zero for good. The judgments it missed now count in the
    gateway's load (:data:`llmgw.control.gateway.load.LOAD`, what the autoscaler reads) as queued
    requests of the judge's model, as a model's own requests at zero replicas do."""
    from llmgw.control.gateway.load import LOAD, LoadCounter  # noqa: PLC0415

    servers = ServerThread()
    try:
        up = Upstream("r-m", f"127.0.0.1:{servers.serve(fake_llama('replica-m', 'key-m'))}", "key-m")
        client = JudgeClient({"sleepy": JudgeRoute("sleepy", "qwen3guard", (), "scaled to zero")}.get)
        policy = Policy(name="open", judge="sleepy", fail=FailMode.OPEN, check=[Direction.IN])
        guard = GuardInspector(GuardConfig(policies=[policy]), client)
        load = LoadCounter()
        client.on_missing = load.missed  # as the control plane wires it (llmgw.control.server)
        app = build_gateway_app(StaticRouter(routes={"m": Route("m", (up,))}), keys={KEY},
                                allow_loopback_without_key=False, inspector=guard, load=load)
        url = f"http://127.0.0.1:{servers.serve(app)}/v1/chat/completions"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(2):
            r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
            assert r.status_code == 200, r.text
            assert r.headers["x-llmgw-guard-in"] == "unjudged"
        demand = app[LOAD]()
        assert demand["sleepy"].queued == 2, demand
        assert "sleepy" not in app[LOAD]()  # reported once, as a model's missed requests are
        servers.run(client.close())
    finally:
        servers.close()
