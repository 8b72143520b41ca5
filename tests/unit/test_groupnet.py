"""llmgw.agent.groups.groupnet: RPC traffic between a group's head and workers over the agents' mTLS.

Real sockets and real TLS with certificates from a real cluster CA; the "protected process" is a
small Python echo server standing in for ``rpc-server`` (started in a network namespace of its own
when the tests run as root). What is checked: bytes flow head engine -> forwarder -> worker
tunnel -> protected server and back (and how fast); the worker refuses a client with another
node's certificate, with none, with one from another CA, and plain TCP; the head refuses a worker
whose certificate is not the expected node's (or is not an agent's); the forwarder refuses every
process but the allowed one; as root, the protected server cannot be reached from the host's
namespace while the tunnel reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from llmgw.agent.groups.groupnet import GroupNetError, HeadForwarder, WorkerTunnel, verify_peer_cert
from llmgw.agent.groups.isolation import NS_PORT, EngineLink, IsolatedProcess, netns_unavailable, start_isolated
from llmgw.tlsconf import CA

pytestmark = pytest.mark.timeout(120)

ECHO = r"""
import socket, sys, threading
srv = socket.create_server(("127.0.0.1", int(sys.argv[1])))
def serve(c):
    with c:
        buf = bytearray(1 << 20)
        while n := c.recv_into(buf):
            c.sendall(memoryview(buf)[:n])
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

#: A client process: connect to 127.0.0.1:argv[1], send b"hello", print what comes back (repr).
CLIENT = r"""
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
s.sendall(b"hello")
try:
    print(repr(s.recv(100)))
except OSError as e:
    print("error", e)
"""


@dataclass
class Pki:
    ca: Path
    head: tuple[Path, Path]
    worker: tuple[Path, Path]
    other_node: tuple[Path, Path]
    other_ca_head: tuple[Path, Path]
    other_ca_worker: tuple[Path, Path]
    server: tuple[Path, Path]
    ca_obj: CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = CA.create(), CA.create("another cluster")
    ca.write(d)
    return Pki(
        ca=d / "ca.pem",
        head=ca.issue_client("head-1").write(d, "head"),
        worker=ca.issue_client("worker-1").write(d, "worker"),
        other_node=ca.issue_client("node-x").write(d, "other-node"),
        other_ca_head=other.issue_client("head-1").write(d, "other-ca-head"),
        other_ca_worker=other.issue_client("worker-1").write(d, "other-ca-worker"),
        server=ca.issue_server(["127.0.0.1"]).write(d, "server"),
        ca_obj=ca,
    )


@pytest.fixture
def echo_script(tmp_path: Path) -> Path:
    p = tmp_path / "echo.py"
    p.write_text(ECHO)
    return p


@pytest.fixture
async def engine(echo_script: Path) -> AsyncIterator[IsolatedProcess]:
    """The protected process: the echo server, isolated when the tests run as root."""
    eng = await start_isolated(lambda port: [sys.executable, str(echo_script), str(port)], ready_timeout_s=20)
    yield eng
    await eng.stop()


@pytest.fixture
async def tunnel(engine: IsolatedProcess, pki: Pki) -> AsyncIterator[WorkerTunnel]:
    t = WorkerTunnel(
        engine=engine.link, head_node_id="head-1", ca=pki.ca, cert=pki.worker[0], key=pki.worker[1], host="127.0.0.1"
    )
    await t.start()
    yield t
    await t.close()


def _forwarder(pki: Pki, workers: dict[str, str], cert: tuple[Path, Path] | None = None) -> HeadForwarder:
    cert = cert or pki.head
    return HeadForwarder(workers=workers, ca=pki.ca, cert=cert[0], key=cert[1])


async def _roundtrip(port: int, payload: bytes = b"ping") -> bytes:
    """Send ``payload`` to 127.0.0.1:port, return what comes back (b"" when the connection is closed)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        out = b""
        with contextlib.suppress(ConnectionError):
            while len(out) < len(payload):
                chunk = await asyncio.wait_for(reader.read(65536), 10)
                if not chunk:
                    break
                out += chunk
        return out
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()


async def _tls_roundtrip(endpoint: str, cert: tuple[Path, Path] | None) -> bytes:
    """Talk TLS to a worker tunnel as a client (no check of the server: we play the attacker)."""
    host, port = endpoint.rsplit(":", 1)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    try:
        reader, writer = await asyncio.open_connection(host, int(port), ssl=ctx)
    except (ssl.SSLError, ConnectionError):
        return b""
    try:
        writer.write(b"ping")
        await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(100), 10)
        except (ssl.SSLError, ConnectionError):
            return b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()


async def _wait_for(cond: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.02)


# --- the whole path ----------------------------------------------------------------------------


async def test_bytes_flow_both_ways_through_forwarder_and_tunnel(tunnel: WorkerTunnel, pki: Pki) -> None:
    fwd = _forwarder(pki, {"worker-1": tunnel.endpoint})
    local = await fwd.start()
    assert fwd.rpc_arg == local["worker-1"]
    fwd.allow(os.getpid())
    port = int(local["worker-1"].rsplit(":", 1)[1])
    payload = os.urandom(3 * 1024 * 1024 + 17)
    assert await _roundtrip(port, payload) == payload
    assert await _roundtrip(port, b"again") == b"again"
    assert tunnel.accepted == 2
    assert tunnel.refused == 0
    await fwd.close()


async def test_relay_throughput(tunnel: WorkerTunnel, pki: Pki) -> None:
    """256 MiB each way through forwarder + TLS + tunnel + echo; prints MB/s (one direction's bytes)."""
    fwd = _forwarder(pki, {"worker-1": tunnel.endpoint})
    port = int((await fwd.start())["worker-1"].rsplit(":", 1)[1])
    fwd.allow(os.getpid())
    total, chunk = 256 * 1024 * 1024, os.urandom(1024 * 1024)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=4 * 1024 * 1024)

    async def send() -> None:
        for _ in range(total // len(chunk)):
            writer.write(chunk)
            await writer.drain()

    async def receive() -> int:
        got = 0
        while got < total:
            data = await reader.read(4 * 1024 * 1024)
            assert data
            got += len(data)
        return got

    t0 = time.perf_counter()
    _, got = await asyncio.gather(send(), receive())
    secs = time.perf_counter() - t0
    assert got == total
    print(f"relay throughput: {total / secs / 1e6:.0f} MB/s each way ({total >> 20} MiB in {secs:.2f} s)")
    writer.close()
    await writer.wait_closed()
    await fwd.close()


async def test_close_drops_live_connections(tunnel: WorkerTunnel, pki: Pki) -> None:
    fwd = _forwarder(pki, {"worker-1": tunnel.endpoint})
    port = int((await fwd.start())["worker-1"].rsplit(":", 1)[1])
    fwd.allow(os.getpid())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"x")
    assert await asyncio.wait_for(reader.read(10), 10) == b"x"
    await fwd.close()
    assert await asyncio.wait_for(reader.read(10), 10) == b""
    writer.close()
    assert not fwd._relays.transports
    assert not fwd._relays.tasks
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)


# --- the worker refuses everyone but the head --------------------------------------------------


async def test_worker_accepts_the_head(tunnel: WorkerTunnel, pki: Pki) -> None:
    assert await _tls_roundtrip(tunnel.endpoint, pki.head) == b"ping"


@pytest.mark.parametrize("who", ["other_node", "worker", "other_ca_head", "server", None])
async def test_worker_refuses_other_certificates(tunnel: WorkerTunnel, pki: Pki, who: str | None) -> None:
    """Another node's cert, the worker's own, a cert with the head's CN from another CA, the control
    plane's server cert (not a client cert), no cert at all: nothing comes back, all logged."""
    cert = getattr(pki, who) if who else None
    assert await _tls_roundtrip(tunnel.endpoint, cert) == b""
    await _wait_for(lambda: tunnel.refused == 1)
    assert tunnel.accepted == 0


async def test_worker_refuses_plain_tcp(tunnel: WorkerTunnel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("llmgw.agent.groups.groupnet.HANDSHAKE_TIMEOUT_S", 0.5)
    host, port = tunnel.endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"\x00" * 64)  # not a TLS record
    got = b""
    with contextlib.suppress(ConnectionError):
        got = await asyncio.wait_for(reader.read(100), 10)
    assert got == b""  # closed, nothing answered
    writer.close()
    await _wait_for(lambda: tunnel.refused == 1)
    assert tunnel.accepted == 0


async def test_worker_refusal_is_logged(tunnel: WorkerTunnel, pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="llmgw.agent.groups.groupnet"):
        await _tls_roundtrip(tunnel.endpoint, pki.other_node)
        await _wait_for(lambda: tunnel.refused == 1)
    assert "'node-x', not of the head 'head-1'" in caplog.text


# --- the head refuses a worker that is not the expected one ------------------------------------


async def test_head_refuses_worker_with_another_nodes_cert(tunnel: WorkerTunnel, pki: Pki) -> None:
    """The tunnel presents worker-1's cert; the head expects worker-2 there: nothing is relayed."""
    fwd = _forwarder(pki, {"worker-2": tunnel.endpoint})
    port = int((await fwd.start())["worker-2"].rsplit(":", 1)[1])
    fwd.allow(os.getpid())
    assert await _roundtrip(port) == b""
    assert fwd.accepted == 0
    await fwd.close()


async def test_head_refuses_worker_from_another_ca(engine: IsolatedProcess, pki: Pki) -> None:
    """A tunnel that accepts our head but presents a cert (CN worker-1) from another CA."""
    impostor = WorkerTunnel(
        engine=engine.link, head_node_id="head-1", ca=pki.ca, cert=pki.other_ca_worker[0],
        key=pki.other_ca_worker[1], host="127.0.0.1",
    )  # fmt: skip
    await impostor.start()
    fwd = _forwarder(pki, {"worker-1": impostor.endpoint})
    port = int((await fwd.start())["worker-1"].rsplit(":", 1)[1])
    fwd.allow(os.getpid())
    assert await _roundtrip(port) == b""
    assert fwd.accepted == 0
    await fwd.close()
    await impostor.close()


def test_verify_peer_cert(pki: Pki) -> None:
    ca = x509.load_pem_x509_certificate(pki.ca.read_bytes())

    def der(p: Path) -> bytes:
        return x509.load_pem_x509_certificate(p.read_bytes()).public_bytes(Encoding.DER)

    verify_peer_cert(der(pki.worker[0]), ca, "worker-1")
    with pytest.raises(GroupNetError, match="not node 'worker-2'"):
        verify_peer_cert(der(pki.worker[0]), ca, "worker-2")
    with pytest.raises(GroupNetError, match="not issued by the cluster CA"):
        verify_peer_cert(der(pki.other_ca_worker[0]), ca, "worker-1")
    with pytest.raises(GroupNetError, match="not an agent certificate"):
        verify_peer_cert(der(pki.server[0]), ca, "127.0.0.1")
    with pytest.raises(GroupNetError, match="not valid now"):
        verify_peer_cert(der(pki.worker[0]), ca, "worker-1", now=dt.datetime.now(dt.UTC) + dt.timedelta(days=4000))
    with pytest.raises(GroupNetError, match="CA certificate"):
        verify_peer_cert(ca.public_bytes(Encoding.DER), ca, "llmgw cluster CA")
    with pytest.raises(GroupNetError, match="no certificate"):
        verify_peer_cert(None, ca, "worker-1")


# --- the forwarder accepts only the head engine's process --------------------------------------


def short_allow_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on the forwarder looks for a connection's process among the allowed ones for 0.1 s,
    not ALLOW_WAIT_S (2 s, for an engine that dials before the runner's thread allows it), before
    it refuses (read at each connection): each refusal here waited the whole 2 s. A connection
    from a process allowed before it connected is found at the first look, made however short the
    wait."""
    monkeypatch.setattr("llmgw.agent.groups.groupnet.ALLOW_WAIT_S", 0.1)


async def test_forwarder_refuses_before_allow_and_other_processes(
    tunnel: WorkerTunnel, pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    short_allow_wait(monkeypatch)  # the only connection let through is this process's, allowed long before
    fwd = _forwarder(pki, {"worker-1": tunnel.endpoint})
    port = int((await fwd.start())["worker-1"].rsplit(":", 1)[1])
    assert await _roundtrip(port) == b""  # nobody allowed yet
    client = tmp_path / "client.py"
    client.write_text(CLIENT)

    async def run_client() -> str:
        proc = await asyncio.create_subprocess_exec(sys.executable, str(client), str(port), stdout=subprocess.PIPE)
        out, _ = await proc.communicate()
        return out.decode().strip()

    fwd.allow(os.getpid())  # us, not the client process
    assert await run_client() in ("b''", "error [Errno 104] Connection reset by peer")
    assert fwd.refused == 2
    assert await _roundtrip(port) == b"ping"  # we are allowed

    fwd.disallow(os.getpid())
    assert await _roundtrip(port) == b""
    assert tunnel.accepted == 1
    await fwd.close()


async def test_forwarder_accepts_the_allowed_child_process(
    tunnel: WorkerTunnel, pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The allowed pid is another process (as llama-server is): its connection goes through."""
    fwd = _forwarder(pki, {"worker-1": tunnel.endpoint})
    port = int((await fwd.start())["worker-1"].rsplit(":", 1)[1])
    client = tmp_path / "client.py"
    client.write_text("import time; time.sleep(0.5)\n" + CLIENT)
    proc = await asyncio.create_subprocess_exec(sys.executable, str(client), str(port), stdout=subprocess.PIPE)
    fwd.allow(proc.pid)
    out, _ = await proc.communicate()
    assert out.decode().strip() == "b'hello'"
    short_allow_wait(monkeypatch)  # the child's connection had the whole 2 s; this refusal need not wait them
    assert await _roundtrip(port) == b""  # the test process itself is not allowed
    await fwd.close()


def test_allow_unknown_pid() -> None:
    fwd = HeadForwarder.__new__(HeadForwarder)
    fwd._allowed = {}
    with pytest.raises(GroupNetError, match="cannot allow pid"):
        fwd.allow(2**22 + 12345)


# --- isolation ---------------------------------------------------------------------------------


@pytest.mark.skipif(netns_unavailable() is not None, reason=f"no network namespaces: {netns_unavailable()}")
async def test_engine_unreachable_from_host_namespace(engine: IsolatedProcess, tunnel: WorkerTunnel, pki: Pki) -> None:
    assert engine.link.isolated
    assert engine.link.port == NS_PORT
    assert os.stat(f"/proc/{engine.pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
    with socket.socket() as s:
        s.settimeout(2)
        with pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", NS_PORT))
    # ... while the agent reaches it through its namespace, and the head through the tunnel
    sock = await engine.link.connect()
    sock.close()
    assert await _tls_roundtrip(tunnel.endpoint, pki.head) == b"ping"


async def test_fallback_without_isolation(echo_script: Path) -> None:
    eng = await start_isolated(lambda port: [sys.executable, str(echo_script), str(port)], isolate=False)
    try:
        assert not eng.link.isolated
        assert eng.link.note == "isolation turned off"
        assert await _roundtrip(eng.link.port) == b"ping"  # reachable from the host: what isolation prevents
    finally:
        await eng.stop()


async def test_engine_that_exits_is_reported(tmp_path: Path) -> None:
    with pytest.raises(GroupNetError, match="exited"):
        await start_isolated(lambda port: [sys.executable, "-c", "raise SystemExit(3)"], ready_timeout_s=10)


async def test_link_in_namespace_of_a_gone_process() -> None:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await proc.wait()
    with pytest.raises(GroupNetError):
        await EngineLink.in_namespace_of(proc.pid, timeout_s=0.2)


async def test_an_engine_stopped_while_starting_is_not_left_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner stopped while its engine starts (the spec changed, the agent stops) cancels
    start_isolated: the engine must go with it. This cancels while it waits for the engine to
    listen (the long window: once start_isolated waits for it and the engine runs its own code);
    the short one while its namespace is joined is handled the same way but too brief to hit from
    a test."""
    import psutil  # noqa: PLC0415

    slow, started = tmp_path / "slow.py", tmp_path / "started"
    slow.write_text(f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(60)\n")  # never listens
    waiting = asyncio.Event()
    wait_listening = EngineLink.wait_listening

    async def spied(link: EngineLink, timeout_s: float, exited: Callable[[], bool] | None = None) -> None:
        waiting.set()
        await wait_listening(link, timeout_s, exited)

    monkeypatch.setattr(EngineLink, "wait_listening", spied)
    task = asyncio.create_task(start_isolated(lambda _port: [sys.executable, str(slow)], ready_timeout_s=30))
    await _wait_for(lambda: waiting.is_set() and started.exists(), within_s=20)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    def running() -> list[int]:
        return [p.pid for p in psutil.process_iter(["cmdline"]) if str(slow) in " ".join(p.info["cmdline"] or [])]

    await _wait_for(lambda: not running(), within_s=5)
