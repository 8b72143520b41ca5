"""Keys, limits and accounting on the gateway's hot path: the limiter's arithmetic with a fixed clock,
then the real gateway over HTTP with stored keys (revoked, expired, model-restricted), 429s with
OpenAI's headers, stream usage asked of the engine and hidden, x-request-id, and the access log.
Fake llama-servers (``tests.helpers.gateway``) stand in for engines."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from llmgw.control.gateway.accesslog import log_exchange
from llmgw.control.gateway.accounting import Accounting
from llmgw.control.gateway.app import build_gateway_app
from llmgw.control.gateway.callers import Caller, Callers
from llmgw.control.gateway.inspect import Exchange
from llmgw.control.gateway.keys import GatewayKeys, digest
from llmgw.control.gateway.limits import Limiter, period_end, reset_text
from llmgw.control.gateway.sse import StreamTally
from llmgw.control.store import open_store
from llmgw.control.store.offloop import OffLoop
from llmgw.control.store.rows import ApiKeyRow
from llmgw.routing import Route, StaticRouter, Upstream
from tests.helpers.gateway import ServerThread, fake_llama


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# -- the limiter's arithmetic --------------------------------------------------------------------


def test_rpm_admits_the_limit_per_minute_then_429_with_openai_headers() -> None:
    clock = Clock(1_800_000_000.0 + 15)  # 15 s into a minute
    lim = Limiter(clock=clock)
    c = Caller("app", rpm=3)
    seen = [lim.admit(c) for _ in range(3)]
    assert all(r is None for r, _ in seen)
    assert [h["x-ratelimit-remaining-requests"] for _, h in seen] == ["2", "1", "0"]
    assert seen[0][1]["x-ratelimit-limit-requests"] == "3"
    assert seen[0][1]["x-ratelimit-reset-requests"] == "45s"
    refused, _ = lim.admit(c)
    assert refused is not None
    assert refused.code == "rate_limit_exceeded"
    assert "requests per minute" in refused.message
    assert "limit 3" in refused.message
    assert refused.headers["Retry-After"] == "45"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    clock.t += 45  # the next minute
    assert lim.admit(c)[0] is None


def test_tpm_refuses_after_the_tokens_are_spent_and_other_control_planes_count() -> None:
    clock = Clock(1_800_000_000.0)
    lim = Limiter(clock=clock)
    c = Caller("app", tpm=100)
    assert lim.admit(c)[0] is None
    lim.spend(c, 60)
    _, h = lim.admit(c)
    assert h["x-ratelimit-remaining-tokens"] == "40"
    lim.set_others({("app", 1_800_000_000 // 60 * 60): (5, 40)})  # another control plane's 40 tokens
    refused, _ = lim.admit(c)
    assert refused is not None
    assert "tokens per minute" in refused.message
    # what this control plane wrote is taken once, and given back when the write failed
    deltas = lim.take_deltas()
    assert deltas == [("app", 1_800_000_000 // 60 * 60, 2, 60)]
    assert lim.take_deltas() == []
    lim.give_back(deltas)
    assert lim.take_deltas() == deltas


def test_budget_per_day_counts_the_store_and_what_is_not_synced() -> None:
    now = 1_800_000_000.0  # 2027-01-15 08:00 UTC
    clock = Clock(now)
    lim = Limiter(clock=clock)
    c = Caller("app", budget_tokens=1000, budget_period="day")
    lim.set_budget_base({("app", "2027-01-15"): 900, ("app", "2027-01-14"): 5000, ("other", "2027-01-15"): 9})
    _, h = lim.admit(c)
    assert h["x-ratelimit-remaining-tokens"] == "100"
    lim.spend(c, 60)
    lim.take_deltas()  # being written: still counted
    lim.spend(c, 50)
    refused, _ = lim.admit(c)
    assert refused is not None
    assert refused.code == "insufficient_quota"
    assert "1000 tokens per day" in refused.message
    assert int(refused.headers["Retry-After"]) == int(period_end("day", now) - now)
    # the budget's -tokens three, as on the answers before it (an operator's finding: none on the 429)
    assert refused.headers["x-ratelimit-limit-tokens"] == "1000"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    assert refused.headers["x-ratelimit-reset-tokens"] == reset_text(period_end("day", now) - now)
    clock.t = period_end("day", now) + 1  # a new day
    assert lim.admit(c)[0] is None
    month = Caller("m", budget_tokens=10, budget_period="month")
    lim.set_budget_base({("m", "2027-01-01"): 4, ("m", "2027-01-10"): 5, ("m", "2026-12-31"): 99})
    clock.t = now
    assert lim.admit(month)[0] is None  # 9 this month; December's 99 do not count
    assert lim.budget_used(month, now) == 9


def test_tokens_of_requests_in_flight_count_until_they_end() -> None:
    """Tokens are counted when an answer ends, so requests sent at once were all admitted on a budget
    they went through many times over (8 of 150 tokens against 200: 1,472 served, a security tester's
    finding). What each may use is held from admission to its end: a burst goes over by one request."""
    clock = Clock(1_800_000_000.0)
    lim = Limiter(clock=clock)
    budget = Caller("b", budget_tokens=200, budget_period="day")
    verdicts = [lim.admit(budget, 155)[0] for _ in range(8)]
    assert [v is None for v in verdicts] == [True, True] + [False] * 6  # 0 and 155 held < 200; then 310
    refused = verdicts[2]
    assert refused is not None
    assert refused.code == "insufficient_quota"
    assert "(310 used, 310 of them held by requests in flight)" in refused.message
    lim.release(budget, 155)
    lim.spend(budget, 30)  # what the first one used
    assert lim.admit(budget, 155)[0] is None  # 30 used + 155 held < 200
    tpm = Caller("t", tpm=100)
    assert lim.admit(tpm, 160)[0] is None  # a single request larger than the limit is not refused for it
    refused, _ = lim.admit(tpm, 10)
    assert refused is not None
    assert "limit 100, used 160 (160 held by requests in flight)" in refused.message
    lim.release(tpm, 160)
    _, h = lim.admit(tpm, 10)
    assert h["x-ratelimit-remaining-tokens"] == "100"  # nothing used; its own hold is not shown
    _, h = lim.admit(tpm, 0)
    assert h["x-ratelimit-remaining-tokens"] == "90"  # the one before still in flight
    rpm_only = Caller("r", rpm=100)
    assert lim.admit(rpm_only, 10_000)[0] is None
    assert lim.admit(rpm_only, 10_000)[0] is None  # no token limit: nothing held
    lim.release(rpm_only, 10_000)  # and nothing to give back


def test_a_request_whose_input_does_not_fit_in_what_is_left_is_refused() -> None:
    """One embeddings request of 5,888 tokens was served on a tpm of 200 and a budget of 500 (a
    security tester's finding): the input's tokens are certain, so they must fit in what is left.
    Its output is not (max_tokens is a ceiling): that is held, not required to fit."""
    lim = Limiter(clock=Clock(1_800_000_000.0))
    c = Caller("e", tpm=200, budget_tokens=500, budget_period="day")
    refused, _ = lim.admit(c, 5888, 5888)
    assert refused is not None
    assert refused.code == "rate_limit_exceeded"
    assert "limit 200, used 0, and this request's input is about 5888 tokens" in refused.message
    assert lim.admit(c, 1200, 150)[0] is None  # 150 of input fit; its 1,050 of output are held
    lim.release(c, 1200)
    lim.spend(c, 190)
    refused, _ = lim.admit(c, 20, 20)
    assert refused is not None  # 190 + 20 > 200
    budget = Caller("b", budget_tokens=500, budget_period="day")
    refused, _ = lim.admit(budget, 600, 600)
    assert refused is not None
    assert refused.code == "insufficient_quota"
    assert "(0 used; this request's input is about 600 tokens)" in refused.message
    assert lim.admit(budget, 400, 400)[0] is None


@pytest.mark.parametrize(("s", "text"), [(0.25, "250ms"), (12, "12s"), (12.2, "13s"), (90, "1m30s"), (3725, "1h2m5s")])
def test_reset_text_is_openais(s: float, text: str) -> None:
    assert reset_text(s) == text


def test_callers_refuse_revoked_and_expired_keys() -> None:
    clock = Clock(1000.0)
    callers = Callers(GatewayKeys(None, initial={"sk-file"}), clock=clock)
    live = ApiKeyRow("alice", "sk-llmgw-alice00", digest("sk-a").hex(), models=("gemma",), rpm=5, expires_at=1500.0)
    gone = ApiKeyRow("bob", "sk-llmgw-bob0000", digest("sk-b").hex(), revoked_at=900.0)
    assert callers.set_rows([live, gone])
    assert not callers.set_rows([live, gone])  # same revisions: nothing to rebuild
    a = callers.lookup("sk-a")
    assert a is not None
    assert (a.name, a.rpm, a.models) == ("alice", 5, frozenset({"gemma"}))
    assert callers.lookup("sk-b") is None
    file_caller = callers.lookup("sk-file")
    assert file_caller is not None
    assert file_caller.name == "keys-file"
    assert not file_caller.limited
    clock.t = 1500.0
    assert callers.lookup("sk-a") is None


def test_stream_tally_hides_the_usage_event_it_asked_for() -> None:
    events = (
        b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
        b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":26,"completion_tokens":5,"total_tokens":31}}\n\n'
        b"data: [DONE]\n\n"
    )
    hidden = StreamTally(hide=True, prompt_chars=40)
    out = hidden.feed(events)
    assert b'"usage"' not in out
    assert out.endswith(b"data: [DONE]\n\n")
    assert b'"Hi"' in out
    assert hidden.usage() == {"prompt_tokens": 26, "completion_tokens": 5, "total_tokens": 31}
    shown = StreamTally(hide=False, prompt_chars=40)
    assert shown.feed(events) == events
    left = StreamTally(hide=True, prompt_chars=40)
    left.feed(events.split(b'data: {"choices":[]')[0])  # the client left before the end
    assert left.usage() == {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11, "estimated": True}


def test_a_completions_streams_usage_on_its_last_token_is_hidden_and_the_token_kept() -> None:
    """llama-server's ``/v1/completions`` stream carries ``usage`` (and ``timings``) on its last token's
    event, asked or not: a client that did not ask got them (the chat path hid them: a new user's
    finding). Hidden, the event keeps its text and finish_reason; counted all the same."""
    events = (
        b'data: {"choices":[{"text":"Once","index":0,"finish_reason":null}],"object":"text_completion"}\n\n'
        b'data: {"choices":[{"text":" upon","index":0,"finish_reason":"length"}],"object":"text_completion",'
        b'"usage":{"prompt_tokens":4,"completion_tokens":2,"total_tokens":6},"timings":{"predicted_n":2}}\n\n'
        b"data: [DONE]\n\n"
    )
    hidden = StreamTally(hide=True, prompt_chars=16)
    out = hidden.feed(events)
    assert b'"usage"' not in out
    assert b'"timings"' not in out
    assert b'"text":" upon"' in out
    assert b'"finish_reason":"length"' in out
    assert out.endswith(b"data: [DONE]\n\n")
    assert hidden.usage() == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert StreamTally(hide=False, prompt_chars=16).feed(events) == events


# -- the gateway with stored keys ---------------------------------------------------------------


@dataclass
class Env:
    url: str
    callers: Callers
    exchanges: list[Exchange] = field(default_factory=list)

    def chat(self, key: str | None, model: str = "gemma", text: str = "hi", **extra: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {"model": model, "messages": [{"role": "user", "content": text}], **extra}
        r = httpx.post(f"{self.url}/v1/chat/completions", json=body, headers=headers)
        self.exchange(r)
        return r

    def exchange(self, r: httpx.Response, within_s: float = 5.0) -> Exchange:
        """The exchange of the request ``r`` answered, once the gateway's loop has handed it to ``observe``.

        ``observe`` runs on the server thread's loop just after the handler returns, so the client can
        hold its answer first; and an earlier request's exchange (another test's too) can land after
        this one was sent: it is picked by its ``x-request-id``, never as ``exchanges[-1]``."""
        rid = r.headers["x-request-id"]
        deadline = time.monotonic() + within_s
        while not (mine := [e for e in list(self.exchanges) if e.request_id == rid]):
            assert time.monotonic() < deadline, f"the exchange of request {rid} not recorded within {within_s} s"
            time.sleep(0.01)
        (ex,) = mine
        return ex


ROWS = [
    ApiKeyRow("limited", "sk-llmgw-limite", digest("sk-limited").hex(), rpm=2),
    ApiKeyRow("only-g", "sk-llmgw-only-g", digest("sk-only").hex(), models=("g",)),
    ApiKeyRow("old", "sk-llmgw-old000", digest("sk-old").hex(), expires_at=time.time() - 1),
    ApiKeyRow("tokens", "sk-llmgw-tokens", digest("sk-tokens").hex(), tpm=10),
    ApiKeyRow("budget", "sk-llmgw-budget", digest("sk-budget").hex(), budget_tokens=400, budget_period="day"),
]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    servers = ServerThread()
    port = servers.serve(fake_llama("replica-a", "key-a"))
    up = Upstream("r-a", f"127.0.0.1:{port}", "key-a")
    router = StaticRouter(
        routes={"gemma": Route("gemma", (up,), created=1), "other": Route("other", (up,), created=2)},
        aliases={"g": "gemma"},
    )
    callers = Callers(GatewayKeys(None, initial={"sk-file"}))
    callers.set_rows(ROWS)
    exchanges: list[Exchange] = []
    app = build_gateway_app(
        router, keys=(), allow_loopback_without_key=False, observe=exchanges.append,
        callers=callers, limiter=Limiter(),
    )
    gw = servers.serve(app, handler_cancellation=True)
    yield Env(f"http://127.0.0.1:{gw}", callers, exchanges)
    servers.close()


def test_rate_limited_key_gets_429_in_openai_shape(env: Env) -> None:
    # malformed requests are refused before they are counted: three spent the rpm of 2 and the next
    # valid one got 429 (a new user's finding)
    bad = [env.chat("sk-limited", stream=True, stream_options={"include_usage": "yes"}) for _ in range(3)]
    assert [r.status_code for r in bad] == [400, 400, 400]
    ok = [env.chat("sk-limited") for _ in range(2)]
    assert [r.status_code for r in ok] == [200, 200]
    assert ok[1].headers["x-ratelimit-remaining-requests"] == "0"
    r = env.chat("sk-limited")
    if r.status_code == 200:  # the minute turned between the requests
        r = env.chat("sk-limited")
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert r.headers["x-ratelimit-limit-requests"] == "2"
    assert env.exchange(r).code == "rate_limit_exceeded"
    assert env.exchange(r).key == "limited"
    client = openai.OpenAI(base_url=f"{env.url}/v1", api_key="sk-limited", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "hi"}])
    client.close()


def _wait(done: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, f"not within {within_s} s"
        time.sleep(0.01)


def test_tokens_per_minute_counted_for_streams_too(env: Env) -> None:
    seen = len(env.exchanges)
    r = env.chat("sk-tokens", stream=True)  # 9 tokens, asked of the engine with include_usage
    assert r.status_code == 200
    assert '"usage"' not in r.text  # the client did not ask for it: hidden
    # A stream's tokens are counted when the handler ends, which may come a moment after the client
    # has read the last event (seen once in CI): wait for its exchange, recorded just after. Only
    # this key's: the previous test's last 429 can be recorded after ``seen`` was read (seen in CI).
    def mine() -> list[Exchange]:
        return [e for e in env.exchanges[seen:] if e.key == "tokens"]

    _wait(lambda: len(mine()) == 1)
    assert mine()[0].usage == {"completion_tokens": 4, "prompt_tokens": 5, "total_tokens": 9}
    shown = env.chat("sk-tokens", stream=True, stream_options={"include_usage": True})  # 9 < 10: admitted
    assert '"usage"' in shown.text
    _wait(lambda: len(mine()) == 2)
    r = env.chat("sk-tokens")
    assert r.status_code == 429
    assert "tokens per minute" in r.json()["error"]["message"]


def test_model_outside_a_keys_list_is_404_as_if_absent(env: Env) -> None:
    assert env.chat("sk-only", model="gemma").status_code == 200  # its alias 'g' names gemma
    r = env.chat("sk-only", model="other")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "model 'other' does not exist; known models: gemma"
    models = httpx.get(f"{env.url}/v1/models", headers={"Authorization": "Bearer sk-only"}).json()
    assert [m["id"] for m in models["data"]] == ["gemma"]
    every = httpx.get(f"{env.url}/v1/models", headers={"Authorization": "Bearer sk-file"}).json()
    assert sorted(m["id"] for m in every["data"]) == ["gemma", "other"]
    assert httpx.get(f"{env.url}/v1/models/other", headers={"Authorization": "Bearer sk-only"}).status_code == 404


def test_expired_and_revoked_keys_are_401(env: Env) -> None:
    assert env.chat("sk-old").status_code == 401
    env.callers.set_rows([*ROWS[:3], ApiKeyRow("tokens", "x", digest("sk-tokens").hex(), revoked_at=1.0, revision=2)])
    try:
        r = env.chat("sk-tokens")
        assert r.status_code == 401
        assert "revoked" in r.json()["error"]["message"]
    finally:
        env.callers.set_rows(ROWS)


@pytest.mark.parametrize(
    "header", ["Bearer", "Basic dXNlcjpwYXNz", "sk-limited", "Bearer sk-limited extra", "Token x", "bearer sk-wrong"]
)
def test_malformed_authorization_is_401_never_500(env: Env, header: str) -> None:
    r = httpx.post(
        f"{env.url}/v1/chat/completions",
        json={"model": "gemma", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": header},
    )
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_request_id_on_every_response_and_sent_to_the_engine(env: Env) -> None:
    r = env.chat("sk-file", text="echo-request-id")
    rid = r.headers["x-request-id"]
    assert len(rid) == 24
    assert r.json()["choices"][0]["message"]["content"] == rid
    mine = httpx.post(
        f"{env.url}/v1/chat/completions",
        json={"model": "gemma", "messages": [{"role": "user", "content": "echo-request-id"}]},
        headers={"Authorization": "Bearer sk-file", "x-request-id": "trace-42"},
    )
    assert mine.headers["x-request-id"] == "trace-42"
    assert mine.json()["choices"][0]["message"]["content"] == "trace-42"
    odd = httpx.get(f"{env.url}/v1/nothing", headers={"x-request-id": "has space"})
    assert odd.status_code == 404
    assert len(odd.headers["x-request-id"]) == 24
    assert env.chat("wrong").headers["x-request-id"]
    assert httpx.get(f"{env.url}/healthz").headers["x-request-id"]


def test_access_log_line_has_no_prompt_or_secret(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    ex = env.exchange(env.chat("sk-file", text="my secret prompt sk-limited", stream=True))
    with caplog.at_level(logging.INFO, logger="llmgw.access"):
        log_exchange(ex)
    # only this logger's: the caplog handler also takes what the server thread logs meanwhile
    (record,) = [r for r in caplog.records if r.name == "llmgw.access"]
    line = record.getMessage()
    assert f"request_id={ex.request_id} key=keys-file kind=chat model=gemma replica=r-a status=200 stream=true" in line
    assert "prompt_tokens=5 completion_tokens=4" in line
    assert "secret" not in line
    assert "sk-" not in line
    json.dumps(line)


async def test_refused_by_a_limit_or_a_busy_model_is_not_usage(tmp_path: Path) -> None:
    """A new user's flood: one key's usage read 1,063 requests and 1,046 errors for 17 answered, the
    rest 429 ``model_busy`` (the model's capacity, not the key's errors). Those are not usage, as a
    limit's 429s were not; an answer and a replica's failure are (a real SQLite store, synced)."""
    store = open_store(f"sqlite:///{tmp_path / 'usage.db'}")
    callers = Callers(GatewayKeys(None))
    accounting = Accounting(store, OffLoop(), "cp", callers, Limiter())
    for status, code in ((200, ""), (429, "model_busy"), (429, "rate_limit_exceeded"), (502, "upstream_failed")):
        accounting.observe(Exchange(requested="m", model="m", replica="", status=status, stream=False,
                                    overhead_ms=0.0, upstream_ms=0.0, key="alice", code=code))
    # a stream cut after its 200 (its replica died) is an error too; one that ended well is not
    for code in ("upstream_failed", ""):
        accounting.observe(Exchange(requested="m", model="m", replica="r", status=200, stream=True,
                                    overhead_ms=0.0, upstream_ms=0.0, key="alice", code=code))
    await accounting.sync()
    (row,) = store.usage(key="alice", since_day="2000-01-01")
    assert (row.requests, row.errors) == (4, 2)


def test_parallel_requests_cannot_spend_a_budget_many_times_and_each_gives_back_its_hold(env: Env) -> None:
    """Eight streams sent at once on a budget of 400 tokens, 150 each at most: those admitted while
    the others are in flight fit the budget but for one (before, all eight were admitted). Then one at
    a time, many more than 400 / 150 are served: each request's hold is given back when it ends,
    a 499 included (a leaked hold would lock the key out)."""
    def stream(_: int) -> int:
        body = {"model": "gemma", "messages": [{"role": "user", "content": "think-first"}], "stream": True,
                "max_tokens": 150}
        r = httpx.post(f"{env.url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-budget"})
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(stream, range(8)))
    assert statuses.count(200) in (3, 4), statuses  # 0, 150, 300 held < 400 (+1 if one ended already)
    assert statuses.count(429) == 8 - statuses.count(200)
    for _ in range(8):  # each uses a few tokens (the fake engine's usage), far below its hold
        with pytest.raises(httpx.ReadTimeout):  # a client leaving a plain request: a 499
            httpx.post(f"{env.url}/v1/chat/completions", headers={"Authorization": "Bearer sk-budget"},
                       json={"model": "gemma", "messages": [{"role": "user", "content": "think-first"}],
                             "max_tokens": 150, "stream": True}, timeout=httpx.Timeout(5, read=0.05))
    _wait(lambda: env.chat("sk-budget", max_tokens=150).status_code == 200)
    assert [env.chat("sk-budget", max_tokens=150).status_code for _ in range(6)] == [200] * 6



def test_an_embedding_request_its_client_leaves_holds_its_slot_until_the_engine_answers() -> None:
    """llama-server computes an embeddings request it accepted whatever the connection; the gateway
    freed the slot when the client left and sent the next request at once, so abandoned requests
    queued inside the engine out of the fair queue's sight (a 2-token request waited 3 min 10 s
    behind them: a security tester's finding). A stand-in engine that answers after 1 s, whatever its
    client does, and one slot: the next request reaches it only after the abandoned one is done; one
    left while it waits for the slot never reaches it."""
    seen: list[tuple[str, float, float]] = []
    arrived: list[str] = []  # as each reaches the engine, a second before it is in ``seen``

    async def embed(request: web.Request) -> web.Response:
        body = await request.json()
        t0 = time.monotonic()
        arrived.append(body["input"])
        await asyncio.sleep(1.0)  # computing, its client there or not
        seen.append((body["input"], t0, time.monotonic()))
        return web.json_response({"object": "list", "model": "emb", "data": [{"object": "embedding", "index": 0,
                                  "embedding": [0.1]}], "usage": {"prompt_tokens": 3, "total_tokens": 3}})

    engine = web.Application()
    engine.router.add_post("/v1/embeddings", embed)
    engine.router.add_get("/props", lambda _r: web.json_response({"total_slots": 1}))
    servers = ServerThread()
    try:
        port = servers.serve(engine)
        router = StaticRouter(routes={"emb": Route("emb", (Upstream("r-e", f"127.0.0.1:{port}", "k", slots=1),),
                                                   role="embedding", created=1)})
        app = build_gateway_app(router, keys=(), allow_loopback_without_key=True, limiter=Limiter())
        url = f"http://127.0.0.1:{servers.serve(app, handler_cancellation=True)}/v1/embeddings"
        with pytest.raises(httpx.ReadTimeout):  # the client leaves while the engine computes
            httpx.post(url, json={"model": "emb", "input": "left"}, timeout=httpx.Timeout(5, read=0.3))
        r = httpx.post(url, json={"model": "emb", "input": "next"}, timeout=10)
        assert r.status_code == 200, r.text
        (left, _, end_left), (nxt, t0_next, _) = sorted(seen, key=lambda s: s[1])
        assert (left, nxt) == ("left", "next")
        assert t0_next >= end_left - 0.05, f"the next one reached the engine {end_left - t0_next:.2f} s early"
        # One whose client leaves while it still waits for the slot never reaches the engine: carried
        # on, it would have been computed for free (nothing charged: no replica had it).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(httpx.post, url, json={"model": "emb", "input": "busy"}, timeout=10)
            _wait(lambda: "busy" in arrived)  # it holds the slot
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url, json={"model": "emb", "input": "queued"}, timeout=httpx.Timeout(5, read=0.3))
            assert busy.result().status_code == 200
        # Carried on, it would reach the engine as the slot came free, before busy's answer was out:
        # 0.5 s is the slack the old wait for its end in ``seen`` left (1.5 s less its 1 s computing).
        time.sleep(0.5)
        assert arrived == ["left", "next", "busy"]
        assert [s[0] for s in seen] == ["left", "next", "busy"]
    finally:
        servers.close()
