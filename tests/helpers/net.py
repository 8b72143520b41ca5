"""Ports and a file server for tests: free ports picked at run time, never fixed ones.

:func:`free_port` picks below the kernel's ephemeral range (32768-60999 by default), from a block
of its own for each pytest-xdist worker: a port the kernel picked for port 0 is one it may also
give to any outgoing connection, and another worker's pick, in the moment between the test
choosing it and its server binding it (seen in CI: ``address already in use`` on 43355 while
three workers ran). tests/e2e/test_init_ha.py's PostgreSQL ports live at 20000 and above.
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

from aiohttp import web

#: Each worker's block of ports: [BASE + n × BLOCK, BASE + (n + 1) × BLOCK), n from PYTEST_XDIST_WORKER,
#: for up to WORKERS workers (scripts/test starts 5), all below 20,000 (test_init_ha's PostgreSQL ports).
BASE, BLOCK, WORKERS = 10_000, 2_000, 5


def _block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    n = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    start = BASE + (n % WORKERS) * BLOCK
    return range(start, start + BLOCK)


_BLOCK = _block()
# Start at a point of the block that differs between runs, so a port a run's leftover still holds
# is not the first one the next run tries.
_NEXT = itertools.count(os.getpid() % BLOCK)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, from this worker's block (see the module docstring).

    Raises:
        RuntimeError: every port of the block is taken.
    """
    for _ in range(BLOCK):
        port = _BLOCK[next(_NEXT) % BLOCK]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_BLOCK.start}-{_BLOCK.stop - 1}")


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """``app`` served on a free loopback port, on the running loop; returns its runner
    (``cleanup()`` it) and base URL (``http://127.0.0.1:PORT``)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def serve_files(files_dir: Path) -> tuple[web.AppRunner, str]:
    """A static file server over ``files_dir`` on a free loopback port (symlinks followed, as the
    mirror's files would be served); returns its runner (``cleanup()`` it) and base URL."""
    app = web.Application()
    app.router.add_static("/", files_dir, follow_symlinks=True)
    return await serve_app(app)
