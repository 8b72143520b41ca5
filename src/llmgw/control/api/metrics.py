"""``GET /metrics`` on the admin listener: the control plane's Prometheus metrics (Prometheus text format).

What it exports (``prometheus-client``, one registry per control plane, never the global one):

- the process: prometheus-client's ``process_*`` (resident memory, CPU seconds, open files) and
  ``python_info``, and ``llmgw_build_info{version}``;
- the gateway, fed by :meth:`ControlPlaneMetrics.observe` once per request
  (:class:`~llmgw.control.gateway.inspect.Exchange`): ``llmgw_gateway_requests_total{model,key,kind,status}``,
  ``llmgw_gateway_request_seconds{model,kind}`` (whole time), ``llmgw_gateway_ttft_seconds{model}``
  (streams: to the first byte), ``llmgw_gateway_overhead_seconds{kind}`` (the gateway's own time,
  buckets from 50 µs), ``llmgw_gateway_tokens_total{model,key,direction}``,
  ``llmgw_gateway_rate_limited_total{key,code}``, ``llmgw_gateway_guard_blocks_total{model}``,
  ``llmgw_gateway_refused_keys_total{reason}`` (401s: ``reason`` is ``invalid`` or ``missing``, a
  fixed set; a refused request is counted there only, never under a key, model or kind label),
  ``llmgw_gateway_streams_broken_total{model,code}`` (a stream whose 200 went out and that ended with an
  error event: counted 200 above, so a replica dying mid-answer showed nowhere but the access log;
  ``code`` one of :data:`BROKEN_CODES` or ``other``);
- the gateway's queue and replica choice (:mod:`llmgw.control.gateway.queue`), fed by the balancer:
  ``llmgw_gateway_queue_length{model}`` (requests waiting now, read at scrape time from
  :meth:`ControlPlaneMetrics.track_queues`), ``llmgw_gateway_queue_wait_seconds{model}``
  (:meth:`ControlPlaneMetrics.waited`, once per request that asked the queue, 0 when a slot was
  free; a request refused after waiting counts its wait, one refused at once nothing) and
  ``llmgw_gateway_routing_decisions_total{model,reason}`` (:meth:`ControlPlaneMetrics.routed`,
  ``reason`` one of :data:`ROUTING_REASONS`);
- the judges, read at scrape time from the guard's own counters
  (:class:`~llmgw.control.gateway.guard.GuardStats`): ``llmgw_guard_verdicts_total{direction,verdict}``,
  ``llmgw_guard_errors_total{kind}`` (``timeout`` among them), ``llmgw_guard_unjudged_total{direction}``,
  ``llmgw_guard_refused_unavailable_total{direction}``, and ``llmgw_guard_judgment_seconds{judge}``,
  a histogram fed per judgment;
- the cluster, read from the store at scrape time (with the store's deadline; while the database
  is down the last read is exported and ``llmgw_store_up`` is 0): ``llmgw_replicas{model,state}``
  (every catalog model in every state, 0s included), ``llmgw_model_replicas_wanted{model}``,
  ``llmgw_node_up{node,state}``, ``llmgw_node_cores{node}``, ``llmgw_node_memory_total_bytes{node}``,
  ``llmgw_node_memory_available_bytes{node}``, ``llmgw_node_gpus{node}``, ``llmgw_leader`` (1 when this
  control plane leads), ``llmgw_term``, ``llmgw_autoscale_desired_replicas{model}`` (an autoscaled
  model's last decided count);
- autoscaling, counted on the leader (:meth:`ControlPlaneMetrics.decided`):
  ``llmgw_autoscale_decisions_total{model,direction}`` (``up``/``down``);
- each engine's own ``/metrics`` (llama-server's ``--metrics``), relayed by the agents
  (:mod:`llmgw.control.api.enginemetrics`), with ``replica``, ``model`` and ``node`` labels.

Label values come from the catalog (model names), the store (key names, node ids, replica ids) and
fixed sets (kind, status codes, verdicts): nothing a client writes in a request becomes a label, so no
request can make this page grow. A model name that did not resolve is ``unknown``.

Access: from loopback without a token (the admin listener's default address); from anywhere else
the admin token as for every admin route (Prometheus: ``authorization: {credentials_file: …}``).
Cost on the request path: :meth:`ControlPlaneMetrics.observe` ~6 µs (timeit, this 2-core machine).
Each label set's child is looked up once and kept (:meth:`ControlPlaneMetrics._child`):
``prometheus-client``'s ``labels()`` checks and converts its values under a lock on every call, which was
a large part of ``observe``'s cost (timeit, two runs each way at load ~12 on 2 cores: ``observe``
23.6-37.7 µs before, 17.0-31.3 µs after; ``waited`` 7.2 µs before, 1.6-3.5 µs after; ``routed`` 3.3-5.9 µs
before, 1.9-2.0 µs after). Children are never removed here, so a kept one is always the registered one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, Info, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from llmgw import __version__
from llmgw.bearer import bearer_is
from llmgw.control.gateway.inspect import Exchange
from llmgw.control.reconcile.autoscale import wanted_replicas
from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.control.store.rows import DecisionRow, NodeRow, ReplicaRow
from llmgw.guard.formats import Safety
from llmgw.protocol import ReplicaState

if TYPE_CHECKING:
    from llmgw.control.api.enginemetrics import EngineMetrics
    from llmgw.control.gateway.guard import GuardStats
    from llmgw.control.reconcile.membership import Membership

#: Latency buckets (s): LLM answers take from milliseconds to minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: The gateway's own time (s): its target is under a millisecond without a guard policy.
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05,
                    0.1, 0.25, 0.5, 1, 2.5, 5)
"""With a guard policy the gateway's own time includes judging the prompt (and the answer): up to
seconds on a CPU judge; the buckets past 0.05 s keep those from all reading as 0.05 s."""
JUDGE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_LIMIT_CODES = frozenset({"rate_limit_exceeded", "insufficient_quota"})
#: Queue waits (s): from none (a slot was free) to the queue's longest bounds (a minute or two).
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
#: Why the balancer sent a request where it did, the only label values of
#: ``llmgw_gateway_routing_decisions_total``: ``affinity`` (the replica likely holding its prefix),
#: ``least_load`` (no affinity, the least-loaded replica), ``overflow`` (its affinity replica was busy
#: past the bound: the least-loaded one instead), ``round_robin`` (a model routed ``round-robin``),
#: ``queued`` (it waited in the queue first), ``busy`` (refused: 429 ``model_busy``).
ROUTING_REASONS = ("affinity", "least_load", "overflow", "round_robin", "queued", "busy")
_ROUTING_REASONS = frozenset(ROUTING_REASONS)
#: ``Exchange.refused``'s values: the only label values of ``llmgw_gateway_refused_keys_total``.
_REFUSED_REASONS = ("invalid", "missing")
#: The error codes a stream can end with after its 200 (the labels of ``llmgw_gateway_streams_broken_total``):
#: its replica broke or went silent, the gateway's drain deadline cut it, the judge of its held answer was missing.
BROKEN_CODES = ("upstream_failed", "upstream_timeout", "shutting_down", "judge_unavailable")


class _ClusterCollector(Collector):
    """Replicas, nodes, leader and term from the last store read (:meth:`ControlPlaneMetrics.refresh`)."""

    def __init__(self, owner: ControlPlaneMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        o = self.owner
        up = GaugeMetricFamily("llmgw_store_up", "1 when the last store read for this page succeeded")
        up.add_metric([], 1.0 if o.store_ok else 0.0)
        yield up
        replicas = GaugeMetricFamily("llmgw_replicas", "Replicas per model and state", labels=["model", "state"])
        # every catalog model in every state from 0: a model scaled to 0, or its last ready replica gone,
        # reads 0 rather than a series that vanishes (an alert on "ready < wanted" needs both)
        counts = {(m, str(st)): 0 for m in o.models for st in ReplicaState}
        for r in o.replicas:
            counts[(r.model, r.state)] = counts.get((r.model, r.state), 0) + 1
        for (model, state), n in sorted(counts.items()):
            replicas.add_metric([model, state], n)
        yield replicas
        node_up = GaugeMetricFamily("llmgw_node_up", "1 for a node in this state", labels=["node", "state"])
        cores = GaugeMetricFamily("llmgw_node_cores", "Logical cores a node reports", labels=["node"])
        total = GaugeMetricFamily("llmgw_node_memory_total_bytes", "A node's memory (bytes)", labels=["node"])
        avail = GaugeMetricFamily("llmgw_node_memory_available_bytes", "A node's available memory (bytes)",
                                  labels=["node"])
        gpus = GaugeMetricFamily("llmgw_node_gpus", "GPUs a node reports", labels=["node"])
        for node in o.nodes:
            inv = node.inventory
            node_up.add_metric([node.id, node.state], 1.0)
            cores.add_metric([node.id], inv.cores)
            total.add_metric([node.id], inv.memory_total_bytes)
            avail.add_metric([node.id], inv.memory_available_bytes)
            gpus.add_metric([node.id], len(inv.gpus))
        yield from (node_up, cores, total, avail, gpus)
        wanted = GaugeMetricFamily("llmgw_autoscale_desired_replicas",
                                   "Replicas an autoscaled model wants (the leader's last decision)", labels=["model"])
        for model, n in sorted(o.wanted.items()):
            wanted.add_metric([model], n)
        want = GaugeMetricFamily("llmgw_model_replicas_wanted",
                                 "Replicas a model wants now (autoscaled: the last decision in [min, max]; else min)",
                                 labels=["model"])
        for model, n in sorted(o.models.items()):
            want.add_metric([model], n)
        yield from (wanted, want)
        if o.members is not None:
            leader = GaugeMetricFamily("llmgw_leader", "1 when this control plane leads (runs the reconcilers)")
            leader.add_metric([], 1.0 if o.members.election.leading else 0.0)
            term = GaugeMetricFamily("llmgw_term", "The leadership term this control plane knows")
            term.add_metric([], o.members.term())
            yield from (leader, term)


class _QueueCollector(Collector):
    """``llmgw_gateway_queue_length{model}`` at scrape time, from :meth:`ControlPlaneMetrics.track_queues`."""

    def __init__(self, owner: ControlPlaneMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("llmgw_gateway_queue_length", "Requests waiting in the gateway's queue for a slot",
                                   labels=["model"])
        lengths = self.owner.queue_lengths
        for model, n in sorted((lengths() if lengths is not None else {}).items()):
            family.add_metric([model], n)
        yield family


#: The directions a guard policy judges: the prompt (``in``) and the answer (``out``).
_DIRECTIONS = ("in", "out")


class _GuardCollector(Collector):
    """The guard's counters (:class:`~llmgw.control.gateway.guard.GuardStats`) at scrape time."""

    def __init__(self, stats: GuardStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = self.stats
        # Every (direction, verdict) and direction from 0, not from its first event: rate() and increase()
        # lose a series' first sample, so a first block read as nothing (a new user's report).
        verdicts = CounterMetricFamily("llmgw_guard_verdicts", "Judge verdicts", labels=["direction", "verdict"])
        for key, n in sorted(({f"{d} {v}": 0 for d in _DIRECTIONS for v in Safety} | s.verdicts).items()):
            direction, _, verdict = key.partition(" ")
            verdicts.add_metric([direction, verdict], n)
        errors = CounterMetricFamily("llmgw_guard_errors", "Judgments without a verdict, by kind (timeout, ...)",
                                     labels=["kind"])
        for kind, n in sorted(s.errors.items()):
            errors.add_metric([kind], n)
        unjudged = CounterMetricFamily("llmgw_guard_unjudged", "Served without a verdict (fail: open)",
                                       labels=["direction"])
        refused = CounterMetricFamily("llmgw_guard_refused_unavailable", "Refused without a verdict (fail: closed)",
                                      labels=["direction"])
        for family, d in ((unjudged, s.unjudged), (refused, s.refused_unavailable)):
            for direction, n in sorted((dict.fromkeys(_DIRECTIONS, 0) | d).items()):
                family.add_metric([direction], n)
        yield from (verdicts, errors, unjudged, refused)


class ControlPlaneMetrics:
    """The control plane's registry and the gateway's metrics (see the module docstring).

    Args:
        store: read at scrape time for replicas and nodes (through ``db``).
        db: the store's thread pool with its deadline.
        members: leader and term (None: not exported).
        guard: the guard's counters (None: no guard metrics).
        engines: the engines' relayed metrics (None: none).
    """

    def __init__(
        self,
        store: Store | None = None,
        db: OffLoop | None = None,
        *,
        members: Membership | None = None,
        guard: GuardStats | None = None,
        engines: EngineMetrics | None = None,
    ) -> None:
        self.store, self.db, self.members, self.engines = store, db, members, engines
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        # the control plane's own process (process_resident_memory_bytes, process_cpu_seconds_total,
        # open fds...) and which llmgw and Python it is, as prometheus_client's default registry has them
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        Info("llmgw_build", "This control plane's llmgw version", registry=r).info({"version": __version__})
        self.requests = Counter("llmgw_gateway_requests", "Gateway requests", ["model", "key", "kind", "status"],
                                registry=r)
        self.latency = Histogram("llmgw_gateway_request_seconds", "Whole request time (s)", ["model", "kind"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("llmgw_gateway_ttft_seconds",
                              "Time to a stream's first token: its first body bytes sent to the client (s)",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.overhead = Histogram("llmgw_gateway_overhead_seconds", "The gateway's own time per request (s)",
                                  ["kind"], buckets=OVERHEAD_BUCKETS, registry=r)
        self.tokens = Counter("llmgw_gateway_tokens", "Tokens in (prompt) and out (completion)",
                              ["model", "key", "direction"], registry=r)
        self.limited = Counter("llmgw_gateway_rate_limited", "Requests refused by a key's limit or budget",
                               ["key", "code"], registry=r)
        self.refused = Counter("llmgw_gateway_refused_keys", "Requests refused for their key (401)", ["reason"],
                               registry=r)
        for reason in _REFUSED_REASONS:  # exported at 0 from the start, so rate() sees the first one
            self.refused.labels(reason)
        self.blocks = Counter("llmgw_gateway_guard_blocks", "Requests the guard refused", ["model"], registry=r)
        self.broken = Counter("llmgw_gateway_streams_broken", "Streams that ended with an error event after their 200",
                              ["model", "code"], registry=r)
        self.judgment = Histogram("llmgw_guard_judgment_seconds", "Time a judge took per judgment (s)", ["judge"],
                                  buckets=JUDGE_BUCKETS, registry=r)
        self.queue_wait = Histogram("llmgw_gateway_queue_wait_seconds",
                                    "Time a request waited in the gateway's queue for a slot (s)", ["model"],
                                    buckets=QUEUE_WAIT_BUCKETS, registry=r)
        self.routing = Counter("llmgw_gateway_routing_decisions", "The balancer's replica choices, by reason",
                               ["model", "reason"], registry=r)
        self.autoscale = Counter("llmgw_autoscale_decisions", "The leader's autoscaling decisions, by direction",
                                 ["model", "direction"], registry=r)
        #: (metric, label values) → its child, made once (see the module docstring).
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}
        self.queue_lengths: Callable[[], Mapping[str, int]] | None = None
        self.wanted: dict[str, int] = {}  # an autoscaled model's last decided count, read at scrape time
        self.models: dict[str, int] = {}  # every catalog model -> the replicas it wants now
        self.replicas: list[ReplicaRow] = []
        self.nodes: list[NodeRow] = []
        self.store_ok = True
        r.register(_ClusterCollector(self))
        r.register(_QueueCollector(self))
        if guard is not None:
            r.register(_GuardCollector(guard))
            guard.on_judgment = lambda judge, ms: self.judgment.labels(judge).observe(ms / 1000)
        if engines is not None:
            r.register(engines)

    def _child(self, metric: MetricWrapperBase, *values: str) -> Any:
        """``metric.labels(*values)``, made once per label set and kept."""
        child = self._children.get((metric, values))
        if child is None:
            child = self._children[(metric, values)] = metric.labels(*values)
        return child

    def observe(self, ex: Exchange) -> None:
        """Count one gateway request (the gateway's ``observe``; on the event loop, memory only)."""
        child = self._child
        if ex.refused:
            child(self.refused, ex.refused if ex.refused in _REFUSED_REASONS else "invalid").inc()
            return
        model = ex.model or ("-" if ex.kind == "models" else "unknown")  # "-": the list, no model asked
        key = ex.key or "-"
        child(self.requests, model, key, ex.kind, str(ex.status)).inc()
        if ex.replica:  # answered by a replica: a request refused before one (400, 404, 429, 503) is
            # counted above, not timed (its 0 s pulled a model's latency quantiles down)
            child(self.latency, model, ex.kind).observe((ex.overhead_ms + ex.upstream_ms) / 1000)
        child(self.overhead, ex.kind).observe(ex.overhead_ms / 1000)
        if ex.stream and ex.status == 200 and ex.ttft_ms > 0:  # 0: no token reached the client
            child(self.ttft, model).observe(ex.ttft_ms / 1000)
        if ex.usage is not None:
            for direction, field in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
                n = ex.usage.get(field)
                if isinstance(n, int) and n > 0:
                    child(self.tokens, model, key, direction).inc(n)
        if ex.code in _LIMIT_CODES:
            child(self.limited, key, ex.code).inc()
        if ex.blocked:
            child(self.blocks, model).inc()
        elif ex.stream and ex.status == 200 and ex.code:
            child(self.broken, model, ex.code if ex.code in BROKEN_CODES else "other").inc()

    def track_queues(self, lengths: Callable[[], Mapping[str, int]]) -> None:
        """Export ``lengths()`` (catalog model name → requests waiting, every model with a queue, 0s
        included) as ``llmgw_gateway_queue_length`` at each scrape; nothing on the request path."""
        self.queue_lengths = lengths

    def waited(self, model: str, seconds: float) -> None:
        """One request's wait in the queue of ``model`` (a catalog name), in seconds (0: a slot was free)."""
        self._child(self.queue_wait, model).observe(seconds)

    def routed(self, model: str, reason: str) -> None:
        """Count one routing decision for ``model`` (a catalog name).

        Raises:
            ValueError: ``reason`` is not one of :data:`ROUTING_REASONS` (a label set that cannot grow).
        """
        if reason not in _ROUTING_REASONS:
            raise ValueError(f"routing reason {reason!r} is not one of {', '.join(ROUTING_REASONS)}")
        self._child(self.routing, model, reason).inc()

    def decided(self, row: DecisionRow) -> None:
        """Count one autoscaling decision (``direction``: ``up`` or ``down``); the leader's, any thread."""
        self.autoscale.labels(row.model, "up" if row.to_n > row.from_n else "down").inc()

    async def refresh(self) -> None:
        """Read replicas and nodes from the store (off the loop, with its deadline); on failure keep the
        last read and set ``llmgw_store_up`` to 0."""
        if self.store is None or self.db is None:
            return
        store = self.store
        try:
            self.replicas, self.nodes, last, models = await self.db.run(
                lambda: (store.list_replicas(), store.list_nodes(), store.last_decisions(), store.list_models())
            )
            self.wanted = {m: d.to_n for m, d in last.items()}
            # each catalog model's wanted count, as the leader places it (autoscale.wanted_replicas)
            self.models = {r.name: wanted_replicas(r.model, last) for r in models}
            self.store_ok = True
        except Exception:  # any store failure: the page still answers, saying so
            self.store_ok = False

    def exposition(self) -> bytes:
        """The page: the text format of everything registered."""
        return generate_latest(self.registry)


def _loopback(remote: str | None) -> bool:
    return remote is not None and (remote.startswith(("127.", "::ffff:127.")) or remote == "::1")


@dataclass(frozen=True)
class MetricsContext:
    """What :func:`page` reads, kept on the admin app under :data:`METRICS` by
    :func:`add_metrics_route`: the collectors and the admin token."""

    metrics: ControlPlaneMetrics
    token: str


#: Where the admin app keeps its :class:`MetricsContext`.
METRICS: web.AppKey[MetricsContext] = web.AppKey("metrics", MetricsContext)


def token_ok(request: web.Request, token: str) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <token>`` (compared in constant time)."""
    return bearer_is(request.headers.get("Authorization", ""), token)


async def page(request: web.Request) -> web.Response:
    """``GET /metrics``: open from loopback, else 401 without the admin token."""
    ctx = request.app[METRICS]
    metrics = ctx.metrics
    if not _loopback(request.remote) and not token_ok(request, ctx.token):
        return web.json_response(
            {"error": {"code": "unauthorized",
                       "message": "send the admin token: 'Authorization: Bearer <token>' (Prometheus: "
                                  "authorization: {credentials_file: …}); loopback needs none"}},
            status=401,
        )
    t0 = time.perf_counter()
    await metrics.refresh()
    body = metrics.exposition()
    headers = {"x-llmgw-scrape-ms": f"{(time.perf_counter() - t0) * 1000:.1f}"}
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST, **headers})


#: The metrics route.
ROUTES = [web.get("/metrics", page)]


def add_metrics_route(app: web.Application, metrics: ControlPlaneMetrics, token: str) -> None:
    """Add ``GET /metrics`` to the admin API ``app``: open from loopback, else the admin ``token``
    (the admin app's auth middleware lets ``/metrics`` through to this check); a
    :class:`MetricsContext` from the arguments goes under :data:`METRICS`."""
    app[METRICS] = MetricsContext(metrics=metrics, token=token)
    app.add_routes(ROUTES)
