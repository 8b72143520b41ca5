"""The balancer's choice, pure (no network): rendezvous ranking, 1/N movement, the load bound,
slots, round-robin, least load, and the prefix key. The end-to-end behaviour on real llama-server
replicas is tests/e2e/test_routing_e2e.py."""

from __future__ import annotations

import asyncio
import collections
import heapq
import random
import time
from typing import Any

import pydantic
import pytest

from llmgw.catalog import Model
from llmgw.control.gateway.balancer import (
    AFFINITY,
    HOME_WAIT,
    LEAST_LOAD,
    MIN_ANSWERS,
    OVERFLOW,
    ROUND_ROBIN,
    STALE_S,
    Balancer,
    Lease,
    load_bound,
)
from llmgw.control.gateway.prefix import prefix_key, rendezvous, replica_hash
from llmgw.control.gateway.queue import FairQueue
from llmgw.control.gateway.table import build_routes, profile_slots
from llmgw.control.reconcile.leader import spec_hash
from llmgw.control.store.rows import PlacementSummary, ReplicaRow
from llmgw.routing import Route, Upstream

KEYS = 20_000


def _first(key: int, ids: list[str]) -> str:
    return ids[rendezvous(key, [replica_hash(r) for r in ids])[0]]


def _route(n: int, *, slots: int = 4, routing: str = "cache-aware") -> tuple[Route, Balancer]:
    ups = tuple(Upstream(f"r{i}", f"127.0.0.1:{9000 + i}", "k") for i in range(n))
    route = Route("m", ups, routing=routing)
    bal = Balancer(clock=lambda: 100.0)
    bal.slots(route)  # the replicas become known (no reader: slots set below)
    for up in ups:
        bal.set_slots(up.replica_id, slots)
    return route, bal


def test_rendezvous_is_deterministic_and_even() -> None:
    ids = ["rep-a", "rep-b", "rep-c"]
    firsts = collections.Counter(_first(k * 7919 + 1, ids) for k in range(KEYS))
    # Another "control plane": a new list object, the replicas in another order.
    again = collections.Counter(_first(k * 7919 + 1, list(reversed(ids))) for k in range(KEYS))
    assert firsts == again
    for r in ids:  # each gets a third, within 3 %
        assert abs(firsts[r] / KEYS - 1 / 3) < 0.03, firsts


def test_a_replica_added_or_removed_moves_one_nth_of_the_keys() -> None:
    three = ["rep-a", "rep-b", "rep-c"]
    four = [*three, "rep-d"]
    keys = [prefix_key({"prompt": f"conversation {i}"}) or 0 for i in range(KEYS)]
    moved_in = sum(_first(k, three) != _first(k, four) for k in keys) / KEYS
    assert all(_first(k, four) == "rep-d" for k in keys if _first(k, three) != _first(k, four))
    assert abs(moved_in - 1 / 4) < 0.02, moved_in
    two = ["rep-a", "rep-c"]
    moved_out = sum(_first(k, three) != _first(k, two) for k in keys) / KEYS
    assert all(_first(k, three) == "rep-b" for k in keys if _first(k, three) != _first(k, two))
    assert abs(moved_out - 1 / 3) < 0.02, moved_out


@pytest.mark.parametrize(
    ("in_flight", "replicas", "bound"),
    [(0, 3, 2), (1, 3, 2), (2, 3, 3), (8, 3, 5), (11, 3, 6), (0, 1, 3), (99, 4, 33)],
)
def test_load_bound(in_flight: int, replicas: int, bound: int) -> None:
    assert load_bound(in_flight, replicas) == bound


def test_same_key_same_replica_until_the_bound_then_its_next_choice() -> None:
    route, bal = _route(3)
    key = prefix_key({"messages": [{"role": "user", "content": "hello"}]})
    first = bal.take(route, key)
    assert first is not None
    assert first.reason == AFFINITY
    first.release()
    order = [route.upstreams[i].replica_id for i in rendezvous(key or 0, [replica_hash(u.replica_id) for u in
                                                                           route.upstreams])]
    assert first.up.replica_id == order[0]
    held = [bal.take(route, key) for _ in range(6)]
    # in flight before each (4 slots per replica; bound ceil(1.25 × (k + 1) / 3) + 1): 0 and 1 (bound
    # 2: the first choice takes both), 2 (bound 3), 3 (bound 3: the first is at it, the second takes
    # it), 4 (bound 4: the first has 3), 5 (bound 4: the first is at it)
    assert [(x.up.replica_id, x.reason) for x in held if x] == [
        (order[0], AFFINITY), (order[0], AFFINITY), (order[0], AFFINITY), (order[1], OVERFLOW),
        (order[0], AFFINITY), (order[1], OVERFLOW),
    ]


def test_no_replica_beyond_its_slots_and_none_when_all_are_full() -> None:
    route, bal = _route(2, slots=2)
    leases = [bal.take(route, prefix_key({"prompt": f"p{i}"})) for i in range(4)]
    assert all(leases)
    per = collections.Counter(x.up.replica_id for x in leases if x)
    assert per == {"r0": 2, "r1": 2}
    assert bal.take(route, prefix_key({"prompt": "more"})) is None
    assert {r.in_flight for r in bal.loads().values()} == {2}
    for x in leases:
        assert x is not None
        x.release()
        x.release()  # twice counts once
    assert {r.in_flight for r in bal.loads().values()} == {0}


def test_least_load_prefers_the_faster_replica() -> None:
    route, bal = _route(2)
    t = [0.0]
    bal.clock = lambda: t[0]
    for rid, took in (("r0", 4.0), ("r1", 1.0)):
        lease = bal.take(route, None, exclude={"r1" if rid == "r0" else "r0"})
        assert lease is not None
        assert lease.up.replica_id == rid
        t[0] += took
        lease.release()
    picked = bal.take(route, None)
    assert picked is not None
    assert (picked.up.replica_id, picked.reason) == ("r1", LEAST_LOAD)
    assert bal.loads()["r0"].service_s == 4.0


def _timed(route: Route, bal: Balancer, took: dict[str, float]) -> list[float]:
    """Give each replica MIN_ANSWERS answers of ``took[id]`` seconds (its EWMA); returns the clock, settable."""
    t = [100.0]
    bal.clock = lambda: t[0]
    for up in route.upstreams:
        for _ in range(MIN_ANSWERS):
            t[0] = 100.0  # each answer starts at 100 s: all of them recent at the end
            lease = bal.take(route, None, exclude={u.replica_id for u in route.upstreams} - {up.replica_id})
            assert lease is not None
            t[0] += took[up.replica_id]
            lease.release()
    t[0] = 100.0 + max(took.values())
    return t


def test_a_slow_replica_waits_for_a_faster_ones_slot_unless_the_queue_is_long() -> None:
    """Shortest expected delay with a threshold: r2 answers in 6 s, r0 and r1 in 1 s (2 slots each).
    With r0 and r1 full, the first waiter waits (1 / (2/1 + 2/1) + 1 = 1.25 s < 6 s) rather than take
    r2's free slot; with 20 waiting, 20 / 4 + 1 = 6 s is no better, and r2 serves."""
    route, bal = _route(3, slots=2)
    _timed(route, bal, {"r0": 1.0, "r1": 1.0, "r2": 6.0})
    keys = [prefix_key({"prompt": f"p{i}"}) for i in range(40)]
    fast = [bal.take(route, k) for k in keys[:4]]
    assert sorted(x.up.replica_id for x in fast if x) == ["r0", "r0", "r1", "r1"]
    assert all(bal.take(route, k) is None for k in keys[4:12])  # the keys whose home is r2 too
    late = bal.take(route, keys[12], waiting=20)
    assert late is not None
    assert late.up.replica_id == "r2"
    # One of the fast ones frees: the next request goes there.
    assert fast[0] is not None
    fast[0].release()
    again = bal.take(route, keys[13])
    assert again is not None
    assert again.up.replica_id == fast[0].up.replica_id


def test_equal_replicas_and_stale_times_are_not_judged() -> None:
    """Within SPEED_RATIO of each other the free slot is taken; an EWMA older than STALE_S is not
    judged (the slow replica is tried again)."""
    route, bal = _route(2, slots=1)
    t = _timed(route, bal, {"r0": 1.0, "r1": 1.4})
    held = bal.take(route, None, exclude={"r1"})
    assert held is not None
    other = bal.take(route, None)
    assert other is not None
    assert other.up.replica_id == "r1"
    other.release()
    held.release()
    route, bal = _route(2, slots=1)
    t = _timed(route, bal, {"r0": 1.0, "r1": 5.0})
    held = bal.take(route, None, exclude={"r1"})
    assert held is not None
    assert bal.take(route, None) is None
    t[0] += STALE_S
    probe = bal.take(route, None)
    assert probe is not None
    assert probe.up.replica_id == "r1"


def test_round_robin_rotates_over_free_replicas() -> None:
    route, bal = _route(3, slots=1, routing="round-robin")
    seen = []
    for _ in range(6):
        lease = bal.take(route, 123)
        assert lease is not None
        assert lease.reason == ROUND_ROBIN
        seen.append(lease.up.replica_id)
        lease.release()
    assert seen == ["r0", "r1", "r2", "r0", "r1", "r2"]
    held = bal.take(route, None)
    assert held is not None
    nxt = bal.take(route, None)
    assert nxt is not None
    assert nxt.up.replica_id != held.up.replica_id


def test_a_refused_replica_is_passed_over_unless_all_were() -> None:
    route, bal = _route(2)
    key = prefix_key({"prompt": "x"})
    first = bal.take(route, key)
    assert isinstance(first, Lease)
    first.release(answered=False)
    bal.refused(first.up.replica_id)
    other = bal.take(route, key)
    assert other is not None
    assert other.up.replica_id != first.up.replica_id
    other.release()
    bal.refused(other.up.replica_id)
    assert bal.take(route, key) is not None  # both refused lately: tried anyway
    assert bal.take(route, key, exclude={"r0", "r1"}) is None
    assert bal.decisions[("m", AFFINITY)] >= 1


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        # A conversation's later turns keep the key (system + first user message).
        (
            {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]},
            {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]},
            True,
        ),
        (
            {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]},
            {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hey"}]},
            False,
        ),
        ({"prompt": "a" * 2048 + "x"}, {"prompt": "a" * 2048 + "y"}, True),
        ({"prompt": "a" * 100 + "x"}, {"prompt": "a" * 100 + "y"}, False),
        ({"prompt": ["once"]}, {"prompt": "once"}, True),
        ({"prompt": [1, 2, 3]}, {"prompt": [1, 2, 4]}, False),
    ],
)
def test_prefix_key(a: dict[str, Any], b: dict[str, Any], same: bool) -> None:
    ka, kb = prefix_key(a), prefix_key(b)
    assert ka is not None
    assert (ka == kb) is same


def test_no_key_for_embeddings() -> None:
    assert prefix_key({"input": "text"}) is None
    assert prefix_key({"prompt": [["a"], ["b"]]}) is None


def _model(**extra: Any) -> Model:
    return Model(name="m", source="http://mirror/m.gguf",
                 profiles=[{"name": "cpu", "args": ["--parallel", "3"]}, {"name": "v", "engine": "vllm"}], **extra)


def test_catalog_routing_and_queue_reach_the_route() -> None:
    m = _model(routing="round-robin", queue={"size": 0, "wait_s": 2.5})
    rows = [ReplicaRow(id="r1", model="m", node="n", profile="cpu", key="k", state="ready", endpoint="h:1"),
            ReplicaRow(id="r2", model="m", node="n", profile="v", key="k", state="ready", endpoint="h:2")]
    routes, _, _ = build_routes([m], rows, {}, {})
    r = routes["m"]
    assert (r.routing, r.queue_size, r.queue_wait_s) == ("round-robin", 0, 2.5)
    assert build_routes([_model(aliases=["a1", "a2"])], [], {}, {})[0]["m"].aliases == ("a1", "a2")  # guard policies
    assert [u.slots for u in r.upstreams] == [3, 4]
    assert profile_slots(Model(name="m", source="s", profiles=[{"name": "p", "args": ["-np=2"]}]), "p") == 2


def test_a_model_whose_placement_failed_is_unplaceable_on_its_route() -> None:
    """``Route.unplaceable``: the explanation's summary when nothing is placed and the last placement
    failed (a from-zero model's held requests are refused with it); never when placed or with replicas."""
    why = "0/2 nodes can run it: 2 not enough cores"
    failed = {"m": PlacementSummary(why, placed=False)}
    routes, _, _ = build_routes([_model()], [], failed, {})
    assert (routes["m"].unplaceable, routes["m"].unavailable) == (True, why)
    routes, _, _ = build_routes([_model()], [], {"m": PlacementSummary("0/0 replicas placed", placed=True)}, {})
    assert routes["m"].unplaceable is False
    pending = [ReplicaRow(id="r1", model="m", node="n", profile="cpu", key="k")]
    routes, _, _ = build_routes([_model()], pending, failed, {})  # one placed, the next one failed
    assert routes["m"].unplaceable is False
    routes, _, _ = build_routes([_model()], [], {}, {})
    assert routes["m"].unplaceable is False


def test_a_model_switched_off_with_max_0_says_so_and_is_not_retried() -> None:
    """A new user's finding: ``scaling.max=0`` made every request a 503 'placed on no node (scaling.min
    is 0)' with ``Retry-After``, though no retry could help. Now the route says what to raise, and is
    unplaceable (no Retry-After); a replica still serving (draining away) keeps it routable."""
    off = _model(scaling={"min": 0, "max": 0})
    routes, _, _ = build_routes([off], [], {"m": PlacementSummary("0/0 replicas placed", placed=True)}, {})
    assert routes["m"].unplaceable is True
    assert routes["m"].unavailable == (
        "scaling.max is 0, so no replica may run; raise it: llmgw ctl model set m scaling.max=1")
    ready = [ReplicaRow(id="r1", model="m", node="n", profile="cpu", key="k", state="ready", endpoint="h:1")]
    routes, _, _ = build_routes([off], ready, {}, {})
    assert (routes["m"].unplaceable, len(routes["m"].upstreams)) == (False, 1)


def test_new_fields_at_their_defaults_keep_the_spec_hash() -> None:
    """Replicas must not restart on upgrade: the spec hash covers the profile, not routing/queue."""
    assert spec_hash(_model(), "cpu") == spec_hash(_model(routing="round-robin", queue={"size": 1}), "cpu")
    assert "routing" not in _model().model_dump(exclude_defaults=True)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("routing", "random", "routing"),
        ("queue", {"size": 2.0}, "queue.size"),
        ("queue", {"size": "2"}, "queue.size"),
        ("queue", {"size": 10_001}, "queue.size"),
        ("queue", {"wait_s": 0}, "queue.wait_s"),
        ("queue", {"wait_s": float("nan")}, "queue.wait_s"),
        ("queue", {"wait_s": 601}, "queue.wait_s"),
        ("queue", {"depth": 3}, "queue.depth"),
    ],
)
def test_bad_routing_and_queue_values_name_the_field(field: str, value: Any, words: str) -> None:
    with pytest.raises(pydantic.ValidationError) as e:
        _model(**{field: value})
    assert words in str(e.value)


def _closed_loop(conversations: int, seed: int, *, replicas: int = 3, slots: int = 4, turns: int = 8) -> float:
    """Conversations asking turn after turn (no think time) through one balancer, each turn taking a
    random 0.2-0.6 s plus a prefill that is short on the replica that served its previous turn and
    grows with the history elsewhere; a turn that finds no free slot waits for one (as in the queue).
    Returns the share of turns (after the first) served by the previous turn's replica."""
    rnd = random.Random(seed)
    now = [0.0]
    route, bal = _route(replicas, slots=slots)
    bal.clock = lambda: now[0]
    keys = [prefix_key({"messages": [{"role": "user", "content": f"conversation {seed}-{k}"}]}) for k in
            range(conversations)]
    last: list[str | None] = [None] * conversations
    turn = [0] * conversations
    running: list[tuple[float, int, int, Lease]] = []
    waiting = list(range(conversations))
    same = asked = 0
    while waiting or running:
        for k in list(waiting):
            lease = bal.take(route, keys[k])
            if lease is None:
                continue
            waiting.remove(k)
            hit = last[k] == lease.up.replica_id
            same, asked = same + (hit and turn[k] > 0), asked + (turn[k] > 0)
            last[k] = lease.up.replica_id
            took = rnd.uniform(0.2, 0.6) + (0.1 if hit else 0.3 * (1 + turn[k]))
            heapq.heappush(running, (now[0] + took, id(lease), k, lease))
        assert all(x.in_flight <= slots for x in bal.loads().values())
        now[0], _, k, lease = heapq.heappop(running)
        lease.release()
        turn[k] += 1
        if turn[k] < turns:
            waiting.append(k)
    return same / asked


@pytest.mark.parametrize("conversations", [6, 8, 10, 12])
def test_below_saturation_turns_stay_on_their_replica(conversations: int) -> None:
    """Up to as many conversations as slots (3 × 4): at least 97 % of turns land where the previous
    one ran. Measured over 40 seeds, 6/8/10/12 conversations: 0.990/0.981/0.991/0.989 with c = 1.25
    (c = 1.1: 0.973-0.987; c = 2: 0.989-0.996; this model has no CPU sharing between a replica's
    slots, which is what the bound protects). With 14 conversations for 12 slots, 0.28 for every c:
    a waiting turn takes the first slot that frees, wherever it is."""
    shares = [_closed_loop(conversations, seed) for seed in range(10)]
    assert sum(shares) / len(shares) >= 0.97, shares


async def _saturated(home_wait: float, seed: int, conversations: int = 14, turns: int = 8) -> float:
    """Closed loop of ``conversations`` on 3 replicas × 4 slots (12) through the real FairQueue and
    Balancer.taker, with real sleeps (ms): a turn on the previous turn's replica takes 4-8 ms, elsewhere
    20-30 ms (its history prefilled again); a 0-2 ms pause between turns. The share of turns (after
    the first) on the previous turn's replica."""
    rnd = random.Random(seed)
    route, bal = _route(3, slots=4)
    bal.clock = time.monotonic
    bal.home_wait = home_wait
    queue: FairQueue[Lease] = FairQueue("m", size=100, wait_s=60.0, give_back=lambda x: x.release(answered=False))
    bal.on_free = lambda _model: queue.wake()
    same = asked = 0

    async def conversation(k: int) -> None:
        nonlocal same, asked
        key = prefix_key({"messages": [{"role": "user", "content": f"saturated {seed}-{k}"}]})
        last = ""
        for turn in range(turns):
            lease = await queue.acquire(f"c{k}", 0, bal.taker(route, key, (), queue.__len__), service_s=0.02,
                                        slots=12)
            hit = lease.up.replica_id == last
            same, asked = same + (hit and turn > 0), asked + (turn > 0)
            last = lease.up.replica_id
            await asyncio.sleep(rnd.uniform(0.004, 0.008) if hit else rnd.uniform(0.02, 0.03))
            lease.release()
            await asyncio.sleep(rnd.uniform(0, 0.002))

    await asyncio.gather(*(conversation(k) for k in range(conversations)))
    assert {x.in_flight for x in bal.loads().values()} == {0}
    return same / asked


async def test_past_saturation_a_turn_waits_briefly_for_its_replica() -> None:
    """14 conversations on 12 slots: without waiting for its replica (home_wait 0) a turn takes the
    first slot that frees, wherever; with HOME_WAIT most turns stay. Measured (5 seeds, this 2-core
    machine at load ~10): 0.39-0.55 without, 0.82-0.91 with."""
    without = [await _saturated(0.0, seed) for seed in range(3)]
    with_wait = [await _saturated(HOME_WAIT, seed) for seed in range(3)]
    assert sum(with_wait) / 3 >= 0.7, (with_wait, without)
    assert sum(with_wait) / 3 >= sum(without) / 3 + 0.2, (with_wait, without)


def test_a_key_stays_where_its_prefix_is_cached_however_slow_that_replica_looks() -> None:
    """r2 answers in 6 s, r0 and r1 in 1 s: a new key whose first choice is r2 goes elsewhere, but a
    key whose last request went to r2 (its prefix is cached there) stays on r2."""
    route, bal = _route(3, slots=2)
    _timed(route, bal, {"r0": 1.0, "r1": 1.0, "r2": 6.0})
    ids = [u.replica_id for u in route.upstreams]
    homed = [k for k in range(200) if _first(k, ids) == "r2"]
    new, old = homed[0], homed[1]
    held = bal.take(route, old, exclude={"r0", "r1"})  # its earlier turn ran on r2 (r2 was all there was)
    assert held is not None
    held.release()
    moved = bal.take(route, new)
    assert moved is not None
    assert moved.up.replica_id != "r2"
    kept = bal.take(route, old)
    assert kept is not None
    assert (kept.up.replica_id, kept.reason) == ("r2", AFFINITY)


def _answer(bal: Balancer, route: Route, rid: str, t: list[float], took: float, tokens_per_s: float) -> None:
    """One answer on ``rid`` that took ``took`` s and decoded 16 tokens at ``tokens_per_s`` (llama-server's timings)."""
    lease = bal.take(route, None, exclude={u.replica_id for u in route.upstreams} - {rid})
    assert lease is not None
    t[0] += took
    lease.release()
    lease.observe({"predicted_n": 16, "predicted_ms": 16_000 / tokens_per_s, "prompt_n": 900})


def test_two_control_planes_that_saw_different_request_sizes_place_new_keys_alike() -> None:
    """Two gateways (two balancers) over 3 equal replicas: one saw cold prefills on r0 (10 s) and
    cached turns elsewhere (1 s), the other the reverse, so their service times differ 10x, but the
    engines' decode rates agree (25 tokens/s). Speed is judged by the rates, so every new key goes to
    the same replica through both; a replica decoding at a third of the others' rate is passed over
    by both."""
    planes = []
    for slow_seen in ("r0", "r1"):
        route, bal = _route(3, slots=2)
        t = [100.0]
        bal.clock = lambda t=t: t[0]  # type: ignore[misc]
        for up in route.upstreams:
            for _ in range(MIN_ANSWERS):
                _answer(bal, route, up.replica_id, t, 10.0 if up.replica_id == slow_seen else 1.0, 25.0)
        planes.append((route, bal))
    for k in range(300):
        picks = []
        for route, bal in planes:
            lease = bal.take(route, k)
            assert lease is not None
            picks.append(lease.up.replica_id)
            lease.release(answered=False)
        assert picks[0] == picks[1], k
    for route, bal in planes:
        t2 = [200.0]
        bal.clock = lambda t2=t2: t2[0]  # type: ignore[misc]
        for up in route.upstreams:
            for _ in range(MIN_ANSWERS * 3):
                _answer(bal, route, up.replica_id, t2, 5.0 if up.replica_id == "r2" else 1.0,
                        8.0 if up.replica_id == "r2" else 25.0)
        homed = [k for k in range(1000, 1300) if _first(k, ["r0", "r1", "r2"]) == "r2"]  # keys not seen yet
        moved = [bal.take(route, k) for k in homed[:2]]
        assert all(x is not None and x.up.replica_id != "r2" for x in moved)


def test_timings_that_cannot_be_a_rate_are_ignored() -> None:
    """A warm-up's one token, a missing or odd ``timings``: no decode rate (the service time is judged)."""
    route, bal = _route(1)
    lease = bal.take(route, None)
    assert lease is not None
    lease.release()
    for timings in (None, "x", {}, {"predicted_n": 0, "predicted_ms": 10.0}, {"predicted_n": 16, "predicted_ms": 0},
                    {"predicted_n": "16", "predicted_ms": 100.0}, {"predicted_n": 16.5, "predicted_ms": 100.0}):
        lease.observe(timings)
    rep = bal._reps["r0"]
    assert (rep.rated, rep.rate) == (0, 0.0)
    lease.observe({"predicted_n": 16, "predicted_ms": 640.0})
    assert (rep.rated, rep.rate) == (1, 25.0)
    # Token-weighted: a 2-token answer at 200 tokens/s (overhead, noise) barely moves a 16-token one's 25.
    lease.observe({"predicted_n": 2, "predicted_ms": 10.0})
    assert 25.0 < rep.rate < 30.0, rep.rate
    assert bal.loads()["r0"].tokens_per_s == rep.rate


def test_a_few_short_answers_are_not_judged() -> None:
    """Below RATE_MIN_TOKENS decoded a replica's rate is not judged, however slow: r2's two 4-token
    answers at 2 tokens/s against r0's and r1's 25 do not move a key whose first choice is r2."""
    route, bal = _route(3, slots=2)
    t = [100.0]
    bal.clock = lambda: t[0]
    for up in route.upstreams:
        for _ in range(MIN_ANSWERS):
            slow = up.replica_id == "r2"
            lease = bal.take(route, None, exclude={u.replica_id for u in route.upstreams} - {up.replica_id})
            assert lease is not None
            t[0] += 2.0 if slow else 1.0
            lease.release()
            lease.observe({"predicted_n": 4, "predicted_ms": 2_000.0 if slow else 160.0})
    homed = [k for k in range(5000, 5300) if _first(k, ["r0", "r1", "r2"]) == "r2"]
    kept = bal.take(route, homed[0])
    assert kept is not None
    assert (kept.up.replica_id, kept.reason) == ("r2", AFFINITY)
