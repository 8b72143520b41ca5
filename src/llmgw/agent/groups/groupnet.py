"""The network of a replica spread over several nodes: llama.cpp's RPC traffic over the agents' mTLS.

A model larger than one node runs as one ``llama-server --rpc w1,w2,...`` on the group's *head*
node and one ``rpc-server`` per *worker* node. llama.cpp's RPC protocol has no authentication at
all: whoever reaches an ``rpc-server`` can allocate, read and write its device memory and run
graphs on it, and its authors warn never to expose it. This module makes sure that neither another
process on the worker's machine nor another node can drive a worker:

::

    head node                                           worker node
    llama-server --rpc 127.0.0.1:P ──TCP──▶ HeadForwarder ══mTLS══▶ WorkerTunnel ──▶ rpc-server
      (only this pid may connect:           (head's client cert;     (only the head's     (its own network
       checked with psutil)                  worker's cert checked    cert is accepted)    namespace: lo only)
                                             by hand)

1. **The worker's engine in a network namespace of its own** (:func:`start_isolated`,
   :func:`isolated_argv`, :class:`EngineLink`). As root on Linux, ``rpc-server`` is started in a
   fresh network namespace that holds nothing but its own loopback, and listens on
   ``127.0.0.1:PORT`` *there*. No process in the host's namespace (any other process on the
   machine, any other node) has a route to it: connecting to ``127.0.0.1:PORT`` on the host reaches
   the host's loopback, not the engine's. The agent reaches it by creating its sockets inside that
   namespace: a short-lived thread ``setns()``'s into the namespace (through a file descriptor on
   ``/proc/<pid>/ns/net`` held open from the start, so a reused pid cannot redirect us), creates the
   socket and exits; a socket keeps the namespace it was created in, so the event loop then
   connects it and relays bytes as usual. Joining a namespace needs CAP_SYS_ADMIN, which only
   root (the agent) has.

   How the namespace is made: the engine's argv is prefixed with a tiny Python launcher
   (``python -I -c LAUNCHER argv...``) that calls ``unshare(CLONE_NEWNET)`` through ctypes, brings
   ``lo`` up with the ``SIOCGIFFLAGS``/``SIOCSIFFLAGS`` ioctls and ``execv()``'s the engine, so the
   engine keeps the launcher's pid. Chosen over ``unshare --net`` + ``ip link set lo up`` (needs
   util-linux *and* iproute2 and a shell to chain them) and over a ``preexec_fn`` (not safe in a
   process with threads, which the agent has): it needs nothing but the interpreter the agent runs
   on, and it works with the agent's own ``subprocess.Popen`` (log files, ``start_new_session``).

   When not root, not on Linux, or when ``unshare`` fails (a container without CAP_SYS_ADMIN),
   the engine falls back to ``127.0.0.1`` in the host namespace: a warning is logged and
   :attr:`EngineLink.isolated` is False with :attr:`EngineLink.note` saying why, for the caller to
   report. Then any local process can drive the engine (the mTLS tunnel still keeps other nodes
   out).

2. **WorkerTunnel**: on the worker, a TLS listener on the node's cluster address. It presents the
   worker's agent certificate, *requires* a client certificate from the cluster CA, and accepts
   only the certificate whose CN is the group's head node id; every other connection (no TLS, no
   certificate, another CA, another node) is closed at once and logged. Accepted connections are
   relayed to the isolated engine.

3. **HeadForwarder**: on the head, one listener per worker on ``127.0.0.1`` (a free port) for
   ``llama-server --rpc``. Loopback is reachable by every local process, so each accepted
   connection is checked with psutil to come from the head engine's own process (its pid, given by
   :meth:`HeadForwarder.allow` once the engine started; before that every connection is refused),
   then forwarded over mTLS with the head's agent certificate.

   The agents' certificates carry extendedKeyUsage *clientAuth only*, so OpenSSL acting as a TLS
   client rejects one presented by a server ("unsupported certificate purpose"). The head's leg
   therefore runs with ``CERT_NONE`` in OpenSSL and verifies the worker's certificate itself right
   after the handshake (:func:`verify_peer_cert`): issued and signed by the cluster CA, within its
   validity dates, not a CA, an agent (clientAuth) certificate, CN equal to the expected worker's
   node id. The handshake still proves that the peer holds the private key of the certificate it
   presented (TLS 1.3 CertificateVerify / TLS 1.2 signed key exchange are checked whatever the
   verify mode), so the check after the handshake is as strong as OpenSSL's. No byte is relayed
   before it passed.

Relaying (:class:`_Pipe`) works on transports and protocols, not streams: each chunk the kernel
(or TLS) hands over is written straight to the other side (no intermediate stream buffer), with
flow control both ways (a full write buffer on one side pauses reading on the other). Buffers are
large (``READ_CHUNK`` per read, ``WRITE_HIGH`` write buffer) because RPC moves model weights:
hundreds of MB to GB while a model loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import datetime as dt
import logging
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import GroupNetError
from llmgw.tlsconf import peer_common_name

log = logging.getLogger(__name__)

#: The port the engine listens on inside its own namespace (rpc-server's default; nothing else
#: lives there, so it is always free).
NS_PORT = 50052
#: Seconds a peer has to complete the TLS handshake before it is dropped.
HANDSHAKE_TIMEOUT_S = 10.0
#: Seconds to connect (TCP + TLS) from the head to a worker.
CONNECT_TIMEOUT_S = 10.0
#: Bytes of a socket's kernel buffers we ask for (the kernel may cap it at net.core.[rw]mem_max).
SOCK_BUF = 4 * 1024 * 1024
#: Write buffer high/low water marks of a relayed transport, in bytes: above ``WRITE_HIGH`` the
#: other side stops being read until the buffer drains below ``WRITE_LOW``.
WRITE_HIGH = 8 * 1024 * 1024
WRITE_LOW = 2 * 1024 * 1024
#: Seconds the head forwarder keeps looking for an accepted connection's process among the allowed
#: ones: the engine dials at once, the runner allows its pid right after Popen (another thread).
ALLOW_WAIT_S = 2.0
#: The exit status of the launcher when it cannot make the namespace (before exec).
LAUNCHER_NO_NS = 121

_CLONE_NEWNET = 0x40000000

#: Run as ``python -I -c LAUNCHER argv...``: a new network namespace, ``lo`` up, exec the engine.
LAUNCHER = r"""
import ctypes, fcntl, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x40000000) != 0:
    sys.stderr.write("llmgw groupnet: unshare(CLONE_NEWNET) failed: %s\n" % os.strerror(ctypes.get_errno()))
    sys.stderr.flush()
    os._exit(121)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
ifr = fcntl.ioctl(s, 0x8913, struct.pack("16sH22x", b"lo", 0))
flags = struct.unpack("16sH22x", ifr)[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))
s.close()
os.execv(sys.argv[1], sys.argv[1:])
"""


# --- the engine's namespace -------------------------------------------------------------------


def netns_unavailable() -> str | None:
    """Why the engine cannot get a network namespace of its own here, or None when it can (root on Linux)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "the agent does not run as root, so it cannot create or join network namespaces"
    if not os.path.exists("/proc/self/ns/net"):
        return "/proc/self/ns/net is missing (no network namespaces in this kernel)"
    return None


def isolated_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` prefixed with the launcher that runs it in a new network namespace with ``lo`` up.

    The engine keeps the launcher's pid (``execv``), so ``/proc/<pid>/ns/net`` is its namespace.
    ``argv[0]`` must be a path (it is not looked up on PATH). Exits with :data:`LAUNCHER_NO_NS` when
    ``unshare`` is refused, before running anything.
    """
    return [sys.executable, "-I", "-c", LAUNCHER, *argv]


def _netns_ino(path: str) -> int:
    return os.stat(path).st_ino


def _setns(ns_fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(ns_fd, _CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setns into the engine's network namespace: {os.strerror(e)}")


def _socket_in_netns(ns_fd: int) -> socket.socket:
    """A new TCP socket created inside the namespace ``ns_fd`` refers to.

    Done in a dedicated thread that enters the namespace (``setns`` changes only the calling
    thread's namespace), creates the socket and ends; the namespace dies with the thread, so no
    thread of the agent (event loop or pool) is ever left in the engine's namespace.
    """
    out: list[socket.socket] = []
    err: list[BaseException] = []

    def enter_and_create() -> None:
        try:
            _setns(ns_fd)
            out.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        except BaseException as e:  # handed to the caller below
            err.append(e)

    t = threading.Thread(target=enter_and_create, name="groupnet-setns", daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # RPC is request/response: no Nagle delay
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)


@dataclass
class EngineLink:
    """How the agent reaches the protected engine: ``127.0.0.1:port`` inside the engine's own network
    namespace (``isolated``), or in the host's (the fallback; ``note`` says why).

    Make one with :meth:`in_namespace_of` (after starting the engine with :func:`isolated_argv`) or
    :meth:`host`; :meth:`close` releases the namespace file descriptor.
    """

    port: int
    isolated: bool
    note: str = ""
    _ns_fd: int | None = field(default=None, repr=False)

    @classmethod
    def host(cls, port: int, note: str = "") -> EngineLink:
        """The engine on ``127.0.0.1:port`` in the host namespace (reachable by every local process)."""
        return cls(port=port, isolated=False, note=note)

    @classmethod
    async def in_namespace_of(
        cls, pid: int, port: int = NS_PORT, *, timeout_s: float = 10.0, exited: Callable[[], bool] | None = None
    ) -> EngineLink:
        """The engine ``pid`` (started through :func:`isolated_argv`) on ``127.0.0.1:port`` in its namespace.

        Waits up to ``timeout_s`` seconds for the process to have left the host's namespace (the
        launcher unshares right after it starts), then holds a file descriptor on it.

        Raises:
            GroupNetError: the process exited first (``exited()`` True or the pid gone) or never
                left the host's namespace.
        """
        own = _netns_ino("/proc/self/ns/net")
        path = f"/proc/{pid}/ns/net"
        deadline = time.monotonic() + timeout_s
        while True:
            if exited is not None and exited():
                raise GroupNetError(f"the engine (pid {pid}) exited before its network namespace was made")
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError as e:
                raise GroupNetError(f"the engine (pid {pid}) is gone") from e
            if os.fstat(fd).st_ino != own:
                return cls(port=port, isolated=True, _ns_fd=fd)
            os.close(fd)
            if time.monotonic() > deadline:
                raise GroupNetError(f"the engine (pid {pid}) did not leave the host network namespace in {timeout_s} s")
            await asyncio.sleep(0.005)

    async def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> socket.socket:
        """A connected, non-blocking TCP socket to the engine.

        Raises:
            OSError: refused (not listening yet, or gone), or the namespace cannot be entered.
        """
        if self._ns_fd is not None:
            # Synchronous on purpose: a thread started and joined (about 0.1 ms, once per connection),
            # so a cancellation can never leave a socket made by the thread behind.
            sock = _socket_in_netns(self._ns_fd)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            _tune(sock)
            async with asyncio.timeout(timeout_s):
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
        except BaseException:
            sock.close()
            raise
        return sock

    async def wait_listening(self, timeout_s: float, exited: Callable[[], bool] | None = None) -> None:
        """Return once the engine accepts connections (a probe connection is opened and closed).

        Raises:
            GroupNetError: ``exited()`` became True, or ``timeout_s`` seconds passed.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if exited is not None and exited():
                raise GroupNetError("the engine exited before it listened")
            try:
                sock = await self.connect(timeout_s=1.0)
            except (OSError, TimeoutError):
                if time.monotonic() > deadline:
                    raise GroupNetError(
                        f"the engine did not listen on 127.0.0.1:{self.port} within {timeout_s} s"
                    ) from None
                await asyncio.sleep(0.05)
                continue
            sock.close()
            return

    def close(self) -> None:
        """Release the namespace file descriptor (the namespace lives on as long as the engine)."""
        if self._ns_fd is not None:
            os.close(self._ns_fd)
            self._ns_fd = None


def free_local_port() -> int:
    """A TCP port free on ``127.0.0.1`` right now (racy by nature: for the non-isolated fallback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def rpc_server_argv(binary: str | Path, *extra: str) -> Callable[[int], list[str]]:
    """The argv of ``rpc-server`` listening on ``127.0.0.1:<port>``, for :func:`start_isolated`."""
    return lambda port: [str(binary), "-H", "127.0.0.1", "-p", str(port), *extra]


@dataclass
class IsolatedProcess:
    """An engine started by :func:`start_isolated`: the process and the way to reach it."""

    proc: subprocess.Popen[bytes]
    link: EngineLink

    @property
    def pid(self) -> int:
        """The engine's pid (the launcher exec'd it: the same process)."""
        return self.proc.pid

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s`` seconds; then release the link."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        self.link.close()


async def start_isolated(
    argv_for_port: Callable[[int], Sequence[str]],
    *,
    isolate: bool | None = None,
    ready_timeout_s: float = 60.0,
    stdout: IO[bytes] | int | None = subprocess.DEVNULL,
    stderr: IO[bytes] | int | None = subprocess.STDOUT,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    start_new_session: bool = True,
) -> IsolatedProcess:
    """Start an engine listening on ``127.0.0.1`` in a network namespace of its own, and wait until it listens.

    ``argv_for_port(port)`` is the engine's argv listening on ``127.0.0.1:port`` (e.g.
    :func:`rpc_server_argv`); ``argv[0]`` must be a path. ``isolate``: True requires the namespace
    (a :class:`GroupNetError` when it cannot be made), False never makes one, None (default) makes
    one when possible and otherwise falls back to the host namespace on a free port, with a
    warning and :attr:`EngineLink.isolated` False. ``ready_timeout_s``: seconds for the engine to
    listen. The engine's output goes to ``stdout``/``stderr`` (like ``subprocess.Popen``).

    Raises:
        GroupNetError: the engine exited or did not listen in time (it is then stopped).
    """
    why_not = netns_unavailable()
    if isolate and why_not:
        raise GroupNetError(f"cannot isolate the engine: {why_not}")
    popen_kw: dict[str, Any] = {
        "stdin": subprocess.DEVNULL, "stdout": stdout, "stderr": stderr, "cwd": cwd,
        "env": dict(env) if env is not None else None, "start_new_session": start_new_session,
    }  # fmt: skip
    if isolate is not False and why_not is None:
        proc = _spawn(isolated_argv(argv_for_port(NS_PORT)), popen_kw)
        try:
            link = await EngineLink.in_namespace_of(proc.pid, NS_PORT, exited=lambda: proc.poll() is not None)
        except asyncio.CancelledError:
            _kill_now(proc)  # the runner was stopped while the engine was starting: never leave it behind
            raise
        except GroupNetError:
            if proc.poll() is None:
                proc.kill()
            code = await asyncio.to_thread(proc.wait)
            if code != LAUNCHER_NO_NS or isolate:
                raise GroupNetError(f"the engine exited with status {code} before it listened") from None
            why_not = "unshare(CLONE_NEWNET) was refused (see the engine's log)"
        else:
            return await _ready(IsolatedProcess(proc, link), ready_timeout_s)
    note = why_not or "isolation turned off"
    if isolate is None:
        log.warning("groupnet: the engine runs in the host network namespace, reachable by any local process: %s", note)
    port = free_local_port()
    proc = _spawn(list(argv_for_port(port)), popen_kw)
    return await _ready(IsolatedProcess(proc, EngineLink.host(port, note)), ready_timeout_s)


def _kill_now(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` if it runs and reap it (blocking briefly: it cannot ignore SIGKILL)."""
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def _spawn(argv: list[str], kw: dict[str, Any]) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(argv, **kw)
    except OSError as e:
        raise GroupNetError(f"cannot run {argv[0]}: {e}") from e


async def _ready(engine: IsolatedProcess, timeout_s: float) -> IsolatedProcess:
    try:
        await engine.link.wait_listening(timeout_s, exited=lambda: engine.proc.poll() is not None)
    except BaseException:
        await engine.stop()
        raise
    return engine


# --- certificates --------------------------------------------------------------------------------


def load_ca_cert(ca: Path) -> x509.Certificate:
    """The cluster CA certificate (PEM)."""
    return x509.load_pem_x509_certificate(ca.read_bytes())


def verify_peer_cert(
    der: bytes | None, ca_cert: x509.Certificate, node_id: str, now: dt.datetime | None = None
) -> None:
    """Check by hand the agent certificate a worker presented (DER), as OpenSSL would have.

    Accepted only when: it was issued and signed by ``ca_cert``; ``now`` is within its validity;
    it is not a CA; its extendedKeyUsage has clientAuth (an agent's certificate, not the control
    plane's server certificate); its CN is ``node_id``. That the peer holds its private key was
    proved by the handshake.

    Raises:
        GroupNetError: which check failed.
    """
    if not der:
        raise GroupNetError("the worker presented no certificate")
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as e:
        raise GroupNetError(f"the worker's certificate cannot be read: {e}") from e
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature) as e:
        raise GroupNetError(f"the worker's certificate was not issued by the cluster CA ({type(e).__name__})") from e
    now = now or dt.datetime.now(dt.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise GroupNetError(
            "the worker's certificate is not valid now "
            f"(valid {cert.not_valid_before_utc} to {cert.not_valid_after_utc})"
        )
    try:
        if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise GroupNetError("the worker presented a CA certificate")
    except x509.ExtensionNotFound:
        pass
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        usages = None
    if usages is None or ExtendedKeyUsageOID.CLIENT_AUTH not in usages:
        raise GroupNetError("the worker's certificate is not an agent certificate (no clientAuth usage)")
    cns = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if cns != [node_id]:
        raise GroupNetError(f"the worker's certificate names {cns or 'no CN'}, not node {node_id!r}")


def worker_server_context(ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
    """The worker's TLS context: its agent certificate, a client certificate from ``ca`` required."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cafile=str(ca))
    ctx.load_cert_chain(str(cert), str(key))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def head_client_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The head's TLS context towards a worker: its agent certificate; the worker's is checked by
    :func:`verify_peer_cert` after the handshake (``CERT_NONE`` here: see the module docstring)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


# --- relaying ----------------------------------------------------------------------------------


@dataclass
class Traffic:
    """Bytes relayed by a listener since it started, by direction (for logs and metrics)."""

    sent: int = 0  #: towards the engine (head engine -> worker engine)
    received: int = 0  #: back from the engine

    def add(self, n: int, outward: bool) -> None:
        if outward:
            self.sent += n
        else:
            self.received += n


class _Pipe(asyncio.Protocol):
    """One side of a relay: what it receives is written to its peer's transport.

    Until :meth:`link` it holds what arrives (nothing is relayed before both sides are checked).
    Flow control: when our transport's write buffer is full (``pause_writing``) the peer stops
    reading, and resumes when it drained. Either side closing closes the other once its buffered
    bytes are written.
    """

    def __init__(self, live: set[asyncio.Transport], traffic: Traffic, outward: bool) -> None:
        self.transport: asyncio.Transport | None = None
        self._traffic = traffic
        self._outward = outward
        self.peer: _Pipe | None = None
        self._held: list[bytes] = []
        self._live = live
        self._lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not isinstance(transport, asyncio.Transport):
            raise TypeError(f"a relay needs a stream transport, not {transport!r}")
        self.transport = transport
        self._live.add(transport)
        transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_LOW)

    def link(self, peer: _Pipe) -> None:
        self.peer = peer
        held, self._held = self._held, []
        for chunk in held:
            self.data_received(chunk)
        if self._lost:
            self.connection_lost(None)

    def data_received(self, data: bytes) -> None:
        if self.peer is None or self.peer.transport is None:
            self._held.append(data)
            return
        self._traffic.add(len(data), self._outward)
        self.peer.transport.write(data)

    def eof_received(self) -> bool:
        return False  # close our transport: connection_lost closes the peer

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self.transport is not None:
            self._live.discard(self.transport)
        if self.peer is not None and self.peer.transport is not None and not self.peer.transport.is_closing():
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None and not self.peer.transport.is_closing():
            self.peer.transport.resume_reading()


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise GroupNetError(f"{endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def _join_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Relays:
    """What a listener owns: its accept task, its per-connection tasks, its live transports."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()
        self.transports: set[asyncio.Transport] = set()
        self.listeners: list[socket.socket] = []
        self.accepters: list[asyncio.Task[None]] = []

    def spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        for t in [*self.accepters, *self.tasks]:
            t.cancel()
        for t in [*self.accepters, *self.tasks]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for s in self.listeners:
            s.close()
        for tr in list(self.transports):
            tr.abort()
        self.transports.clear()
        self.listeners.clear()
        self.accepters.clear()
        await asyncio.sleep(0)  # let the aborted transports' connection_lost run


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=64, reuse_port=False)
    sock.setblocking(False)
    return sock


async def _accept_loop(sock: socket.socket, relays: _Relays, handle: Callable[[socket.socket, Any], Any]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            conn, addr = await loop.sock_accept(sock)
        except OSError as e:
            log.warning("groupnet: accept on %s failed: %s", sock.getsockname(), e)
            await asyncio.sleep(0.1)
            continue
        conn.setblocking(False)
        _tune(conn)
        relays.spawn(handle(conn, addr))


# --- the worker's side ---------------------------------------------------------------------------


class WorkerTunnel:
    """On a worker node: a TLS listener that lets the group's head, and only it, reach the engine.

    ``host``/``port``: where to listen (the node's cluster address; port 0 = a free one).
    ``ca``/``cert``/``key``: the cluster CA and this agent's certificate and key (PEM paths).
    ``head_node_id``: the only CN accepted. ``engine``: how to reach the protected engine.
    """

    def __init__(
        self, *, engine: EngineLink, head_node_id: str, ca: Path, cert: Path, key: Path, host: str, port: int = 0
    ) -> None:
        if not head_node_id:
            raise GroupNetError("a worker tunnel needs the head's node id")
        self.engine = engine
        self.head_node_id = head_node_id
        self.host, self.port = host, port
        self._ctx = worker_server_context(ca, cert, key)
        self._relays = _Relays()
        self.refused = 0  #: connections refused so far (tests and metrics)
        self.accepted = 0  #: connections relayed so far
        self.traffic = Traffic()

    async def start(self) -> str:
        """Listen; return the endpoint ``host:port`` for the head."""
        sock = _listen(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._relays.listeners.append(sock)
        self._relays.accepters.append(
            asyncio.get_running_loop().create_task(_accept_loop(sock, self._relays, self._handle))
        )
        log.info("groupnet: worker tunnel for head %s on %s", self.head_node_id, self.endpoint)
        return self.endpoint

    @property
    def endpoint(self) -> str:
        """``host:port`` of the listener."""
        return _join_endpoint(self.host, self.port)

    def _refuse(self, addr: Any, why: str) -> None:
        self.refused += 1
        log.warning("groupnet: refused %s on the worker tunnel: %s", addr, why)

    async def _handle(self, conn: socket.socket, addr: Any) -> None:
        loop = asyncio.get_running_loop()
        inbound = _Pipe(self._relays.transports, self.traffic, outward=True)
        try:
            transport, _ = await loop.connect_accepted_socket(
                lambda: inbound, conn, ssl=self._ctx, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S
            )
        except (OSError, TimeoutError, ssl.SSLError) as e:
            conn.close()
            self._refuse(addr, f"TLS handshake failed: {e}")
            return
        ssl_obj = transport.get_extra_info("ssl_object")
        cn = peer_common_name(ssl_obj.getpeercert() if ssl_obj is not None else None)
        if cn != self.head_node_id:
            transport.abort()
            self._refuse(addr, f"certificate of {cn!r}, not of the head {self.head_node_id!r}")
            return
        try:
            sock = await self.engine.connect()
        except (OSError, TimeoutError) as e:
            log.warning("groupnet: the engine does not answer on 127.0.0.1:%d: %s", self.engine.port, e)
            transport.abort()
            return
        try:
            _, outbound = await loop.create_connection(
                lambda: _Pipe(self._relays.transports, self.traffic, outward=False), sock=sock
            )
        except OSError:
            sock.close()
            transport.abort()
            raise
        self.accepted += 1
        log.info("groupnet: head %s (%s) connected to the engine", cn, addr)
        outbound.link(inbound)
        inbound.link(outbound)

    async def close(self) -> None:
        """Stop listening and drop every connection (the engine and its link are the caller's)."""
        await self._relays.close()


# --- the head's side -----------------------------------------------------------------------------


def _belongs_to(procs: Sequence[psutil.Process], local: tuple[str, int], peer: tuple[str, int]) -> int | None:
    """The pid among ``procs`` that owns the TCP socket ``peer`` -> ``local``, or None.

    psutil matches the socket inodes of the process's file descriptors with the kernel's table of
    *our* network namespace, so a socket with the same addresses in another namespace never matches.
    """
    for proc in procs:
        try:
            if not proc.is_running():  # also false when the pid was reused (create time differs)
                continue
            conns = proc.net_connections(kind="tcp")
        except psutil.Error:
            continue
        for c in conns:
            if c.laddr and c.raddr and (c.laddr.ip, c.laddr.port) == peer and (c.raddr.ip, c.raddr.port) == local:
                return proc.pid
    return None


class HeadForwarder:
    """On the head node: ``127.0.0.1`` listeners for ``llama-server --rpc``, one per worker, each
    forwarding over mTLS to that worker's :class:`WorkerTunnel`.

    ``workers``: node id -> endpoint ``host:port`` (in the order ``--rpc`` lists them).
    ``ca``/``cert``/``key``: the cluster CA and this (the head's) agent certificate and key.

    Any local process can connect to a loopback port, and what it sends would reach the workers
    as the head (its certificate), so a connection is relayed only when it comes from a process
    given to :meth:`allow` (the head engine, once started): its source address must be the local
    end of one of that process's TCP connections. Connections before :meth:`allow` are refused.
    """

    def __init__(
        self,
        *,
        workers: Mapping[str, str],
        ca: Path,
        cert: Path,
        key: Path,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        if not workers:
            raise GroupNetError("a head forwarder needs at least one worker")
        self.workers = {node: _split_endpoint(ep) for node, ep in workers.items()}
        self._ca_cert = load_ca_cert(ca)
        self._ctx = head_client_context(cert, key)
        self.connect_timeout_s = connect_timeout_s
        self._allowed: dict[int, psutil.Process] = {}
        self._relays = _Relays()
        self.local: dict[str, str] = {}  #: node id -> the local endpoint for --rpc
        self.refused = 0  #: local connections refused so far
        self.accepted = 0  #: local connections relayed so far
        self.traffic = Traffic()

    async def start(self) -> dict[str, str]:
        """Listen on ``127.0.0.1`` for every worker; return node id -> local ``127.0.0.1:port``."""
        loop = asyncio.get_running_loop()
        for node in self.workers:
            sock = _listen("127.0.0.1", 0)
            self._relays.listeners.append(sock)
            port = sock.getsockname()[1]
            self.local[node] = f"127.0.0.1:{port}"

            async def handle(conn: socket.socket, addr: Any, node: str = node, port: int = port) -> None:
                await self._handle(node, port, conn, addr)

            self._relays.accepters.append(loop.create_task(_accept_loop(sock, self._relays, handle)))
        return dict(self.local)

    @property
    def rpc_arg(self) -> str:
        """The value of ``llama-server --rpc``: the local endpoints, in the workers' order."""
        return ",".join(self.local[n] for n in self.workers)

    def allow(self, pid: int) -> None:
        """Accept connections from process ``pid`` (the head engine, once started).

        Raises:
            GroupNetError: no such process.
        """
        try:
            self._allowed[pid] = psutil.Process(pid)
        except psutil.Error as e:
            raise GroupNetError(f"cannot allow pid {pid}: {e}") from e

    def disallow(self, pid: int) -> None:
        """Stop accepting new connections from ``pid`` (the engine stopped)."""
        self._allowed.pop(pid, None)

    def _refuse(self, addr: Any, why: str) -> None:
        self.refused += 1
        log.warning("groupnet: refused local connection from %s to the head forwarder: %s", addr, why)

    async def _handle(self, node: str, port: int, conn: socket.socket, addr: Any) -> None:
        loop = asyncio.get_running_loop()
        try:
            peer = (str(addr[0]), int(addr[1]))
            pid = None
            # The engine dials its workers milliseconds after it starts, while the runner's thread
            # may not have called allow() yet: look again for up to ALLOW_WAIT_S (a foreign process
            # is still refused, just that much later).
            deadline = loop.time() + ALLOW_WAIT_S
            while True:
                pid = await asyncio.to_thread(_belongs_to, list(self._allowed.values()), ("127.0.0.1", port), peer)
                if pid is not None or loop.time() >= deadline:
                    break
                await asyncio.sleep(0.05)
            if pid is None:
                self._refuse(addr, "not from the head engine's process")
                conn.close()
                return
            host, wport = self.workers[node]
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    transport, outbound = await loop.create_connection(
                        lambda: _Pipe(self._relays.transports, self.traffic, outward=False),
                        host, wport, ssl=self._ctx, server_hostname=None,
                    )  # fmt: skip
            except (OSError, TimeoutError, ssl.SSLError) as e:
                log.warning("groupnet: cannot reach worker %s at %s: %s", node, _join_endpoint(host, wport), e)
                conn.close()
                return
            ssl_obj = transport.get_extra_info("ssl_object")
            try:
                verify_peer_cert(ssl_obj.getpeercert(binary_form=True) if ssl_obj else None, self._ca_cert, node)
            except GroupNetError as e:
                log.warning("groupnet: refused worker %s at %s: %s", node, _join_endpoint(host, wport), e)
                transport.abort()
                conn.close()
                return
            try:
                _, inbound = await loop.connect_accepted_socket(
                    lambda: _Pipe(self._relays.transports, self.traffic, outward=True), conn
                )
            except OSError:
                transport.abort()
                raise
        except BaseException:
            conn.close()
            raise
        self.accepted += 1
        log.info("groupnet: pid %d connected to worker %s", pid, node)
        outbound.link(inbound)
        inbound.link(outbound)

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        await self._relays.close()
