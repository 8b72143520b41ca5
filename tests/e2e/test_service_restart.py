"""``llmgw service restart server`` on real processes: a real control plane under
llmgw's own supervisor in a temp LLMGW_ROOT, a stand-in engine streaming slowly (an aiohttp
server in this process: the stream's timing is what matters, not a model), a replica made ready
through the real agent API (mTLS), and a client streaming through the real gateway while the CLI
restarts the server.

Before the fix: the stream was cut without an error event (SIGKILL after 15 s), and a server.yaml
with a typo printed ``restarted`` with exit 0 and left the gateway down.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiohttp import web

from llmgw import tlsconf
from llmgw.paths import Paths
from llmgw.protocol import (
    HeartbeatReply,
    ReplicaState,
    ReplicaStatus,
)
from llmgw.service.manager import SupervisorManager
from llmgw.service.units import server_unit
from tests.helpers.control import TOKEN, heartbeat, make_install

pytestmark = pytest.mark.e2e



class SlowEngine:
    """llama-server's streamed chat, one event every ``interval`` s for ``events`` events, in a thread."""

    def __init__(self, events: int, interval: float) -> None:
        self.events, self.interval = events, interval
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self.runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def chat(request: web.Request) -> web.StreamResponse:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for i in range(self.events):
                chunk = {"object": "chat.completion.chunk", "model": "x",
                         "choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]}
                await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(self.interval)
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out

        async def start() -> None:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", chat)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = runner.addresses[0][1]
            self.runner = runner
            self._ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def close(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class Install:
    root: Path
    paths: Paths
    ports: dict[str, int]
    ca: tlsconf.CA
    doc: dict[str, Any] = field(default_factory=dict)

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    def write(self, text: str | None = None) -> None:
        self.paths.server_config.write_text(text if text is not None else yaml.safe_dump(self.doc))

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "LLMGW_ROOT": str(self.root)}
        return subprocess.run([sys.executable, "-m", "llmgw", *args], env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.ports['admin']}/api/v1/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False


def wait(what: str, check: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


def serve_model(inst: Install, endpoint: str) -> None:
    """A node over the real agent API, the model ``chat`` in the catalog, its replica ready at ``endpoint``."""
    cert, key = inst.ca.issue_client("node-1").write(inst.root / "agent", "node-1")
    ctx = tlsconf.client_context(inst.paths.pki / "ca.pem", cert, key)
    agent = f"https://127.0.0.1:{inst.ports['agent']}"
    with httpx.Client(verify=ctx, timeout=10) as a, httpx.Client(timeout=10) as admin:
        assert a.post(agent + "/agent/v1/register", content=heartbeat()).status_code == 200
        model = {"name": "chat", "source": "http://m/chat.gguf", "profiles": [{"name": "cpu"}]}
        r = admin.post(f"http://127.0.0.1:{inst.ports['admin']}/api/v1/models", json=model,
                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 201, r.text
        spec = None
        for _ in range(100):
            beat = a.post(agent + "/agent/v1/heartbeat", content=heartbeat())
            reply = HeartbeatReply.model_validate_json(beat.content)
            if reply.desired:
                spec = reply.desired[0]
                break
            time.sleep(0.1)
        assert spec is not None
        ready = ReplicaStatus(id=spec.id, state=ReplicaState.READY, endpoint=endpoint)
        assert a.post(agent + "/agent/v1/heartbeat", content=heartbeat(ready)).status_code == 200


class Stream:
    """A streamed chat request through the gateway, in a thread; ``lines`` as they arrive."""

    def __init__(self, gateway: str) -> None:
        self.lines: list[str] = []
        self.error: BaseException | None = None
        self.first = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(gateway,), daemon=True)
        self._thread.start()

    def _run(self, gateway: str) -> None:
        body = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        try:
            with httpx.stream("POST", gateway + "/v1/chat/completions", json=body, timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.first.set()
        except BaseException as e:
            self.error = e
        self.first.set()

    def join(self, timeout: float = 120) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream never ended"


@pytest.fixture
def drain_s() -> float:
    """``gateway.drain_s`` the server starts with (a test parametrizes it to start with another)."""
    return 20


@pytest.fixture
def install(tmp_path: Path, drain_s: float) -> Iterator[Install]:
    base = make_install(tmp_path.resolve())
    base.paths.admin_token.chmod(0o600)
    doc = yaml.safe_load(base.config.read_text())
    doc["gateway"]["drain_s"] = drain_s
    paths = base.paths
    inst = Install(base.root, paths, base.ports, base.ca, doc)
    inst.write()
    manager = SupervisorManager(paths)
    manager.install("server", server_unit(paths, str(Path(sys.executable).parent / "llmgw"), user=None))
    assert manager.start("server")
    wait("the control plane to answer", inst.healthy)
    try:
        yield inst
    finally:
        manager.stop("server")


def test_restart_drains_a_stream_in_flight(install: Install) -> None:
    """The stream that is running when the restart comes finishes: every event and ``[DONE]``."""
    engine = SlowEngine(events=8, interval=0.5)
    try:
        serve_model(install, f"127.0.0.1:{engine.port}")
        stream = Stream(install.gateway)
        assert stream.first.wait(30)
        assert stream.error is None, stream.error
        done = install.cli("service", "restart", "server")
        stream.join()
    finally:
        engine.close()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "restarted llmgw-server (supervisor, pid " in done.stdout
    assert stream.error is None, stream.error
    words = [json.loads(x[6:])["choices"][0]["delta"]["content"] for x in stream.lines if x.startswith("data: {")]
    assert words == [f"w{i} " for i in range(8)]
    assert stream.lines[-1] == "data: [DONE]"
    assert install.healthy()  # the new one answers


@pytest.mark.parametrize("drain_s", [1])
def test_restart_cuts_a_stream_past_the_deadline_with_an_error_event(install: Install) -> None:
    """``gateway.drain_s: 1`` (the server starts with it: a restart to pick it up cost ~3 s) and a
    stream that would run for a minute: at the deadline it ends with a ``shutting_down`` error event
    and ``data: [DONE]``, well within the unit's stop timeout."""
    engine = SlowEngine(events=200, interval=0.3)
    try:
        serve_model(install, f"127.0.0.1:{engine.port}")
        stream = Stream(install.gateway)
        assert stream.first.wait(30)
        t0 = time.monotonic()
        done = install.cli("service", "restart", "server")
        stream.join()
        took = time.monotonic() - t0
    finally:
        engine.close()
    assert done.returncode == 0, done.stdout + done.stderr
    assert stream.error is None, stream.error
    assert stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
    error = json.loads(stream.lines[-2][6:])["error"]
    assert error["code"] == "shutting_down"
    assert "drain deadline" in error["message"]
    assert took < 15  # cut at the deadline, not killed at TimeoutStopSec
    assert install.healthy()


def test_restart_with_a_typo_refuses_and_leaves_the_server_up(install: Install) -> None:
    before = SupervisorManager(install.paths).status("server").pid
    text = yaml.safe_dump(install.doc).replace("admin_listen:", "admin_listn:")
    install.write(text)
    done = install.cli("service", "restart", "server")
    assert done.returncode != 0, done.stdout
    assert "restarted" not in done.stdout
    assert "was not restarted, and the running one is left as it is" in done.stderr
    assert "admin_listn" in done.stderr
    assert SupervisorManager(install.paths).status("server").pid == before
    assert install.healthy()


def test_restart_that_does_not_come_up_fails_with_the_reason(install: Install) -> None:
    """A config that loads but cannot serve (its gateway port is taken by another program): the
    restart says the service did not come up, with the server's own error, and exits non-zero."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        install.doc["gateway"]["listen"] = f"127.0.0.1:{taken.getsockname()[1]}"
        install.write()
        done = install.cli("service", "restart", "server")
    assert done.returncode != 0, done.stdout
    assert "restarted" not in done.stdout
    assert "llmgw-server did not come up" in done.stderr
    assert "is already in use by another program" in done.stderr


def test_restart_does_not_take_another_programs_health_for_its_own(install: Install) -> None:
    """admin_listen now names a port where another program answers ``/api/v1/health`` 200 (a
    second install's control plane): the new control plane cannot bind it and crash-loops. Before,
    the restart took that other program's 200 for its own, printed ``restarted`` and exited 0."""
    app = web.Application()
    app.router.add_get("/api/v1/health", lambda _: web.json_response({"status": "ok", "pid": 1}))
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        install.doc["admin_listen"] = f"127.0.0.1:{runner.addresses[0][1]}"
        install.write()
        done = install.cli("service", "restart", "server")
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    assert done.returncode != 0, done.stdout
    assert "restarted" not in done.stdout
    assert "llmgw-server did not come up" in done.stderr
    assert "is already in use by another program" in done.stderr
