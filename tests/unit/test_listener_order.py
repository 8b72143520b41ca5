"""The control plane binds its admin API last, so that ``/api/v1/health`` answering means every
listener is bound: ``llmgw server init`` and the tests wait for it, then connect to the agent API
(CI saw that connection refused when the admin API came first). A real control plane, in-process."""

from __future__ import annotations

import ssl
from pathlib import Path

import aiohttp

from tests.helpers.control import make_install, serving
from tests.helpers.net import free_port


async def test_the_admin_api_is_bound_after_every_other_listener(tmp_path: Path) -> None:
    inst = make_install(tmp_path, ui={"listen": f"127.0.0.1:{free_port()}"})
    async with serving(inst) as served:
        assert list(served.bound)[-1] == "admin_listen", list(served.bound)
        assert {"agent_listen", "gateway.listen", "ui.listen"} <= set(served.bound)
        # and the agent API takes a connection as soon as the admin API is up
        ctx = inst.agent_ctx("node-order")
        assert isinstance(ctx, ssl.SSLContext)
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session,
            session.get(f"{inst.agent_url}/api/v1/nosuch") as resp,
        ):
            assert resp.status == 404
