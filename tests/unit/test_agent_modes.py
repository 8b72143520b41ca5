"""A node started by hand keeps its engines' logs and keys private: the agent sets its own modes.

The way an operator starts a node without ``server init``: ``llmgw server add-node`` (a real child
process, against a real control plane on loopback with the cluster CA) writes the bundle, then
``llmgw agent`` runs as a child process under the default umask 0022, in a state directory made
beforehand with ``mkdir`` (0755). The engine is a stand-in script (``--version`` answers, otherwise
it sleeps like a loading llama-server): the log it is given is what is checked, not a model.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from llmgw.agent.node.records import load_records, replicas_dir, stop_all_engines
from llmgw.paths import Paths
from tests.helpers.control import FAKE_ENGINE, TOKEN, make_install, serving
from tests.helpers.net import serve_files
from tests.helpers.waits import until

GB = 1_000_000_000


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_an_agent_started_by_hand_makes_its_state_dir_0700_and_engine_logs_0600(tmp_path: Path) -> None:
    inst = make_install(tmp_path / "cp")
    engine = tmp_path / "llama-server"
    engine.write_text(FAKE_ENGINE)
    engine.chmod(0o755)
    files = tmp_path / "files"
    files.mkdir()
    (files / "m.gguf").write_bytes(b"GGUF" + b"\0" * 1000)
    files_runner, files_url = await serve_files(files)
    node = Paths(tmp_path / "node")
    bundle = tmp_path / "bundle"
    node.agent_state.mkdir(parents=True)
    os.chmod(node.agent_state, 0o755)  # noqa: S103 (as an operator's 'mkdir -p' leaves it: the case under test)
    agent: asyncio.subprocess.Process | None = None
    errors = (tmp_path / "agent.err").open("wb")
    try:
        async with serving(inst):
            add = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "llmgw", "server", "add-node", "node-1", "--out", str(bundle),
                "--address", "127.0.0.1", "--server", inst.agent_url, "--llama-server", str(engine),
                env={**os.environ, "LLMGW_ROOT": str(inst.root)},
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )
            out, _ = await asyncio.wait_for(add.communicate(), 60)
            assert add.returncode == 0, out.decode()
            doc: dict[str, Any] = yaml.safe_load((bundle / "agent.yaml").read_text())
            doc["tls"] = {k: str(bundle / Path(v).name) for k, v in doc["tls"].items()}  # copied to its etc
            inventory = tmp_path / "inventory.yaml"
            inventory.write_text(yaml.safe_dump(
                {"cores": 4, "memory_total_bytes": 8 * GB, "memory_available_bytes": 8 * GB}
            ))
            doc["discovery"] = {"inventory_file": str(inventory)}
            doc["heartbeat_interval_s"] = 0.2
            config = tmp_path / "agent.yaml"
            config.write_text(yaml.safe_dump(doc))
            agent = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "llmgw", "agent", "--config", str(config),
                env={**os.environ, "LLMGW_ROOT": str(node.root)},
                stdout=asyncio.subprocess.DEVNULL, stderr=errors,
                preexec_fn=lambda: os.umask(0o022),  # the umask of a login shell
            )
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
                body = {"name": "m", "source": f"{files_url}/m.gguf", "profiles": [{"name": "cpu", "min_memory_gb": 1}]}
                async with s.post(inst.admin + "/api/v1/models", json=body) as r:
                    assert r.status == 201, await r.text()

            async def engine_started() -> list[Path]:
                assert agent is not None
                assert agent.returncode is None, (tmp_path / "agent.err").read_text()
                logs = list(replicas_dir(node.agent_state).glob("*/engine.log"))
                return logs if load_records(node.agent_state) else []

            (log,) = await until("the agent started an engine with its log", engine_started, within_s=60)
            assert mode(node.agent_state) == 0o700
            assert mode(replicas_dir(node.agent_state)) == 0o700
            assert mode(log.parent) == 0o700
            assert mode(log) == 0o600
            assert mode(log.parent / "api-key") == 0o600
            assert b"--- llmgw agent: starting" in log.read_bytes()
    finally:
        if agent is not None and agent.returncode is None:
            agent.terminate()
            try:
                await asyncio.wait_for(agent.wait(), 20)
            except TimeoutError:
                agent.kill()
                await agent.wait()
        errors.close()
        stop_all_engines(node.agent_state, grace_s=2)
        await files_runner.cleanup()
