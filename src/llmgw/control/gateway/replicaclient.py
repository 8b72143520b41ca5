"""A lean HTTP/1.1 client for the engine replicas: keep-alive connections on asyncio protocols, answers
parsed by ``httptools`` (llhttp, uvicorn's parser).

Why not ``aiohttp.ClientSession`` here: it was the largest part of the gateway's own CPU per proxied
request (``ClientSession._request``, its timer and tracing machinery, a task per request body).
Measured with ``wrk -t2 -c16`` for 10 s against an instant upstream on this 2-core machine (the
gateway process's CPU time per request, A/B runs interleaved, 2026-12-05, load 3.5-8): a bare aiohttp
proxy 165 µs with ``ClientSession``, 83 µs with this client; the gateway with everything on (key,
limiter, usage, metrics, access log) 336 µs before, 219 µs after (medians of 3); relaying a stream,
100 µs per SSE event before, 70 after (medians of 5 streams of 1,000 events).

What it does, and no more (the gateway's replicas are llama-server and vLLM on a trusted network):

* A request's head as given (``POST`` for the answers, ``GET /props`` for the slots), the body sent at once
  (``Content-Length``); no redirects, cookies, proxies, TLS, or compression (no ``Accept-Encoding`` is
  sent, so the engine answers identity).
* Connections per ``host:port`` are kept after a complete answer the engine lets be kept
  (``should_keep_alive``), reused newest first, and closed after ``keepalive_s`` idle (an engine closing
  its side meanwhile takes them out at once). At most ``limit`` are in use at once; more wait.
* A connection that cannot be made (refused, unreachable, or no answer within ``connect_timeout_s``)
  raises :class:`ReplicaUnreachable`: nothing was sent, another replica may be tried. One that breaks
  after the request went out (closed, reset, an answer that is not HTTP) raises :class:`ReplicaBroken`.
  Timeouts raise :class:`TimeoutError`: ``total_s`` for the whole exchange (connect, answer, body),
  ``read_s`` for silence while waiting for the answer or its next chunk (not counted while the
  reader has 64 KiB unread and reading is paused).
* A replica is not trusted with the gateway's memory (a compromised node runs anything on its port):
  heads, framing and trailers are bounded by :data:`MAX_HEAD_BYTES`, a body read whole by
  :data:`MAX_BODY_BYTES`; 1xx answers are skipped; a second answer in the same read closes the connection.
* :meth:`ReplicaResponse.release` keeps the connection only when the whole answer was read;
  otherwise, and with :meth:`ReplicaResponse.close`, the connection is closed, which tells an engine
  still generating that nobody listens (llama-server then frees the slot).
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import AsyncIterator

import httptools

#: A streamed answer's unread bytes past which reading from the replica pauses (aiohttp's default too).
READ_HIGH_WATER = 2**16
#: A body up to this size is sent in one write with its header (one system call); a larger one after it.
JOIN_BODY_BELOW = 2**16
#: The most bytes an answer may send in a row that carry no body: its status line and headers (any 1xx
#: interim answers before them included), chunk framing, trailers. Past it the answer is broken
#: (:class:`ReplicaBroken`). httptools bounds none of them and gathers a header's value by bytes
#: concatenation (quadratic in its length: a replica's endless header stalled the loop and took 138 MB in
#: 6 s). aiohttp's client bounded a head at 128 headers of 8,190 bytes; llama-server's and vLLM's heads
#: are a few hundred bytes.
MAX_HEAD_BYTES = 2**16
#: The largest body :meth:`ReplicaResponse.read` takes whole; past it the answer is broken. The largest
#: real answers are embeddings: 2,048 inputs of a 4,096-wide model are ~170 MB of JSON (~20 bytes a
#: float); the gateway takes requests of up to 64 MiB. Before it, a replica sending a Content-Length of
#: 10**15 filled 525 MB in 6 s, up to the whole ``upstream_timeout_s``. aiohttp's ``read()`` had no bound.
MAX_BODY_BYTES = 2**28


class ReplicaUnreachable(Exception):
    """No connection to the replica could be made (refused, unreachable, connect timeout): nothing was sent."""


class ReplicaBroken(Exception):
    """The replica's connection closed or broke after the request went out, or its answer was not HTTP
    (too large, out of step: the message says which)."""


class ReplicaClosed(ReplicaBroken):
    """The replica closed the connection (or it was reset) before its answer ended."""


def request_head(method: str, endpoint: str, path: str, headers: dict[str, str]) -> bytes:
    """``method path HTTP/1.1``, ``Host: endpoint`` and ``headers``, each line ending in CRLF, as
    :meth:`ReplicaClient.request` takes it (UTF-8). Raises ValueError for a CR or LF in any part (a
    header's end written into a value)."""
    text = f"{method} {path} HTTP/1.1\r\nHost: {endpoint}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    parts = (method, path, endpoint, *headers.keys(), *headers.values())
    if any("\r" in p or "\n" in p for p in parts):
        raise ValueError("a CR or LF in a request's line or header")
    return text.encode()


@functools.lru_cache(maxsize=1024)
def _host_port(endpoint: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as the pair to connect to."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


class _Conn(asyncio.Protocol):
    """One TCP connection to a replica; hands what it reads to the answer in progress."""

    __slots__ = ("endpoint", "idle_since", "lost", "resp", "transport")

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.resp: ReplicaResponse | None = None
        self.lost = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)  # noqa: S101 - create_connection makes one
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:  # bytes while idle: the stream is out of step, the connection is not reused
            self.close()
            return
        resp.feed(data)

    def eof_received(self) -> bool:
        self.lost = True  # not reused from now on
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.resp is not None:
            self.resp.lost(exc)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    def reusable(self, now: float, keepalive_s: float) -> bool:
        """Open and idle for less than ``keepalive_s`` seconds at ``now`` (the loop's clock)."""
        return not self.lost and now - self.idle_since < keepalive_s


class ReplicaResponse:
    """A replica's answer once its status line and headers arrived: ``status``, then the body by
    :meth:`read` (whole) or :meth:`iter_any` (as it comes); :meth:`release` or :meth:`close` after."""

    __slots__ = (
        "_began",
        "_chunks",
        "_client",
        "_conn",
        "_done",
        "_dry",
        "_exc",
        "_finished",
        "_headers",
        "_keep",
        "_keepable",
        "_last",
        "_loop",
        "_parser",
        "_paused",
        "_read_s",
        "_size",
        "_sized",
        "_timer",
        "_waiter",
        "_whole",
        "status",
    )

    def __init__(self, client: ReplicaClient, conn: _Conn, loop: asyncio.AbstractEventLoop,
                 total_s: float | None, read_s: float | None, keep_alive: bool) -> None:
        self.status = 0
        self._client, self._conn, self._loop = client, conn, loop
        # the parser holds this answer's callbacks: a cycle, broken when the answer is done (_finish), so
        # that refcounting frees both at once (the control plane schedules its full collections)
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._chunks: list[bytes] = []
        self._size = self._dry = 0
        self._headers = self._done = self._sized = self._keep = self._paused = self._finished = self._whole = False
        self._keepable = keep_alive
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._read_s = read_s
        self._last = self._began = loop.time()
        self._timer: asyncio.TimerHandle | None = None
        if total_s is not None:
            self._timer = loop.call_at(self._last + total_s, self._timed_out)
        elif read_s is not None:
            self._timer = loop.call_at(self._last + read_s, self._check_read)

    # -- the parser's callbacks (httptools calls them by name) ----------------------------------
    def on_header(self, name: bytes, _value: bytes) -> None:
        if len(name) in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            self._sized = True

    def on_message_begin(self) -> None:
        if self._done:  # a second answer after this one's end: out of step (feed closes the connection)
            raise ReplicaBroken("the replica sent more than one answer")

    def on_headers_complete(self) -> None:
        if self._parser is not None:  # always: called from feed_data
            self.status = self._parser.get_status_code()
        if self.status < 200:  # an interim answer (100 Continue...; 101 is refused by feed): the final one follows
            if self.status < 100:
                raise ReplicaBroken(f"the replica answered status {self.status}")
            return
        self._headers = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._size += len(body)
        if self._size > READ_HIGH_WATER:
            if not self._whole:
                if not self._paused and self._conn.transport is not None:
                    self._paused = True
                    self._conn.transport.pause_reading()
            elif self._size > MAX_BODY_BYTES:
                self._chunks.clear()
                self._fail(ReplicaBroken(f"the replica's answer is larger than {MAX_BODY_BYTES} bytes"))
                self._conn.close()
        self._wake()

    def on_message_complete(self) -> None:
        if not self._headers:  # an interim answer's end
            return
        self._done = True
        self._keep = self._keepable and self._parser is not None and self._parser.should_keep_alive()
        self._stop_timer()
        self._wake()

    # -- from the connection ----------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        """Bytes read from the replica."""
        if self._done:  # bytes after the answer: out of step, the connection is not kept
            self._keep = False
            return
        if self._read_s is not None:
            self._last = self._loop.time()
        if self._parser is None:
            return
        size = self._size
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            self._fail(ReplicaBroken(f"the replica's answer is not HTTP/1.1: {e!r}"))
            self._conn.close()
            return
        if self._size != size:
            self._dry = 0
        elif not self._done:
            self._dry += len(data)
            if self._dry > MAX_HEAD_BYTES:
                self._fail(ReplicaBroken(f"the replica sent over {MAX_HEAD_BYTES} bytes of head, framing or trailers"))
                self._conn.close()

    def lost(self, exc: Exception | None) -> None:
        """The connection closed: the end of an answer without a length, else a broken one."""
        if self._done:
            return
        if self._headers and not self._sized and self._exc is None:  # the body runs to the connection's end
            self._done = True
            self._stop_timer()
            self._wake()
            return
        when = "in the middle of its answer" if self._headers else "before answering"
        self._fail(ReplicaClosed(f"the replica closed the connection {when}" + (f": {exc!r}" if exc else "")))

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None and not self._done:
            self._exc = exc
        self._stop_timer()
        self._wake()

    def _timed_out(self) -> None:
        self._timer = None
        if not self._done:
            self._fail(TimeoutError())
            self._conn.close()

    def _check_read(self) -> None:
        """The read timer: time out after ``read_s`` without bytes (not counting a paused reader)."""
        assert self._read_s is not None  # noqa: S101 - only scheduled with one
        now = self._loop.time()
        # the status line and headers within read_s of the request, however slowly they trickle in
        last = self._last if self._headers else self._began
        due = now + self._read_s if self._paused else last + self._read_s
        if due > now:
            self._timer = self._loop.call_at(due, self._check_read)
        else:
            self._timed_out()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # -- the reader's side -------------------------------------------------------------------------
    async def headers(self) -> None:
        """Wait for the status line and headers (raises as the module docstring says)."""
        while not self._headers and self._exc is None:
            await self._wait()
        if self._exc is not None:
            raise self._exc

    async def read(self) -> bytes:
        """The whole body (what :meth:`iter_any` had not yet given); reading is not paused meanwhile."""
        self._whole = True
        self._resume()
        while not self._done and self._exc is None:
            await self._wait()
        if self._exc is not None:
            raise self._exc
        return self._take()

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive: everything read since the last one, joined."""
        while True:
            while not self._chunks and not self._done and self._exc is None:
                await self._wait()
            if self._chunks:
                data = self._take()
                self._resume()
                yield data
            elif self._exc is not None:
                raise self._exc
            else:
                return

    def _take(self) -> bytes:
        """What was read and not yet taken, joined; the buffer emptied."""
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        return data

    def _resume(self) -> None:
        if self._paused and self._conn.transport is not None:
            self._paused = False
            self._last = self._loop.time()
            self._conn.transport.resume_reading()

    def release(self) -> None:
        """Done with the answer: its connection is kept when the answer was read whole and may be kept."""
        self._finish(keep=self._done and self._keep and self._exc is None and not self._chunks)

    def close(self) -> None:
        """Done with the answer: its connection is closed (the engine sees the client gone)."""
        self._finish(keep=False)

    def _finish(self, *, keep: bool) -> None:
        if self._finished:
            return
        self._finished = True
        self._parser = None
        self._stop_timer()
        self._conn.resp = None
        self._client.put_back(self._conn, keep=keep)


class ReplicaClient:
    """Keep-alive connections to the replicas, at most ``limit`` in use at once (more requests wait).

    ``keepalive_s``: an idle connection older than this is closed, not reused (llama-server's
    cpp-httplib closes its side after 5 s). ``connect_timeout_s``: the longest a new connection may take.
    Use on one event loop; :meth:`close` closes every connection.
    """

    def __init__(self, *, keepalive_s: float, connect_timeout_s: float, limit: int) -> None:
        self.keepalive_s, self.connect_timeout_s, self.limit = keepalive_s, connect_timeout_s, limit
        self._idle: dict[str, list[_Conn]] = {}
        self._busy = 0
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    async def request(self, endpoint: str, head: bytes, body: bytes = b"", *, total_s: float | None = None,
                      read_s: float | None = None, keep_alive: bool = True) -> ReplicaResponse:
        """Send a request to the replica at ``endpoint`` (``host:port``) and return its answer once the
        headers arrived.

        ``head``: the request line and headers, each line ending in CRLF (:func:`request_head`;
        ``Content-Length`` is added). ``total_s``, ``read_s``: seconds (see the module docstring), None
        for no limit. ``keep_alive``: False closes the connection after the answer (a stream's).
        Raises :class:`ReplicaUnreachable`, :class:`ReplicaBroken`, :class:`TimeoutError` (see the
        module docstring); cancelled, the connection is closed.
        """
        loop = asyncio.get_running_loop()
        start = loop.time()
        if self._busy >= self.limit:
            await self._slot()
        self._busy += 1
        conn: _Conn | None = None
        try:
            conn = self._reuse(endpoint, loop.time())
            if conn is None:
                conn = await self._connect(endpoint, loop, None if total_s is None else start + total_s)
            resp = ReplicaResponse(self, conn, loop, None if total_s is None else total_s - (loop.time() - start),
                                   read_s, keep_alive)
        except BaseException:
            if conn is not None:
                conn.close()
            self._done_with()
            raise
        conn.resp = resp
        if conn.lost:  # closed by the replica before the request could go (its connection_lost came first)
            resp.lost(None)
        request = b"".join((head, b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n"))
        assert conn.transport is not None  # noqa: S101 - set by connection_made
        if len(body) < JOIN_BODY_BELOW:
            conn.transport.write(request + body)
        else:
            conn.transport.write(request)
            conn.transport.write(body)
        try:
            await resp.headers()
        except BaseException:
            resp.close()
            raise
        return resp

    def _reuse(self, endpoint: str, now: float) -> _Conn | None:
        idle = self._idle.get(endpoint)
        while idle:
            conn = idle.pop()
            if conn.reusable(now, self.keepalive_s):
                return conn
            conn.close()
        return None

    async def _connect(self, endpoint: str, loop: asyncio.AbstractEventLoop, deadline: float | None) -> _Conn:
        host, port = _host_port(endpoint)
        wait = self.connect_timeout_s
        total = deadline is not None and deadline - loop.time() < wait
        if deadline is not None:
            wait = min(wait, max(deadline - loop.time(), 0.0))
        try:
            async with asyncio.timeout(wait):
                _, conn = await loop.create_connection(lambda: _Conn(endpoint), host, port)
        except TimeoutError as e:
            if total:  # the whole exchange's time ran out first: a timeout, not an unreachable replica
                raise
            raise ReplicaUnreachable(f"cannot connect to {endpoint}: no answer within {wait:g} s") from e
        except OSError as e:
            raise ReplicaUnreachable(f"cannot connect to {endpoint}: {e}") from e
        return conn

    async def _slot(self) -> None:
        while self._busy >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_slot()  # handed a slot, then cancelled: the next one gets it
                raise

    def _wake_slot(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _done_with(self) -> None:
        self._busy -= 1
        if self._slot_waiters:
            self._wake_slot()

    def put_back(self, conn: _Conn, *, keep: bool) -> None:
        """An answer is done with ``conn``: kept idle for reuse when ``keep``, else closed."""
        self._done_with()
        if not keep or conn.lost or self._closed:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        self._idle.setdefault(conn.endpoint, []).append(conn)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_s, self._sweep_idle)

    def _sweep_idle(self) -> None:
        """Close the connections idle longer than ``keepalive_s`` (and those the engine closed)."""
        self._sweep = None
        now = asyncio.get_running_loop().time()
        for endpoint, idle in list(self._idle.items()):
            keep = []
            for conn in idle:
                if conn.reusable(now, self.keepalive_s):
                    keep.append(conn)
                else:
                    conn.close()
            if keep:
                self._idle[endpoint] = keep
            else:
                del self._idle[endpoint]
        if self._idle:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_s / 2, self._sweep_idle)

    def close(self) -> None:
        """Close every idle connection; those in use close when released."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
