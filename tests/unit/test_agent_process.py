"""The agent API in a process of its own (``cluster.agent_api_process: true``, issue 23: heartbeats
off the gateway's event loop): the control plane (``serve`` in-process, or ``llmgw server run``)
starts ``python -m llmgw.control.agentworker`` on the sockets it bound, relays what that process
reports and starts it again when it dies. Real processes, real mTLS with certificates from the
install's CA, real HTTP; the node is the test's client (no engine runs: the wiring is what is tested).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from llmgw.control import agentproc, agentworker
from llmgw.control.agentproc import AgentProcess
from llmgw.control.api.cadence import Cadence
from llmgw.control.api.enginemetrics import EngineMetrics
from llmgw.control.listeners import bind_sockets
from llmgw.control.server import serve
from llmgw.control.store import default_url
from llmgw.errors import PortInUseError, ServiceError
from llmgw.protocol import HeartbeatReply, LogReply
from tests.helpers.control import (
    ADMIN_AUTH,
    CHAT_MODEL,
    Install,
    Served,
    agent_api_processes,
    beat_reply,
    make_install,
    ready_and_routed,
    server_run,
    serving,
    wait_admin_health,
)
from tests.helpers.waits import until

AUTH, MODEL = ADMIN_AUTH, CHAT_MODEL
PAGE = (Path(__file__).parents[1] / "data" / "llama-server-metrics.txt").read_text()




@pytest.fixture
def install(tmp_path: Path) -> Install:
    return make_install(tmp_path, cluster={"agent_api_process": True})


@pytest.fixture
async def served(install: Install) -> AsyncIterator[Served]:
    async with serving(install, stop_s=20) as got:
        yield got




async def test_a_heartbeat_answered_by_the_agent_api_process_reaches_the_leader_and_the_gateway(
    install: Install, served: Served
) -> None:
    """The reply names this control plane (the election's view crosses the channel); the node that
    registered wakes the leader (a replica placed at once); its ready report is routed to at once
    (the refresh the process asks for, or the gateway's own when it finds no ready replica)."""
    [worker] = agent_api_processes()
    assert worker.pid != os.getpid()
    ctx = install.agent_ctx("node-1")
    async with aiohttp.ClientSession() as s:
        first = await beat_reply(s, install, ctx)
        assert first.node_id == "node-1"
        reply = await until("a reply names this control plane's term and agent URL",
                            lambda: _named(s, install, ctx), within_s=5)
        assert reply.term >= 1
        async with s.post(install.admin + "/api/v1/models", json=MODEL, headers=AUTH) as r:
            assert r.status == 201, await r.text()

        async def placed() -> Any:
            return (await beat_reply(s, install, ctx)).desired or None

        [spec] = await until("the leader placed the model's replica on node-1", placed, within_s=10)
        await ready_and_routed(s, install, ctx, spec.id, "chat")


async def _named(s: aiohttp.ClientSession, inst: Install, ctx: Any) -> HeartbeatReply | None:
    reply = await beat_reply(s, inst, ctx)
    return reply if reply.term and reply.leader == inst.agent_url and inst.agent_url in reply.control_planes else None


async def test_engine_pages_and_log_reads_cross_the_process(install: Install, served: Served) -> None:
    """Engine pages posted to the agent API process show on the control plane's GET /metrics; a log
    read asked on the admin API reaches the node through the store and is answered."""
    ctx = install.agent_ctx("node-1")
    async with aiohttp.ClientSession() as s:
        await beat_reply(s, install, ctx)
        pages = [{"replica": "r-x", "model": "chat", "text": PAGE}]
        async with s.post(install.agent_url + "/agent/v1/metrics", json=pages, ssl=ctx) as r:
            assert r.status == 200, await r.text()

        async def relayed() -> bool:
            async with s.get(install.admin + "/metrics") as r:
                return 'llamacpp:tokens_predicted_total{model="chat",node="node-1",replica="r-x"}' in await r.text()

        await until("the relayed engine page on GET /metrics", relayed, within_s=5)
        async with s.post(install.admin + "/api/v1/models", json=MODEL, headers=AUTH) as r:
            assert r.status == 201

        async def placed() -> Any:
            return (await beat_reply(s, install, ctx)).desired or None

        [spec] = await until("a replica placed on node-1", placed, within_s=10)

        async def read() -> tuple[int, Any]:
            async with s.get(f"{install.admin}/api/v1/replicas/{spec.id}/logs", headers=AUTH) as r:
                return r.status, await r.json()

        reading = asyncio.create_task(read())

        async def carried() -> Any:
            return (await beat_reply(s, install, ctx)).log_requests or None

        [req] = await until("a reply carries the log request", carried, within_s=8)
        answer = LogReply(id=req.id, replica_id=spec.id, text="engine line 1\n", offset=14)
        async with s.post(install.agent_url + "/agent/v1/logs", data=answer.model_dump_json(), ssl=ctx) as r:
            assert r.status == 200, await r.text()
        status, body = await asyncio.wait_for(reading, 5)
    assert status == 200, body
    assert body["text"] == "engine line 1\n"


async def test_a_killed_agent_api_process_is_started_again_and_beats_go_on(install: Install, served: Served) -> None:
    """SIGKILL: the sockets stay bound by the control plane, a new process serves them within seconds,
    and the node's next beat (a new connection) is answered."""
    [first] = agent_api_processes()
    ctx = install.agent_ctx("node-1")
    async with aiohttp.ClientSession() as s:
        await beat_reply(s, install, ctx)
    first.send_signal(signal.SIGKILL)
    first.wait(5)

    async def another() -> Any:
        return [w for w in agent_api_processes() if w.pid != first.pid] or None

    await until("a new agent API process", another, within_s=10)
    async with aiohttp.ClientSession() as s:
        reply = await beat_reply(s, install, ctx)
    assert reply.node_id == "node-1"


async def test_stopping_the_control_plane_stops_the_process(install: Install) -> None:
    async with serving(install, stop_s=20):
        [worker] = agent_api_processes()
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    assert agent_api_processes() == []


def test_a_control_plane_killed_takes_its_agent_api_process_with_it(install: Install) -> None:
    """``llmgw server run`` killed with SIGKILL (no shutdown of its own): the process sees its channel
    close and exits."""
    with server_run(install) as proc:
        wait_admin_health(install, proc)
        [worker] = agent_api_processes(proc.pid)
        with socket.create_connection(("127.0.0.1", install.ports["agent"]), timeout=5):
            pass  # the agent API is served before the admin API answers
        proc.kill()
        proc.wait()
        started = time.monotonic()
        worker.wait(10)
    assert time.monotonic() - started < 10


async def test_a_taken_agent_port_is_named(install: Install) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", install.ports["agent"]))
        taken.listen()
        with pytest.raises(PortInUseError) as e:
            await serve(install.config, install.paths, stop=asyncio.Event())
    assert "agent_listen" in str(e.value)
    assert f"port {install.ports['agent']} is already in use" in str(e.value)
    assert agent_api_processes() == []


async def test_the_process_names_the_view_it_is_sent_and_reports_a_node_that_came(install: Install) -> None:
    """:class:`AgentProcess` alone (no control plane around it): the replies carry the view its
    ``cluster`` callable gives, and a node's registration comes back as ``changed`` with ``came``
    (the control plane wakes its leader on it), not left to the leader's timed pass."""
    socks = await bind_sockets("127.0.0.1", install.ports["agent"], what="agent_listen", fix="-")
    came: list[tuple[str, bool]] = []
    proc = AgentProcess(
        install.config, default_url("", install.paths.database), socks,
        on_changed=lambda node, new: came.append((node, new)), engines=EngineMetrics(), cadence=Cadence(),
        cluster=lambda: (7, "https://cp-a:7443", ["https://cp-a:7443", "https://cp-b:7443"]), own_nodes=frozenset,
    )
    await proc.start()
    stop = asyncio.Event()
    running = asyncio.create_task(proc.run(stop))
    try:
        async with aiohttp.ClientSession() as s:
            reply = await beat_reply(s, install, install.agent_ctx("node-1"))
        assert (reply.term, reply.leader) == (7, "https://cp-a:7443")
        assert reply.control_planes == ["https://cp-a:7443", "https://cp-b:7443"]

        async def reported() -> bool:
            return ("node-1", True) in came

        await until("the registration reported over the channel", reported, within_s=5)
    finally:
        stop.set()
        await running
        await proc.close()
    assert proc.proc is not None
    assert proc.proc.returncode == 0


def test_a_stop_while_the_agent_api_process_starts_is_a_clean_stop(install: Install) -> None:
    """SIGTERM to every process of the unit (systemd's ``systemctl stop``) while the agent API process
    is still importing: it dies of the signal, and the control plane, told to stop by the same signal,
    exits 0 without an error (it exited 1 with "the agent API process ... exited with -15 before
    serving ..."; a unit stopped during its start was left failed)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "server", "run"], env={**os.environ, "LLMGW_ROOT": str(install.root)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not agent_api_processes(proc.pid):  # the control plane started it; it has not served yet
            assert proc.poll() is None, proc.communicate()[0].decode()
            assert time.monotonic() < deadline, "no agent API process in 30 s"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "Error" not in out, out


def test_the_agent_api_process_that_cannot_start_says_why_in_one_line(
    install: Install, caplog: pytest.LogCaptureFixture
) -> None:
    """server.yaml's TLS key broken after the control plane read it: the process logs the error's
    message (which says what to do) in one line and exits 1, instead of a 40-line chained traceback
    at every start again (every 1-30 s)."""
    (install.paths.pki / "server-key.pem").write_text("not a key\n")
    ours, theirs = socket.socketpair()
    with ours, socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        ours.sendall(b'{"k":"init","url":"sqlite:///' + str(install.root / "db.sqlite").encode() + b'"}\n')
        code = agentworker.main(["--config", str(install.config), "--listen-fd", str(listening.fileno()),
                                 "--link-fd", str(theirs.detach())])
    assert code == 1
    [record] = [r for r in caplog.records if r.name == agentworker.__name__ and r.levelname == "ERROR"]
    assert "tls.key" in record.getMessage()
    assert "llmgw server init" in record.getMessage()
    assert record.exc_info is None


def fake_python(tmp_path: Path, body: str) -> str:
    """An executable that stands in for the interpreter :class:`AgentProcess` runs: ``body`` in Python."""
    path = tmp_path / "fake-python"
    path.write_text(f"#!{sys.executable}\nimport os, signal, sys, time\n{body}\n")
    path.chmod(0o755)
    return str(path)


@contextmanager
def fake_process(tmp_path: Path, body: str) -> Iterator[AgentProcess]:
    """An :class:`AgentProcess` on a loopback socket of its own that runs :func:`fake_python`'s ``body``."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        yield AgentProcess(tmp_path / "server.yaml", "sqlite://", [socket.socket(fileno=os.dup(listening.fileno()))],
                           on_changed=lambda _n, _c: None, engines=EngineMetrics(), cadence=Cadence(),
                           cluster=lambda: (0, "", []), own_nodes=frozenset, python=fake_python(tmp_path, body))


#: A stand-in for the agent API process that says ``ready`` and exits.
READY_THEN_EXIT = 'os.write(int(sys.argv[sys.argv.index("--link-fd") + 1]), b\'{"k":"ready"}\\n\')'


async def _start_fails(tmp_path: Path, body: str) -> str:
    with fake_process(tmp_path, body) as proc:
        with pytest.raises(ServiceError) as e:
            await proc.start()
        await proc.close()
    return str(e.value)


async def test_an_agent_api_process_that_never_serves_is_named_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One that hangs: 'did not serve ... within' and killed at once (it was said to have 'exited with
    -9', the kill that came STOP_S later, as if it had crashed); one killed by a signal (the OOM
    killer) is named by the signal, not a bare -9."""
    monkeypatch.setattr(agentproc, "START_S", 0.5)
    started = time.monotonic()
    hung = await _start_fails(tmp_path, "time.sleep(60)")
    assert "did not serve" in hung, hung
    assert "within 0.5 s" in hung, hung
    assert time.monotonic() - started < agentproc.STOP_S
    killed = await _start_fails(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    assert "was killed by SIGKILL" in killed, killed
    failed = await _start_fails(tmp_path, "sys.exit(3)")
    assert "exited with 3" in failed, failed
    assert "log lines above say why" in failed, failed


async def test_a_process_that_dies_right_after_serving_is_started_again_ever_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that serves, then dies at once (the OOM killer as the agents reconnect, a crash on
    the first beats), is started again after ever longer waits up to RESPAWN_MAX_S, as one that
    fails before serving is: a 'ready' reset the wait to RESPAWN_MIN_S, so the control plane
    started one every ~1 s for ever (each start ~1 s of CPU for its imports, on the gateway's machine)."""
    monkeypatch.setattr(agentproc, "RESPAWN_MIN_S", 0.05)
    monkeypatch.setattr(agentproc, "RESPAWN_MAX_S", 0.4)
    with fake_process(tmp_path, READY_THEN_EXIT) as proc:
        await proc.start()
        stop = asyncio.Event()
        running = asyncio.create_task(proc.run(stop))
        await asyncio.sleep(2.5)
        stop.set()
        await running
        await proc.close()
    # waits 0.05, 0.1, 0.2, then 0.4 s each: about 8 starts in 2.5 s (it was one every ~0.1 s: 20-25)
    assert proc.starts <= 10, proc.starts


async def test_a_process_closed_while_waiting_to_start_another_starts_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close`` (serve's cleanup after another task failed: ``stop`` is not set) while ``run`` waits
    to start the next process: ``run`` ends at the end of its wait. It went on to start one on the
    sockets ``close`` had closed (ValueError from the spawn; a new process on whatever those fd
    numbers had become, had they been reused)."""
    monkeypatch.setattr(agentproc, "RESPAWN_MIN_S", 0.3)
    with fake_process(tmp_path, READY_THEN_EXIT) as proc:
        await proc.start()
        running = asyncio.create_task(proc.run(asyncio.Event()))

        async def gone() -> bool:
            return proc.proc is not None and proc.proc.returncode is not None

        await until("the first process gone", gone, every_s=0.01)
        await proc.close()
        await asyncio.wait_for(running, 2)
    assert proc.starts == 1


async def test_each_process_started_again_leaves_no_socket_behind(install: Install, served: Served) -> None:
    """The channel's end of a process that died is closed when the next one starts: it was dropped
    unclosed, and serve's gc.freeze() (and GcPauses freezing each full collection's survivors, the
    live channel among them) kept it from ever being collected: one Unix socket more per start."""

    def unix_fds() -> int:
        return len(psutil.Process().net_connections(kind="unix"))

    before = unix_fds()
    for _ in range(2):
        [old] = agent_api_processes()
        old.send_signal(signal.SIGKILL)

        async def another(old: psutil.Process = old) -> Any:
            try:  # the old one, a zombie until reaped, has no command line to read
                return [w for w in agent_api_processes() if w.pid != old.pid] or None
            except psutil.ZombieProcess:
                return None

        await until("a new agent API process", another, within_s=10)
        ctx = install.agent_ctx("node-1")
        async with aiohttp.ClientSession() as s:
            await beat_reply(s, install, ctx)  # it serves (its 'ready' came)
    assert unix_fds() == before


async def test_a_node_count_sent_before_ready_is_taken_not_a_failed_start(tmp_path: Path) -> None:
    """A process started again on a large cluster counts the nodes as it starts (its cadence's first
    count moves the lost threshold) and says so before 'ready': ``start`` takes that message and
    goes on. It took any first message but 'ready' for a failed start, killed the process and, at the
    restart phase of bench/scale.py at 5,000 nodes, stopped the control plane: "was killed by SIGKILL
    before serving"."""
    link = 'int(sys.argv[sys.argv.index("--link-fd") + 1])'
    body = f'os.write({link}, b\'{{"k":"nodes","n":5000}}\\n\'); os.write({link}, b\'{{"k":"ready"}}\\n\')'
    # Until 'stop' comes: the 'init' the control plane sends at once must not end it (a bare read
    # returned with it, and the process exited before the check when the test was starved of CPU).
    until_stop = f"\nseen = b''\nwhile b'stop' not in seen and (got := os.read({link}, 65536)):\n    seen += got"
    with fake_process(tmp_path, body + until_stop) as proc:
        await proc.start()
        try:
            assert proc.cadence.nodes == 5000
            assert proc.proc is not None
            assert proc.proc.returncode is None  # serving, not killed
        finally:
            await proc.close()
