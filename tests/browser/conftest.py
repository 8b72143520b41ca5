"""Browser tests: Playwright for Python driving the system's Chromium (Debian's ``chromium`` package).

Fixtures and helpers:

- ``browser`` (package scope: one Chromium for all of tests/browser, see below for why not the
  session): a headless Chromium. Its path comes from ``LLMGW_CHROMIUM``, else
  ``/usr/bin/chromium``. We never run ``playwright install`` (it downloads browsers from a CDN);
  Playwright launches the system binary through ``executable_path``. When Playwright or Chromium is
  missing the fixture FAILS, it never skips: a browser test that silently does not run proves nothing.
- ``page`` (per test): a page in a fresh context (own cookies and storage), viewport 1280x900.
- :func:`axe_violations` runs axe-core (``tests/browser/vendor/axe.min.js``, vendored and verified by
  ``scripts/vendor-ui``) in the page and returns the "serious" and "critical" violations.
- :func:`shot` saves a full-page screenshot to ``$LLMGW_ARTIFACTS/screenshots/<name>.png``
  (default ``<repo>/test-artifacts/screenshots``).

Sync API under pytest-asyncio (``asyncio_mode = "auto"``, function-scoped loops):

- Browser tests are plain ``def`` tests on Playwright's sync API. pytest-asyncio gives an event loop
  only to ``async def`` tests, so a ``def`` test runs with no loop running and the sync API starts
  fine. Never write ``async def`` browser tests with these fixtures: the sync API raises "It looks
  like you are using Playwright Sync API inside the asyncio loop" there.
- The catch is the other way round. While the sync API is started, Playwright leaves ITS loop marked
  as the thread's running loop between calls (``asyncio._set_running_loop`` in
  ``playwright/_impl/_greenlets.py``: its loop runs in a greenlet on the main thread). Any
  ``asyncio.run``/``run_until_complete`` on the main thread then fails with "Cannot run the event
  loop while another loop is running" -- and that includes pytest-asyncio running every later
  ``async def`` test. A session-scoped ``browser`` therefore broke every async test in tests/unit
  that ran after tests/browser (verified). Hence ``scope="package"``: pytest stops Playwright as
  soon as it leaves tests/browser, and clears the running loop, so the rest of the suite is
  untouched. (Under a module-shuffling plugin such as pytest-randomly the package fixture is just
  set up again when the run comes back to tests/browser: slower, still correct.)
- For the same reason, anything asyncio a browser test needs (the aiohttp app under test) must run
  its loop in a thread of its own, created, run and closed there (see ``site`` in
  ``test_harness.py``); a sync fixture in tests/browser must not call ``asyncio.run`` itself.

Chromium as root: Playwright launches Chromium with ``--no-sandbox`` by default
(``chromium_sandbox=False``), which is what lets it run as root in CI containers; we pass it
explicitly anyway, plus ``--disable-dev-shm-usage`` (small /dev/shm in containers).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

REPO = Path(__file__).resolve().parents[2]
AXE_JS = Path(__file__).resolve().parent / "vendor" / "axe.min.js"
DEFAULT_CHROMIUM = "/usr/bin/chromium"
VIEWPORT = {"width": 1280, "height": 900}
INSTALL_HINT = (
    "run `apt-get install chromium` (or point LLMGW_CHROMIUM at a Chromium binary) "
    "and `pip install -e .[dev]` (it brings playwright); do NOT run `playwright install`"
)


def chromium_path() -> str:
    """The Chromium binary: ``$LLMGW_CHROMIUM``, else ``/usr/bin/chromium``."""
    return os.environ.get("LLMGW_CHROMIUM") or DEFAULT_CHROMIUM


@pytest.fixture(scope="package")
def browser() -> Iterator[Browser]:
    """A headless Chromium for tests/browser; fails (never skips) when it cannot start.

    Package-scoped, not session-scoped: see the module docstring (started Playwright sync API
    breaks pytest-asyncio for every later async test).
    """
    try:
        from playwright.sync_api import Error as PlaywrightError  # noqa: PLC0415
        from playwright.sync_api import sync_playwright  # noqa: PLC0415
    except ImportError as e:
        pytest.fail(f"playwright is not importable ({e}); {INSTALL_HINT}", pytrace=False)
    path = chromium_path()
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"no Chromium executable at {path}; {INSTALL_HINT}", pytrace=False)
    pw = sync_playwright().start()
    try:
        try:
            b = pw.chromium.launch(
                executable_path=path,
                headless=True,
                chromium_sandbox=False,
                args=["--no-sandbox", "--disable-dev-shm-usage"],
            )
        except PlaywrightError as e:
            pytest.fail(f"Chromium at {path} did not start: {e}\n{INSTALL_HINT}", pytrace=False)
        try:
            yield b
        finally:
            b.close()
    finally:
        pw.stop()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A page in a fresh browser context (no shared cookies/storage), viewport 1280x900."""
    context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
    try:
        yield context.new_page()
    finally:
        context.close()


def axe_violations(page: Page) -> list[dict[str, Any]]:
    """Run axe-core on the page; return the violations whose impact is "serious" or "critical".

    Each is axe's violation object (``id``, ``impact``, ``help``, ``helpUrl``, ``nodes`` ...). To
    assert, ``assert not v, format_violations(v)`` gives a readable failure message.
    """
    if not AXE_JS.is_file():
        pytest.fail(f"{AXE_JS} is missing; run scripts/vendor-ui", pytrace=False)
    if not page.evaluate("() => typeof window.axe !== 'undefined'"):
        # Through the DevTools protocol, not a <script> tag: the dashboard's Content-Security-Policy
        # (scripts from /ui/static only) rightly refuses an injected tag, and the test must not
        # turn that policy off to look at the page.
        cdp = page.context.new_cdp_session(page)
        try:
            cdp.send("Runtime.evaluate", {"expression": AXE_JS.read_text()})
        finally:
            cdp.detach()
    result = page.evaluate("async () => await axe.run(document)")
    return [v for v in result["violations"] if v.get("impact") in ("serious", "critical")]


def format_violations(violations: list[dict[str, Any]]) -> str:
    """A readable summary of :func:`axe_violations`'s result, for an assertion message."""
    lines = []
    for v in violations:
        lines.append(f"[{v.get('impact')}] {v.get('id')}: {v.get('help')} ({v.get('helpUrl')})")
        for node in v.get("nodes", [])[:5]:
            lines.append(f"    {json.dumps(node.get('target'))}: {node.get('failureSummary', '')}")
    return "\n".join(lines)


def artifacts_dir() -> Path:
    """``$LLMGW_ARTIFACTS``, else ``<repo>/test-artifacts``."""
    return Path(os.environ.get("LLMGW_ARTIFACTS") or REPO / "test-artifacts")


def shot(page: Page, name: str) -> Path:
    """Save a full-page screenshot to ``<artifacts>/screenshots/<name>.png``; returns its path."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ValueError(f"screenshot name {name!r}: use letters, digits, '.', '_' and '-' only")
    out = artifacts_dir() / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
