"""How a replica fails, on real processes with *fake* engines (small Python scripts standing in for
llama-server, because the real one cannot be made to wedge or print on cue):

- a server whose ``/health`` says 200 while its task loop hangs (``/slots`` never answers) is not
  ready; at the start deadline it is failed as stuck and stopped, its process gone;
- an engine that exits with a code carries the code and its last 50 log lines in ``err``;
- an engine that ignores SIGTERM is SIGKILLed after the grace; nothing is left.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import psutil
import pytest

from llmgw.agent.engines import llamacpp
from llmgw.agent.engines.llamacpp import LlamaServer
from llmgw.agent.node.cache import NodeCache, record_digest
from llmgw.agent.node.records import load_records
from llmgw.agent.replicas.runner import ReplicaRunner, RunnerEnv
from llmgw.protocol import ReplicaSpec, ReplicaState

pytestmark = pytest.mark.e2e

STUCK = """
import http.server, sys, time
args = sys.argv
port = int(args[args.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/health"):
            self.send_response(200); self.end_headers(); self.wfile.write(b'{"status":"ok"}')
        else:
            time.sleep(60)  # the task loop is wedged
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""

CRASH = """
import asyncio
import hashlib
import sys
for i in range(80):
    print(f"log line {i}", flush=True)
print("llama_model_load: error loading model: fake cause", flush=True)
sys.exit(3)
"""

DEAF = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ignoring SIGTERM", flush=True)
time.sleep(120)
"""


def script(tmp: Path, name: str, body: str) -> LlamaServer:
    path = tmp / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return LlamaServer(binary=path, version="fake", flags=frozenset())


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[RunnerEnv]:
    weights = tmp_path / "cache" / "m" / "1" / "w.gguf"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"GGUF")
    record_digest(weights, hashlib.sha256(b"GGUF").hexdigest())
    async with aiohttp.ClientSession() as session:
        yield RunnerEnv(
            agent_state=tmp_path,
            advertise_address="127.0.0.1",
            cores=2,
            has_gpus=False,
            cache=NodeCache(tmp_path / "cache"),
            session=session,
            start_deadline_s=3,
            stop_grace_s=1,
            probe_interval_s=0.1,
        )


def spec(rid: str) -> ReplicaSpec:
    return ReplicaSpec(
        id=rid,
        model="m",
        version="1",
        profile="cpu",
        engine="llamacpp",
        source_url="http://127.0.0.1:9/w.gguf",  # never fetched: the file is in the cache
        file_name="w.gguf",
        key="k",
    )


async def run(env: RunnerEnv, server: LlamaServer, rid: str) -> ReplicaRunner:
    env.engine = server
    runner = ReplicaRunner(spec(rid), env)
    runner.start()
    await runner.wait_settled()
    return runner


async def test_health_ok_but_stuck_is_not_ready(
    tmp_path: Path, env: RunnerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The deep probe's own 5 s time-out, read at each probe, would hold the first probe 2 s past the
    # 3 s deadline; a wedged loop never answers, so 0.5 s decides the same, ending ~3.5 s after start.
    # The deadline keeps its 3 s: the fake server must say 200 on /health within it even under load.
    monkeypatch.setattr(llamacpp, "READY_PROBE_TIMEOUT_S", 0.5)
    runner = await run(env, script(tmp_path, "stuck", STUCK), "r-stuck")
    assert runner.state == ReplicaState.FAILED
    assert "GET /health answered 200 but its task loop never answered" in runner.err
    assert runner.pid is not None
    assert not psutil.pid_exists(runner.pid) or psutil.Process(runner.pid).status() == psutil.STATUS_ZOMBIE
    assert load_records(tmp_path) == []


async def test_exit_code_and_last_50_lines(tmp_path: Path, env: RunnerEnv) -> None:
    runner = await run(env, script(tmp_path, "crash", CRASH), "r-crash")
    assert runner.state == ReplicaState.FAILED
    assert runner.err.startswith(
        "llama-server exited with code 3 before it was ready: error loading model: fake cause"
    ), runner.err
    tail = runner.err.split("its last lines:\n", 1)[1].splitlines()
    assert len(tail) == 50
    assert tail[-1].endswith("fake cause")
    assert tail[0] == "log line 31"


async def test_sigterm_ignored_means_sigkill_after_grace(tmp_path: Path, env: RunnerEnv) -> None:
    env.engine = script(tmp_path, "deaf", DEAF)
    env.stop_grace_s = 0.3  # what is checked is the SIGKILL after it, not its length (the fixture's 1 s)
    runner = ReplicaRunner(spec("r-deaf"), env)
    runner.start()
    for _ in range(50):
        if runner.pid is not None and "ignoring" in runner.log_path.read_text(errors="replace"):
            break
        await asyncio.sleep(0.1)
    pid = runner.pid
    assert pid is not None
    await runner.stop()
    assert runner.state == ReplicaState.STOPPED
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert load_records(tmp_path) == []
