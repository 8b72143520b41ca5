"""A group worker's engine in a network namespace of its own: :func:`start_isolated`,
:func:`isolated_argv`, :class:`EngineLink`, :class:`IsolatedProcess`.

The seam this module is split from :mod:`llmgw.agent.groups.groupnet` along: here, how a process is
made unreachable from the host (and how the agent still reaches it); there, the mTLS tunnels that
carry the group's traffic between nodes to it. llama.cpp's RPC protocol has no authentication at
all, so the worker's ``rpc-server`` must be reachable by nothing but the tunnel:

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
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from llmgw.errors import GroupNetError

log = logging.getLogger(__name__)

#: The port the engine listens on inside its own namespace (rpc-server's default; nothing else
#: lives there, so it is always free).
NS_PORT = 50052
#: Seconds to connect (TCP + TLS) from the head to a worker.
CONNECT_TIMEOUT_S = 10.0
#: Bytes of a socket's kernel buffers we ask for (the kernel may cap it at net.core.[rw]mem_max).
SOCK_BUF = 4 * 1024 * 1024
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
