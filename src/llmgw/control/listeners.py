"""How the control plane's listeners are made: aiohttp runners with the shutdown bound, and the agent
API's sockets bound ahead of the process that serves them.

Both :mod:`llmgw.control.server` (every listener, in one process) and
:mod:`llmgw.control.agentworker` (the agent API in a process of its own,
``cluster.agent_api_process``) build their runners here, so a listener closes the same way
wherever it runs.
"""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from llmgw.httperrors import SERVER_LOG, bind_error
from llmgw.protocol import KEEPALIVE_S

SHUTDOWN_TIMEOUT_S = 3.0
"""Seconds aiohttp gives a listener's last requests when it closes, after the gateway's drain
(admin log streams, heartbeats). aiohttp waits this long for a handler to finish, then cancels it and
waits as long again (``RequestHandler.shutdown``; its timer rounds up to a whole second): 6.0 s
measured for a handler that would have run 60 s (tests/unit/test_listener_shutdown.py). The
listeners close together, so a stop takes at most ``gateway.drain_s`` (≤ 50) + 2 × 3 + 1 s, inside
the unit's ``TimeoutStopSec=60s``."""

#: The gateway asks to have a handler cancelled when its client disconnects (frees the engine's slot).
CANCEL_ON_DISCONNECT = web.AppKey("llmgw_cancel_on_disconnect", bool)


def new_runner(app: web.Application, setting: str) -> web.AppRunner:
    """The runner for ``app`` served as ``setting`` (``agent_listen``, ``gateway.listen``...): no access
    log, one line for a request aiohttp cannot parse, :data:`SHUTDOWN_TIMEOUT_S`, handlers cancelled
    on disconnect when the app asks (:data:`CANCEL_ON_DISCONNECT`). The agent API keeps idle
    connections as long as the agents do (``KEEPALIVE_S``: an agent's beat reuses its mTLS
    connection in a large cluster instead of a new handshake); the others aiohttp's 75 s."""
    return web.AppRunner(
        app,
        access_log=None,
        logger=SERVER_LOG,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        handler_cancellation=app.get(CANCEL_ON_DISCONNECT, False),
        keepalive_timeout=KEEPALIVE_S if setting == "agent_listen" else 75.0,
    )


async def bind_sockets(host: str, port: int, *, what: str, fix: str) -> list[socket.socket]:
    """Bind and listen on ``host:port`` the way aiohttp's ``TCPSite`` would (asyncio's
    ``create_server``: every address ``host`` names, both families for ``""``, ``SO_REUSEADDR``), and
    return the listening sockets (a backlog of 1,024), served by nobody yet: connections wait in the backlog until a
    process serves them (``web.SockSite``). The caller closes them.

    Raises:
        PortInUseError: the port is taken, or cannot be bound (the message as
            :func:`llmgw.httperrors.bind_error` words it, with ``what`` and ``fix``).
    """
    loop = asyncio.get_running_loop()
    try:
        server = await loop.create_server(asyncio.Protocol, host or None, port, reuse_address=True,
                                          start_serving=False)
    except OSError as e:
        raise bind_error(e, what=what, host=host, port=port, fix=fix) from e
    try:
        socks = [socket.socket(fileno=socket.dup(s.fileno())) for s in server.sockets]
    finally:
        server.close()
    for sock in socks:
        sock.listen(1024)  # aiohttp's 128 is short for thousands of agents reconnecting at once (capped by somaxconn)
    return socks
