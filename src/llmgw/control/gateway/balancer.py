"""Which replica serves a request: slots, load and cache affinity; the round-robin of before kept per model.

Each replica has **slots** (the requests its engine runs at once: llama-server's ``GET /props``
``total_slots``, read once per replica id in the background with the replica's key; 1 until it has
answered; for an engine without ``/props``, such as vLLM, the profile's ``--parallel`` /
``--max-num-seqs`` or 4: :attr:`~llmgw.routing.Upstream.slots`), requests **in flight** (sent by
this gateway and not yet finished: :class:`Lease`), and an EWMA of its **service time** (seconds
from the slot taken to the answer's end, weight :data:`EWMA_ALPHA`). A request is only ever given
a replica with a free slot (in flight < slots); when none has one, :meth:`Balancer.take` returns
None and the request waits in the model's queue (or gets 429 ``model_busy``).

Two policies, chosen per model in the catalog (``routing:``):

* ``round-robin`` (the old behaviour): the next replica in rotation that has a free slot.
* ``cache-aware`` (the default): a **prefix key** is taken from the request (:func:`~.prefix.prefix_key`):
  for chat, a CRC-32 of the messages up to and including the first ``user`` message (the system
  prompt and the first turn: the same for every turn of a conversation, different between
  conversations); for ``/v1/completions`` the first :data:`~.prefix.PREFIX_CHARS` characters of the prompt;
  none for embeddings. The replicas are ranked for that key by **rendezvous hashing** (highest
  random weight: ``mix(key ^ hash(replica_id))``, Thaler & Ravishankar 1998): every control plane
  computes the same order from the key and the replica ids alone, with no shared state, and when a
  replica comes or goes only the keys whose first choice it was move (1/N of them: measured
  0.250 of 20,000 keys moved when a 4th replica came, 0.334 when one of 3 left,
  ``tests/unit/test_balancer.py``). The request goes to the first replica in that order with a free
  slot and fewer in flight than the **bound** ``ceil(c × (in flight over the model + 1) / N) + 1``
  (consistent hashing with bounded loads, Mirrokni, Thorup & Zadimoghaddam 2018, c =
  :data:`LOAD_BOUND_C`, plus :data:`AFFINITY_SLACK`): no replica takes more than c times the
  average and one, so a popular prefix spills to its key's second choice (the same second choice on
  every control plane) instead of piling up, while at low load two conversations that share a first
  choice both stay on it (a miss costs the whole history's prefill, one more request a shared slot).
  When every replica is at its bound, the least-loaded one with a free slot (in flight / slots,
  ties to the smaller service time). A model with one replica computes no key (its one replica is
  ``least_load``).

Speed, for ``cache-aware``: a replica with a free slot is passed over when the replicas at least
:data:`RATE_RATIO` times faster (:data:`SPEED_RATIO` by service time) would finish the request
sooner even after waiting for one of their slots, ``waiting / Σ(slots_j / service_j) + max(service_j) < service_i``
(``waiting``: the model's queue, this request included): shortest expected delay with a threshold,
the policy Lin & Kumar (1984) showed optimal for a fast and a slow server sharing a queue: the slow
one serves only while the queue is long. So a slow replica's free slots are not filled as often as
the fast ones' (round-robin and plain least-load fill them), and a new conversation whose first
choice is slow goes to its second. A key whose last request went to a replica stays there however
slow it looks: its prefix is cached there, and time per request is no measure of speed when
requests differ (a cold prefill 30 s, a cached turn 5 s: judging them moved conversations off their
replica, bench/routing.py workload A's reuse fell to 0.59 against round-robin's 0.64). "Faster" is
judged by the engine's **decode rate** (tokens/s: llama-server's ``timings``, ``predicted_n`` /
``predicted_ms``, on every answer, :meth:`Lease.observe`), a property of the replica that both
control planes measure alike whatever the sizes of the requests they happened to send; only for an
engine that reports no timings (vLLM) by the EWMA service time. Judged by service time, two control
planes disagreed: one had sent a replica cold prefills (3.0 s) and another cached turns (1.0 s), so
it passed over a replica the other did not, and a new conversation's turns alternating between
them landed on two replicas (bench/routing.py workload E, 3 equal replicas: 0.56-0.78 of turns on
the first turn's replica; judged by decode rate, 1.00, and workload C's slow replica still passed
over: p95 0.49 of round-robin's). Rates are judged only after :data:`RATE_MIN_TOKENS` decoded,
service times after :data:`MIN_ANSWERS` answers, either for :data:`STALE_S` after the last (a
replica once slow is tried again).

Past saturation, the queue (:meth:`Balancer.taker`): a waiting request whose key's last request
went to a replica that is now full, while another has a free slot, defers
(:class:`~.queue.Defer`): the slot goes to a later waiter in fair order (one whose replica it is,
or one with nothing cached), and it waits for its own up to :data:`HOME_WAIT` × that replica's
``service_s / slots`` (the mean time between its slots freeing), then takes any. Without this a
waiting turn took the first slot that freed, wherever: 14 conversations on 3 × 4 slots through
the real queue, 0.39-0.55 of turns on their replica; with it 0.82-0.91 (tests/unit/test_balancer.py,
5 seeds, load ~10). Keys never seen on that replica (unique prompts, a conversation's first turn)
never wait.

Every pick is counted per replica and reason (:data:`REASONS`: ``affinity``, the key's first
choice; ``overflow``, a later choice under the bound; ``least_load``; ``round_robin``), for
``ctl replicas`` and ``llmgw_gateway_routing_decisions_total``.

A replica that refused a connection, or broke one mid-request, is passed over for
:data:`REFUSED_S` (unless every replica was), so requests queued while it died go to the others:
the slots its broken requests free are not handed to a waiter for it.

Measured here (tests/e2e/test_routing_e2e.py, 3 real llama-server replicas of gemma-3-270m with 2
slots each, two gateway apps as two control planes): 10 conversations × 4 growing turns, the turns
alternating between the gateways: 40 of 40 turns on their conversation's first-choice replica
(every pick ``affinity``), the 10 conversations on all 3 replicas; 18 requests at once: at most 2
in flight per replica and llama-server's ``requests_deferred`` stayed 0. In a closed-loop model of
conversations on 3 × 4 slots (tests/unit/test_balancer.py), 97-99 % of turns land where the
previous turn ran for 6-12 conversations with c = 1.25 (c from 1.1 to 2 within 0.02 of it).
Cost: the key ~5 µs for a 4 kB system prompt (CRC-32; ``json.dumps`` + BLAKE2b cost 45 µs), a take
and release ~4 µs.

Not guaranteed: slots and in flight are per control plane (two control planes each fill a
replica's slots; the engine queues the excess); the key sees text, not tokens, so two
conversations whose first turns differ only past the first user message share a replica; a
request deferring for its replica (above) may be passed by later ones for that long. Speed is a
time per request, not per token: replicas whose requests differ in size (cold prefills on one,
cached turns on another) differ in it too; that is why speed is judged by decode rate where the
engine reports it. Rates and the keys' last replicas are each control plane's own: while one
control plane has judged a slow replica (once it decoded RATE_MIN_TOKENS through it) and another
has not yet, a new conversation's turns may go to its first choice through one and its second
through the other (equal replicas are not judged: their rates agree within RATE_RATIO).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol

from llmgw.control.gateway.prefix import rendezvous, replica_hash
from llmgw.control.gateway.queue import Defer
from llmgw.errors import HttpError
from llmgw.routing import Route, Upstream
from llmgw.words import counted

log = logging.getLogger(__name__)

AFFINITY = "affinity"
OVERFLOW = "overflow"
LEAST_LOAD = "least_load"
ROUND_ROBIN = "round_robin"
#: Why a replica was picked: the only values of the routing-decision counters' ``reason``.
REASONS = (AFFINITY, OVERFLOW, LEAST_LOAD, ROUND_ROBIN)

#: The bounded-load factor c: a replica takes at most c × the average in flight (+1) before its
#: keys spill over. 1.25 is the paper's suggested operating point (max load 1.25× average with
#: O(1/ε²) probes, ε = 0.25).
LOAD_BOUND_C = 1.25
#: Requests a replica may hold beyond c × the average before its keys spill over. Without it, at 1
#: request in flight on 3 replicas the bound is 1, so a second conversation whose first choice was
#: busy with another one left its replica and prefilled its whole history elsewhere (~14 s for 1,000
#: tokens on this machine) to spare one shared slot: bench/routing.py's workload A (3 to 4
#: conversations on 3 replicas of 2 slots) lost a turn in 4-6 that way.
AFFINITY_SLACK = 1
#: A replica is "faster" than another when its service time is at most 1/SPEED_RATIO of the other's.
#: Equal replicas' EWMAs differ by the sizes of their last requests (a cold prefill, a cached turn)
#: and by CPU contention; their medians agree (bench/routing.py workload B, load ~10: latency p50
#: 19.1/19.6/17.7 s by replica). A replica running a third of the time measured 2.9x the others'
#: p50 (workload C, load ~11), but its EWMA, which began with warm-up answers of one token, stayed
#: under 2x theirs for a round: at 2 it kept a quarter of the requests, as round-robin gives it.
SPEED_RATIO = 1.5
#: A request whose first choice is full waits for it (while another replica has a free slot) up to
#: HOME_WAIT × its ``service_s / slots``, the mean time between its slots freeing: twice the mean,
#: so most such waits end at home; a miss instead costs the conversation's whole history again.
HOME_WAIT = 2.0
#: Prefix keys whose last replica is remembered (for :meth:`Balancer.home_wait_s`): ~100 bytes each.
KEYS_KEPT = 65_536
#: Answers a replica must have given before its speed is judged (fewer: a mean of too few sizes).
MIN_ANSWERS = 3
#: Tokens a replica must have decoded (through this gateway) before its decode rate is judged: a few
#: short answers' rate is mostly per-request overhead and scheduling noise (answers of 4 tokens on a
#: loaded machine varied enough that equal replicas were judged apart, tests/e2e/test_routing_e2e.py).
RATE_MIN_TOKENS = 48
#: A replica is "faster" by decode rate when it decodes at least RATE_RATIO times as many tokens per
#: second. Equal replicas' rates differ by CPU contention only; a replica running a third of the time
#: (bench/routing.py workload C) decodes at a third: 2 sits between with room on both sides.
RATE_RATIO = 2.0
#: An EWMA older than this (s since the replica's last answer) is not judged: a replica once slow is
#: tried again, measured afresh; each such try is one request at the slow speed, one per 5 minutes.
STALE_S = 300.0
#: Weight of the newest service time in the EWMA (about the last 5 answers count).
EWMA_ALPHA = 0.2
#: How long (s) a replica that refused a connection is passed over.
REFUSED_S = 5.0
#: Slots assumed for a replica whose engine did not say and whose profile is not known.
FALLBACK_SLOTS = 4

#: Routing-decision reasons beside the balancer's picks: the request waited for its slot; it was refused 429.
QUEUED = "queued"
BUSY = "busy"


class RoutingMetrics(Protocol):
    """Where :class:`~llmgw.control.gateway.upstream.UpstreamPool` reports its decisions (the control plane's
    :class:`~llmgw.control.api.metrics.ControlPlaneMetrics`): ``llmgw_gateway_routing_decisions_total``,
    ``llmgw_gateway_queue_wait_seconds`` and ``llmgw_gateway_queue_length``."""

    def routed(self, model: str, reason: str) -> None:
        """One decision for ``model``: a pick's reason (:data:`REASONS`),
        :data:`QUEUED` (it waited first) or :data:`BUSY` (refused 429)."""
        ...

    def waited(self, model: str, seconds: float) -> None:
        """One request's wait for a slot (s; 0 when one was free at once)."""
        ...

    def track_queues(self, lengths: Callable[[], Mapping[str, int]]) -> None:
        """Read ``lengths()`` (model → waiting) at each scrape."""
        ...


#: Reads a replica's slots (``GET /props`` ``total_slots``); None when its engine does not say.
SlotReader = Callable[[Upstream], Awaitable[int | None]]


def load_bound(in_flight: int, replicas: int, c: float = LOAD_BOUND_C) -> int:
    """The most requests one replica may hold before a key's next choice is tried:
    ``ceil(c × (in_flight + 1) / replicas) + AFFINITY_SLACK`` (in_flight: over the model's replicas,
    before this one)."""
    return math.ceil(c * (in_flight + 1) / replicas) + AFFINITY_SLACK


class _Replica:
    """What the balancer keeps per replica id."""

    __slots__ = ("answered_at", "answers", "decode_ms", "decode_n", "decoded", "h", "in_flight", "known", "model",
                 "picks", "rated", "refused_until", "service_s", "slots")

    def __init__(self, up: Upstream, model: str) -> None:
        self.h = replica_hash(up.replica_id)
        self.model = model
        self.slots = 1
        self.known = False
        self.in_flight = 0
        self.service_s = 0.0
        self.answered_at = -math.inf
        self.answers = 0
        self.decode_n = 0.0
        self.decode_ms = 0.0
        self.decoded = 0
        self.rated = 0
        self.refused_until = 0.0
        self.picks = dict.fromkeys(REASONS, 0)

    @property
    def rate(self) -> float:
        """Decode rate, tokens/s: the EWMA of tokens per answer over the EWMA of their decode time, a
        token-weighted mean (a short answer weighs little); 0 before the first timed answer."""
        return self.decode_n * 1000.0 / self.decode_ms if self.decode_ms else 0.0


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the balancer sees it (``ctl replicas``, the dashboard).

    Attributes:
        replica_id: the replica.
        model: its model's catalog name.
        slots: requests its engine runs at once (``/props``, or the fallback; 1 until read).
        slots_known: whether ``slots`` came from the engine or the profile (False: still 1).
        in_flight: requests this gateway sent it that have not finished.
        service_s: EWMA of its answers' time (s), 0 before the first.
        tokens_per_s: EWMA of its engine's decode rate (tokens/s, :meth:`Lease.observe`), 0 before the first.
        picks: times it was picked, by reason (:data:`REASONS`).
        queued: requests of its model waiting at this gateway for a slot (on any of its replicas).
    """

    replica_id: str
    model: str
    slots: int
    slots_known: bool
    in_flight: int
    service_s: float
    picks: dict[str, int]
    queued: int = 0
    tokens_per_s: float = 0.0


class Lease:
    """One slot of one replica, held from :meth:`Balancer.take` until :meth:`release`.

    ``up`` is the replica; ``reason`` why it was picked. :meth:`release` may be called more than
    once (only the first counts), so every exit of a relay can call it.
    """

    __slots__ = ("_balancer", "_rep", "_t0", "done", "model", "reason", "up")

    def __init__(self, balancer: Balancer, up: Upstream, rep: _Replica, reason: str, model: str) -> None:
        self._balancer = balancer
        self._rep = rep
        self._t0 = balancer.clock()
        self.up = up
        self.reason = reason
        self.model = model
        self.done = False

    def release(self, *, answered: bool = True) -> None:
        """Free the slot. ``answered``: the replica answered completely, so its time feeds the EWMA."""
        if self.done:
            return
        self.done = True
        rep = self._rep
        rep.in_flight -= 1
        if answered:
            now = rep.answered_at = self._balancer.clock()
            rep.answers += 1
            # The plain mean until 1/EWMA_ALPHA answers, then the EWMA: a first short answer (a
            # warm-up's one token) does not stand for the replica's speed for the next dozen.
            rep.service_s += max(EWMA_ALPHA, 1 / rep.answers) * (now - self._t0 - rep.service_s)
        if self._balancer.on_free is not None:
            self._balancer.on_free(self.model)

    def observe(self, timings: object) -> None:
        """The engine's own ``timings`` of this answer (llama-server's ``predicted_n`` tokens decoded
        in ``predicted_ms`` ms; anything else is ignored): feeds the replica's decode rate (tokens/s,
        ``_Replica.rate``; the plain mean, then the EWMA, as ``service_s``), the speed the balancer
        judges once both replicas compared have decoded :data:`RATE_MIN_TOKENS`. May come after
        :meth:`release` (a plain answer is parsed after its slot is freed)."""
        if not isinstance(timings, dict):
            return
        n, ms = timings.get("predicted_n"), timings.get("predicted_ms")
        if type(n) is not int or not isinstance(ms, int | float) or n < 1 or ms <= 0:
            return
        rep = self._rep
        rep.rated += 1
        rep.decoded += n
        weight = max(EWMA_ALPHA, 1 / rep.rated)
        rep.decode_n += weight * (n - rep.decode_n)
        rep.decode_ms += weight * (ms - rep.decode_ms)


@dataclass(eq=False, repr=False)
class Balancer:
    """Slots, load and the choice of replica, for every model of one gateway.

    Args:
        read_slots: reads a replica's slots (:data:`SlotReader`), run once per replica id in the
            background the first time it is seen; None: slots stay at 1 until :meth:`set_slots`.
        clock: monotonic seconds (injected for tests).
        load_c: the bounded-load factor c (:data:`LOAD_BOUND_C`).
        home_wait: how long a request may wait for its key's replica, in its mean slot-freeing times
            (:data:`HOME_WAIT`; 0: never).

    ``on_free(model)`` (set by the owner) is called whenever a slot of ``model`` may have come
    free: a lease released, a replica's slots learned. All methods run on the event loop.
    """

    _: KW_ONLY
    read_slots: SlotReader | None = None
    clock: Callable[[], float] = time.monotonic
    load_c: float = LOAD_BOUND_C
    home_wait: float = HOME_WAIT
    on_free: Callable[[str], None] | None = field(default=None, init=False)
    #: (model, reason) → picks, for the metrics page (read at scrape time).
    decisions: dict[tuple[str, str], int] = field(default_factory=dict, init=False)
    _reps: dict[str, _Replica] = field(default_factory=dict, init=False)
    _next: dict[str, int] = field(default_factory=dict, init=False)
    #: prefix key → the replica its last request went to, the newest :data:`KEYS_KEPT`.
    _where: OrderedDict[int, str] = field(default_factory=OrderedDict, init=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    # -- slots ----------------------------------------------------------------------------------
    def _rep(self, up: Upstream, model: str) -> _Replica:
        rep = self._reps.get(up.replica_id)
        if rep is None:
            rep = self._reps[up.replica_id] = _Replica(up, model)
            if self.read_slots is not None:
                task = asyncio.get_running_loop().create_task(self._learn(up, rep))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        return rep

    async def _learn(self, up: Upstream, rep: _Replica) -> None:
        assert self.read_slots is not None  # noqa: S101
        try:
            slots = await self.read_slots(up)
        except Exception:  # a reader's bug must not leave the replica at 1 slot unexplained
            log.exception("replica %s: reading its slots failed", up.replica_id)
            slots = None
        if slots is None:
            slots = up.slots or FALLBACK_SLOTS
            log.info("replica %s of %s: no slot count from its engine (GET /props); using %d, its profile's",
                     up.replica_id, rep.model, slots)
        self.set_slots(up.replica_id, slots)

    def set_slots(self, replica_id: str, slots: int) -> None:
        """Set a replica's slots (≥ 1) once known; frees waiting requests when they grew."""
        rep = self._reps.get(replica_id)
        if rep is None:
            return
        rep.slots, rep.known = max(1, slots), True
        if self.on_free is not None:
            self.on_free(rep.model)

    async def settle(self) -> None:
        """Wait for the slot reads in progress (tests, and a gateway warming up)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def refused(self, replica_id: str) -> None:
        """The replica refused a connection or broke one: pass it over for :data:`REFUSED_S`. Call it
        before the broken request's lease is released, so the slot that frees is not handed to it."""
        rep = self._reps.get(replica_id)
        if rep is not None:
            rep.refused_until = self.clock() + REFUSED_S

    # -- the choice -----------------------------------------------------------------------------
    def take(self, route: Route, key: int | None, exclude: Collection[str] = (), waiting: int = 1) -> Lease | None:
        """A slot on one of ``route``'s replicas, chosen by its policy (module docstring); None when
        every replica not in ``exclude`` has all its slots in use, or (cache-aware) when the free ones
        are slow enough that waiting for a faster one's slot finishes sooner (:meth:`_too_slow`).
        ``waiting``: requests of the model waiting for a slot, this one included (1 when none waits).
        Takes the slot (in flight + 1)."""
        ups = route.upstreams
        n = len(ups)
        reps, usable, now = self._view(route, exclude)
        if route.routing == "round-robin":
            first = self._next.get(route.model, 0)
            self._next[route.model] = first + 1
            for step in range(n):
                i = (first + step) % n
                if usable[i] and reps[i].in_flight < reps[i].slots:
                    return self._lease(route.model, ups[i], reps[i], ROUND_ROBIN)
            return None
        lease = self._cache_aware(route, key, reps, usable, now, waiting)
        if lease is not None and key is not None:
            where = self._where
            where[key] = lease.up.replica_id
            where.move_to_end(key)
            if len(where) > KEYS_KEPT:
                where.popitem(last=False)
        return lease

    def _cache_aware(
        self, route: Route, key: int | None, reps: list[_Replica], usable: list[bool], now: float, waiting: int
    ) -> Lease | None:
        ups = route.upstreams
        n = len(ups)
        if n == 1:  # what the lists below come to for one replica (never too slow), ~4 µs a request less
            rep = reps[0]
            free_one = usable[0] and rep.in_flight < rep.slots
            return self._lease(route.model, ups[0], rep, LEAST_LOAD) if free_one else None
        fresh = [now - r.answered_at < STALE_S for r in reps]
        service = [r.service_s if r.answers >= MIN_ANSWERS and fresh[i] else 0.0 for i, r in enumerate(reps)]
        speed = [r.rate if r.decoded >= RATE_MIN_TOKENS and fresh[i] else 0.0 for i, r in enumerate(reps)]
        if key is not None and n > 1:
            bound = load_bound(sum(r.in_flight for r in reps), n, self.load_c)
            reason = AFFINITY
            last = self._where.get(key)  # where its prefix is cached: kept there, however slow
            for i in rendezvous(key, [r.h for r in reps]):
                if not usable[i]:
                    continue
                rep = reps[i]
                if rep.in_flight < rep.slots and rep.in_flight < bound and (
                    ups[i].replica_id == last or not self._too_slow(i, reps, usable, service, speed, waiting)
                ):
                    return self._lease(route.model, ups[i], rep, reason)
                reason = OVERFLOW
        free = sorted((reps[i].in_flight / reps[i].slots, reps[i].service_s, i) for i in range(n)
                      if usable[i] and reps[i].in_flight < reps[i].slots)
        for _, _, i in free:
            if not self._too_slow(i, reps, usable, service, speed, waiting):
                return self._lease(route.model, ups[i], reps[i], LEAST_LOAD)
        return None

    def _view(self, route: Route, exclude: Collection[str]) -> tuple[list[_Replica], list[bool], float]:
        """``route``'s replicas, which of them may be given a request now, and the clock."""
        reps = [self._rep(up, route.model) for up in route.upstreams]
        now = self.clock()
        usable = [up.replica_id not in exclude and reps[i].refused_until <= now for i, up in enumerate(route.upstreams)]
        if not any(usable):  # every replica refused lately: try them anyway, rather than none
            usable = [up.replica_id not in exclude for up in route.upstreams]
        return reps, usable, now

    def home_wait_s(self, route: Route, key: int | None, exclude: Collection[str] = ()) -> float:
        """How long (s) a request of ``key`` should wait for its first choice rather than take a free
        slot elsewhere now: :data:`HOME_WAIT` × the first choice's ``service_s / slots`` (the mean time
        between its slots freeing) when it is full while another replica has a free slot and the key's
        last request went there (its prefix is cached there), 0 otherwise (no key, not
        ``cache-aware``, a key not seen there, its first choice free, nothing free elsewhere)."""
        if route.routing != "cache-aware" or key is None or len(route.upstreams) < 2 or key not in self._where:
            return 0.0
        reps, usable, _ = self._view(route, exclude)
        order = [i for i in rendezvous(key, [r.h for r in reps]) if usable[i]]
        if not order:
            return 0.0
        home = reps[order[0]]
        if home.in_flight < home.slots or not any(reps[i].in_flight < reps[i].slots for i in order[1:]):
            return 0.0
        if self._where.get(key) != route.upstreams[order[0]].replica_id:
            return 0.0  # no earlier request of this key ran there: nothing of it is cached to wait for
        return self.home_wait * home.service_s / home.slots

    def taker(
        self, route: Route, key: int | None, exclude: Collection[str], waiting: Callable[[], int]
    ) -> Callable[[], Lease | Defer | None]:
        """``take()`` for the model's :class:`~llmgw.control.gateway.queue.FairQueue`: :meth:`take`,
        except that while the request's first choice is full and another replica has a free slot it
        defers (lets a later waiter have that slot) for :meth:`home_wait_s`, counted from its first
        deferral. ``waiting()``: the queue's length (the ``waiting`` of :meth:`take`). The deadline
        is on ``time.monotonic`` (the queue's default clock)."""
        until: list[float] = []

        def take() -> Lease | Defer | None:
            if key is not None and (until or (wait := self.home_wait_s(route, key, exclude)) > 0):
                now = time.monotonic()
                if not until:
                    until.append(now + wait)
                if now < until[0] and self.home_wait_s(route, key, exclude) > 0:
                    return Defer(until[0])
            return self.take(route, key, exclude, waiting() or 1)

        return take

    @staticmethod
    def _too_slow(
        i: int, reps: list[_Replica], usable: list[bool], service: list[float], speed: list[float], waiting: int
    ) -> bool:
        """Whether replica ``i`` (with a free slot) should be passed over for faster ones: shortest
        expected delay with a threshold (Lin & Kumar 1984, two heterogeneous servers: use the slow one
        only when the queue is long). The faster replicas are those faster by decode rate (``speed``,
        tokens/s, :meth:`Lease.observe`; :data:`RATE_RATIO` times or more; 0: fewer than
        :data:`RATE_MIN_TOKENS` decoded, never judged) where the engine reports it, else by EWMA
        service time (:data:`SPEED_RATIO` times or more; 0: fewer than :data:`MIN_ANSWERS` answers);
        neither is judged :data:`STALE_S` after the replica's last answer. Passed over when they would
        finish the request sooner even after waiting for a slot: none free, ``waiting`` requests take
        slots as they free, one every ``1 / Σ slots_j / service_j`` seconds, so
        ``waiting / Σ(slots_j / service_j) + max(service_j) < service_i``."""
        mine = service[i]
        if not mine:
            return False
        rate = slowest = 0.0
        free = False
        for j, rep in enumerate(reps):
            s = service[j]
            if j == i or not usable[j] or not s:
                continue
            if rep.rated or reps[i].rated:  # the engine says its decode rate: judge by that alone
                if not (speed[i] and speed[j]) or speed[j] < RATE_RATIO * speed[i]:
                    continue
            elif s * SPEED_RATIO > mine:
                continue
            free |= rep.in_flight < rep.slots
            rate += rep.slots / s
            slowest = max(slowest, s)
        if not rate:
            return False
        return (0.0 if free else waiting / rate) + slowest < mine

    def _lease(self, model: str, up: Upstream, rep: _Replica, reason: str) -> Lease:
        rep.in_flight += 1
        rep.picks[reason] += 1
        k = (model, reason)
        self.decisions[k] = self.decisions.get(k, 0) + 1
        return Lease(self, up, rep, reason, model)

    # -- what the queue and the 429 need ----------------------------------------------------------
    def slots(self, route: Route) -> int:
        """The slots of ``route``'s replicas together."""
        return sum(self._rep(up, route.model).slots for up in route.upstreams)

    def service_s(self, route: Route) -> float:
        """The model's typical service time (s): the mean EWMA of its replicas that answered, 1.0
        before any did (a guess for ``Retry-After`` only)."""
        times = [r.service_s for up in route.upstreams if (r := self._reps.get(up.replica_id)) and r.service_s]
        return sum(times) / len(times) if times else 1.0

    def busy_error(self, route: Route) -> HttpError:
        """429 ``model_busy`` with ``Retry-After`` (one service time, at least 1 s): every slot is in use."""
        wait = max(1, math.ceil(self.service_s(route)))
        return HttpError(
            429,
            "model_busy",
            f"every slot of model '{route.model}' is busy ({counted(self.slots(route), 'slot')}); retry in {wait} s",
            headers={"Retry-After": str(wait)},
        )

    # -- what operators see -----------------------------------------------------------------------
    def loads(self, queued: Mapping[str, int] | None = None) -> dict[str, ReplicaLoad]:
        """Every replica seen so far, by id (see :class:`ReplicaLoad`); ``queued``: model → requests
        waiting for it (the queues')."""
        waiting = queued or {}
        return {
            rid: ReplicaLoad(
                rid, r.model, r.slots, r.known, r.in_flight, r.service_s, dict(r.picks), waiting.get(r.model, 0),
                r.rate,
            )
            for rid, r in self._reps.items()
        }

    def forget(self, keep: Collection[str]) -> None:
        """Drop the state of replicas not in ``keep`` that have nothing in flight (gone replicas)."""
        for rid in [rid for rid, r in self._reps.items() if rid not in keep and not r.in_flight]:
            del self._reps[rid]
