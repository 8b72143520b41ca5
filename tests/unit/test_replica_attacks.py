"""A replica that answers anything (a node whose certificate was stolen runs its own program on the
replica's port): raw bytes from an asyncio server against the gateway's client
(:mod:`llmgw.control.gateway.replicaclient`) and, for what reaches clients, the gateway itself. The
gateway must stay bounded (memory, time), fail the answer clearly, and never keep a connection whose
bytes are out of step."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from llmgw.control.gateway import replicaclient
from llmgw.control.gateway.app import build_gateway_app
from llmgw.control.gateway.replicaclient import (
    MAX_BODY_BYTES,
    MAX_HEAD_BYTES,
    ReplicaBroken,
    ReplicaClient,
    request_head,
)
from llmgw.routing import Route, StaticRouter, Upstream

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"


class _Replica:
    """A raw server answering each request with ``answer``; :meth:`close` ends its connections too."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await asyncio.sleep(0.01)


async def _serve(answer: Answer) -> tuple[_Replica, str]:
    replica = _Replica()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        replica.writers.add(writer)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await answer(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    replica.server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return replica, f"127.0.0.1:{replica.server.sockets[0].getsockname()[1]}"


def _writes(*parts: bytes, pause: float = 0.05) -> Answer:
    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause)

    return answer


def _endless(prefix: bytes, piece: bytes) -> Answer:
    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(prefix)
        while True:
            writer.write(piece)
            await writer.drain()

    return answer


@pytest.fixture
async def client() -> AsyncIterator[ReplicaClient]:
    c = ReplicaClient(keepalive_s=4.0, connect_timeout_s=2.0, limit=8)
    yield c
    assert c._busy == 0  # every answer gave its slot back
    c.close()


async def _ask(client: ReplicaClient, endpoint: str, **kw: float | bool) -> tuple[int, bytes]:
    resp = await client.request(endpoint, request_head("POST", endpoint, "/x", {}), b"{}", **kw)  # type: ignore[arg-type]
    try:
        return resp.status, await resp.read()
    finally:
        resp.release()


@pytest.mark.parametrize(
    ("prefix", "piece"),
    [
        (b"HTTP/1.1 200 OK\r\nX-A: ", b"a" * 65536),  # a header line that never ends
        (b"HTTP/1.1 200 OK\r\n", b"X-A: b\r\n" * 4096),  # headers that never end
        (b"HTTP/1.1 200 ", b"O" * 65536),  # a status line that never ends
        (b"", b"HTTP/1.1 100 Continue\r\n\r\n" * 1024),  # a 100-continue storm
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-T: ", b"a" * 65536),  # trailers
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_endless_heads_and_trailers_fail_at_the_bound(
    client: ReplicaClient, prefix: bytes, piece: bytes, stream: bool
) -> None:
    """Before: httptools gathered the header (quadratically) until the timeout, 138 MB in 6 s; a
    stream's has no total timeout, so without end."""
    server, endpoint = await _serve(_endless(prefix, piece))
    kw: dict[str, float | bool] = {"read_s": 30, "keep_alive": False} if stream else {"total_s": 30}
    with pytest.raises(ReplicaBroken, match=f"over {MAX_HEAD_BYTES} bytes"):
        async with asyncio.timeout(5):
            await _ask(client, endpoint, **kw)
    await server.close()


@pytest.mark.parametrize("framing", [b"Content-Length: 1000000000000000\r\n", b"Transfer-Encoding: chunked\r\n", b""])
async def test_a_body_read_whole_is_bounded(
    client: ReplicaClient, framing: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a Content-Length of 10**15 (or an endless chunked or to-the-end body) filled memory until
    the timeout (525 MB in 6 s; the gateway's is 600 s)."""
    assert MAX_BODY_BYTES == 2**28
    monkeypatch.setattr(replicaclient, "MAX_BODY_BYTES", 2**21)  # the same check, 2 MiB for the test's speed
    piece = b"10000\r\n" + b"x" * 65536 + b"\r\n" if b"chunked" in framing else b"x" * 65536
    server, endpoint = await _serve(_endless(b"HTTP/1.1 200 OK\r\n" + framing + b"\r\n", piece))
    with pytest.raises(ReplicaBroken, match=f"larger than {2**21} bytes"):
        async with asyncio.timeout(3):
            await _ask(client, endpoint, total_s=60)
    await server.close()


async def test_a_trickled_head_of_a_stream_times_out_after_read_s(client: ReplicaClient) -> None:
    """A byte of head every 0.1 s is never silence; before, a stream's request waited without end."""
    server, endpoint = await _serve(_writes(*[b"HTTP/1.1 200 OK\r\n"] + [b"X"] * 40, pause=0.1))
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(TimeoutError):
        await _ask(client, endpoint, read_s=0.5, keep_alive=False)
    assert loop.time() - began < 2  # before: 4.5 s, the trickle's end and then read_s of silence
    await server.close()


async def test_interim_answers_are_skipped(client: ReplicaClient) -> None:
    """RFC 9112: 1xx answers come before the final one. Before: the 100 was taken as the answer (empty)
    and the connection kept, the real answer then read as the next request's."""
    server, endpoint = await _serve(_writes(b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early\r\n\r\n", OK))
    assert await _ask(client, endpoint, total_s=5) == (200, b"{}")
    assert await _ask(client, endpoint, total_s=5) == (200, b"{}")  # the kept connection is in step
    await server.close()


@pytest.mark.parametrize("status", [b"101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade", b"099 X"])
async def test_an_upgrade_or_a_status_below_100_is_broken(client: ReplicaClient, status: bytes) -> None:
    """Before: a 101 raised httptools' HttpParserUpgrade out of data_received (asyncio's 'Fatal error'),
    the answer taken as a 101 with an empty body and its connection kept."""
    server, endpoint = await _serve(_writes(b"HTTP/1.1 " + status + b"\r\n\r\n" + OK))
    with pytest.raises(ReplicaBroken):
        await _ask(client, endpoint, total_s=5)
    assert not client._idle
    await server.close()


@pytest.mark.parametrize("extra", [b"HTTP/1.1 500 X\r\nContent-Length: 5\r\n\r\nWRONG", b"HTTP/1.1 200 OK\r\n"])
async def test_a_second_answer_in_the_same_read_is_not_taken(client: ReplicaClient, extra: bytes) -> None:
    """Before: a whole second answer in the same read replaced the status and was appended to the body
    (200 '{}' became 500 '{}WRONG'), and its connection was kept; a partial one was kept too, its
    rest then read as the next request's answer."""
    server, endpoint = await _serve(_writes(OK + extra))
    assert await _ask(client, endpoint, total_s=5) == (200, b"{}")
    assert not client._idle  # out of step: closed
    await server.close()


# -- through the gateway ----------------------------------------------------------------------------


async def _gateway(endpoint: str) -> tuple[web.AppRunner, str]:
    router = StaticRouter(routes={"m": Route("m", (Upstream("r-1", endpoint, "key"),))})
    app = build_gateway_app(router, keys={"sk"}, allow_loopback_without_key=False, upstream_timeout_s=5)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"


async def _post(url: str, stream: bool) -> tuple[int, bytes]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers={"Authorization": "Bearer sk"}) as r:
        return r.status, await r.read()


@pytest.mark.parametrize(("answer", "why"), [
    (_endless(b"HTTP/1.1 200 OK\r\nX-A: ", b"a" * 65536), "sent over 65536 bytes of head"),
    (_endless(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000000\r\n\r\n", b"x" * 65536),
     "answer is larger than 2097152 bytes"),
])
async def test_the_gateway_answers_502_to_an_endless_answer(
    answer: Answer, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client is told what the replica did (it read "closed the connection before answering",
    which sends an operator looking for a crash)."""
    monkeypatch.setattr(replicaclient, "MAX_BODY_BYTES", 2**21)
    server, endpoint = await _serve(answer)
    runner, url = await _gateway(endpoint)
    async with asyncio.timeout(4):  # before: the gateway's 5 s timeout, a 504, after filling memory
        status, body = await _post(url, stream=False)
    assert status == 502
    error = json.loads(body)["error"]
    assert error["code"] == "upstream_failed"
    refused = "the replica of model 'm' sent an answer the gateway refused before answering ("
    assert error["message"].startswith(refused), error
    assert why in error["message"], error
    await runner.cleanup()
    await server.close()


@pytest.mark.parametrize("status", [b"302 Found\r\nLocation: http://169.254.169.254/", b"999 X"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_redirect_or_a_status_past_599_is_a_502(status: bytes, stream: bool) -> None:
    """Before: relayed to the client as it came (a 302 with the replica's body, a 999)."""
    server, endpoint = await _serve(_writes(b"HTTP/1.1 " + status + b"\r\nContent-Length: 2\r\n\r\n{}"))
    runner, url = await _gateway(endpoint)
    got, body = await _post(url, stream=stream)
    assert got == 502
    assert json.loads(body)["error"]["code"] == "upstream_invalid"
    await runner.cleanup()
    await server.close()


async def test_a_stream_line_that_never_ends_ends_the_stream() -> None:
    """Before: the rewriter held the line whole, joined again with each chunk (quadratic), without end."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    piece = b"10000\r\n" + b"a" * 65536 + b"\r\n"
    first = b'data: {"a": '
    server, endpoint = await _serve(_endless(head + b"%x\r\n%s\r\n" % (len(first), first), piece))
    runner, url = await _gateway(endpoint)
    async with asyncio.timeout(4):
        status, body = await _post(url, stream=True)
    assert status == 200  # the stream had begun: its end is an error event
    assert b'"code": "upstream_failed"' in body
    await runner.cleanup()
    await server.close()
