"""The metric names llmgw exports or relays, for checking what deploy/ asks of them (the Grafana
dashboard, the Prometheus alert rules)."""

from __future__ import annotations

import re
from pathlib import Path

from llmgw.control.api.enginemetrics import EngineMetrics
from llmgw.control.api.metrics import ControlPlaneMetrics
from llmgw.control.gateway.guard import GuardStats
from llmgw.control.gateway.inspect import Exchange
from llmgw.protocol import EngineMetricsText

ROOT = Path(__file__).parents[2]
#: A metric name in a PromQL expression: llmgw's own, or llama-server's as the control plane relays it.
NAME = re.compile(r"\b(llmgw_[a-z_]+|llamacpp:[a-z_]+)")
#: Read from the store and the election on a served control plane (tests/unit/test_metrics.py reads
#: them there), not from a registry made here.
FROM_THE_STORE = {"llmgw_replicas", "llmgw_model_replicas_wanted", "llmgw_node_up", "llmgw_node_memory_available_bytes",
                  "llmgw_node_memory_total_bytes", "llmgw_store_up", "llmgw_leader", "llmgw_term"}


def exported() -> set[str]:
    """Every series name a control plane's ``/metrics`` can show: its registry after a judged, a
    refused and an answered request and a queue wait, a recorded llama-server ``/metrics`` page
    relayed, and :data:`FROM_THE_STORE`."""
    stats = GuardStats()
    stats.verdicts["in safe"] = 1
    stats.errors["timeout"] = 1
    engines = EngineMetrics()
    page = (ROOT / "tests" / "data" / "llama-server-metrics.txt").read_text()
    engines.put("n", [EngineMetricsText(replica="r", model="m", text=page)])
    m = ControlPlaneMetrics(guard=stats, engines=engines)
    assert stats.on_judgment is not None
    stats.on_judgment("judge", 12.0)
    m.observe(Exchange("m", "m", "r", 429, True, 0.1, 1.0, {"prompt_tokens": 1, "completion_tokens": 1},
                       key="k", code="rate_limit_exceeded", blocked=True, ttft_ms=1.0))
    m.observe(Exchange("m", "m", "r", 200, True, 0.1, 1.0, key="k", ttft_ms=1.0))
    m.observe(Exchange("m", "m", "r", 200, True, 0.1, 1.0, key="k", ttft_ms=1.0, code="upstream_failed"))
    m.track_queues(lambda: {"m": 0})
    m.waited("m", 0.5)
    names = {line.split("{")[0].split(" ")[0] for line in m.exposition().decode().splitlines()
             if line and not line.startswith("#")}
    return names | FROM_THE_STORE
