"""What a kept TLS connection costs the control plane in memory: a real ``llmgw server run`` process,
300 real mTLS connections to its agent API (each with a node's certificate from the cluster CA, kept
open as agents keep theirs), its resident memory read before and after (psutil).

With asyncio's default read buffer (256 KiB, zero-filled, per connection) this measured 287 KiB per
connection; with :data:`llmgw.tlsconf.TLS_READ_BUFFER` 47 KiB. The bound sits between the two."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import aiohttp
import psutil

from tests.helpers.control import make_install, server_run, wait_admin_health

CONNECTIONS = 300
MAX_KIB_PER_CONNECTION = 140


async def _open(url: str, ctx: ssl.SSLContext, n: int) -> list[aiohttp.ClientSession]:
    """``n`` sessions, each with one kept-alive mTLS connection that has answered one request."""
    sessions = []
    for _ in range(n):
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=1))
        sessions.append(session)
        async with session.get(f"{url}/api/v1/nosuch") as resp:
            await resp.read()
    return sessions


async def test_a_kept_tls_connection_costs_the_control_plane_under_140_kib(tmp_path: Path) -> None:
    inst = make_install(tmp_path)
    ctx = inst.agent_ctx("node-mem")
    with server_run(inst) as proc:
        wait_admin_health(inst, proc)
        server = psutil.Process(proc.pid)
        sessions = await _open(inst.agent_url, ctx, 20)  # warm: the first connections' one-off costs
        try:
            await asyncio.sleep(0.5)
            before = server.memory_info().rss
            sessions += await _open(inst.agent_url, ctx, CONNECTIONS)
            await asyncio.sleep(0.5)
            per_kib = (server.memory_info().rss - before) / CONNECTIONS / 1024
        finally:
            await asyncio.gather(*(s.close() for s in sessions))
    print(f"{per_kib:.1f} KiB of control-plane memory per kept mTLS connection")
    assert per_kib < MAX_KIB_PER_CONNECTION
