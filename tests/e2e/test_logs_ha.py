"""``llmgw ctl logs`` through the control plane the node does NOT heartbeat to, on real parts.

Two real control planes (``serve`` in-process, leader election on one real PostgreSQL database), a
real agent (``run_agent``) configured with both, beating to its home among them (rendezvous hashing
of its node id), the real llama-server running gemma-3-270m on it. ``ctl logs`` is run (the real
CLI) against the other control plane's admin API: the read crosses the control planes through the
shared store (:mod:`llmgw.control.api.logbroker`) and shows the engine's real log. Nothing is
mocked.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from llmgw.agent.loop.controlplanes import rendezvous
from llmgw.agent.loop.loop import run_agent
from llmgw.agent.node.records import stop_all_engines
from llmgw.config import AgentConfig
from llmgw.paths import Paths
from tests.conftest import Assets
from tests.helpers.control import TOKEN, pg_install, serving
from tests.helpers.net import serve_files
from tests.helpers.postgres import Cluster
from tests.helpers.waits import until

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {TOKEN}"}
GB = 1_000_000_000




async def test_ctl_logs_on_the_other_control_plane_shows_the_real_engine_log(
    tmp_path: Path, pg_cluster: Cluster, assets: Assets, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    url = pg_cluster.new_database()
    a = pg_install(tmp_path / "a", "cp-a", url)
    b = pg_install(tmp_path / "b", "cp-b", url, tls_of=a)
    files = tmp_path / "files"
    files.mkdir()
    (files / "gemma.gguf").symlink_to(assets.model)
    node = tmp_path / "node"
    cert, key = a.ca.issue_client("node-1").write(node / "etc", "agent")
    inv = node / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"cores": 4, "memory_total_bytes": 8 * GB, "memory_available_bytes": 6 * GB}))
    # The agent beats to its home among both (rendezvous hashing of its node id); ctl logs asks the other.
    home = rendezvous("node-1", [a.agent_url, b.agent_url])[0]
    other = b if home == a.agent_url else a
    cfg = AgentConfig.model_validate({
        "server": a.agent_url,
        "servers": [b.agent_url],
        "node_id": "node-1",
        "tls": {"ca": a.paths.pki / "ca.pem", "cert": cert, "key": key},
        "discovery": {"inventory_file": str(inv)},
        "engines": {"llamacpp": {"binary": str(assets.llama_server)}},
        "heartbeat_interval_s": 0.5,
    })
    files_runner, files_url = await serve_files(files)
    stop = asyncio.Event()
    try:
        async with serving(a), serving(b), aiohttp.ClientSession(headers=AUTH) as s:
            agent = asyncio.create_task(run_agent(cfg, Paths(node), stop=stop))
            try:
                profile = {"name": "cpu", "min_memory_gb": 1, "cpu_cores": 1, "args": ["--ctx-size", "512"]}
                model = {"name": "gemma", "source": f"{files_url}/gemma.gguf", "profiles": [profile]}
                async with s.post(b.admin + "/api/v1/models", json=model) as r:
                    assert r.status == 201, await r.text()

                async def ready() -> str | None:
                    async with s.get(b.admin + "/api/v1/replicas?model=gemma") as r:
                        reps = await r.json()
                    return next((x["id"] for x in reps if x["state"] == "ready"), None)

                rid = await until("the replica is ready on node-1", ready, within_s=120)
                env = {**os.environ, "LLMGW_ROOT": str(tmp_path / ("b" if other is b else "a"))}
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "llmgw", "ctl", "logs", rid, "-n", "400",
                    "--server", other.admin, "--token", TOKEN, env=env,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                )
                out, err = await asyncio.wait_for(proc.communicate(), 60)
                assert proc.returncode == 0, err.decode()
                text = out.decode()
                assert "--- llmgw agent: starting" in text
                assert "llama-server" in text
                # The agent never left its home: the read crossed control planes (the other one asked).
                switched = [r.getMessage() for r in caplog.records
                            if r.name == "llmgw.agent" and "does not answer" in r.getMessage()]
                assert switched == []
            finally:
                stop.set()
                await asyncio.wait_for(agent, 20)
    finally:
        stop_all_engines(Paths(node).agent_state, grace_s=2)
        await files_runner.cleanup()
