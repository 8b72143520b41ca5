"""The browser harness itself: Chromium starts, clicks work, axe runs, screenshots are written."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from aiohttp import web

from tests.browser.conftest import axe_violations, format_violations, shot

if TYPE_CHECKING:  # imported in the test: without playwright, the browser fixture says what to install
    from playwright.sync_api import Page

PAGE = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>Harness</title></head>
<body>
  <main>
    <h1>Browser harness</h1>
    <p id="status" role="status">Not clicked</p>
    <button type="button" id="go"
            onclick="document.getElementById('status').textContent = 'Clicked'">Click me</button>
  </main>
</body>
</html>
"""


@pytest.fixture
def site() -> Iterator[str]:
    """An aiohttp app serving PAGE on 127.0.0.1 (random port), on its own loop in a thread.

    The loop is created, run and closed entirely in that thread: the main thread cannot run an
    event loop while Playwright's sync API is started (see tests/browser/conftest.py).
    """

    async def index(_: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    Ready = tuple[int, asyncio.AbstractEventLoop, asyncio.Event]
    ready: queue.Queue[Ready | BaseException] = queue.Queue()

    async def serve() -> None:
        app = web.Application()
        app.router.add_get("/", index)
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            stop = asyncio.Event()
            ready.put((runner.addresses[0][1], asyncio.get_running_loop(), stop))
            await stop.wait()
        finally:
            await runner.cleanup()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as e:  # surfaced to the fixture below
            ready.put(e)

    thread = threading.Thread(target=run, name="harness-site", daemon=True)
    thread.start()
    got = ready.get(timeout=10)
    if isinstance(got, BaseException):
        raise got
    port, loop, stop = got
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)


@pytest.mark.browser
def test_click_axe_and_screenshot(page: Page, site: str) -> None:
    from playwright.sync_api import expect  # noqa: PLC0415

    page.goto(site)
    status = page.locator("#status")
    expect(status).to_have_text("Not clicked")
    page.get_by_role("button", name="Click me").click()
    expect(status).to_have_text("Clicked")

    violations = axe_violations(page)
    assert not violations, format_violations(violations)

    path = shot(page, "harness-clicked")
    assert path.is_file()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
