"""A vLLM group over two GPU nodes, with a fake ``vllm`` and a fake ``ray``: there is no GPU (nor
vLLM or Ray) on this machine, so the engine is played by small scripts that record what they are run
with and when, and the fake ``vllm serve`` answers like vLLM's API (``/health``, a chat completion).
Everything else is real: the control plane (served in this process), two real agents with declared
H100 inventories, the gateway.

What is checked: the commands and their order: ``ray start --head`` on the head, ``ray start
--address <head's address>`` on the worker (which learns it from the control plane), ``ray status``
on the head until it counts both nodes, then ``vllm serve`` with ``--tensor-parallel-size 1
--pipeline-parallel-size 2 --distributed-executor-backend ray``, ``RAY_ADDRESS`` and the profile's
``NCCL_SOCKET_IFNAME``; the group answers through the gateway.
"""

from __future__ import annotations

import json
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers.groupworld import GB, World, group_world
from tests.helpers.waits import until

pytestmark = pytest.mark.e2e

FAKE_RAY = '''#!{python}
"""A fake ray: start --head / start --address (both --block), status --address."""
import json, os, signal, sys, time
CALLS, STATE = {calls!r}, {state!r}
def record(**kw):
    with open(CALLS, "a") as f:
        f.write(json.dumps({{"t": time.time(), "argv": sys.argv[1:], **kw}}) + "\\n")
args = sys.argv[1:]
if args[:1] == ["status"]:
    nodes = json.load(open(STATE))["nodes"] if os.path.exists(STATE) else 0
    record(what="status", nodes=nodes)
    print("======== Autoscaler status: 2026-12-02 ========\\nNode status\\n" + "-" * 40 + "\\nActive:")
    for i in range(nodes):
        print(f" 1 node_{{i:040x}}")
    print("Pending:\\n (no pending nodes)\\nRecent failures:\\n (no failures)")
    sys.exit(0)
if args[:1] == ["start"]:
    record(what="head" if "--head" in args else "worker", nccl=os.environ.get("NCCL_SOCKET_IFNAME", ""))
    state = json.load(open(STATE)) if os.path.exists(STATE) else {{"nodes": 0}}
    state["nodes"] += 1
    json.dump(state, open(STATE, "w"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(1)
sys.exit(2)
'''

FAKE_VLLM = '''#!{python}
"""A fake vllm serve: records its argv and environment, then answers /health and chat completions."""
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
CALLS = {calls!r}
args = sys.argv[1:]
with open(CALLS, "a") as f:
    env = os.environ
    seen = {{"ray_address": env.get("RAY_ADDRESS", ""), "nccl": env.get("NCCL_SOCKET_IFNAME", ""),
            "key": bool(env.get("VLLM_API_KEY"))}}
    f.write(json.dumps({{"t": time.time(), "what": "vllm", "argv": args, **seen}}) + "\\n")
port = int(args[args.index("--port") + 1])
name = args[args.index("--served-model-name") + 1]
class H(BaseHTTPRequestHandler):
    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send(200, {{}} if self.path == "/health" else {{"object": "list", "data": []}})
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(200, {{"id": "x", "object": "chat.completion", "model": name, "choices": [{{"index": 0,
            "message": {{"role": "assistant", "content": "hello from the pipeline"}}, "finish_reason": "stop"}}],
            "usage": {{"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}}})
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _h100(index: int) -> dict[str, Any]:
    return {"index": index, "name": "NVIDIA H100 80GB HBM3", "klass": "h100-80gb", "memory_total_bytes": 80 * GB}


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[tuple[World, Path]]:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    calls, state = tmp_path / "calls.jsonl", tmp_path / "ray-state.json"
    for name, text in (("ray", FAKE_RAY), ("vllm", FAKE_VLLM)):
        path = bin_dir / name
        path.write_text(text.format(python=sys.executable, calls=str(calls), state=str(state)))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    files = tmp_path / "files"
    files.mkdir()
    (files / "big.safetensors").write_bytes(b"\0" * 1000)
    async with group_world(tmp_path, files) as w:
        for node in ("gpu-a", "gpu-b"):
            w.start_agent(node, bin_dir / "none", 60, cores=16, gpus=[_h100(0)], vllm=bin_dir / "vllm")
        yield w, calls


async def test_a_vllm_group_runs_ray_then_vllm_serve_in_order(world: tuple[World, Path]) -> None:
    w, calls = world
    profile = {"name": "h100", "engine": "vllm", "gpu_class": "h100-80gb", "gpu_count": 1, "nodes": 2,
               "min_memory_gb": 120, "env": {"NCCL_SOCKET_IFNAME": "lo"}}
    model = {"name": "big", "source": f"{w.files}/big.safetensors", "profiles": [profile]}
    await w.api("POST", "/api/v1/models", model)

    async def ready() -> dict[str, Any] | None:
        reps = [r for r in await w.api("GET", "/api/v1/replicas?model=big") if r["node"]]
        return reps[0] if reps and reps[0]["state"] == "ready" else None

    group = await until("the vLLM group is ready", ready, 60)
    assert group["node"] == group["members"][0]["node"]  # the head serves the API
    for node in ("gpu-a", "gpu-b"):  # every stage's node has the weights, at the same cache path
        cached = list((w.root / "nodes" / node).rglob("big.safetensors"))
        assert len(cached) == 1, node
    assert [m["memory_gb"] for m in group["members"]] == [60.0, 60.0]  # one pipeline stage per node

    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    order = [c["what"] for c in seen if c["what"] != "status" or c["nodes"] == 2][:4]
    assert order == ["head", "worker", "status", "vllm"], seen
    start_head = next(c for c in seen if c["what"] == "head")["argv"]
    assert start_head[:3] == ["start", "--head", "--node-ip-address"]
    assert start_head[-2:] == ["--disable-usage-stats", "--block"]
    address = f"{start_head[3]}:{start_head[5]}"
    assert next(c for c in seen if c["what"] == "worker")["argv"] == [
        "start", "--address", address, "--node-ip-address", "127.0.0.1", "--disable-usage-stats", "--block",
    ]
    serve = next(c for c in seen if c["what"] == "vllm")
    argv = serve["argv"]
    assert argv[0] == "serve"
    assert argv[2:8] == ["--tensor-parallel-size", "1", "--pipeline-parallel-size", "2",
                         "--distributed-executor-backend", "ray"]
    assert argv[-2:] == ["--served-model-name", "big"]
    assert (serve["ray_address"], serve["nccl"], serve["key"]) == (address, "lo", True)
    assert {c["nccl"] for c in seen if c["what"] in ("head", "worker")} == {"lo"}

    body = {"model": "big", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s, s.post(w.gateway + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["message"]["content"] == "hello from the pipeline"
