"""Autoscaling end to end: a real control plane (``serve``), a real agent (``run_agent``) and real
llama-server replicas of gemma-3-270m (one slot each: ``-np 1``), driven through the real gateway.

A burst of concurrent streams on one replica raises the wanted count in panic at once; the second
replica starts and serves; once the traffic ends, the newest replica drains and stops. Every
request of the run is answered 200, none cut by the scale-down.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.conftest import Assets
from tests.e2e.test_cluster import Cluster, cluster, gateway_chat_url, gemma_on_node_a, replicas_of  # noqa: F401 - a fixture

pytestmark = pytest.mark.e2e

BODY = {"model": "m", "messages": [{"role": "user", "content": "Count from one to twenty."}], "max_tokens": 48,
        "stream": True}


async def _stream(s: aiohttp.ClientSession, url: str) -> int:
    async with s.post(url, json=BODY) as r:
        body = await r.read()
        if r.status == 200:
            assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
        return r.status


async def test_burst_scales_up_in_panic_then_drains_down_without_a_failed_request(
    cluster: Cluster, assets: Assets  # noqa: F811
) -> None:
    c = cluster
    profile = await gemma_on_node_a(c, assets)
    scaling = {"min": 1, "max": 2, "stable_window_s": 4.0, "panic_window_s": 2.0, "scale_down_after_s": 3.0}
    await c.api("POST", "/api/v1/models", {"name": "m", "source": f"{c.files}/gemma.gguf", "scaling": scaling,
                                           "profiles": [profile]})

    async def ready(n: int) -> bool:
        return len([r for r in await replicas_of(c, "m") if r["state"] == "ready"]) == n

    await c.until("one replica ready", lambda: ready(1), within_s=60)
    view = await c.api("GET", "/api/v1/models/m/autoscale")
    assert (view["target"], view["wanted"]) == (1.0, 1)  # target: the profile's -np 1
    url = gateway_chat_url(c)
    statuses: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        burst = time.monotonic()
        tasks = [asyncio.create_task(_stream(s, url)) for _ in range(3)]

        async def wanted_two() -> bool:
            return (await c.api("GET", "/api/v1/models/m/autoscale"))["wanted"] == 2

        await c.until("two replicas wanted", wanted_two, within_s=10)
        reaction = time.monotonic() - burst
        statuses += await asyncio.gather(*tasks)
        # keep a trickle going while the second replica starts, and after
        while not await ready(2):
            statuses.append(await _stream(s, url))
            assert time.monotonic() - burst < 90, "the second replica is not ready in 90 s"
        started = time.monotonic() - burst
        for _ in range(2):  # both replicas serve
            statuses += await asyncio.gather(_stream(s, url), _stream(s, url))
        idle = time.monotonic()

        async def back_to_one() -> bool:
            reps = await replicas_of(c, "m")
            return len(reps) == 1

        # One request at a time (1 in flight on 2 replicas: the desire is 1), so the scale-down
        # happens under traffic: the drained replica must not cut any of them.
        while not await back_to_one():
            statuses.append(await _stream(s, url))
            assert time.monotonic() - idle < 90, "not back to one replica in 90 s"
        down = time.monotonic() - idle
    view = await c.api("GET", "/api/v1/models/m/autoscale")
    reasons = [d["reason"] for d in view["decisions"]]
    assert reasons[-1].startswith("scaled 1 → 2: "), reasons
    assert reasons[-1].endswith(", panic"), reasons
    assert reasons[0].startswith("scaled 2 → 1: "), reasons
    failed = [x for x in statuses if x != 200]
    print(f"scale_up_reaction_s: {reaction:.2f} second_ready_s: {started:.1f} back_to_one_s: {down:.1f} "
          f"requests: {len(statuses)} failed_requests: {len(failed)}")
    assert failed == []
