"""The engine metrics relay end to end: a real llama-server (gemma-3-270m, ``--metrics``, an API key)
read by the agent's :func:`~llmgw.agent.loop.metrics.read_pages` and posted by
:func:`~llmgw.agent.loop.metrics.push_loop` over real mTLS to a real control plane (``serve`` in-process),
whose ``GET /metrics`` then shows llama-server's counters labelled with replica, model and node."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.agent.engines.llamacpp import FIT_OFF
from llmgw.agent.loop.metrics import push_loop, read_pages
from llmgw.protocol import ReplicaState, ReplicaStatus
from tests.conftest import Assets
from tests.helpers.control import make_install, serving
from tests.helpers.net import free_port
from tests.helpers.processes import stop_process

pytestmark = pytest.mark.e2e

KEY = "replica-key-e2e"


@pytest.fixture(scope="module")
def engine(assets: Assets) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(assets.llama_server), "-m", str(assets.model), "--host", "127.0.0.1", "--port", str(port), *FIT_OFF,
         "--api-key", KEY, "--metrics", "-c", "512", "--threads", "1", "-np", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 200, r.text
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(proc)


async def test_llama_server_metrics_reach_the_control_planes_page(engine: str, tmp_path: Path) -> None:
    ready = ReplicaStatus(id="r-e2e", state=ReplicaState.READY, endpoint=engine)
    starting = ReplicaStatus(id="r-other", state=ReplicaState.STARTING, endpoint=engine)
    async with aiohttp.ClientSession() as plain:
        pages = await read_pages(plain, [(ready, "gemma", KEY), (starting, "gemma", KEY)])
        assert [p.replica for p in pages] == ["r-e2e"]
        assert "llamacpp:tokens_predicted_total 5" in pages[0].text
        assert await read_pages(plain, [(ready, "gemma", "wrong-key")]) == []  # llama-server: 401
    inst = make_install(tmp_path)
    async with serving(inst):
        connector = aiohttp.TCPConnector(ssl=inst.agent_ctx("node-7"))
        async with aiohttp.ClientSession() as plain, aiohttp.ClientSession(connector=connector) as api:
            stop = asyncio.Event()
            task = asyncio.create_task(
                push_loop(plain, api, lambda: [(ready, "gemma", KEY)], lambda: inst.agent_url, stop, every_s=0.2)
            )
            try:
                for _ in range(50):
                    await asyncio.sleep(0.2)
                    async with plain.get(inst.admin + "/metrics") as r:
                        text = await r.text()
                    if "llamacpp:tokens_predicted_total" in text:
                        break
            finally:
                stop.set()
                await task
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text) for s in fam.samples
    }
    labels = (("model", "gemma"), ("node", "node-7"), ("replica", "r-e2e"))
    assert samples[("llamacpp:tokens_predicted_total", labels)] == 5
    assert ("llamacpp:requests_processing", labels) in samples
