"""The gateway's client to the replicas (:mod:`llmgw.control.gateway.replicaclient`) against a real
aiohttp server on loopback: kept connections, bodies whole and streamed, timeouts, broken and refused
connections, cancellation and the limit on connections in use. The gateway's own tests drive it through
the relays; these pin the client's contract where the gateway's tests do not reach (a stale kept
connection, a body larger than the read pause, a body that ends with the connection)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web

from llmgw.control.gateway.replicaclient import (
    ReplicaBroken,
    ReplicaClient,
    ReplicaResponse,
    ReplicaUnreachable,
    request_head,
)

PEERS = web.AppKey("peers", set)


async def _plain(request: web.Request) -> web.Response:
    request.app[PEERS].add(request.transport.get_extra_info("peername") if request.transport else None)
    return web.Response(body=b"x" * len(await request.read()))


async def _stream(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse()
    await out.prepare(request)
    for i in range(3):
        await out.write(b"data: %d\n\n" % i)
        await asyncio.sleep(0.02)
    await out.write_eof()
    return out


async def _slow(_: web.Request) -> web.Response:
    await asyncio.sleep(1.0)
    return web.Response(text="late")


async def _silent(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse()
    await out.prepare(request)
    await out.write(b"a")
    await asyncio.sleep(1.0)
    await out.write(b"b")
    return out


async def _broken(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse()
    await out.prepare(request)
    await out.write(b"half")
    assert request.transport is not None
    request.transport.close()
    return out


async def _big(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse()
    await out.prepare(request)
    for _ in range(50):
        await out.write(b"y" * 10_000)
    await out.write_eof()
    return out


@dataclass
class Replica:
    endpoint: str
    peers: set[object]  # the client ends of the connections it was asked on


@pytest.fixture
async def replica() -> AsyncIterator[Replica]:
    app = web.Application(client_max_size=2**24)
    app[PEERS] = set()
    for path, handler in (("/plain", _plain), ("/stream", _stream), ("/slow", _slow), ("/silent", _silent),
                          ("/broken", _broken), ("/big", _big)):
        app.router.add_post(path, handler)
    # keepalive_timeout: closes an idle kept connection after 0.3 s. handler_cancellation: a handler
    # whose client left (a time-out, a cancel) ends then, not at the end of its 1 s sleep, which the
    # runner's cleanup waited out.
    runner = web.AppRunner(app, keepalive_timeout=0.3, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield Replica(f"127.0.0.1:{runner.addresses[0][1]}", app[PEERS])
    await runner.cleanup()


def _client(limit: int = 8) -> ReplicaClient:
    return ReplicaClient(keepalive_s=4.0, connect_timeout_s=2.0, limit=limit)


def _head(endpoint: str, path: str) -> bytes:
    return request_head("POST", endpoint, path, {"Content-Type": "application/json"})


async def _read_all(resp: ReplicaResponse) -> bytes:
    return b"".join([c async for c in resp.iter_any()])


async def test_plain_bodies_of_every_size_on_one_kept_connection(replica: Replica) -> None:
    endpoint = replica.endpoint
    client = _client()
    for n in (0, 10, 100_000, 2_000_000):  # 2 MB answer: past the 64 KiB read pause, read whole
        resp = await client.request(endpoint, _head(endpoint, "/plain"), b"z" * n, total_s=10)
        assert resp.status == 200
        assert await resp.read() == b"x" * n
        resp.release()
    assert len(replica.peers) == 1
    client.close()


async def test_a_connection_the_replica_closed_while_idle_is_not_reused(replica: Replica) -> None:
    endpoint = replica.endpoint
    client = _client()
    for again in (True, False):
        resp = await client.request(endpoint, _head(endpoint, "/plain"), b"ab", total_s=5)
        assert await resp.read() == b"xx"
        resp.release()
        if again:
            await asyncio.sleep(0.6)  # the server's keep-alive (0.3 s) ran out: the next request connects again
    assert len(replica.peers) == 2
    client.close()


async def test_stream_chunks_as_they_come_and_connection_not_kept(replica: Replica) -> None:
    endpoint = replica.endpoint
    client = _client()
    resp = await client.request(endpoint, _head(endpoint, "/stream"), b"", read_s=5, keep_alive=False)
    chunks = [c async for c in resp.iter_any()]
    resp.release()
    assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert len(chunks) == 3
    assert not client._idle  # a stream's connection is closed, not kept
    client.close()


async def test_a_slow_reader_of_a_large_stream_gets_every_byte(replica: Replica) -> None:
    endpoint = replica.endpoint
    client = _client()
    resp = await client.request(endpoint, _head(endpoint, "/big"), b"", read_s=5)
    total = 0
    async for chunk in resp.iter_any():
        total += len(chunk)
        await asyncio.sleep(0.005)  # reading pauses past 64 KiB unread and resumes as it is read
    resp.release()
    assert total == 500_000
    client.close()


async def test_timeouts(replica: Replica) -> None:
    endpoint = replica.endpoint
    client = _client()
    with pytest.raises(TimeoutError):
        await client.request(endpoint, _head(endpoint, "/slow"), b"", total_s=0.3)
    resp = await client.request(endpoint, _head(endpoint, "/silent"), b"", read_s=0.3)
    with pytest.raises(TimeoutError):
        await _read_all(resp)
    resp.close()
    assert client._busy == 0
    client.close()


async def test_broken_mid_answer_and_refused(replica: Replica) -> None:
    endpoint = replica.endpoint
    client = _client()
    resp = await client.request(endpoint, _head(endpoint, "/broken"), b"", read_s=5)
    with pytest.raises(ReplicaBroken):
        await _read_all(resp)
    resp.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ReplicaUnreachable):
        await client.request(f"127.0.0.1:{port}", _head(endpoint, "/plain"), b"", total_s=5)
    assert client._busy == 0
    client.close()


async def test_cancelled_request_closes_its_connection_and_the_limit_holds(replica: Replica) -> None:
    endpoint = replica.endpoint
    client = _client(limit=2)
    task = asyncio.ensure_future(client.request(endpoint, _head(endpoint, "/slow"), b"", total_s=5))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client._busy == 0
    assert not client._idle

    async def one() -> None:
        resp = await client.request(endpoint, _head(endpoint, "/slow"), b"", total_s=5)
        assert await resp.read() == b"late"
        resp.release()

    t0 = time.monotonic()
    await asyncio.gather(one(), one(), one())  # two at once, the third after one of them
    assert time.monotonic() - t0 >= 1.9
    client.close()


def test_request_head_refuses_a_line_break() -> None:
    assert request_head("GET", "h:1", "/props", {"A": "b"}) == b"GET /props HTTP/1.1\r\nHost: h:1\r\nA: b\r\n"
    with pytest.raises(ValueError, match="CR or LF"):
        request_head("POST", "h:1", "/p", {"Authorization": "Bearer k\r\nX-Evil: 1"})


async def test_a_body_without_a_length_ends_with_the_connection() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    endpoint = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = _client()
    resp = await client.request(endpoint, _head(endpoint, "/eof"), b"", total_s=5)
    assert (resp.status, await resp.read()) == (200, b"all of it")
    resp.release()
    assert not client._idle  # not kept: its end was the connection's
    client.close()
    server.close()
    await server.wait_closed()
