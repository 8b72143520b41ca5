"""The gateway queue's and the balancer's metrics (:mod:`llmgw.control.api.metrics`): their values in
the registry's exposition, label values from the catalog and a fixed reason set only, and their
families on the ``/metrics`` page of a real control plane (``serve`` in a thread, SQLite)."""

from __future__ import annotations

import pathlib

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.control.api.metrics import ROUTING_REASONS, ControlPlaneMetrics
from tests.helpers.control import make_install
from tests.unit.test_ctl_model_rm import ThreadedControlPlane

FAMILIES = ("llmgw_gateway_queue_length", "llmgw_gateway_queue_wait_seconds", "llmgw_gateway_routing_decisions")


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_queue_length_wait_and_routing_decisions_are_exported() -> None:
    m = ControlPlaneMetrics()
    queues = {"gemma": 3, "qwen": 0}
    m.track_queues(lambda: queues)
    m.waited("gemma", 0.0)
    m.waited("gemma", 0.8)
    for reason in ("affinity", "affinity", "overflow", "busy"):
        m.routed("gemma", reason)
    got = _samples(m.exposition().decode())
    assert got[("llmgw_gateway_queue_length", frozenset({"model": "gemma"}.items()))] == 3
    assert got[("llmgw_gateway_queue_length", frozenset({"model": "qwen"}.items()))] == 0
    assert got[("llmgw_gateway_queue_wait_seconds_count", frozenset({"model": "gemma"}.items()))] == 2
    assert got[("llmgw_gateway_queue_wait_seconds_sum", frozenset({"model": "gemma"}.items()))] == pytest.approx(0.8)
    assert got[("llmgw_gateway_queue_wait_seconds_bucket", frozenset({"model": "gemma", "le": "0.5"}.items()))] == 1
    assert got[("llmgw_gateway_routing_decisions_total",
                frozenset({"model": "gemma", "reason": "affinity"}.items()))] == 2
    assert got[("llmgw_gateway_routing_decisions_total",
                frozenset({"model": "gemma", "reason": "busy"}.items()))] == 1
    queues["gemma"] = 0  # read at scrape time
    assert _samples(m.exposition().decode())[
        ("llmgw_gateway_queue_length", frozenset({"model": "gemma"}.items()))] == 0


def test_a_reason_outside_the_fixed_set_is_refused() -> None:
    m = ControlPlaneMetrics()
    with pytest.raises(ValueError, match="routing reason 'whatever' is not one of affinity, least_load"):
        m.routed("gemma", "whatever")
    assert "whatever" not in m.exposition().decode()
    assert set(ROUTING_REASONS) == {"affinity", "least_load", "overflow", "round_robin", "queued", "busy"}


def test_the_families_are_on_a_served_control_planes_metrics_page(tmp_path: pathlib.Path) -> None:
    inst = make_install(tmp_path)
    with ThreadedControlPlane(inst):
        r = httpx.get(inst.admin + "/metrics")  # loopback: no token
    assert r.status_code == 200, r.text
    types = {fam.name: fam.type for fam in text_string_to_metric_families(r.text)}
    assert [types.get(name) for name in FAMILIES] == ["gauge", "histogram", "counter"]
