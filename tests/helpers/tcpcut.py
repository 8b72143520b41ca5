"""A TCP forwarder that a test can cut, as a network partition would cut a control plane off its
database, and heal again.

:class:`CutProxy` listens on a free loopback port and forwards each connection to ``target``, one
thread per direction. :meth:`CutProxy.cut` stops moving bytes both ways without closing anything
(the sockets stay open and the proxy's kernel still acknowledges what arrives, as the kernels at both
ends of a partition would keep their connections); new connections are still accepted, and get no
answer (libpq's ``connect_timeout`` ends them). :meth:`CutProxy.heal` moves the bytes again, those
held during the cut first, as TCP would deliver them once the path is back.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading


class CutProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` until :meth:`close`; :meth:`cut` / :meth:`heal`.

    Args:
        target: (host, port) to forward to.

    Example::

        with CutProxy(("127.0.0.1", 5432)) as proxy:
            url = f"postgresql://u@127.0.0.1:{proxy.port}/db"
            proxy.cut()
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="cutproxy-accept").start()

    def cut(self) -> None:
        """Stop moving bytes (both ways, every connection, new ones too)."""
        self._flowing.clear()

    def heal(self) -> None:
        """Move bytes again."""
        self._flowing.set()

    def close(self) -> None:
        """Close the listener and every connection."""
        self._closed.set()
        self._flowing.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.close()

    def __enter__(self) -> CutProxy:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                continue
            upstream.settimeout(None)
            with self._lock:
                self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True, name="cutproxy-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                self._flowing.wait()
                ready, _, _ = select.select([src], [], [], 0.1)
                if not ready or not self._flowing.is_set():
                    continue
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except (OSError, ValueError):  # ValueError: select() on a socket the other pump closed (fd -1)
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
