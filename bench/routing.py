"""Routing policies side by side: round-robin vs cache-aware, through the real gateway, on real replicas.

    python bench/routing.py [--quick] [--cache-ram MIB] [--swa-full] [--system-prompts N]

Starts 3 real llama-server replicas of gemma-3-270m (each ``--threads 1 --parallel 2 --ctx-size 8192
--cache-ram 0``; prompt caching on: llama-server's default ``cache_prompt``, ``--slot-prompt-similarity``
at its 0.10, so a request takes the slot whose cached prompt it matches best) and gateway processes
in front of them (:mod:`routing_fleet`): the gateway app the control plane builds, on a static table
with model ``rr`` (``routing: round-robin``) and model ``ca`` (``routing: cache-aware``) over the
same replicas, and three stored keys. Every request goes through a gateway over HTTP.

Engine settings, and why. ``--cache-ram 0``: the agent's default is 1024 MiB of host-RAM prompt
cache per replica, which for this 270M model (18 KiB of KV per token: ~27 MiB for 1,500 tokens)
holds every conversation of the run on every replica, so it would stand for no real model; for an 8B
model (128 KiB per token) it holds about 5 conversations of 1,500 tokens. With 0, the slots are the
cache: "more conversations than one replica's slots and cache hold". ``--cache-ram 1024`` shows the
other case. No
``--swa-full``: gemma-3 slides 5 of 6 layers over 512 tokens, yet this build reused a cut-back prefix
without it (measured on one replica: a new conversation with the same system prompt on the slot
holding another's history reused 1,318 of 1,345 prompt tokens; the next turn 1,360 of 1,411).

llama-server's fields relied on (read from real answers of this build, 0.5.0-dev 0c1e570): a plain
answer's top-level ``timings`` (``prompt_n``: prompt tokens evaluated, ``cache_n``: reused from the
slot, ``prompt_ms``, ``predicted_n``, ``predicted_ms``; ``prompt_n + cache_n`` equals
``usage.prompt_tokens``, which also carries ``prompt_tokens_details.cached_tokens``); a stream's
``timings`` come on its last event, the ``usage`` event when ``stream_options.include_usage`` is
asked (the gateway drops that event for a client that did not ask, so this client asks); and
``GET /props`` ``total_slots`` (2).

Workloads:

A. **multi-turn chat**: conversations, each a system prompt of ~1,000 tokens and a growing history
   (short questions, answers of ``max_tokens`` 16, temperature 0, a seeded pause of up to
   :data:`THINK_S` before each turn), 4 at once: more than one replica's 2 slots hold, fewer than all
   6. Each conversation has its own system prompt (a user's document, an agent's instructions: the
   issue's "a conversation's cached prefix"), so only a replica that served the conversation holds
   its prefix. Then even a perfect policy cannot reuse a first turn: the best share is
   ~(turns-1)/turns less the new tokens, 0.73 at 4 turns, ~0.85 at the 8 of the full run (real chats
   run longer). ``--conversations``, ``--turns`` and ``--rules`` size it (a loaded machine prefills
   ~1,000 tokens in 60-140 s: see the run times below). ``--system-prompts 2`` makes them share 2 (an
   application's users): round-robin then
   reuses the system prompt on every replica (llama-server gives a request the slot whose cached
   prompt matches best) and affinity gains only the history. Per request: TTFT (streamed: to the
   first content token) and the ``timings`` above → ``cached_prompt_share`` =
   Σcache_n / Σ(cache_n + prompt_n). Each policy on freshly started replicas (empty caches).
B. **no shared prefix**: unique prompts (~60 tokens), non-streamed, 6 at once (all slots); rounds
   alternate the policies so the machine's drift falls on both → requests/s each.
C. **one slow replica**: as B but 4 at once (below the 6 slots: at 6 every slot is used, slow or
   not, so no policy has a choice), with replica ``r3`` stopped (SIGSTOP) for 2/3 of every 100 ms, as
   ``cpulimit`` does: it runs a third of the time, a machine a third as fast, whatever the load. (Not
   ``--threads``: every replica already runs one thread on 2 cores; nor ``taskset``: 3 replicas on 2
   cores already share them, so pinning one onto a core slows that core's other replica too.) The
   progress line prints the p50 on r3 beside r1/r2's → p95 latency each.
D. **two keys, one flooding**: key ``flood`` sends its requests all at once; key ``other`` then sends
   one at a time (each 1 s after the previous answer) while the flood lasts. A request's wait = its
   latency − the engine's own time (``prompt_ms`` + ``predicted_ms``): the wait anywhere, gateway
   queue or engine queue → the other key's p95 wait vs the median engine time of all
   (``median_service_s``).
E. **two control planes**: two gateway processes on the same replicas, sharing nothing; conversations
   one at a time, each one's turns alternating between them → ``same_replica_share``: turns after the first that
   ``x-llmgw-replica`` names the first turn's replica.

A 429 is retried after its ``Retry-After`` and a 502 ``upstream_failed`` (the gateway POSTed onto a
keep-alive connection the engine had closed; seen about once a run) up to twice, as a client would;
both are counted on the progress lines, and their time counts.

Targets: ``ttft_p50_ratio`` ≤ 0.4, ``ca_cached_prompt_share`` ≥ 0.8,
``no_prefix_throughput_ratio`` ≥ 0.95, ``slow_replica_p95_ratio`` ≤ 0.7,
``other_key_queue_wait_p95_s`` ≤ ``median_service_s``, ``same_replica_share`` 1.0. Each is printed as
PASS/FAIL; a FAIL, or a figure the gateway cannot produce yet (``n/a (policy not merged)``: today's
gateway has no ``Route.routing``), exits 1. Figures are printed last, one ``name: value unit`` a line.

Run time on this machine (2 cores; one replica prefills ~70 tokens/s alone, 22-33 while other
engineers' tests run; every figure moves with that load): ``--quick`` (prompts of ~260 tokens)
68 s round-robin only at load ~2, 168 s at load ~6, 236 s with both policies at load 6-8; the full
run 213 s on main at load ~3 (95 s ``--quick``), 426 s and 533 s at load 6-11 (2026-12-03). At
load 10-15 (9-20 prefill tokens/s) workload A's full size did not finish round-robin in 480 s;
``--workloads A --conversations 3 --turns 8 --rules 8`` took 252-424 s, ``--workloads C --rounds 2
--per-round 12`` 180 s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
from routing_fleet import KEYS, Answer, Fleet, ReplicaSpec, chat, policy_merged

NA = "n/a (policy not merged)"


@dataclass(frozen=True)
class Sizes:
    """How much of each workload a run does."""

    conversations: int  # A: conversations per policy
    turns: int  # A: requests per conversation
    at_once: int  # A: conversations in flight
    system_prompts: int  # A: distinct system prompts the conversations share
    rules: int  # A: the system prompt's length, in rules of ~33 tokens
    rounds: int  # B, C: rounds alternating the policies
    per_round: int  # B, C: requests per policy per round
    flood: int  # D: the flooding key's requests, sent at once
    other: int  # D: the other key's requests, one at a time
    e_conversations: int  # E
    e_turns: int  # E


# A cold prefill of ~1,000 tokens takes ~14 s here (llama-server at --threads 1: ~70 prompt tokens/s,
# ~12 generated tokens/s), which sets these sizes: the full run within ~10 minutes, --quick ~2.
FULL = Sizes(conversations=4, turns=8, at_once=4, system_prompts=4, rules=30, rounds=4, per_round=12, flood=40,
             other=3, e_conversations=3, e_turns=4)
QUICK = Sizes(conversations=3, turns=3, at_once=3, system_prompts=3, rules=8, rounds=1, per_round=4, flood=16,
              other=2, e_conversations=2, e_turns=3)
E_RULES = 8  # E: the system prompt of ~300 tokens (the decision is what is measured, not the prefill)
AT_ONCE = 6  # B: requests in flight (3 replicas x 2 slots: saturated)
SLOW_AT_ONCE = 4  # C: fewer than the slots, so a policy has a choice (at 6 every slot is used, slow or not)
MAX_TOKENS = 16
#: A: a user's pause before each turn, uniform in [0, THINK_S) s, seeded per conversation. Without it
#: the conversations ran in lockstep and round-robin's rotation stayed in phase with them: 3 at once
#: on 3 replicas kept each on one replica (rr cached share 0.52 of at most 0.73); 4 at once moved
#: each one replica on every turn (a hit never).
THINK_S = 1.0

# -- prompts ---------------------------------------------------------------------------------------

_WORDS = ("amber", "harbor", "lantern", "orchard", "copper", "meadow", "falcon", "river", "quartz", "willow",
    "ember", "summit", "velvet", "canyon", "maple", "garnet", "thistle", "beacon", "cobalt", "prairie",
    "saffron", "glacier", "juniper", "marble", "cedar", "tundra", "indigo", "pebble", "sparrow", "walnut")
_TOPICS = ("refunds", "shipping", "invoices", "warranties", "passwords", "upgrades", "deliveries", "returns",
    "coupons", "subscriptions", "accounts", "payments")


def system_prompt(i: int, rules: int = 30) -> str:
    """System prompt ``i``: ``rules`` numbered rules of ~33 tokens each (30: ~1,000 tokens by gemma's
    tokenizer, counted at start)."""
    rnd = random.Random(f"system-{i}")
    company = f"{rnd.choice(_WORDS).title()} {rnd.choice(_WORDS).title()} Ltd"
    lines = [f"You are the support assistant of {company}. Follow these house rules exactly."]
    for k in range(1, rules + 1):
        w = rnd.sample(_WORDS, 3)
        lines.append(f"Rule {k}: when a customer asks about {rnd.choice(_TOPICS)} for the {w[0]} {w[1]} plan, "
                     f"answer with code {rnd.randint(1000, 9999)} and mention the {w[2]} desk.")
    return "\n".join(lines)


def question(conv: int, turn: int) -> str:
    """The user's ``turn``-th question in conversation ``conv``."""
    rnd = random.Random(f"q-{conv}-{turn}")
    return (f"Question {turn + 1}: which code applies to {rnd.choice(_TOPICS)} on the {rnd.choice(_WORDS)} "
            "plan? Reply in five words or fewer.")


def unique_prompt(n: int) -> list[dict[str, str]]:
    """A prompt of ~60 tokens sharing nothing with any other (the chat template aside)."""
    rnd = random.Random(f"unique-{n}")
    words = " ".join(rnd.choice(_WORDS) for _ in range(40))
    return [{"role": "user", "content": f"Note {n}-{rnd.randint(0, 10**9)}: {words}. Summarise this note."}]



# -- measurements ----------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def ok(a: Answer, what: str) -> Answer:
    """``a`` when it is a 200, else exit with what failed."""
    if a.status != 200:
        raise SystemExit(f"FAIL: {what}: HTTP {a.status} from replica {a.replica or '-'}: {a.error}")
    return a


def share(answers: list[Answer]) -> float:
    """Prompt tokens the engines reused: Σcache_n / Σ(cache_n + prompt_n)."""
    cached, evaluated = sum(a.cache_n for a in answers), sum(a.prompt_n for a in answers)
    if cached + evaluated == 0:
        raise SystemExit("FAIL: llama-server returned no timings (prompt_n/cache_n): cannot measure reuse")
    return cached / (cached + evaluated)


def session() -> aiohttp.ClientSession:
    """The client: no connection limit, LLM-sized timeouts."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=900))


async def multi_turn(gateway: str, model: str, sizes: Sizes, first_conv: int = 0) -> list[Answer]:
    """Workload A on ``model``: every conversation's turns in order, ``sizes.at_once`` conversations at once."""
    todo = list(range(first_conv, first_conv + sizes.conversations))
    out: list[Answer] = []
    async with session() as s:
        async def worker() -> None:
            while todo:
                conv = todo.pop(0)
                messages = [{"role": "system", "content": system_prompt(conv % sizes.system_prompts, sizes.rules)}]
                pause = random.Random(f"think-{conv}")
                for turn in range(sizes.turns):
                    await asyncio.sleep(pause.uniform(0, THINK_S))  # the user reads, then types
                    messages.append({"role": "user", "content": question(conv, turn)})
                    a = ok(await chat(s, gateway, KEYS["bench"], model, messages, max_tokens=MAX_TOKENS,
                                      stream=True), f"A {model} conversation {conv} turn {turn}")
                    if not a.prompt_n + a.cache_n:
                        raise SystemExit(f"FAIL: A {model}: a stream without llama-server's timings: {a}")
                    messages.append({"role": "assistant", "content": a.text})
                    out.append(a)

        await asyncio.gather(*(worker() for _ in range(sizes.at_once)))
    return out


async def rounds(
    gateway: str, models: list[str], sizes: Sizes, base: int, at_once: int
) -> dict[str, tuple[list[Answer], float]]:
    """Workloads B and C: ``sizes.rounds`` rounds, each ``sizes.per_round`` unique prompts per model,
    ``at_once`` in flight, the models' order alternating; per model, its answers and its seconds in all."""
    out: dict[str, tuple[list[Answer], float]] = {m: ([], 0.0) for m in models}
    n = base
    async with session() as s:
        for r in range(sizes.rounds):
            for model in models if r % 2 == 0 else models[::-1]:
                gate = asyncio.Semaphore(at_once)

                async def one(i: int, model: str = model, gate: asyncio.Semaphore = gate) -> Answer:
                    async with gate:
                        return ok(await chat(s, gateway, KEYS["bench"], model, unique_prompt(i),
                                             max_tokens=MAX_TOKENS), f"{model} unique prompt {i}")

                t0 = time.perf_counter()
                got = await asyncio.gather(*(one(n + i) for i in range(sizes.per_round)))
                answers, seconds = out[model]
                out[model] = (answers + list(got), seconds + time.perf_counter() - t0)
                n += sizes.per_round
    return out


async def flood(gateway: str, model: str, sizes: Sizes) -> tuple[list[Answer], list[Answer]]:
    """Workload D: the ``flood`` key's requests all at once; 1 s later the ``other`` key's, one at a time
    (each sent 1 s after the previous answer) while the flood lasts. Returns (flood answers, other
    answers); a flood 429 is kept (a bounded queue may refuse), an ``other`` 429 is retried after its
    ``Retry-After`` (the wait counts). Exits when no ``other`` request was sent during the flood."""
    async with session() as s:
        tasks = [asyncio.create_task(chat(s, gateway, KEYS["flood"], model, unique_prompt(10**6 + i),
                                          max_tokens=MAX_TOKENS, retry_busy=False)) for i in range(sizes.flood)]
        others: list[Answer] = []
        for j in range(sizes.other):
            await asyncio.sleep(1.0)  # the first after 1 s: the flood is in, every slot busy, the rest queued
            if all(t.done() for t in tasks):
                break
            others.append(ok(await chat(s, gateway, KEYS["other"], model, unique_prompt(2 * 10**6 + j),
                                        max_tokens=MAX_TOKENS), "D: the other key's request"))
        floods = await asyncio.gather(*tasks)
    if not others:
        raise SystemExit("FAIL: D: the flood was over before the other key's first request; make it larger")
    bad = [a for a in floods if a.status not in (200, 429)]
    if bad:
        raise SystemExit(f"FAIL: D: the flood got HTTP {bad[0].status}: {bad[0].error}")
    if any(not a.prompt_n + a.cache_n for a in [*others, *floods] if a.status == 200):
        raise SystemExit("FAIL: D: an answer without llama-server's timings: cannot tell service from wait")
    return floods, others


async def two_planes(gateways: list[str], model: str, sizes: Sizes) -> float:
    """Workload E on ``model``: turns alternate between the gateways; the share of turns after the first
    served by the first turn's replica."""
    same = later = 0
    async with session() as s:
        async def conversation(conv: int) -> None:
            nonlocal same, later
            messages = [{"role": "system", "content": system_prompt(1000 + conv, E_RULES)}]
            first = ""
            for turn in range(sizes.e_turns):
                messages.append({"role": "user", "content": question(conv, turn)})
                a = ok(await chat(s, gateways[turn % len(gateways)], KEYS["bench"], model, messages,
                                  max_tokens=MAX_TOKENS), f"E {model} conversation {conv} turn {turn}")
                messages.append({"role": "assistant", "content": a.text})
                if turn == 0:
                    first = a.replica
                else:
                    later += 1
                    same += a.replica == first

        # One conversation at a time: at once, N conversations in lockstep on N replicas keep each
        # gateway's round-robin counter in phase, and round-robin looked sticky (1.00 at 3 and 3).
        for c in range(sizes.e_conversations):
            await conversation(c)
    return same / later


# -- the run ---------------------------------------------------------------------------------------

SLOW_DUTY = 1 / 3  # workload C: the slow replica runs a third of the time


def replica_args(cache_ram_mib: int, swa_full: bool) -> list[str]:
    """llama-server's sizing for every replica (see the module docstring)."""
    args = ["--threads", "1", "--parallel", "2", "--ctx-size", "8192", "--cache-ram", str(cache_ram_mib)]
    return [*args, "--swa-full"] if swa_full else args


def replicas(args: list[str], *, slow: bool = False) -> list[ReplicaSpec]:
    """Three replicas ``r1``..``r3``; with ``slow``, ``r3`` runs :data:`SLOW_DUTY` of the time."""
    return [ReplicaSpec(f"r{i + 1}", args, duty=SLOW_DUTY if slow and i == 2 else 1.0) for i in range(3)]


def count_tokens(fleet: Fleet, text: str) -> int:
    """Tokens of ``text`` by the model's own tokenizer (llama-server ``POST /tokenize``)."""
    r = fleet.replicas[0]
    resp = httpx.post(f"http://127.0.0.1:{r.port}/tokenize", json={"content": text},
                      headers={"Authorization": f"Bearer {r.key}"}, timeout=10)
    resp.raise_for_status()
    return len(resp.json()["tokens"])


def by_replica(answers: list[Answer]) -> str:
    """``r1=5 r2=4 ...``: requests each replica served, and the 429s retried before them."""
    counts = " ".join(f"{k}={v}" for k, v in sorted(Counter(a.replica for a in answers).items()))
    return (f"{counts}; 429s retried: {sum(a.refused for a in answers)}; 502 upstream_failed retried: "
            f"{sum(a.broken for a in answers)}")


Figure = tuple[str, float | str, str]
"""(name, value, unit); a str value is why there is none (``n/a (...)``)."""


def _ratio(num: float | None, den: float) -> float | str:
    return NA if num is None else num / den


def run_a(sizes: Sizes, rargs: list[str], work: Path, models: list[str]) -> list[Figure]:
    """Workload A, each policy on freshly started replicas."""
    a: dict[str, list[Answer]] = {}
    for model in models:
        with Fleet(replicas(rargs), gateways=1, workdir=work) as fleet:
            if model == models[0]:
                props = fleet.props()
                sys_tokens = [count_tokens(fleet, system_prompt(i, sizes.rules)) for i in range(sizes.system_prompts)]
                print(f"replicas: 3 x llama-server {' '.join(rargs)}; GET /props total_slots="
                      f"{props.get('total_slots')}; system prompts: {sys_tokens} tokens", flush=True)
            print(f"A {model}: {sizes.conversations} conversations x {sizes.turns} turns, {sizes.at_once} at once, "
                  f"{sizes.system_prompts} system prompts, fresh replicas", flush=True)
            t0 = time.monotonic()
            a[model] = asyncio.run(multi_turn(fleet.gateways[0], model, sizes))
            ttft = [x.ttft_s for x in a[model]]
            print(f"  {time.monotonic() - t0:.0f} s; by replica {by_replica(a[model])}; ttft p50 "
                  f"{statistics.median(ttft):.3f} s p95 {pct(ttft, 0.95):.3f} s; cached share {share(a[model]):.3f}; "
                  f"prompt tokens p50 {statistics.median(x.prompt_n + x.cache_n for x in a[model]):.0f}", flush=True)
    rr50 = statistics.median(x.ttft_s for x in a["rr"])
    ca50 = statistics.median(x.ttft_s for x in a["ca"]) if "ca" in a else None
    return [
        ("rr_ttft_p50_s", rr50, "s"),
        ("ca_ttft_p50_s", NA if ca50 is None else ca50, "s"),
        ("rr_ttft_p95_s", pct([x.ttft_s for x in a["rr"]], 0.95), "s"),
        ("ca_ttft_p95_s", pct([x.ttft_s for x in a["ca"]], 0.95) if "ca" in a else NA, "s"),
        ("ttft_p50_ratio", _ratio(ca50, rr50), ""),
        ("rr_cached_prompt_share", share(a["rr"]), ""),
        ("ca_cached_prompt_share", share(a["ca"]) if "ca" in a else NA, ""),
    ]


def run_bde(sizes: Sizes, rargs: list[str], work: Path, models: list[str], which: str) -> list[Figure]:
    """Workloads B, D and E (those in ``which``) on one set of replicas behind two gateways."""
    figures: list[Figure] = []
    with Fleet(replicas(rargs), gateways=2, workdir=work) as fleet:
        if "B" in which:
            print(f"B: {sizes.rounds} rounds x {sizes.per_round} unique prompts per policy, {AT_ONCE} at once",
                  flush=True)
            b = asyncio.run(rounds(fleet.gateways[0], models, sizes, base=0, at_once=AT_ONCE))
            rps = {m: len(xs) / secs for m, (xs, secs) in b.items()}
            for m, (xs, _) in b.items():
                p50 = {r: statistics.median(x.total_s for x in xs if x.replica == r)
                       for r in sorted({x.replica for x in xs})}
                print(f"  {m}: {rps[m]:.2f} req/s; by replica {by_replica(xs)}; latency p50 by replica "
                      f"{' '.join(f'{r}={v:.2f}' for r, v in p50.items())} s", flush=True)
            figures += [
                ("rr_no_prefix_rps", rps["rr"], "req/s"),
                ("ca_no_prefix_rps", rps.get("ca", NA), "req/s"),
                ("no_prefix_throughput_ratio", _ratio(rps.get("ca"), rps["rr"]), ""),
            ]
        if "D" in which:
            d_model = models[-1]
            print(f"D ({d_model}): key 'flood' sends {sizes.flood} at once, key 'other' one at a time", flush=True)
            floods, others = asyncio.run(flood(fleet.gateways[0], d_model, sizes))
            served = [x for x in [*floods, *others] if x.status == 200]
            waits = [x.total_s - x.engine_s for x in others]
            refused = sum(x.status == 429 for x in floods)
            print(f"  other's waits {[round(w, 2) for w in waits]} s; by replica {by_replica(others)}; flood: "
                  f"{refused} of {len(floods)} refused 429", flush=True)
            figures += [
                ("other_key_queue_wait_p95_s", pct(waits, 0.95), "s"),
                ("median_service_s", statistics.median(x.engine_s for x in served), "s"),
                ("flood_refused_429", float(refused), "requests"),
                ("other_key_refused_429", float(sum(x.refused for x in others)), "requests"),
            ]
        if "E" in which:
            same: dict[str, float] = {}
            for m in models:
                print(f"E {m}: {sizes.e_conversations} conversations x {sizes.e_turns} turns alternating two "
                      "gateways", flush=True)
                same[m] = asyncio.run(two_planes(fleet.gateways, m, sizes))
                print(f"  same replica share {same[m]:.2f}", flush=True)
            figures += [("rr_same_replica_share", same["rr"], ""), ("same_replica_share", same.get("ca", NA), "")]
    return figures


def run_c(sizes: Sizes, rargs: list[str], work: Path, models: list[str]) -> list[Figure]:
    """Workload C on replicas of which ``r3`` is slowed."""
    with Fleet(replicas(rargs, slow=True), gateways=1, workdir=work) as fleet:
        print(f"C: r3 runs {SLOW_DUTY:.2f} of the time (SIGSTOP/SIGCONT); {sizes.rounds} rounds x "
              f"{sizes.per_round} unique prompts per policy, {SLOW_AT_ONCE} at once", flush=True)
        c = asyncio.run(rounds(fleet.gateways[0], models, sizes, base=10**5, at_once=SLOW_AT_ONCE))
    p95 = {m: pct([x.total_s for x in xs], 0.95) for m, (xs, _) in c.items()}
    for m, (xs, _) in c.items():
        slow = [x.total_s for x in xs if x.replica == "r3"]
        fast = [x.total_s for x in xs if x.replica != "r3"]
        print(f"  {m}: p95 {p95[m]:.2f} s; by replica {by_replica(xs)}; p50 on r3 "
              f"{statistics.median(slow) if slow else float('nan'):.2f} s, on r1/r2 "
              f"{statistics.median(fast) if fast else float('nan'):.2f} s", flush=True)
    return [
        ("rr_slow_replica_p95_s", p95["rr"], "s"),
        ("ca_slow_replica_p95_s", p95.get("ca", NA), "s"),
        ("slow_replica_p95_ratio", _ratio(p95.get("ca"), p95["rr"]), ""),
    ]


#: Each target: what is printed, the figure, the test.
TARGETS: list[tuple[str, str, Callable[[float, dict[str, float | str]], bool]]] = [
    ("ttft_p50_ratio <= 0.4", "ttft_p50_ratio", lambda v, _: v <= 0.4),
    ("ca_cached_prompt_share >= 0.8", "ca_cached_prompt_share", lambda v, _: v >= 0.8),
    ("no_prefix_throughput_ratio >= 0.95", "no_prefix_throughput_ratio", lambda v, _: v >= 0.95),
    ("slow_replica_p95_ratio <= 0.7", "slow_replica_p95_ratio", lambda v, _: v <= 0.7),
    ("other_key_queue_wait_p95_s <= median_service_s", "other_key_queue_wait_p95_s",
     lambda v, f: isinstance(f["median_service_s"], float) and v <= f["median_service_s"]),
    ("same_replica_share == 1.0", "same_replica_share", lambda v, _: v == 1.0),
]


def verdicts(figures: list[Figure]) -> list[tuple[str, bool | None]]:
    """Each target: (what, passed); None when its figure is n/a or was not measured (a failure too)."""
    f = {name: value for name, value, _ in figures}
    out: list[tuple[str, bool | None]] = []
    for what, name, test in TARGETS:
        value = f.get(name)
        out.append((what, test(value, f) if isinstance(value, float) else None))
    return out


def main() -> None:
    """Parse the options, run the workloads, print the verdicts and the figures; exit 1 unless all pass."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the harness")
    ap.add_argument("--cache-ram", type=int, default=0, metavar="MIB",
                    help="llama-server's host-RAM prompt cache per replica (default 0: see the docstring)")
    ap.add_argument("--swa-full", action="store_true", help="llama-server --swa-full (gemma-3's sliding layers keep "
                    "the whole context)")
    ap.add_argument("--system-prompts", type=int, help="system prompts workload A's conversations share "
                    "(default: one each)")
    ap.add_argument("--conversations", type=int, help="A: conversations (default 4; --quick 3)")
    ap.add_argument("--turns", type=int, help="A: turns per conversation (default 8; --quick 3)")
    ap.add_argument("--rules", type=int, help="A: system prompt rules of ~33 tokens (default 30: ~1,000 "
                    "tokens; --quick 8)")
    ap.add_argument("--rounds", type=int, help="B, C: rounds alternating the policies (default 4: each "
                    "first in 2; --quick 1)")
    ap.add_argument("--per-round", type=int, help="B, C: requests per policy per round (default 12; --quick 4)")
    ap.add_argument("--workloads", default="ABCDE", help="which workloads to run (default ABCDE; a target "
                    "whose workload did not run is N/A, and the run exits 1)")
    args = ap.parse_args()
    which = args.workloads.upper()
    if not which or set(which) - set("ABCDE"):
        ap.error(f"--workloads {args.workloads!r}: letters from ABCDE, e.g. --workloads A")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every Fleet stops its processes
    sizes = QUICK if args.quick else FULL
    if args.system_prompts:
        sizes = Sizes(**{**sizes.__dict__, "system_prompts": args.system_prompts})
    for name in ("conversations", "turns", "rules", "rounds", "per_round"):
        if (value := getattr(args, name)) is not None:
            if value < 1:
                ap.error(f"--{name.replace('_', '-')} {value}: give 1 or more")
            sizes = Sizes(**{**sizes.__dict__, name: value})
            if name == "conversations" and not args.system_prompts:
                sizes = Sizes(**{**sizes.__dict__, "system_prompts": value})
    sizes = Sizes(**{**sizes.__dict__, "at_once": min(sizes.at_once, sizes.conversations)})
    merged = policy_merged()
    models = ["rr", "ca"] if merged else ["rr"]
    print(f"cores: {os.cpu_count()} (3 replicas x --threads 1, the gateways and this client share them); "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; policies: {', '.join(models)}"
          f"{'' if merged else ' (cache-aware not merged: round-robin only)'}",
          flush=True)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-routing-"))
    rargs = replica_args(args.cache_ram, args.swa_full)
    figures: list[Figure] = []
    try:
        if "A" in which:
            figures += run_a(sizes, rargs, work, models)
        if set(which) & set("BDE"):
            figures += run_bde(sizes, rargs, work, models, which)
        if "C" in which:
            figures += run_c(sizes, rargs, work, models)
    except BaseException:
        print(f"logs kept in {work}", flush=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    print(f"run time: {time.monotonic() - t0:.0f} s ({'quick' if args.quick else 'full'}, workloads {which}); "
          f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    passed = True
    for what, result in verdicts(figures):
        print(f"{'N/A' if result is None else 'PASS' if result else 'FAIL'}: {what}")
        passed &= bool(result)
    for name, value, unit in figures:
        if isinstance(value, str):
            print(f"{name}: {value}")
        else:
            shown = f"{value:.0f}" if unit == "requests" else f"{value:.3f}"
            print(f"{name}: {shown} {unit}".rstrip())
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
