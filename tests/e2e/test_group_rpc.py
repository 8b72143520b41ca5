"""A model larger than one node, on real processes: a control plane (serve) and three real agents
(run_agent) on loopback with declared inventories that let gemma-3-270m fit only across two of them;
the group is served by a real ``llama-server --rpc`` on the head over a real ``rpc-server`` on the
worker (isolated in its own network namespace, reached through the agents' mTLS tunnel), answering
through the gateway. Then kill -9 of the worker's rpc-server: the group is replaced and answers
again. A model no set of nodes can hold gets the explanation word for word. The worker's tunnel
refuses a connection without a certificate and one with another node's certificate.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Assets
from tests.helpers.groupworld import World, group_world
from tests.helpers.waits import until

pytestmark = pytest.mark.e2e

GB = 1_000_000_000
# No node can hold 1.0 GB; node-a and node-b together can (0.6 + 0.5); node-c is the smallest.
FREE_GB = {"node-a": 0.6, "node-b": 0.5, "node-c": 0.3}


@pytest.fixture
async def world(tmp_path: Path, assets: Assets) -> AsyncIterator[World]:
    files = tmp_path / "files"
    files.mkdir()
    (files / "gemma.gguf").symlink_to(assets.model)
    async with group_world(tmp_path, files) as w:
        for node, free in FREE_GB.items():
            w.start_agent(node, assets.llama_server, free)
        yield w


async def _group(w: World, model: str) -> dict[str, Any] | None:
    reps = [r for r in await w.api("GET", f"/api/v1/replicas?model={model}") if r["node"]]
    return reps[0] if reps else None


async def test_a_group_over_two_nodes_answers_and_survives_a_workers_death(world: World) -> None:
    w = world
    await until("three nodes", lambda: _count_nodes(w, 3), 30)
    profile = {"name": "rpc", "nodes": 2, "min_memory_gb": 1.0, "cpu_cores": 1, "args": ["--ctx-size", "512"]}
    await w.api("POST", "/api/v1/models", {"name": "gemma", "source": f"{w.files}/gemma.gguf", "profiles": [profile]})

    async def ready() -> dict[str, Any] | None:
        g = await _group(w, "gemma")
        return g if g and g["state"] == "ready" else None

    group = await until("the group is ready", ready, 120)
    members = [(m["node"], m["rank"]) for m in group["members"]]
    assert members == [("node-a", 0), ("node-b", 1)]  # the head has the most free memory
    assert [round(m["memory_gb"], 3) for m in group["members"]] == [0.545, 0.455]  # split by free memory
    status, text = await w.chat("gemma")
    assert status == 200, text
    assert '"content"' in text
    ex = await w.api("GET", "/api/v1/explain-placement?model=gemma")
    assert ex["summary"] == "1/1 replicas placed on node-a (head) + node-b"
    assert group["members"][0]["state"] == "ready"  # the head's entry shows the replica's state

    # The worker's tunnel lets only the head's certificate in.
    endpoint = group["members"][1]["endpoint"]
    host, port = endpoint.rsplit(":", 1)
    assert await _refused(host, int(port), None)
    assert await _refused(host, int(port), w.inst.agent_ctx("node-c"))

    # kill -9 the worker's rpc-server: the group fails and is placed again, and answers again.
    rpc_pid = _rpc_server_pid(w.root / "nodes" / "node-b")
    os.kill(rpc_pid, signal.SIGKILL)

    async def replaced() -> dict[str, Any] | None:
        g = await _group(w, "gemma")
        return g if g and g["id"] != group["id"] and g["state"] == "ready" else None

    again = await until("the group is replaced and ready again", replaced, 180)
    assert again["restarts"] >= 1
    status, text = await w.chat("gemma")
    assert status == 200, text


async def test_the_explanation_when_no_set_of_nodes_fits(world: World) -> None:
    w = world
    await until("three nodes", lambda: _count_nodes(w, 3), 30)
    profile = {"name": "rpc", "nodes": 2, "min_memory_gb": 2.0}
    await w.api("POST", "/api/v1/models", {"name": "big", "source": f"{w.files}/gemma.gguf", "profiles": [profile]})

    async def explained() -> dict[str, Any] | None:
        ex = await w.api("GET", "/api/v1/explain-placement?model=big")
        return ex if ex.get("evaluated_at") else None

    ex = await until("an explanation", explained, 30)
    assert not ex["placed"]
    assert ex["summary"] == (
        "0/3 nodes can run it as a group of 2: 1 of 2 nodes found: the second needs 1.4 GB, "
        "best remaining node has 0.5 GB free"
    )


async def _count_nodes(w: World, n: int) -> bool:
    nodes = await w.api("GET", "/api/v1/nodes")
    return len([x for x in nodes if x["state"] == "ready"]) == n


def _rpc_server_pid(node_root: Path) -> int:
    import psutil  # noqa: PLC0415

    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        cmd = p.info["cmdline"] or []
        if any(str(a).endswith("rpc-server") for a in cmd[:3]) and str(node_root) in (p.info["cwd"] or ""):
            return int(p.info["pid"])
    raise AssertionError(f"no rpc-server of {node_root}")


async def _refused(host: str, port: int, ctx: ssl.SSLContext | None) -> bool:
    """Whether the worker's tunnel closes on us: without a certificate, or with another node's."""
    client = ctx or ssl.create_default_context()
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=client), 10)
    except (ssl.SSLError, ConnectionError, OSError):
        return True
    try:
        writer.write(b"\x00" * 16)
        await writer.drain()
        got = await asyncio.wait_for(reader.read(1), 10)
    except (ssl.SSLError, ConnectionError, OSError):
        got = b""
    finally:
        writer.close()
    return got == b""
