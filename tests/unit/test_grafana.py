"""deploy/grafana/llmgw.json: valid JSON whose every query names a metric llmgw exports or relays
(the control plane's registry after a request, and a recorded llama-server ``/metrics`` page)."""

from __future__ import annotations

import json

from tests.helpers.metricnames import NAME, ROOT, exported


def test_every_dashboard_query_names_an_exported_metric() -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "llmgw.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 14
    missing = {n for e in exprs for n in NAME.findall(e)} - exported()
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
