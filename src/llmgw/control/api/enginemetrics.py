"""Engines' own metrics, relayed: what agents post to ``POST /agent/v1/metrics``, re-exposed on the
control plane's ``GET /metrics`` (:mod:`llmgw.control.api.metrics`).

Each agent reads its ready replicas' ``/metrics`` (llama-server runs with ``--metrics``) every
``agent.metrics.PUSH_EVERY_S`` (15 s) and posts the pages here, over the agent API's mTLS (the node is
the client certificate's CN). The control plane keeps the latest pages per node in memory and drops
a node's after :data:`STALE_S` without a post (its agent moved to another control plane, or went).
So each control plane exposes the engines of the agents that beat to it: scrape every control
plane (one target each) and the sum covers the cluster without double counting.

At scrape time the pages are parsed (``prometheus_client.parser``), every sample gets ``replica``,
``model`` and ``node`` labels, and families of the same name from several replicas are merged into
one (one HELP and TYPE each, as the text format requires). Bounds: 256 KiB per page, 64 replicas per
node, :data:`MAX_FAMILIES` families per page, :data:`MAX_LINES_PER_NODE` lines per node; a page that
does not parse, or past a node's lines, is skipped and counted in ``llmgw_engine_metrics_errors_total``.

The lines bound the scrape's cost, which is paid on the control plane's event loop (the gateway's
and the agent API's): a node posting 1 MiB of one-sample lines (56,000 samples in 16 pages) made
every ``GET /metrics`` take 0.5 s, during which a heartbeat waited 0.45 s (6 ms otherwise). A
llama-server page is 45 lines, a vLLM page about a thousand.

A page is what a node says, and a node may be compromised: a family or sample whose name is one of
the control plane's own (:data:`RESERVED_PREFIXES`: ``llmgw_``, and prometheus-client's ``process_``
and ``python_``) is never relayed. A node posting ``llmgw_leader 1`` or ``llmgw_replicas{state="ready"} 5``
(its page's ``model`` naming any model) made ``/metrics`` show a second family of that name, whose
series kept the alert rules of ``deploy/prometheus/llmgw-alerts.yml`` (``max(llmgw_leader) == 0``,
a model serving nothing) from ever firing; it also duplicated HELP/TYPE lines, which the text format
forbids (vLLM's own ``process_*``/``python_*`` families collided the same way).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from llmgw.protocol import EngineMetricsText

log = logging.getLogger(__name__)

#: Seconds after which a node's pages are dropped (four missed pushes).
STALE_S = 60.0
MAX_REPLICAS_PER_NODE = 64
MAX_FAMILIES = 200
MAX_LINES_PER_NODE = 10_000
#: Name prefixes of the control plane's own families (:mod:`llmgw.control.api.metrics`); relayed
#: families and samples named so are dropped (see the module docstring).
RESERVED_PREFIXES = ("llmgw_", "process_", "python_")


def reserved(family: Metric) -> bool:
    """Whether ``family`` (or one of its samples) takes a name of the control plane's own."""
    return family.name.startswith(RESERVED_PREFIXES) or any(
        s.name.startswith(RESERVED_PREFIXES) for s in family.samples
    )


class EngineMetrics(Collector):
    """The latest engine pages per node, exposed as one merged set of families (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._pages: dict[str, tuple[float, list[EngineMetricsText]]] = {}
        self.errors = 0

    def put(self, node: str, pages: list[EngineMetricsText]) -> None:
        """Keep ``node``'s pages (its last post replaces the one before), as many as fit in
        :data:`MAX_REPLICAS_PER_NODE` pages and :data:`MAX_LINES_PER_NODE` lines; the others are
        counted as errors."""
        kept: list[EngineMetricsText] = []
        lines = 0
        for page in pages[:MAX_REPLICAS_PER_NODE]:
            n = page.text.count("\n") + 1
            if lines + n > MAX_LINES_PER_NODE:
                self.errors += 1
                log.debug("replica %s on %s: its /metrics page is past the node's %d lines; not relayed",
                          page.replica, node, MAX_LINES_PER_NODE)
                continue
            lines += n
            kept.append(page)
        self._pages[node] = (self.clock(), kept)

    def collect(self) -> Iterator[Metric]:
        now = self.clock()
        for node in [n for n, (t, _) in self._pages.items() if now - t > STALE_S]:
            del self._pages[node]
        merged: dict[str, Metric] = {}
        for node, (_, pages) in sorted(self._pages.items()):
            for page in pages:
                try:
                    families = list(text_string_to_metric_families(page.text))[:MAX_FAMILIES]
                except (ValueError, TypeError, IndexError) as e:
                    self.errors += 1
                    log.debug("replica %s on %s: its /metrics page does not parse: %s", page.replica, node, e)
                    continue
                extra = {"replica": page.replica, "model": page.model, "node": node}
                for fam in families:
                    if reserved(fam):
                        continue
                    out = merged.get(fam.name)
                    if out is None:
                        out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                    elif out.type != fam.type:
                        continue  # two engines disagree on a family's type: keep the first's
                    for s in fam.samples:
                        out.add_sample(s.name, {**s.labels, **extra}, s.value, s.timestamp, s.exemplar)
        yield from merged.values()
        errors = CounterMetricFamily("llmgw_engine_metrics_errors", "Relayed engine pages that did not parse")
        errors.add_metric([], self.errors)
        yield errors
