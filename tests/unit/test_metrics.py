"""``GET /metrics`` of a real control plane (``serve`` in-process, SQLite) after real gateway requests,
and engine pages relayed through the agent API (mTLS). The engine is a stand-in for the gateway part;
the relayed page is a real llama-server's ``/metrics`` (b1-0c1e570 with ``--metrics``, recorded in
tests/data; the e2e test reads a live one)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

import llmgw
from llmgw.control.api.enginemetrics import EngineMetrics
from llmgw.control.api.metrics import ControlPlaneMetrics
from llmgw.control.gateway.guard import GuardStats
from llmgw.control.gateway.inspect import Exchange
from llmgw.protocol import EngineMetricsText
from tests.helpers.control import TOKEN, make_install, serving
from tests.unit.test_keys_cluster import _chat, _ready_model, fake_engine  # noqa: F401 - a fixture

PAGE = (Path(__file__).parents[1] / "data" / "llama-server-metrics.txt").read_text()
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_observe_counts_by_label_values_from_the_catalog_only() -> None:
    m = ControlPlaneMetrics()
    usage = {"prompt_tokens": 5, "completion_tokens": 4}
    m.observe(Exchange("g", "gemma", "r-1", 200, True, 0.3, 120.0, usage, key="alice", ttft_ms=40.0))
    m.observe(Exchange("whatever-the-client-typed", "", "", 404, False, 0.1, 0.0, key="alice",
                       code="model_not_found"))
    m.observe(Exchange("g", "gemma", "", 429, False, 0.1, 0.0, key="alice", code="rate_limit_exceeded"))
    m.observe(Exchange("g", "gemma", "", 400, False, 0.1, 0.0, key="bob", code="content_blocked", blocked=True))
    got = _samples(m.exposition().decode())
    assert got[("llmgw_gateway_requests_total", frozenset(
        {"model": "gemma", "key": "alice", "kind": "chat", "status": "200"}.items()))] == 1
    assert got[("llmgw_gateway_requests_total", frozenset(
        {"model": "unknown", "key": "alice", "kind": "chat", "status": "404"}.items()))] == 1
    assert got[("llmgw_gateway_tokens_total", frozenset(
        {"model": "gemma", "key": "alice", "direction": "completion"}.items()))] == 4
    assert got[("llmgw_gateway_rate_limited_total", frozenset(
        {"key": "alice", "code": "rate_limit_exceeded"}.items()))] == 1
    assert got[("llmgw_gateway_guard_blocks_total", frozenset({"model": "gemma"}.items()))] == 1
    assert got[("llmgw_gateway_ttft_seconds_count", frozenset({"model": "gemma"}.items()))] == 1
    assert "whatever-the-client-typed" not in m.exposition().decode()
    # timed only when a replica answered: the 429 and the 400 of gemma, refused before one, would
    # have read as 0 s answers (and the 404 as a "model=unknown" series)
    assert got[("llmgw_gateway_request_seconds_count", frozenset({"model": "gemma", "kind": "chat"}.items()))] == 1
    assert ("llmgw_gateway_request_seconds_count", frozenset({"model": "unknown", "kind": "chat"}.items())) not in got


def test_engine_pages_merge_into_one_family_per_name() -> None:
    clock = [0.0]
    engines = EngineMetrics(clock=lambda: clock[0])
    engines.put("node-1", [EngineMetricsText(replica="r-1", model="gemma", text=PAGE),
                           EngineMetricsText(replica="r-2", model="qwen", text=PAGE.replace(" 4\n", " 7\n"))])
    engines.put("node-2", [EngineMetricsText(replica="r-3", model="gemma", text="not a # metrics { page")])
    m = ControlPlaneMetrics(engines=engines)
    text = m.exposition().decode()
    assert text.count("# TYPE llamacpp:tokens_predicted_total counter") == 1
    got = _samples(text)
    key = ("llamacpp:tokens_predicted_total", frozenset({"replica": "r-2", "model": "qwen", "node": "node-1"}.items()))
    assert got[key] == 7
    assert got[("llmgw_engine_metrics_errors_total", frozenset())] == 1
    clock[0] = 61.0  # no post for a minute: the node's pages go
    assert "llamacpp" not in m.exposition().decode()


def test_a_node_cannot_relay_the_control_planes_own_families() -> None:
    """A compromised node's page naming llmgw's own families (``llmgw_leader 1``, a ready replica
    count for any model, ``process_*``) is not relayed: its series kept the alert rules (no leader,
    a model serving nothing) from firing, and duplicated their HELP/TYPE lines. Its engine's own
    families still are."""
    engines = EngineMetrics()
    lie = ("# TYPE llmgw_leader gauge\nllmgw_leader 1\n"
           "# TYPE llmgw_replicas gauge\nllmgw_replicas{state=\"ready\"} 5\n"
           "# TYPE process_cpu_seconds counter\nprocess_cpu_seconds_total 5\n"
           "# TYPE llamacpp:x gauge\nllmgw_store_up 1\n")
    engines.put("evil", [EngineMetricsText(replica="r-1", model="gemma", text=lie + PAGE)])
    text = ControlPlaneMetrics(engines=engines).exposition().decode()
    assert "llmgw_leader" not in text  # no store here: nothing but the lie could have shown one
    assert text.count("# TYPE process_cpu_seconds_total counter") == 1
    got = _samples(text)
    assert not [k for k in got if dict(k[1]).get("node") == "evil" and not k[0].startswith("llamacpp:")]
    assert got[("llamacpp:tokens_predicted_total", frozenset(
        {"replica": "r-1", "model": "gemma", "node": "evil"}.items()))] == 4


def test_a_nodes_pages_are_bounded_in_lines() -> None:
    """A node posting 1 MiB of one-sample lines made every scrape parse and render them all on the
    event loop (0.5 s here, a heartbeat waiting 0.45 s); past MAX_LINES_PER_NODE (10,000) a page is
    dropped and counted, and the pages within it are still relayed."""
    flood = "# TYPE a gauge\n" + "".join(f'a{{l="{i}"}} 1\n' for i in range(3500))  # 3,502 lines
    engines = EngineMetrics()
    engines.put("evil", [EngineMetricsText(replica="r-0", model="m", text=PAGE)]  # 46 lines
                + [EngineMetricsText(replica=f"r-{j}", model="m", text=flood) for j in range(1, 17)])
    text = ControlPlaneMetrics(engines=engines).exposition().decode()
    assert text.count("\n") < 11_000
    got = _samples(text)
    r0 = frozenset({"replica": "r-0", "model": "m", "node": "evil"}.items())
    assert got[("llamacpp:tokens_predicted_total", r0)] == 4
    assert got[("llmgw_engine_metrics_errors_total", frozenset())] == 14  # two flood pages fit


async def test_metrics_page_of_a_served_control_plane(tmp_path: Path, fake_engine: str) -> None:  # noqa: F811
    inst = make_install(tmp_path)
    async with serving(inst), aiohttp.ClientSession() as s:
        await _ready_model(s, inst, fake_engine)
        async with s.post(inst.admin + "/api/v1/keys", json={"name": "team", "rpm": 1}, headers=AUTH) as r:
            secret = (await r.json())["secret"]
        for _ in range(50):  # the key reaches the gateway at the next sync (0.5 s)
            if await _chat(s, inst, secret) == 200:
                break
            await asyncio.sleep(0.1)
        assert await _chat(s, inst, secret) == 429
        ctx = inst.agent_ctx("node-1")
        body = [{"replica": "r-x", "model": "chat", "text": PAGE}]
        async with s.post(inst.agent_url + "/agent/v1/metrics", json=body, ssl=ctx) as r:
            assert r.status == 200, await r.text()
        async with s.get(inst.admin + "/metrics") as r:  # loopback: no token needed
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain; version=")
            text = await r.text()
    got = _samples(text)
    assert got[("llmgw_gateway_requests_total", frozenset(
        {"model": "chat", "key": "team", "kind": "chat", "status": "200"}.items()))] >= 1
    assert got[("llmgw_gateway_rate_limited_total", frozenset(
        {"key": "team", "code": "rate_limit_exceeded"}.items()))] == 1
    assert got[("llmgw_replicas", frozenset({"model": "chat", "state": "ready"}.items()))] == 1
    # every state from 0 (a vanished series cannot be compared), and what the model wants
    assert got[("llmgw_replicas", frozenset({"model": "chat", "state": "failed"}.items()))] == 0
    assert got[("llmgw_model_replicas_wanted", frozenset({"model": "chat"}.items()))] == 1
    assert got[("llmgw_node_cores", frozenset({"node": "node-1"}.items()))] == 4
    assert got[("llmgw_leader", frozenset())] == 1
    assert got[("llmgw_store_up", frozenset())] == 1
    # the process itself, as operators watch any service (issue 23's cp_rss_mib, from the page)
    assert got[("process_resident_memory_bytes", frozenset())] > 10_000_000
    assert got[("llmgw_build_info", frozenset({"version": llmgw.__version__}.items()))] == 1
    assert got[("llamacpp:tokens_predicted_total", frozenset(
        {"replica": "r-x", "model": "chat", "node": "node-1"}.items()))] == 4


def test_guard_counters_start_at_zero_for_every_direction_and_verdict() -> None:
    """``rate()``/``increase()`` need a series' 0 before its first event: without it the first
    block after a start read as nothing (a new user measured increase() 3.45 for 4 verdicts)."""
    stats = GuardStats()
    got = _samples(ControlPlaneMetrics(guard=stats).exposition().decode())
    for direction in ("in", "out"):
        for verdict in ("safe", "unsafe", "controversial"):
            key = ("llmgw_guard_verdicts_total", frozenset({"direction": direction, "verdict": verdict}.items()))
            assert got[key] == 0
        assert got[("llmgw_guard_unjudged_total", frozenset({"direction": direction}.items()))] == 0
    stats.verdicts["in unsafe"] = 2
    got = _samples(ControlPlaneMetrics(guard=stats).exposition().decode())
    assert got[("llmgw_guard_verdicts_total", frozenset({"direction": "in", "verdict": "unsafe"}.items()))] == 2
