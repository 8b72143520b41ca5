"""Ports and a file server for tests: always ephemeral ports, never fixed ones."""

from __future__ import annotations

import socket
from pathlib import Path

from aiohttp import web


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick for port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def serve_files(files_dir: Path) -> tuple[web.AppRunner, str]:
    """A static file server over ``files_dir`` on a free loopback port (symlinks followed, as the
    mirror's files would be served); returns its runner (``cleanup()`` it) and base URL."""
    app = web.Application()
    app.router.add_static("/", files_dir, follow_symlinks=True)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
