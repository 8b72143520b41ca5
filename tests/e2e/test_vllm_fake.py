"""vLLM replicas with a FAKE ``vllm`` (a Python script): this machine has no GPU and no vLLM.

The fake behaves as the parts the agent relies on: ``vllm serve MODEL … --host H --port P
--served-model-name N``, the key from ``VLLM_API_KEY``, nothing listening for a moment (loading),
then ``/health`` 200 and ``/v1/models`` behind the key; it starts a child standing in for
``VLLM::EngineCore`` that would outlive a SIGKILLed API process. Checked: argv and key handling,
readiness, and that stop ends the whole process group (the child too). Also: on a CPU-only node
vLLM is ``unsupported`` with the reason; with NVIDIA it is ``installing`` (the venv is not built
here: ``install=False``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import psutil
import pytest

from llmgw.agent.engines import vllm
from llmgw.agent.node.cache import NodeCache, record_digest
from llmgw.agent.node.records import load_records
from llmgw.agent.replicas.runner import ReplicaRunner, RunnerEnv
from llmgw.protocol import ProvisionState, ReplicaSpec, ReplicaState

pytestmark = pytest.mark.e2e

FAKE_VLLM = """
import http.server, json, os, subprocess, sys, time
args = sys.argv[1:]
assert args[0] == "serve", args
def val(flag):
    return args[args.index(flag) + 1]
port, name, key = int(val("--port")), val("--served-model-name"), os.environ["VLLM_API_KEY"]
assert "--api-key" not in args
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # "VLLM::EngineCore"
open("engine-core.pid", "w").write(str(child.pid))
print("argv: " + json.dumps(args), flush=True)
time.sleep(0.5)  # loading: nothing answers yet
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            self.send_response(200); self.end_headers(); return
        if self.headers.get("Authorization") != "Bearer " + key:
            self.send_response(401); self.end_headers(); self.wfile.write(b'{"error":"Unauthorized"}'); return
        body = json.dumps({"data": [{"id": name}]}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a):
        pass
print("Application startup complete.", flush=True)
http.server.ThreadingHTTPServer((val("--host"), port), H).serve_forever()
"""


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[RunnerEnv]:
    weights = tmp_path / "cache" / "qwen" / "1" / "w.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"weights")
    record_digest(weights, hashlib.sha256(b"weights").hexdigest())
    fake = tmp_path / "vllm"
    fake.write_text(f"#!{sys.executable}\n{FAKE_VLLM}")
    fake.chmod(0o755)
    async with aiohttp.ClientSession() as session:
        yield RunnerEnv(
            agent_state=tmp_path,
            advertise_address="127.0.0.1",
            cores=2,
            has_gpus=True,
            cache=NodeCache(tmp_path / "cache"),
            session=session,
            vllm=vllm.VllmServer(fake),
            vllm_start_deadline_s=20,
            stop_grace_s=2,
            probe_interval_s=0.1,
        )


async def test_vllm_serve_ready_keyed_and_stopped_by_group(tmp_path: Path, env: RunnerEnv) -> None:
    spec = ReplicaSpec(
        id="v-1",
        model="qwen",
        version="1",
        profile="gpu",
        engine="vllm",
        source_url="http://127.0.0.1:9/w.safetensors",
        file_name="w.safetensors",
        args=["--max-model-len", "4096", "--port", "1", "--served-model-name", "evil"],
        gpu_indexes=[0],
        key="s3cret",
    )
    runner = ReplicaRunner(spec, env)
    runner.start()
    assert await runner.wait_settled() == ReplicaState.READY, runner.err
    assert runner.pid is not None
    argv = json.loads(runner.log_path.read_text().split("argv: ", 1)[1].splitlines()[0])
    assert argv[:4] == ["serve", str(tmp_path / "cache" / "qwen" / "1" / "w.safetensors"), "--max-model-len", "4096"]
    assert argv.count("--port") == 1
    assert argv[argv.index("--port") + 1] == str(runner.port)
    assert argv[argv.index("--served-model-name") + 1] == "qwen"
    assert "s3cret" not in psutil.Process(runner.pid).cmdline()
    assert psutil.Process(runner.pid).environ()["CUDA_VISIBLE_DEVICES"] == "0"

    url = f"http://{runner.status().endpoint}/v1/models"
    async with env.session.get(url, headers={"Authorization": "Bearer s3cret"}) as resp:
        assert resp.status == 200
        assert (await resp.json(content_type=None))["data"][0]["id"] == "qwen"
    async with env.session.get(url) as resp:
        assert resp.status == 401

    core = int((runner.dir / "engine-core.pid").read_text())
    assert psutil.pid_exists(core)
    await runner.stop()
    for pid in (runner.pid, core):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert load_records(tmp_path) == []


def test_vllm_status_by_node_kind(tmp_path: Path) -> None:
    prov = vllm.VllmProvisioner(tmp_path)
    status, server = prov.status(has_nvidia=False)
    assert (status.state, server) == (ProvisionState.UNSUPPORTED, None)
    assert status.detail == vllm.NO_GPU
    # Declared GPUs: no download is started, and the status says what to do instead.
    status, _ = prov.status(has_nvidia=True, install=False)
    assert (status.state, status.detail) == (ProvisionState.UNSUPPORTED, vllm.NOT_INSTALLING)
    fake = tmp_path / "my-vllm"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    status, server = vllm.VllmProvisioner(tmp_path, configured=fake).status(has_nvidia=False)
    assert status.state == ProvisionState.INSTALLED
    assert server is not None
    assert server.binary == fake
