"""A manual scale-down drains: ``llmgw ctl model scale m 1`` on a model of two replicas (not
autoscaled) while a stream is in flight on the newest. The newest replica is routed no more at once, its
stream still ends with ``data: [DONE]``, and it stops only after that.

Real processes throughout: a control plane (``serve``), an agent (``run_agent``), two llama-server
replicas of gemma-3-270m (one slot each, ``routing: round-robin`` so that the two streams go one to
each), the real gateway, and ``llmgw ctl`` as a child process. The answers are long by
construction: ``logit_bias`` bans gemma's end tokens (1 ``<eos>``, 106 ``<end_of_turn>``), so each
stream runs to its ``max_tokens``; the one on the oldest replica is only there so that the other
lands on the newest, and is left after its first token.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.conftest import Assets
from tests.e2e.test_cluster import Cluster, cluster, gateway_chat_url, gemma_on_node_a, replicas_of  # noqa: F401 - a fixture
from tests.helpers.control import TOKEN

pytestmark = pytest.mark.e2e

#: Tokens of each stream: the newest replica's must outlast ``ctl``'s start and the leader's drain
#: (a second or two, more on a loaded machine). At 160 (~6-9 s of decoding) CI's run on a slow machine
#: (2026-12-06) saw it end 10 ms before the test saw the drain: 240.
MAX_TOKENS = 240


def _body(n: int) -> dict[str, object]:
    return {"model": "m", "stream": True, "max_tokens": MAX_TOKENS, "logit_bias": {"1": -100, "106": -100},
            "messages": [{"role": "user", "content": f"Count from {n} to 900, one number per line."}]}


async def test_ctl_model_scale_down_drains_a_replica_with_a_stream_in_flight(
    cluster: Cluster, assets: Assets  # noqa: F811
) -> None:
    c = cluster
    profile = await gemma_on_node_a(c, assets)
    await c.api("POST", "/api/v1/models", {"name": "m", "source": f"{c.files}/gemma.gguf", "routing": "round-robin",
                                           "scaling": {"min": 2, "max": 2}, "profiles": [profile]})

    async def two_ready() -> bool:
        return len([r for r in await replicas_of(c, "m") if r["state"] == "ready"]) == 2

    await c.until("two replicas ready", two_ready, within_s=90)
    reps = sorted(await replicas_of(c, "m"), key=lambda r: (r["created_at"], r["id"]))
    oldest, newest = reps[0]["id"], reps[1]["id"]
    url = gateway_chat_url(c)
    seen: list[tuple[float, dict[str, float | None]]] = []  # (monotonic, {replica id: draining_since})
    ended: dict[str, float] = {}
    ended_at: dict[str, float] = {}  # unix seconds, to compare with the store's draining_since

    async def watch(stop: asyncio.Event) -> None:
        while not stop.is_set():
            seen.append((time.monotonic(), {r["id"]: r["draining_since"] for r in await replicas_of(c, "m")}))
            await asyncio.sleep(0.1)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as s:
        first_chunk = {k: asyncio.Event() for k in (0, 1)}

        async def stream(n: int) -> tuple[int, str, bytes]:
            async with s.post(url, json=_body(n)) as r:
                replica, body = r.headers.get("x-llmgw-replica", ""), b""
                async for chunk in r.content.iter_any():
                    body += chunk
                    if b'"content"' in body:
                        first_chunk[n].set()
                        if replica == oldest:  # it only keeps the other stream off the oldest: left at once
                            break  # (the engine stops within a second: 5 CPU-s of tokens nobody reads)
                ended[replica], ended_at[replica] = time.monotonic(), time.time()
                return r.status, replica, body

        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        streams = [asyncio.create_task(stream(n)) for n in (0, 1)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_chunk.values())), 120)
        # ctl as an operator runs it, while both streams are in flight
        ctl = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "llmgw", "ctl", "model", "scale", "m", "1", "--server", c.admin, "--token", TOKEN],
            capture_output=True, text=True, env={**os.environ, "LLMGW_ROOT": str(c.root)}, timeout=60,
        )
        assert ctl.returncode == 0, ctl.stdout + ctl.stderr
        assert ctl.stdout.strip() == "m: scaling 1..1"

        async def draining() -> bool:
            return any(r["id"] == newest and r["draining_since"] for r in await replicas_of(c, "m"))

        await c.until("the newest replica draining", draining, within_s=20)
        drain_seen = time.monotonic()
        # routed no more: a request now goes to the oldest
        async with s.post(url, json={**_body(5), "max_tokens": 4}) as r:
            assert r.status == 200
            assert r.headers["x-llmgw-replica"] == oldest
            await r.read()
        results = await asyncio.gather(*streams)

        async def one_left() -> bool:
            return [r["id"] for r in await replicas_of(c, "m")] == [oldest]

        await c.until("the drained replica stopped", one_left, within_s=60)
        gone_seen = time.monotonic()
        stop.set()
        await watcher
    assert sorted(rep for _, rep, _ in results) == sorted([oldest, newest])
    for status, rep, body in results:
        assert status == 200, (rep, body[-300:])
        assert b'"error"' not in body, (rep, body[-300:])
        if rep == newest:  # the drained replica's stream ran to its end
            assert body.rstrip().endswith(b"data: [DONE]"), (rep, body[-300:])
    # the drain began while the newest replica's stream was still in flight (the leader's own time of
    # it, not when the test's poll first saw it), and the replica was listed (draining) until that
    # stream had ended
    since = next((ids[newest] for _t, ids in seen if ids.get(newest) is not None), None)
    assert since is not None, "no sample of the newest replica draining"
    assert since < ended_at[newest], (f"the stream ended {since - ended_at[newest]:.2f} s before the drain "
                                      "began: make the answers longer")
    # the watcher's first sample without it, or (when its last sample came before the stop) the poll's
    gone_at = min([t for t, ids in seen if newest not in ids] or [gone_seen])
    assert gone_at > ended[newest]
    assert all(ids[newest] is not None for t, ids in seen if drain_seen <= t < ended[newest] and newest in ids)


async def test_a_new_version_drains_the_old_replica_under_its_stream(cluster: Cluster, assets: Assets) -> None:  # noqa: F811
    """Rolling a model to new weights (``PATCH`` of its ``source`` and ``version``, what ``ctl model
    set m source=… version=2`` sends) while a stream is in flight: the old replica drains (the leader
    routes it no more; its agent keeps its engine although the spec now names version 2) and its
    stream ends with ``data: [DONE]``; a replica of version 2 is placed beside it and serves. Before,
    the agent restarted the engine in place and the stream ended ``upstream_failed`` 2 s after the
    change (an operator's finding)."""
    c = cluster
    profile = await gemma_on_node_a(c, assets)
    (c.root / "files" / "gemma-2.gguf").symlink_to(assets.model)
    await c.api("POST", "/api/v1/models", {"name": "m", "source": f"{c.files}/gemma.gguf", "version": "1",
                                           "scaling": {"min": 1, "max": 1}, "profiles": [profile]})

    async def ready_ids() -> list[str]:
        return [r["id"] for r in await replicas_of(c, "m") if r["state"] == "ready" and not r["draining_since"]]

    await c.until("a replica ready", ready_ids, within_s=90)
    (old,) = await ready_ids()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as s:
        first = asyncio.Event()

        async def stream() -> tuple[int, str, bytes]:
            async with s.post(gateway_chat_url(c), json=_body(0)) as r:
                body = b""
                async for chunk in r.content.iter_any():
                    body += chunk
                    if b'"content"' in body:
                        first.set()
                return r.status, r.headers.get("x-llmgw-replica", ""), body

        running = asyncio.create_task(stream())
        await asyncio.wait_for(first.wait(), 120)
        await c.api("PATCH", "/api/v1/models/m", {"source": f"{c.files}/gemma-2.gguf", "version": "2"})

        async def old_draining() -> bool:
            return any(r["id"] == old and r["draining_since"] for r in await replicas_of(c, "m"))

        await c.until("the old replica draining", old_draining, within_s=20)
        assert not running.done(), "the stream ended before the change: make the answer longer"
        status, replica, body = await running
        assert (status, replica) == (200, old)
        assert body.rstrip().endswith(b"data: [DONE]"), body[-300:]
        assert b'"error"' not in body, body[-300:]

        async def new_only() -> bool:
            reps = await replicas_of(c, "m")
            return len(reps) == 1 and reps[0]["id"] != old and reps[0]["state"] == "ready"

        await c.until("the old replica gone and version 2 ready", new_only, within_s=90)
        async with s.post(gateway_chat_url(c), json={**_body(1), "max_tokens": 4}) as r:
            assert r.status == 200
            assert r.headers["x-llmgw-replica"] != old
            await r.read()
