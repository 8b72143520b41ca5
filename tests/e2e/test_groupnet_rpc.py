"""A model over two "nodes" through :mod:`llmgw.agent.groups.groupnet`, with the real llama.cpp RPC backend.

The worker side runs the real ``rpc-server`` (in a network namespace of its own when the tests run
as root) behind a :class:`~llmgw.agent.groups.groupnet.WorkerTunnel`; the head side runs the real
``llama-server --rpc`` pointed at a :class:`~llmgw.agent.groups.groupnet.HeadForwarder`, with real mTLS
certificates from a cluster CA in between. ``-ngl 99`` puts the model's layers on the RPC device,
so its weights travel through the tunnel and every token is computed through it. Then: the answer
to ``/completion``; and that nothing else gets anything: plain TCP to the worker's TLS port, the
forwarder from a process other than llama-server, the rpc-server's port from the host namespace.

Binaries and model: the test assets (``scripts/assets`` builds llama-server with the RPC backend and
rpc-server beside it; ``LLAMA_SERVER``, ``RPC_SERVER`` and ``MODEL`` override them), through the
``assets`` fixture: missing ones skip, and FAIL under ``LLMGW_REQUIRE_ASSETS=1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from llmgw.agent.engines.llamacpp import FIT_OFF
from llmgw.agent.groups.groupnet import HeadForwarder, WorkerTunnel
from llmgw.agent.groups.isolation import NS_PORT, IsolatedProcess, rpc_server_argv, start_isolated
from llmgw.tlsconf import CA
from tests.conftest import Assets
from tests.helpers.net import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

@dataclass
class Binaries:
    rpc_server: Path
    llama_server: Path
    model: Path


@pytest.fixture(scope="module")
def binaries(assets: Assets) -> Binaries:
    """The assets' rpc-server, llama-server (built with ``-DGGML_RPC=ON``) and gemma-3-270m."""
    return Binaries(rpc_server=assets.rpc_server, llama_server=assets.llama_server, model=assets.model)


@dataclass
class Group:
    worker: IsolatedProcess
    tunnel: WorkerTunnel
    forwarder: HeadForwarder
    head: subprocess.Popen[bytes]
    url: str
    logs: Path


async def _healthy(url: str, head: subprocess.Popen[bytes], logs: Path) -> None:
    async with httpx.AsyncClient() as client:
        for _ in range(600):
            if head.poll() is not None:
                pytest.fail(f"llama-server exited with {head.returncode}:\n{(logs / 'head.log').read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url}/health", timeout=2)).status_code == 200:
                    return
            await asyncio.sleep(0.2)
    pytest.fail(f"llama-server not healthy in 120 s:\n{(logs / 'head.log').read_text()[-3000:]}")


@pytest.fixture
async def group(binaries: Binaries, tmp_path: Path) -> AsyncIterator[Group]:
    ca = CA.create()
    ca.write(tmp_path)
    head_cert = ca.issue_client("head-1").write(tmp_path, "head")
    worker_cert = ca.issue_client("worker-1").write(tmp_path, "worker")
    with (tmp_path / "worker.log").open("ab") as wlog:
        worker = await start_isolated(rpc_server_argv(binaries.rpc_server, "-t", "1"), stdout=wlog, ready_timeout_s=60)
    tunnel = WorkerTunnel(
        engine=worker.link, head_node_id="head-1", ca=tmp_path / "ca.pem", cert=worker_cert[0], key=worker_cert[1],
        host="127.0.0.1",
    )  # fmt: skip
    forwarder = HeadForwarder(
        workers={"worker-1": await tunnel.start()}, ca=tmp_path / "ca.pem", cert=head_cert[0], key=head_cert[1]
    )
    await forwarder.start()
    port = free_port()
    with (tmp_path / "head.log").open("ab") as hlog:
        head = subprocess.Popen(  # noqa: ASYNC220 (as the agent's runner does)
            [str(binaries.llama_server), "-m", str(binaries.model), "--rpc", forwarder.rpc_arg, "-ngl", "99",
             "--host", "127.0.0.1", "--port", str(port), *FIT_OFF, "-c", "512", "-np", "1", "--threads", "1"],
            stdout=hlog, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    forwarder.allow(head.pid)  # at once: before llama-server gets to connect to its RPC servers
    g = Group(worker, tunnel, forwarder, head, f"http://127.0.0.1:{port}", tmp_path)
    try:
        await _healthy(g.url, head, tmp_path)
        yield g
    finally:
        head.terminate()
        await asyncio.to_thread(head.wait, 30)
        await forwarder.close()
        await tunnel.close()
        await worker.stop()


async def _raw(host: str, port: int, payload: bytes) -> bytes | None:
    """Plain TCP: send ``payload``, return what came back (b"" closed), or None when refused."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return None
    try:
        writer.write(payload)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
            return await asyncio.wait_for(reader.read(1024), 15)
        return b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


#: What a llama.cpp RPC client sends first: RPC_CMD_HELLO (14) and a zero-length payload.
HELLO = bytes([14]) + (0).to_bytes(8, "little")


async def test_llama_server_answers_through_the_tunnel(group: Group) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(
            f"{group.url}/completion", json={"prompt": "The capital of France is", "n_predict": 8, "temperature": 0}
        )
    assert r.status_code == 200, r.text
    assert r.json()["content"].strip()
    assert group.tunnel.accepted >= 1
    assert group.forwarder.accepted >= 1
    assert group.tunnel.refused == 0
    assert group.forwarder.refused == 0
    # the model's layers went to the worker through the tunnel (token embeddings stay on the head)
    print(f"through the tunnel: {group.tunnel.traffic}")
    assert group.tunnel.traffic.sent > 20_000_000
    assert group.forwarder.traffic.sent == group.tunnel.traffic.sent
    assert "Accepted client connection" in (group.logs / "worker.log").read_text()


async def test_nothing_else_reaches_the_worker(group: Group) -> None:
    host, port = group.tunnel.endpoint.rsplit(":", 1)
    # plain TCP speaking RPC to the worker's TLS port: closed, nothing answered
    assert await _raw(host, int(port), HELLO) == b""
    for _ in range(100):  # the refusal is counted once the failed handshake reaches the tunnel's task
        if group.tunnel.refused:
            break
        await asyncio.sleep(0.05)
    assert group.tunnel.refused == 1
    # the forwarder, from this process (not llama-server): closed, nothing answered
    fport = int(group.forwarder.rpc_arg.rsplit(":", 1)[1])
    assert await _raw("127.0.0.1", fport, HELLO) == b""
    assert group.forwarder.refused == 1
    if group.worker.link.isolated:
        # rpc-server's port from the host namespace: nothing listens there
        assert await _raw("127.0.0.1", NS_PORT, HELLO) is None
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex(("127.0.0.1", NS_PORT)) != 0
    # and the group still serves
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(f"{group.url}/completion", json={"prompt": "Hello", "n_predict": 4})
    assert r.status_code == 200
