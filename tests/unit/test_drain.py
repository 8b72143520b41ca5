"""The gateway's drain on shutdown (:mod:`llmgw.control.gateway.drain`), on a real aiohttp server and client:
requests in flight may finish; at the deadline a stream ends with an error event and ``[DONE]``,
a plain request with a 503; while closing, new requests are refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from llmgw.control.gateway.drain import Drain


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, Drain]]:
    drain = Drain()

    async def forever(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        while True:
            await out.write(b'data: {"choices": []}\n\n')
            await asyncio.sleep(0.05)

    async def short(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for _ in range(5):
            await out.write(b'data: {"choices": []}\n\n')
            await asyncio.sleep(0.05)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def slow_plain(_: web.Request) -> web.Response:
        await asyncio.sleep(60)
        return web.json_response({})

    app = web.Application(middlewares=[drain.middleware])
    app.on_response_prepare.append(drain.on_prepare)
    app.router.add_post("/forever", forever)
    app.router.add_post("/short", short)
    app.router.add_post("/plain", slow_plain)
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", drain
    await runner.cleanup()


async def read_all(session: aiohttp.ClientSession, url: str) -> list[str]:
    async with session.post(url) as r:
        return [line.decode().strip() async for line in r.content if line.strip()]


async def test_a_stream_past_the_deadline_ends_well_formed(served: tuple[str, Drain]) -> None:
    base, drain = served
    async with aiohttp.ClientSession() as s:
        reading = asyncio.create_task(read_all(s, base + "/forever"))
        finishing = asyncio.create_task(read_all(s, base + "/short"))
        plain = asyncio.create_task(s.post(base + "/plain"))
        for _ in range(500):  # all three reach their handlers
            if drain.in_flight == 3:
                break
            await asyncio.sleep(0.01)
        finished, cut = await drain.drain(0.5)
        lines = await asyncio.wait_for(reading, 5)
        done = await asyncio.wait_for(finishing, 5)
        resp = await asyncio.wait_for(plain, 5)
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "shutting_down"
        resp.release()
        # While closing, a new request is refused with the same code.
        async with s.post(base + "/short") as late:
            assert late.status == 503
            assert (await late.json())["error"]["code"] == "shutting_down"
    assert (finished, cut) == (1, 2)
    assert done[-1] == "data: [DONE]"
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "shutting_down"
    assert "drain deadline" in error["message"]
