"""Many nodes on loopback: a real control plane (serve) and real agents (run_agent), each node under
its own LLMGW_ROOT with its own certificate and a declared inventory (agent.yaml
discovery.inventory_file): three CPU nodes and two GPU nodes with two declared H100s each.

In the five-node test the engine is a stand-in script (``--version`` answers; otherwise it sleeps
like a loading llama-server), so placement and GPU assignment run on real agents without a model:
a replica stays ``starting``, which is all those checks need. The lost-node test runs the real
llama-server with gemma-3-270m, because an engine that outlives its agent must be adopted by the
next one (pid, start time and command line match) before it can be stopped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import yaml

from llmgw import tlsconf
from llmgw.agent.loop.loop import run_agent
from llmgw.agent.node.records import load_records, stop_all_engines
from llmgw.config import AgentConfig
from llmgw.paths import Paths
from llmgw.protocol import Heartbeat, Inventory
from tests.conftest import Assets
from tests.helpers.control import FAKE_ENGINE, TOKEN, make_install, serving
from tests.helpers.net import serve_files
from tests.helpers.waits import until

pytestmark = pytest.mark.e2e

GB = 1_000_000_000


def gpu(index: int) -> dict[str, Any]:
    return {"index": index, "name": "NVIDIA H100 80GB HBM3", "klass": "h100-80gb", "memory_total_bytes": 80 * GB}


@dataclass
class Cluster:
    root: Path
    ca: tlsconf.CA
    admin: str
    agent_url: str
    files: str
    engine: Path
    agents: dict[str, tuple[asyncio.Event, asyncio.Task[None]]] = field(default_factory=dict)

    def node_root(self, node: str) -> Path:
        return self.root / "nodes" / node

    def config(self, node: str, inventory: dict[str, Any], engine: Path | None = None) -> AgentConfig:
        root = self.node_root(node)
        root.mkdir(parents=True, exist_ok=True)
        cert, key = self.ca.issue_client(node).write(root / "etc", "agent")
        inv = root / "inventory.yaml"
        inv.write_text(yaml.safe_dump(inventory))
        return AgentConfig.model_validate(
            {
                "server": self.agent_url,
                "node_id": node,
                "tls": {"ca": Paths(self.root).pki / "ca.pem", "cert": cert, "key": key},
                "discovery": {"inventory_file": str(inv)},
                "engines": {"llamacpp": {"binary": str(engine or self.engine)}},
                "heartbeat_interval_s": 0.2,
            }
        )

    def start(self, node: str, cfg: AgentConfig) -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_agent(cfg, Paths(self.node_root(node)), stop=stop))
        self.agents[node] = (stop, task)

    async def stop(self, node: str) -> None:
        stop, task = self.agents.pop(node)
        stop.set()
        await asyncio.wait_for(task, 15)

    async def api(self, method: str, path: str, body: Any = None) -> Any:
        async with (
            aiohttp.ClientSession() as s,
            s.request(method, self.admin + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as r,
        ):
            assert r.status < 300, await r.text()
            return await r.json() if r.content_length != 0 else None

    async def until(self, what: str, pred: Callable[[], Any], within_s: float = 20) -> Any:
        """:func:`tests.helpers.waits.until`."""
        return await until(what, pred, within_s)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    inst = make_install(tmp_path, node_lost_after_s=1.5)
    engine = tmp_path / "llama-server"
    engine.write_text(FAKE_ENGINE)
    engine.chmod(engine.stat().st_mode | stat.S_IXUSR)
    files_dir = tmp_path / "files"
    files_dir.mkdir()
    for name in ("big.gguf", "huge.gguf"):
        (files_dir / name).write_bytes(b"GGUF" + b"\0" * 1000)
    files_runner, files_url = await serve_files(files_dir)
    try:
        async with serving(inst):
            c = Cluster(tmp_path, inst.ca, inst.admin, inst.agent_url, files_url, engine)
            try:
                yield c
            finally:
                for node in list(c.agents):
                    await c.stop(node)
                for node_dir in (tmp_path / "nodes").glob("*"):
                    stop_all_engines(Paths(node_dir).agent_state, grace_s=2)
    finally:
        await files_runner.cleanup()


def cpu_inventory(avail_gb: float = 8) -> dict[str, Any]:
    return {"cores": 4, "memory_total_bytes": 8 * GB, "memory_available_bytes": int(avail_gb * GB)}


def gpu_inventory() -> dict[str, Any]:
    return {"cores": 16, "memory_total_bytes": 64 * GB, "memory_available_bytes": 64 * GB, "gpus": [gpu(0), gpu(1)]}


async def replicas_of(c: Cluster, model: str) -> list[dict[str, Any]]:
    return [r for r in await c.api("GET", f"/api/v1/replicas?model={model}") if r["node"]]


async def gemma_on_node_a(c: Cluster, assets: Assets) -> dict[str, Any]:
    """gemma-3-270m in the cluster's file server (``{c.files}/gemma.gguf``) and ``node-a``, a CPU node
    whose agent runs the real llama-server, ready; returns a one-core ``cpu`` profile for a model of it
    (``--ctx-size 512 -np 1``)."""
    (c.root / "files" / "gemma.gguf").symlink_to(assets.model)
    c.start("node-a", c.config("node-a", cpu_inventory(), engine=assets.llama_server))
    await c.until("node-a ready", lambda: c.api("GET", "/api/v1/nodes"))
    return {"name": "cpu", "min_memory_gb": 1, "cpu_cores": 1, "args": ["--ctx-size", "512", "-np", "1"]}


def gateway_chat_url(c: Cluster) -> str:
    """The control plane's gateway ``/v1/chat/completions`` URL, from its server.yaml."""
    listen = yaml.safe_load((c.root / "etc" / "llmgw" / "server.yaml").read_text())["gateway"]["listen"]
    return f"http://{listen}/v1/chat/completions"


async def test_five_nodes_spread_gpus_exclusive_cpu_fallback_outside_memory_and_explanations(cluster: Cluster) -> None:
    c = cluster
    for i in (1, 2):
        c.start(f"cpu-{i}", c.config(f"cpu-{i}", cpu_inventory()))
    c.start("cpu-3", c.config("cpu-3", cpu_inventory(avail_gb=1)))  # another program holds 7 GB
    for i in (1, 2):
        c.start(f"gpu-{i}", c.config(f"gpu-{i}", gpu_inventory()))

    async def five_ready() -> bool:
        return len([n for n in await c.api("GET", "/api/v1/nodes") if n["state"] == "ready"]) == 5

    await c.until("five nodes ready", five_ready)
    await c.api(
        "POST",
        "/api/v1/models",
        {
            "name": "big",
            "source": f"{c.files}/big.gguf",
            "scaling": {"min": 6, "max": 6},
            "profiles": [
                {"name": "gpu", "gpu_class": "h100-80gb", "priority": 200, "min_memory_gb": 40},
                {"name": "cpu", "priority": 100, "min_memory_gb": 2, "cpu_cores": 2},
            ],
        },
    )

    async def six() -> list[dict[str, Any]]:
        reps = await replicas_of(c, "big")
        return reps if len(reps) == 6 else []

    reps = await c.until("six replicas placed", six)
    on_gpu = sorted((r["node"], tuple(r["gpu_indexes"])) for r in reps if r["profile"] == "gpu")
    assert on_gpu == [("gpu-1", (0,)), ("gpu-1", (1,)), ("gpu-2", (0,)), ("gpu-2", (1,))]
    # GPU nodes full: the CPU profile on CPU nodes, spread, never onto cpu-3 (memory used outside llmgw)
    assert sorted(r["node"] for r in reps if r["profile"] == "cpu") == ["cpu-1", "cpu-2"]

    async def gpu_replica_reported() -> bool:
        return any(r["state"] != "pending" for r in await replicas_of(c, "big"))

    await c.until("agents report their replicas", gpu_replica_reported)

    await c.api(
        "POST",
        "/api/v1/models",
        {"name": "huge", "source": f"{c.files}/huge.gguf", "profiles": [{"name": "cpu", "min_memory_gb": 100}]},
    )

    async def explained() -> Any:
        ex = await c.api("GET", "/api/v1/explain-placement?model=huge")
        return ex if ex.get("evaluated_at") else None

    ex = await c.until("huge explained", explained)
    assert ex["placed"] is False
    # 100 GB on nodes of 8 and 64: too small, whatever is freed there
    assert ex["summary"] == "0/5 nodes can run it: 5 nodes with too little memory"
    assert [(r["node"], r["code"], r["reason"]) for r in ex["rejections"]] == [
        (n, "memory_too_small", f"needs 100.0 GB memory, the node has {gb} GB in all: too small")
        for n, gb in (("cpu-1", "8.0"), ("cpu-2", "8.0"), ("cpu-3", "8.0"), ("gpu-1", "64.0"), ("gpu-2", "64.0"))
    ]
    assert ex["would_fit_if"] == [  # once for the five nodes, not a line each
        "cpu-1, cpu-2, cpu-3 and 2 more are too small (8.0 to 64.0 GB memory, needs 100.0): "
        "add a node with at least 100.0 GB"
    ]
    assert not any(line.startswith("free") for line in ex["would_fit_if"])
    pending = [r for r in await c.api("GET", "/api/v1/replicas?model=huge") if r["state"] == "pending"]
    assert [(r["id"], r["pending_reason"]) for r in pending] == [
        ("huge#pending-1", "0/5 nodes can run it: 5 nodes with too little memory")
    ]


async def test_lost_node_replica_moves_engine_stopped_on_return_profile_change_and_duplicate_id(
    cluster: Cluster, assets: Assets
) -> None:
    c = cluster
    real = assets.llama_server
    (c.root / "files" / "gemma.gguf").symlink_to(assets.model)
    cfg_a = c.config("node-a", cpu_inventory(), engine=real)
    c.start("node-a", cfg_a)
    await c.until("node-a ready", lambda: c.api("GET", "/api/v1/nodes"))
    profile = {"name": "cpu", "min_memory_gb": 1, "cpu_cores": 1, "args": ["--ctx-size", "512"]}
    await c.api(
        "POST",
        "/api/v1/models",
        {"name": "m", "source": f"{c.files}/gemma.gguf", "profiles": [profile]},
    )
    state_a = Paths(c.node_root("node-a")).agent_state

    async def engine_on_a() -> int:
        recs = load_records(state_a)
        return recs[0].pid if recs else 0

    pid = await c.until("an engine runs on node-a", engine_on_a)
    (first,) = await replicas_of(c, "m")
    assert first["node"] == "node-a"

    c.start("node-b", c.config("node-b", cpu_inventory(), engine=real))
    await c.stop("node-a")  # the agent goes; its engine keeps running, as after a crash
    assert psutil.pid_exists(pid)
    # ...but no longer answers (frozen): a silent node's replica whose engine still answers the
    # control plane's probe would stay where it is (tests/e2e/test_lost_agent.py).
    os.kill(pid, signal.SIGSTOP)

    async def moved() -> list[dict[str, Any]]:
        reps = await replicas_of(c, "m")
        return reps if reps and reps[0]["node"] == "node-b" else []

    (second,) = await c.until("the replica moves to node-b", moved)
    assert second["id"] != first["id"]

    os.kill(pid, signal.SIGCONT)
    c.start("node-a", cfg_a)  # node-a comes back: nothing wants its engine any more

    async def engine_stopped() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    await c.until("node-a's unwanted engine is stopped", engine_stopped)

    # A profile change restarts the replica onto the new profile.
    await c.api("PUT", "/api/v1/models/m/profiles", [{**profile, "args": ["--ctx-size", "1024"]}])

    async def replaced() -> list[dict[str, Any]]:
        reps = await replicas_of(c, "m")
        return reps if reps and reps[0]["id"] != second["id"] else []

    await c.until("the replica restarts onto the new profile", replaced)

    # A second agent presenting node-b's id while node-b is alive is refused, naming the node.
    cert, key = c.ca.issue_client("node-b").write(c.root / "impostor", "agent")
    ctx = tlsconf.client_context(Paths(c.root).pki / "ca.pem", cert, key)
    beat = Heartbeat(
        inventory=Inventory(**cpu_inventory()), instance="someone-else"
    ).model_dump_json()
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s,
        s.post(c.agent_url + "/agent/v1/heartbeat", data=beat, headers={"Content-Type": "application/json"}) as r,
    ):
        body = await r.json()
    assert r.status == 409
    assert body["error"]["code"] == "node_id_in_use"
    assert body["error"]["message"].startswith("node id 'node-b' is in use by another agent")
