"""deploy/grafana/llmgw.json: valid JSON whose every query names a metric llmgw exports or relays
(the control plane's registry after a request, and a recorded llama-server ``/metrics`` page)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from llmgw.control.api.enginemetrics import EngineMetrics
from llmgw.control.api.metrics import ControlPlaneMetrics
from llmgw.control.gateway.guard import GuardStats
from llmgw.control.gateway.inspect import Exchange
from llmgw.protocol import EngineMetricsText

ROOT = Path(__file__).parents[2]
NAME = re.compile(r"\b(llmgw_[a-z_]+|llamacpp:[a-z_]+)")


def test_every_dashboard_query_names_an_exported_metric() -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "llmgw.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 14
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
    m.track_queues(lambda: {"m": 0})
    m.waited("m", 0.5)
    exported = {line.split("{")[0].split(" ")[0] for line in m.exposition().decode().splitlines()
                if line and not line.startswith("#")}
    exported |= {"llmgw_replicas", "llmgw_model_replicas_wanted", "llmgw_node_up", "llmgw_node_memory_available_bytes",
                 "llmgw_node_memory_total_bytes", "llmgw_leader", "llmgw_term"}  # from the store and membership:
    # test_metrics.py reads them on a served control plane
    missing = {n for e in exprs for n in NAME.findall(e)} - exported
    assert not missing, f"the dashboard asks for metrics nobody exports: {sorted(missing)}"


def test_the_data_source_picked_at_import_is_the_one_the_panels_use() -> None:
    """Grafana's import asks for the ``__inputs`` data source and puts it where ``${DS_PROMETHEUS}``
    stands: the ``datasource`` variable's default, which every panel reads. Nothing named it, so
    the choice at import was ignored for the default Prometheus (a new user's report)."""
    dash = json.loads((ROOT / "deploy" / "grafana" / "llmgw.json").read_text())
    [wanted] = [i["name"] for i in dash["__inputs"] if i["type"] == "datasource"]
    [var] = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert var["current"]["value"] == f"${{{wanted}}}"
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]}
    assert uids == {f"${{{var['name']}}}"}
