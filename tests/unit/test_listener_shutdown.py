"""A listener closes within its bound whatever its handlers are doing.

The unit's ``TimeoutStopSec`` counts on it: after the gateway's drain, each listener gives its last
requests (an admin log stream, a heartbeat) ``SHUTDOWN_TIMEOUT_S`` to finish, then cancels them and
waits as long again (aiohttp's ``RequestHandler.shutdown``, its timer rounded up to a second). Real
aiohttp, a real socket, a handler that would run for 60 s: the listener's cleanup returns within
2 × 3 s + 1 s (aiohttp's own default is 60 s, which a runner built without the setting waits).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
from aiohttp import web

from llmgw.control.listeners import SHUTDOWN_TIMEOUT_S
from llmgw.control.server import _start
from tests.helpers.net import free_port


async def test_a_listener_with_a_request_in_flight_closes_within_the_shutdown_timeout(tmp_path: Path) -> None:
    entered = asyncio.Event()

    async def slow(_: web.Request) -> web.Response:
        entered.set()
        await asyncio.sleep(60)
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/slow", slow)
    runner, (host, port) = await _start(app, f"127.0.0.1:{free_port()}", "admin.listen", tmp_path / "server.yaml")
    async with httpx.AsyncClient(timeout=70) as client:
        request = asyncio.create_task(client.get(f"http://{host}:{port}/slow"))
        await asyncio.wait_for(entered.wait(), 10)
        started = time.monotonic()
        await runner.cleanup()
        took = time.monotonic() - started
        request.cancel()
    assert took <= 2 * SHUTDOWN_TIMEOUT_S + 1.0, f"the listener took {took:.1f}s to close (bound {SHUTDOWN_TIMEOUT_S}s)"
