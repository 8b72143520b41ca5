"""The gateway's slots and queue, in process: real HTTP through the real gateway app to small
stand-in engines (llama-server's ``/props`` and a chat answer that takes as long as asked; a real
llama-server cannot be told how long to take). The same on real llama-server replicas:
tests/e2e/test_routing_e2e.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web

from llmgw.control.gateway.app import build_gateway_app, gateway_pool
from llmgw.control.gateway.inspect import Exchange
from llmgw.control.gateway.upstream import UpstreamPool
from llmgw.routing import Route, StaticRouter, Upstream
from tests.helpers.gateway import ServerThread
from tests.helpers.net import free_port

KEY = "sk-routing"


@dataclass
class Engine:
    """A stand-in with ``slots`` slots: ``/props``, and a chat answer after ``sleep:S`` seconds;
    ``running``/``peak`` count the requests it holds at once."""

    name: str
    slots: int
    running: int = 0
    peak: int = 0
    served: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        async def props(request: web.Request) -> web.Response:
            assert request.headers["Authorization"] == f"Bearer key-{self.name}"
            return web.json_response({"total_slots": self.slots})

        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            text = body["messages"][-1]["content"]
            self.running += 1
            self.peak = max(self.peak, self.running)
            try:
                await asyncio.sleep(float(text.split("sleep:")[1].split()[0]) if "sleep:" in text else 0)
            finally:
                self.running -= 1
            self.served.append(text)
            answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": self.name}}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
            return web.json_response(answer)

        app = web.Application()
        app.router.add_get("/props", props)
        app.router.add_post("/v1/chat/completions", chat)
        return app


@dataclass
class Recorder:
    """What the pool reports to the control plane's metrics (:class:`RoutingMetrics`)."""

    routed_: Counter[tuple[str, str]] = field(default_factory=Counter)
    waits: list[tuple[str, float]] = field(default_factory=list)
    lengths: Callable[[], Mapping[str, int]] | None = None

    def routed(self, model: str, reason: str) -> None:
        self.routed_[(model, reason)] += 1

    def waited(self, model: str, seconds: float) -> None:
        self.waits.append((model, seconds))

    def track_queues(self, lengths: Callable[[], Mapping[str, int]]) -> None:
        self.lengths = lengths


@dataclass
class Env:
    url: str
    engines: list[Engine]
    pool: UpstreamPool
    router: StaticRouter
    servers: ServerThread
    metrics: Recorder
    exchanges: list[Exchange] = field(default_factory=list)

    def ask(self, model: str, text: str, timeout: float = 30) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": text}]}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout)


@pytest.fixture
def env() -> Iterator[Env]:
    servers = ServerThread()
    engines = [Engine("a", 2), Engine("b", 2)]
    ups = tuple(Upstream(e.name, f"127.0.0.1:{servers.serve(e.app())}", f"key-{e.name}") for e in engines)
    router = StaticRouter(routes={
        "m": Route("m", ups),
        "noq": Route("noq", ups, queue_size=0),
        "short": Route("short", ups, queue_wait_s=0.3),
        "deadfirst": Route("deadfirst", (Upstream("dead", f"127.0.0.1:{free_port()}", "k"), *ups)),
    })
    metrics = Recorder()
    exchanges: list[Exchange] = []
    app = build_gateway_app(router, keys={KEY}, allow_loopback_without_key=False, routing_metrics=metrics,
                            observe=exchanges.append)
    url = f"http://127.0.0.1:{servers.serve(app, handler_cancellation=True)}"
    env = Env(url, engines, gateway_pool(app), router, servers, metrics, exchanges)
    assert env.ask("m", "warm").status_code == 200
    servers.run(env.pool.balancer.settle())
    yield env
    servers.close()


def _many(env: Env, model: str, texts: list[str]) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as ex:
        return list(ex.map(lambda t: env.ask(model, t), texts))


def test_requests_beyond_the_slots_wait_and_all_are_served(env: Env) -> None:
    # 1 s each: the 12 clients' connections open over a few hundred ms on a loaded machine (each
    # httpx client makes its TLS context), so at 0.2 s some found a slot already free (7 of 8 waited).
    results = _many(env, "m", [f"r{i} sleep:1.0" for i in range(12)])
    assert [r.status_code for r in results] == [200] * 12
    assert [e.peak for e in env.engines] == [2, 2]  # never more than its slots on an engine
    loads = env.pool.loads()
    assert {(x.slots, x.in_flight, x.queued) for x in loads.values()} == {(2, 0, 0)}
    assert sum(sum(x.picks.values()) for x in loads.values()) == 13
    m = env.metrics
    picks = sum(n for (model, reason), n in m.routed_.items() if model == "m" and reason not in ("queued", "busy"))
    assert picks == 13
    assert m.routed_[("m", "queued")] == 8, m.routed_  # 4 slots: the other 8 waited
    assert sorted(w > 0 for model, w in m.waits if model == "m").count(True) == 8
    assert m.lengths is not None
    assert m.lengths() == {"m": 0}
    # The access log's queued_ms: the 8 that waited say so, and it is part of upstream_ms (a new user
    # read 30 s of queueing as 30 s of engine time).
    deadline = time.monotonic() + 5
    while len(served := [e for e in env.exchanges if e.status == 200 and e.model == "m"]) < 13:
        assert time.monotonic() < deadline, len(served)
        time.sleep(0.01)
    waited = [e for e in served if e.queued_ms > 0]
    assert len(waited) == 8
    assert all(e.queued_ms < e.upstream_ms for e in waited)
    assert all(e.queued_ms >= 500 for e in waited[-4:])  # the last four waited for a 1 s answer


def test_no_queue_429_at_once_with_retry_after(env: Env) -> None:
    t0 = time.monotonic()
    results = _many(env, "noq", [f"r{i} sleep:0.5" for i in range(8)])
    codes = Counter(r.status_code for r in results)
    assert codes == {200: 4, 429: 4}
    refused = next(r for r in results if r.status_code == 429)
    assert refused.json()["error"]["code"] == "model_busy"
    assert int(refused.headers["Retry-After"]) >= 1
    assert time.monotonic() - t0 < 5
    assert env.metrics.routed_[("noq", "busy")] == 4


def test_a_wait_past_wait_s_is_a_429(env: Env) -> None:
    """The two beyond the 4 slots wait their 0.3 s and are refused; each wait is in the queue-wait
    metric like a served request's (it left out the requests refused after waiting)."""
    results = _many(env, "short", [f"r{i} sleep:1.5" for i in range(6)])
    assert Counter(r.status_code for r in results) == {200: 4, 429: 2}
    waited_out = [r for r in results if r.status_code == 429 and "waited" in r.json()["error"]["message"]]
    waits = sorted(w for model, w in env.metrics.waits if model == "short")
    assert len(waits) == 4 + len(waited_out), waits  # the 4 served at once (0 s) and each refused after waiting
    assert all(w >= 0.3 for w in waits[4:]), waits
    assert waited_out, [r.text for r in results]  # the estimate had no service time: both waited


def test_a_client_leaving_frees_its_slot_and_its_place(env: Env) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        held = [ex.submit(env.ask, "m", f"held{i} sleep:2.0") for i in range(4)]
        time.sleep(0.3)
        for i in range(2):  # these wait in the queue, and leave
            with pytest.raises(httpx.ReadTimeout):
                env.ask("m", f"leaver{i} sleep:0", timeout=0.2)
        assert [f.result().status_code for f in held] == [200] * 4
    deadline = time.monotonic() + 2
    while sum(x.in_flight for x in env.pool.loads().values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert {(x.in_flight, x.queued) for x in env.pool.loads().values()} == {(0, 0)}
    assert not any("leaver" in t for e in env.engines for t in e.served)  # a leaver never reached one
    assert env.ask("m", "after").status_code == 200


def test_a_refused_replica_is_passed_over(env: Env) -> None:
    results = _many(env, "deadfirst", [f"d{i}" for i in range(6)])
    assert [r.status_code for r in results] == [200] * 6
    assert {r.headers["x-llmgw-replica"] for r in results} <= {"a", "b"}
    assert env.pool.loads()["dead"].in_flight == 0


def test_a_replica_added_while_requests_wait_serves_them_at_once(env: Env) -> None:
    """An autoscaler's new replica relieves the requests already queued, not only those that come
    after it (a new user's scale-up left 3 waiters on the one busy replica, the 4th a 429, while the
    new replica served nothing). The table's change reaches the queue through ``Router.watch``, as
    the control plane's routing refresh tells it (``StoreRouter.refresh_in``)."""
    ups = env.router.routes["m"].upstreams
    env.router.put(Route("grow", ups[:1]))  # engine a only: 2 slots
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        busy = [ex.submit(env.ask, "grow", f"busy{i} sleep:4.0") for i in range(2)]
        deadline = time.monotonic() + 5
        while env.engines[0].running < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        waiting = [ex.submit(env.ask, "grow", f"waiter{i} sleep:0.1") for i in range(2)]
        deadline = time.monotonic() + 5
        while env.pool.queue_lengths().get("grow", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert env.pool.queue_lengths()["grow"] == 2  # both wait for engine a
        env.servers.run(_put(env.router, Route("grow", ups)))  # engine b is ready: routed now
        answers = [f.result() for f in waiting]
        # served while engine a still holds its two (4 s each): not when a slot of a freed
        ahead = [f.done() for f in busy]
        assert [f.result().status_code for f in busy] == [200, 200]
    assert [r.status_code for r in answers] == [200, 200]
    assert [r.headers["x-llmgw-replica"] for r in answers] == ["b", "b"]
    assert ahead == [False, False], "the waiters were served only once engine a freed a slot"
    assert {t for t in env.engines[1].served if t.startswith("waiter")} == {"waiter0 sleep:0.1", "waiter1 sleep:0.1"}


async def _put(router: StaticRouter, route: Route) -> None:
    router.put(route)  # on the gateway's loop, as the control plane's refresh tells its watchers
