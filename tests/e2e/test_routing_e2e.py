"""Routing on real llama-server replicas (gemma-3-270m, ``--parallel 2``) through real gateways.

Three replicas behind a :class:`~llmgw.routing.StaticRouter` (the routes a control plane would
build), two gateway apps with their own balancers (two control planes). What is checked: a
conversation's turns stay on one replica, on both gateways; conversations spread; no replica ever
holds more than its slots (the gateway's counters, and llama-server's own
``llamacpp:requests_deferred`` stays 0: it never had to queue one), the rest wait in the gateway's
queue or, without one, get 429 at once; round-robin still rotates; the requests waiting when a
replica is killed are served by the others; a cancelled stream gives its slot back.
"""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from llmgw.agent.engines.llamacpp import FIT_OFF
from llmgw.control.gateway.app import build_gateway_app, gateway_pool
from llmgw.control.gateway.balancer import AFFINITY, Balancer
from llmgw.control.gateway.upstream import UpstreamPool
from llmgw.routing import Route, StaticRouter, Upstream
from tests.conftest import Assets
from tests.helpers.gateway import ServerThread
from tests.helpers.net import free_port
from tests.helpers.processes import stop_processes

pytestmark = pytest.mark.e2e

KEY = "sk-route"
SLOTS = 2
SYSTEM = "You are a terse assistant. Answer in a few words. " * 8


def start_replica(assets: Assets, key: str) -> tuple[subprocess.Popen[bytes], str]:
    """A llama-server with ``SLOTS`` slots on a free port, ready; (process, endpoint)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            *(str(assets.llama_server), "-m", str(assets.model), "--host", "127.0.0.1", "--port", str(port), *FIT_OFF),
            *("--api-key", key, "-c", str(1024 * SLOTS), "--threads", "1", "-np", str(SLOTS), "--metrics"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc, f"127.0.0.1:{port}"
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "llama-server exited"
        assert time.monotonic() < deadline, "llama-server not ready in 60 s"
        time.sleep(0.2)


@dataclass
class World:
    servers: ServerThread
    ups: tuple[Upstream, ...]
    procs: list[subprocess.Popen[bytes]]
    balancers: list[Balancer]
    pools: list[UpstreamPool]
    urls: list[str]
    router: StaticRouter

    def settle(self) -> None:
        for b in self.balancers:
            self.servers.run(b.settle())


def _chat(model: str, turns: list[str], answers: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    msgs: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user", "content": t})
        if answers and i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    return {"model": model, "messages": msgs, "max_tokens": 4, "temperature": 0, **extra}


def ask(url: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=timeout)


@pytest.fixture(scope="module")
def world(assets: Assets) -> Iterator[World]:
    procs: list[subprocess.Popen[bytes]] = []
    servers = ServerThread()
    try:
        ups = []
        for i in range(3):
            proc, endpoint = start_replica(assets, f"key-{i}")
            procs.append(proc)
            ups.append(Upstream(f"rep-{i}", endpoint, f"key-{i}"))
        router = StaticRouter(routes={
            "gemma": Route("gemma", tuple(ups)),
            "gemma-rr": Route("gemma-rr", tuple(ups), routing="round-robin"),
            "gemma-noq": Route("gemma-noq", tuple(ups), queue_size=0),
            "stale": Route("stale", (Upstream("rep-0", ups[0].endpoint, "an-old-key"),)),
        })
        # The second control plane lists the replicas in another order: the choice must not depend on it.
        router2 = StaticRouter(routes={"gemma": Route("gemma", tuple(reversed(ups)))})
        balancers = [Balancer(), Balancer()]
        urls, pools = [], []
        for r, b in zip((router, router2), balancers, strict=True):
            app = build_gateway_app(r, keys={KEY}, allow_loopback_without_key=False, balancer=b)
            pools.append(gateway_pool(app))
            urls.append(f"http://127.0.0.1:{servers.serve(app, handler_cancellation=True)}")
        w = World(servers, tuple(ups), procs, balancers, pools, urls, router)
        for url in urls:  # each gateway reads the replicas' slots on first sight
            assert ask(url, _chat("gemma", ["warm up"])).status_code == 200
        w.settle()
        assert {b.loads()[u.replica_id].slots for b in balancers for u in ups} == {SLOTS}
        yield w
    finally:
        servers.close()
        stop_processes(procs)


def test_a_conversation_stays_on_one_replica_on_both_control_planes(world: World) -> None:
    """(a) Ten conversations of three growing turns, each turn through both gateways alternately (the
    first and third through one, the second through the other): every turn of a conversation lands on
    the same replica, on both."""
    before = world.balancers[0].decisions.get(("gemma", AFFINITY), 0)
    placed: dict[int, set[str]] = {}
    for c in range(10):
        turns, answers = [f"Conversation {c}: name a colour."], []
        for t in range(3):
            url = world.urls[t % 2]
            r = ask(url, _chat("gemma", turns, answers))
            assert r.status_code == 200, r.text
            placed.setdefault(c, set()).add(r.headers["x-llmgw-replica"])
            answers.append(r.json()["choices"][0]["message"]["content"] or "ok")
            turns.append(f"And another one, number {t}?")
    assert all(len(s) == 1 for s in placed.values()), placed
    # (b) the conversations spread over the replicas
    assert len({next(iter(s)) for s in placed.values()}) == 3, placed
    assert world.balancers[0].decisions.get(("gemma", AFFINITY), 0) - before == 20  # its half, all affine


def _burst(world: World, model: str, n: int) -> tuple[list[httpx.Response], Counter[str]]:
    """``n`` requests at once through the first gateway; their answers and each replica's peak in flight."""
    bal = world.balancers[0]
    peak: Counter[str] = Counter()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for rid, load in list(bal.loads().items()):
                peak[rid] = max(peak[rid], load.in_flight)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            # 4 tokens: all n are sent at once, long before the first answer ends (~0.4 s of prompt and
            # decoding each); each token costs the engine ~50 ms of CPU (gemma's 262k-token output layer)
            bodies = [_chat(model, [f"Burst {i}: count to five."], max_tokens=4) for i in range(n)]
            results = list(pool.map(lambda b: ask(world.urls[0], b), bodies))
    finally:
        stop.set()
        sampler.join()
    return results, peak


def _deferred(up: Upstream) -> float:
    """llama-server's ``llamacpp:requests_deferred``: requests it had to hold for want of a free slot."""
    metrics = httpx.get(f"http://{up.endpoint}/metrics", headers={"Authorization": f"Bearer {up.key}"}).text
    found = re.search(r"^llamacpp:requests_deferred\s+(\S+)", metrics, re.M)
    assert found is not None
    return float(found.group(1))


def test_no_replica_holds_more_than_its_slots_the_rest_wait(world: World) -> None:
    """(c) 18 requests at once for 6 slots: all are answered, the gateway never has more than 2 in
    flight on a replica, and llama-server never deferred one (it never had more than its slots): the
    12 beyond the slots waited in the gateway's queue."""
    results, peak = _burst(world, "gemma", 18)
    assert [r.status_code for r in results] == [200] * 18, [r.text for r in results if r.status_code != 200]
    assert max(peak.values()) == SLOTS, peak
    assert [_deferred(up) for up in world.ups] == [0, 0, 0]
    assert {load.in_flight for load in world.balancers[0].loads().values()} == {0}
    assert world.pools[0].loads()["rep-0"].queued == 0


def test_without_a_queue_the_rest_get_429_at_once(world: World) -> None:
    """(c) ``queue: {size: 0}``: what finds no free slot is answered 429 ``model_busy`` with
    ``Retry-After`` at once, and the replicas still never hold more than their slots."""
    t0 = time.monotonic()
    results, peak = _burst(world, "gemma-noq", 18)
    statuses = Counter(r.status_code for r in results)
    assert set(statuses) == {200, 429}, statuses
    assert statuses[200] >= 6, statuses
    for r in results:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "model_busy"
            assert int(r.headers["Retry-After"]) >= 1
    assert max(peak.values()) == SLOTS, peak
    assert [_deferred(up) for up in world.ups] == [0, 0, 0]
    assert time.monotonic() - t0 < 60


def test_round_robin_still_rotates(world: World) -> None:
    """(d) ``routing: round-robin``: the same conversation goes to each replica in turn."""
    seen = [ask(world.urls[0], _chat("gemma-rr", ["Same question."])).headers["x-llmgw-replica"] for _ in range(6)]
    assert seen[:3] == seen[3:]
    assert sorted(seen[:3]) == ["rep-0", "rep-1", "rep-2"]


def test_a_cancelled_stream_and_errors_give_their_slot_back(world: World) -> None:
    """(f) A stream the client leaves after its first chunk, a non-streamed request the client gives
    up on, and a replica error: in flight is back to 0 on every replica."""
    bal = world.balancers[0]
    body = _chat("gemma", ["Write a long story about a ship."], stream=True, max_tokens=400)
    with httpx.stream("POST", f"{world.urls[0]}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_raw())
        # 1 while the answer streams; 0 when the model already ended a short answer (it fit in the
        # socket's buffer before the client read its first chunk: seen in CI under load).
        assert sum(x.in_flight for x in bal.loads().values()) in (0, 1)
    with pytest.raises(httpx.ReadTimeout):
        ask(world.urls[0], _chat("gemma", ["Write a long poem."], max_tokens=400), timeout=0.3)
    bad = ask(world.urls[0], {**_chat("gemma", ["x"]), "temperature": "hot"})
    assert bad.status_code == 400, bad.text
    refused = ask(world.urls[0], _chat("stale", ["x"]))  # the replica refuses the gateway's key
    assert refused.status_code == 502, refused.text
    deadline = time.monotonic() + 5
    while sum(x.in_flight for x in bal.loads().values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert {x.in_flight for x in bal.loads().values()} == {0}


def test_a_replica_killed_while_requests_wait(world: World, assets: Assets) -> None:
    """(e) A fourth replica; all 8 slots busy and 8 more requests waiting in the queue; the fourth is
    killed. Its own 2 requests in flight end 502 (generation is never retried), and every waiting
    request is served by the other three, none lost, none on the dead one."""
    proc, endpoint = start_replica(assets, "key-x")
    bal, pool = world.balancers[0], world.pools[0]
    try:
        extra = Upstream("rep-x", endpoint, "key-x")
        world.router.routes["four"] = Route("four", (*world.ups, extra), queue_wait_s=300)
        assert ask(world.urls[0], _chat("four", ["warm up"])).status_code in (200,)
        world.settle()
        assert bal.loads()["rep-x"].slots == SLOTS

        def body(tag: str, i: int, max_tokens: int = 32) -> dict[str, Any]:
            # 32 tokens keep every slot busy well past the kill (~0.1-0.5 s after they start; 2 s or
            # more of decoding on a loaded machine); 48 cost 6 x 16 tokens more on the surviving three
            return _chat("four", [f"{tag} {i}: tell a long story."], max_tokens=max_tokens)

        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            busy = [ex.submit(ask, world.urls[0], body("busy", i)) for i in range(8)]
            deadline = time.monotonic() + 30
            while sum(x.in_flight for x in bal.loads().values()) < 8:
                assert time.monotonic() < deadline, bal.loads()
                time.sleep(0.01)
            # The waiting ones short: what is checked is who serves them, not for how long.
            waiting = [ex.submit(ask, world.urls[0], body("waiting", i, 8)) for i in range(8)]
            while len(pool.queues["four"]) < 8:
                assert time.monotonic() < deadline, len(pool.queues["four"])
                time.sleep(0.01)
            assert bal.loads()["rep-x"].in_flight == SLOTS
            proc.kill()
            proc.wait(10)
            done_busy = [f.result() for f in busy]
            done_waiting = [f.result() for f in waiting]
        busy_codes = Counter(r.status_code for r in done_busy)
        assert busy_codes == {200: 6, 502: 2}, [r.text for r in done_busy]
        assert [r.status_code for r in done_waiting] == [200] * 8, [r.text for r in done_waiting]
        assert "rep-x" not in {r.headers["x-llmgw-replica"] for r in done_waiting}
        assert {x.in_flight for x in bal.loads().values()} == {0}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        world.router.routes.pop("four", None)


def test_a_full_queue_429_at_once_and_a_client_leaving_frees_its_place(world: World) -> None:
    """(c) ``queue: {size: 2}``: with the 6 slots busy and 2 waiting, the next request is answered 429
    ``model_busy`` with ``Retry-After`` at once (not after a wait); a waiting client that leaves frees
    its place at once (a new request is admitted in its place) and never reaches a replica; every
    request admitted is answered 200, once."""
    bal, pool = world.balancers[0], world.pools[0]
    world.router.routes["q2"] = Route("q2", world.ups, queue_size=2, queue_wait_s=300)
    try:
        def body(tag: str, i: int, max_tokens: int = 4) -> dict[str, Any]:
            # gemma's end tokens banned (1 <eos>, 106 <end_of_turn>): each answer runs to its max_tokens
            return _chat("q2", [f"{tag} {i}: tell a long story about a lighthouse."], max_tokens=max_tokens,
                         logit_bias={"1": -100, "106": -100})

        def until(what: str, ok: Any, limit: float = 30.0) -> None:
            deadline = time.monotonic() + limit
            while not ok():
                assert time.monotonic() < deadline, what
                time.sleep(0.01)

        picks = sum(sum(x.picks.values()) for x in bal.loads().values())
        with concurrent.futures.ThreadPoolExecutor(10) as ex:
            # Busy for as long as the steps below take (the leaver's 2 s at most of it): 64 tokens on
            # three 1-thread engines sharing 2 cores, ~6 s here idle, longer under load.
            busy = [ex.submit(ask, world.urls[0], body("busy", i, 64)) for i in range(6)]
            until("6 in flight", lambda: sum(x.in_flight for x in bal.loads().values()) == 6)
            waiting = ex.submit(ask, world.urls[0], body("waiting", 0))
            leaver = ex.submit(ask, world.urls[0], body("leaver", 0), 2.0)
            until("2 waiting", lambda: len(pool.queues["q2"]) == 2)
            t0 = time.monotonic()
            full = ask(world.urls[0], body("full", 0))
            assert time.monotonic() - t0 < 5  # at once, while the slots stay busy
            assert full.status_code == 429, full.text
            assert full.json()["error"]["code"] == "model_busy"
            assert int(full.headers["Retry-After"]) >= 1
            with pytest.raises(httpx.ReadTimeout):
                leaver.result()
            until("the leaver's place freed", lambda: len(pool.queues["q2"]) == 1, 5.0)
            assert sum(x.in_flight for x in bal.loads().values()) == 6  # the slots are still busy
            late = ex.submit(ask, world.urls[0], body("late", 0))  # admitted in the leaver's place
            until("the late one waiting", lambda: len(pool.queues["q2"]) == 2, 5.0)
            answers = [f.result() for f in (*busy, waiting, late)]
        assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers if r.status_code != 200]
        # 8 picks: the 6, the waiting one and the late one; the leaver and the refused one none.
        assert sum(sum(x.picks.values()) for x in bal.loads().values()) - picks == 8
        assert {x.in_flight for x in bal.loads().values()} == {0}
        assert len(pool.queues["q2"]) == 0
    finally:
        world.router.routes.pop("q2", None)


def test_the_decode_rate_comes_from_llama_servers_timings_plain_and_streamed(world: World) -> None:
    """Every answer, plain or streamed, gives the balancer the engine's decode rate (llama-server's
    ``timings``: ``predicted_n`` tokens in ``predicted_ms``): the speed replicas are compared by,
    the same through every control plane. The streamed one comes on the usage event the gateway asks
    for and hides from a client that did not ask."""
    bal = world.balancers[1]
    for stream in (False, True):
        body = _chat("gemma", [f"Tell a long story about a lighthouse keeper ({stream})."], max_tokens=12,
                     stream=stream)
        rated = {rid: rep.rated for rid, rep in bal._reps.items()}
        r = ask(world.urls[1], body)
        assert r.status_code == 200, r.text
        rid = r.headers["x-llmgw-replica"]
        # The gateway counts it as the relay ends, just after the client has the last byte.
        deadline = time.monotonic() + 5
        while bal._reps[rid].rated == rated[rid] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bal._reps[rid].rated == rated[rid] + 1, (stream, rid)
        if stream:
            assert '"usage"' not in r.text  # the client did not ask for it
        rate = bal.loads()[rid].tokens_per_s
        assert 1.0 < rate < 5_000.0, rate  # gemma-3-270m decodes ~25 tokens/s on one core here


def test_llama_server_reports_its_slots(world: World) -> None:
    """The slots the gateway uses are llama-server's own ``total_slots``."""
    up = world.ups[0]
    props = httpx.get(f"http://{up.endpoint}/props", headers={"Authorization": f"Bearer {up.key}"}).json()
    assert props["total_slots"] == SLOTS == world.balancers[1].loads()[up.replica_id].slots
