"""Judgments queue with admission, on the real gateway app over real HTTP.

The judge here is a FAKE on purpose: an aiohttp app speaking llama-server's ``/apply-template``,
``/props`` and streamed ``/v1/chat/completions`` that takes exactly :data:`HOLD_S` per judgment on
one slot. A fake, because the test is about time: a real judge's speed on this shared 2-core machine
varies too much to say which request must be admitted and which refused (the real judge under
concurrent load is tests/e2e/test_guard_e2e.py).

Before admission, every judgment was sent to the judge at once and queued there out of sight: the
ones at the back waited until the budget ran out and got 503 after it, with nothing to say when to
retry. Now a judgment that would not be reached within its budget is refused at once with
``Retry-After``, and the judge never sees it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web

from llmgw.control.gateway.app import build_gateway_app
from llmgw.control.gateway.guard import GuardInspector
from llmgw.errors import JudgeError
from llmgw.guard.admission import JudgeQueue, JudgeTime
from llmgw.guard.config import Direction, GuardConfig, Policy
from llmgw.guard.judge import JudgeClient, JudgeRoute
from llmgw.routing import Route, StaticRouter, Upstream
from tests.helpers.gateway import ServerThread, fake_llama

#: Seconds the fake judge takes per judgment, one at a time.
HOLD_S = 1.0
#: The policy's budget: room for about three judgments in a row.
BUDGET_S = 4.0
KEY = "judge-key"


@dataclass
class SlowJudge:
    """One slot; each judgment holds it :data:`HOLD_S` s, then streams ``Safety: Safe``."""

    asked: list[str] = field(default_factory=list)
    lock: asyncio.Lock | None = None

    def app(self) -> web.Application:
        async def template(_: web.Request) -> web.Response:
            return web.json_response({"prompt": "<|im_start|>user\n<BEGIN SAFETY POLICY>\ncanary"})

        async def props(_: web.Request) -> web.Response:
            return web.json_response({"total_slots": 1})

        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            if self.lock is None:
                self.lock = asyncio.Lock()
            async with self.lock:
                self.asked.append(body["messages"][-1]["content"])
                await asyncio.sleep(HOLD_S)
            answer = "Safety: Safe\nCategories: None"
            if not body.get("stream"):
                return web.json_response({"choices": [{"message": {"content": answer}, "finish_reason": "stop"}]})
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for piece in ("Safety", ":", " Safe", "\n", "Categories", ":", " None"):
                await out.write(b"data: " + json.dumps({"choices": [{"delta": {"content": piece}}]}).encode() + b"\n\n")
            await out.write(b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
            return out

        app = web.Application()
        app.router.add_post("/apply-template", template)
        app.router.add_get("/props", props)
        app.router.add_post("/v1/chat/completions", chat)
        return app


@dataclass
class Env:
    url: str
    judge: SlowJudge
    guard: GuardInspector


@pytest.fixture
def env() -> Iterator[Env]:
    servers = ServerThread()
    judge = SlowJudge()
    jport = servers.serve(judge.app())
    eport = servers.serve(fake_llama("engine", "engine-key"))
    route = JudgeRoute("slow", "qwen3guard", (Upstream("j-1", f"127.0.0.1:{jport}", KEY),))
    policy = Policy(name="queued", judge="slow", check=[Direction.IN], budget_s=BUDGET_S)
    guard = GuardInspector(GuardConfig(policies=[policy]), JudgeClient({"slow": route}.get))
    app = build_gateway_app(
        StaticRouter(routes={"chat": Route("chat", (Upstream("r-1", f"127.0.0.1:{eport}", "engine-key"),))}),
        keys={"sk"}, allow_loopback_without_key=True, inspector=guard,
    )
    port = servers.serve(app)
    try:
        yield Env(f"http://127.0.0.1:{port}", judge, guard)
    finally:
        servers.run(guard.client.close())
        servers.close()


async def _ask(client: httpx.AsyncClient, url: str, text: str) -> tuple[str, httpx.Response, float]:
    t0 = time.perf_counter()
    r = await client.post(f"{url}/v1/chat/completions", json={"model": "chat", "messages": [
        {"role": "user", "content": text}]})
    return text, r, time.perf_counter() - t0


def test_a_burst_is_admitted_as_far_as_the_budget_reaches_and_the_rest_refused_at_once(env: Env) -> None:
    async def run() -> list[tuple[str, httpx.Response, float]]:
        async with httpx.AsyncClient(timeout=60) as c:
            for i in range(3):  # the judge's time becomes known (mean ~1 s)
                _, r, _ = await _ask(c, env.url, f"warm {i}")
                assert r.status_code == 200, r.text
            return list(await asyncio.gather(*(_ask(c, env.url, f"burst {i}") for i in range(8))))

    results = asyncio.run(run())
    served = [t for t, r, _ in results if r.status_code == 200]
    refused = [(t, r, s) for t, r, s in results if r.status_code != 200]
    # 1 s each on one slot, 4 s budget: about three fit; the other five are refused.
    assert 1 <= len(served) <= 4, [(t, r.status_code) for t, r, _ in results]
    assert len(refused) >= 4
    for text, r, seconds in refused:
        err = r.json()["error"]
        assert r.status_code == 503
        assert err["code"] == "judge_unavailable"
        assert "busy" in err["message"]
        assert "retry in" in err["message"]
        assert int(r.headers["Retry-After"]) >= 1
        assert err["retry_after_s"] == int(r.headers["Retry-After"])
        assert seconds < BUDGET_S  # at once: not after the budget ran out
        assert text not in env.judge.asked  # never sent to the judge
    stats = env.guard.stats.as_dict()
    assert stats["errors"].get("timeout", 0) == 0, stats  # nobody waited past its budget
    assert stats["errors"]["busy"] == len(refused)
    assert env.guard.client.queues["slow"].refused == len(refused)


def test_without_a_queue_a_free_slot_is_never_refused(env: Env) -> None:
    """Even a judge slower than its budget gets its chance when nothing is ahead of it."""
    async def run() -> JudgeError | None:
        try:
            await env.guard.client.judge(["slow"], Direction.IN, "alone", budget_s=0.2)
        except JudgeError as e:
            return e
        return None

    err = asyncio.run(run())
    assert err is not None
    assert err.kind == "timeout"  # it was tried, and timed out: not refused
    # The judge notes the request on its server thread, which may not have got to it when the client
    # gave up 0.2 s after sending.
    deadline = time.monotonic() + 5
    while not env.judge.asked:
        assert time.monotonic() < deadline, "the judge did not get the request within 5 s"
        time.sleep(0.01)
    assert env.judge.asked == ["alone"]
    time.sleep(HOLD_S)  # let the fake judge finish before the servers stop


# -- the queue itself -----------------------------------------------------------------------------------


def test_judge_time_follows_rfc6298() -> None:
    t = JudgeTime()
    assert t.expected() == 1.0  # the prior
    t.add(2.0)
    assert (t.mean, t.dev) == (2.0, 1.0)
    t.add(2.0)
    assert t.mean == 2.0
    assert t.dev == 0.75
    assert t.expected() == 3.5


def test_queue_order_and_estimate() -> None:
    async def run() -> list[str]:
        q = JudgeQueue("j")
        q.resize(2)
        q.record(1.0)
        q.record(1.0)  # mean 1.0, dev 0.375
        order: list[str] = []

        async def one(name: str, hold: float) -> None:
            async with q.admit(10):
                order.append(name)
                await asyncio.sleep(hold)

        tasks = [asyncio.create_task(one(n, 0.05)) for n in "abcd"]
        await asyncio.sleep(0)
        assert (q.in_flight, len(q.waiters)) == (2, 2)
        assert q.estimate() == (2.0, 1.75)  # 4 ahead on 2 slots: two rounds of 1 s, then 1 + 2 × 0.375
        with pytest.raises(JudgeError) as e:
            async with q.admit(3.0):
                pass
        assert e.value.kind == "busy"
        assert e.value.retry_after_s == 1.0
        await asyncio.gather(*tasks)
        assert (q.in_flight, len(q.waiters)) == (0, 0)
        return order

    assert asyncio.run(run()) == list("abcd")


def test_a_waiter_that_can_no_longer_make_it_is_refused_as_soon_as_that_is_known() -> None:
    async def run() -> tuple[str, int, int]:
        q = JudgeQueue("j")
        q.record(0.1)
        q.record(0.1)  # judgments look quick: mean 0.1 s
        hold = asyncio.Event()

        async def first() -> None:
            async with q.admit(10):
                await hold.wait()

        t = asyncio.create_task(first())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(_enter(q, 2.0))
        await asyncio.sleep(0)
        assert len(q.waiters) == 1  # admitted: 0.1 s ahead of it
        q.record(5.0)  # the judge turned slow: 5 s a judgment cannot fit in 2 s
        with pytest.raises(JudgeError) as e:
            await waiter
        hold.set()
        await t
        return e.value.kind, q.in_flight, len(q.waiters)

    assert asyncio.run(run()) == ("busy", 0, 0)


async def _enter(q: JudgeQueue, left_s: float) -> None:
    async with q.admit(left_s):
        pass


def test_a_waiter_that_times_out_leaves_the_queue() -> None:
    async def run() -> tuple[int, int]:
        q = JudgeQueue("j")
        hold = asyncio.Event()

        async def first() -> None:
            async with q.admit(10):
                await hold.wait()

        t = asyncio.create_task(first())
        await asyncio.sleep(0)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05), q.admit(10):
                pass
        hold.set()
        await t
        return q.in_flight, len(q.waiters)

    assert asyncio.run(run()) == (0, 0)
