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

1. **The worker's engine in a network namespace of its own**, reachable only from the agent:
   :mod:`llmgw.agent.groups.isolation` (this module's other half, split along that seam: isolating
   a process there, carrying traffic to it here).

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
import datetime as dt
import logging
import socket
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.agent.groups.isolation import CONNECT_TIMEOUT_S, EngineLink, _tune
from llmgw.errors import GroupNetError
from llmgw.tlsconf import peer_common_name

log = logging.getLogger(__name__)

#: Seconds a peer has to complete the TLS handshake before it is dropped.
HANDSHAKE_TIMEOUT_S = 10.0
#: Write buffer high/low water marks of a relayed transport, in bytes: above ``WRITE_HIGH`` the
#: other side stops being read until the buffer drains below ``WRITE_LOW``.
WRITE_HIGH = 8 * 1024 * 1024
WRITE_LOW = 2 * 1024 * 1024
#: Seconds the head forwarder keeps looking for an accepted connection's process among the allowed
#: ones: the engine dials at once, the runner allows its pid right after Popen (another thread).
ALLOW_WAIT_S = 2.0


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


class _Relay:
    """What both listeners (:class:`WorkerTunnel`, :class:`HeadForwarder`) share: the connections
    they own (:class:`_Relays`), their counters and traffic, and joining an accepted connection to
    the one opened for it (:meth:`_splice`)."""

    def __init__(self) -> None:
        self._relays = _Relays()
        self.refused = 0  #: connections refused so far (tests and metrics)
        self.accepted = 0  #: connections relayed so far
        self.traffic = Traffic()

    def _pipe(self, *, outward: bool) -> _Pipe:
        """A new relay end counted in :attr:`traffic` (``outward``: toward the engine or worker)."""
        return _Pipe(self._relays.transports, self.traffic, outward=outward)

    def _splice(self, inbound: _Pipe, outbound: _Pipe) -> None:
        """Count one more connection relayed and relay both ways between its two ends."""
        self.accepted += 1
        outbound.link(inbound)
        inbound.link(outbound)

    async def close(self) -> None:
        """Stop listening and drop every connection (the engine and its link are the caller's)."""
        await self._relays.close()


# --- the worker's side ---------------------------------------------------------------------------


class WorkerTunnel(_Relay):
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
        super().__init__()
        self._ctx = worker_server_context(ca, cert, key)

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
        inbound = self._pipe(outward=True)
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
            _, outbound = await loop.create_connection(lambda: self._pipe(outward=False), sock=sock)
        except OSError:
            sock.close()
            transport.abort()
            raise
        log.info("groupnet: head %s (%s) connected to the engine", cn, addr)
        self._splice(inbound, outbound)


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


class HeadForwarder(_Relay):
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
        super().__init__()  # refused and accepted count local connections
        self._allowed: dict[int, psutil.Process] = {}
        self.local: dict[str, str] = {}  #: node id -> the local endpoint for --rpc

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
                        lambda: self._pipe(outward=False),
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
                _, inbound = await loop.connect_accepted_socket(lambda: self._pipe(outward=True), conn)
            except OSError:
                transport.abort()
                raise
        except BaseException:
            conn.close()
            raise
        log.info("groupnet: pid %d connected to worker %s", pid, node)
        self._splice(inbound, outbound)
