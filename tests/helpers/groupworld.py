"""Several real agents (run_agent) on loopback with declared inventories, beside a control plane
served in-process: the world of tests/e2e/test_group_rpc.py and bench/rpc.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from llmgw.agent.loop.loop import run_agent
from llmgw.agent.node.records import stop_all_engines
from llmgw.config import AgentConfig
from llmgw.paths import Paths
from tests.helpers.control import TOKEN, Install, make_install, serving
from tests.helpers.net import serve_files

GB = 1_000_000_000


@dataclass
class World:
    """A control plane (``inst``, served by the caller) and the agents started with :meth:`start_agent`."""

    inst: Install
    root: Path
    files: str
    gateway: str
    agents: dict[str, tuple[asyncio.Event, asyncio.Task[None]]] = field(default_factory=dict)

    async def api(self, method: str, path: str, body: Any = None) -> Any:
        async with (
            aiohttp.ClientSession() as s,
            s.request(method, self.inst.admin + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as r,
        ):
            assert r.status < 300, await r.text()
            return await r.json() if r.status != 204 else None

    def start_agent(
        self,
        node: str,
        llama_server: Path,
        free_gb: float,
        cores: int = 2,
        labels: dict[str, str] | None = None,
        *,
        gpus: list[dict[str, Any]] | None = None,
        vllm: Path | None = None,
    ) -> None:
        """Start node ``node``'s agent in this process, declaring ``cores`` and ``free_gb`` GB free."""
        root = self.root / "nodes" / node
        root.mkdir(parents=True, exist_ok=True)
        cert, key = self.inst.ca.issue_client(node).write(root / "etc", "agent")
        inv = root / "inventory.yaml"
        total, free = int(max(1.0, free_gb) * GB), int(free_gb * GB)
        inv.write_text(
            yaml.safe_dump(
                {"cores": cores, "memory_total_bytes": total, "memory_available_bytes": free, "gpus": gpus or []}
            )
        )
        engines: dict[str, Any] = {"llamacpp": {"binary": str(llama_server)}}
        if vllm is not None:
            engines["vllm"] = {"binary": str(vllm)}
        cfg = AgentConfig.model_validate(
            {
                "server": self.inst.agent_url,
                "node_id": node,
                "tls": {"ca": self.inst.paths.pki / "ca.pem", "cert": cert, "key": key},
                "discovery": {"inventory_file": str(inv)},
                "engines": engines,
                "heartbeat_interval_s": 0.2,
                "labels": labels or {},
            }
        )
        stop = asyncio.Event()
        self.agents[node] = (stop, asyncio.create_task(run_agent(cfg, Paths(root), stop=stop)))

    async def chat(self, model: str) -> tuple[int, str]:
        body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
        async with (
            aiohttp.ClientSession() as s,
            s.post(self.gateway + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r,
        ):
            return r.status, await r.text()

    async def stop_agents(self) -> None:
        """Stop every agent started here (their engines stop with them: group members do)."""
        for stop, task in self.agents.values():
            stop.set()
            await asyncio.wait_for(task, 30)
        self.agents.clear()


@asynccontextmanager
async def group_world(tmp: Path, files: Path) -> AsyncIterator[World]:
    """A control plane served in-process over ``tmp / "cp"`` (nodes lost after 30 s) and a file
    server over ``files`` (the mirror's stand-in); yields the :class:`World` to start agents in.
    On the way out every agent stops and every engine left under ``tmp / "nodes"`` is stopped."""
    runner, url = await serve_files(files)
    inst = make_install(tmp / "cp", node_lost_after_s=30)
    try:
        async with serving(inst):
            w = World(inst, tmp, url, f"http://127.0.0.1:{inst.ports['gateway']}")
            try:
                yield w
            finally:
                await w.stop_agents()
                for node_dir in (tmp / "nodes").glob("*"):
                    stop_all_engines(Paths(node_dir).agent_state, grace_s=2)
    finally:
        await runner.cleanup()
