"""Mirrors and upstreams for tests: a real MirrorServer on ephemeral loopback ports (in a thread for
sync clients, or on the test's loop), a raw-request probe, and a Hugging Face-like upstream."""

from __future__ import annotations

import asyncio
import hashlib
import pathlib
import threading
from typing import Any

import aiohttp
from aiohttp import web

from llmgw.mirror.models import FetchStatus
from llmgw.mirror.policy import SourcePolicy
from llmgw.mirror.server import MirrorServer

BASE = "http://mirror.test:8081"
"""The base URL :class:`Mirror` serves its files under."""


class ThreadedMirror:
    """A MirrorServer on 127.0.0.1 ephemeral ports, on its own event loop in a thread, for
    synchronous clients; ``with`` starts and stops it."""

    def __init__(self, root: pathlib.Path, policy: SourcePolicy | None = None) -> None:
        # By default file: sources from the test's directory (the store's parent), as --import-dir would allow.
        self.server = MirrorServer(
            root=root, listen="127.0.0.1:0", api_listen="127.0.0.1:0", base="http://m.test:8081",
            policy=policy or SourcePolicy(import_dirs=(root.parent.resolve(),)),
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedMirror:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.server.api_port}"


class Mirror:
    """A MirrorServer on 127.0.0.1 ephemeral ports. Its default policy imports ``file:`` sources
    from ``<root's parent>/in`` and fetches from any address (the upstreams here are on loopback);
    the policy tests give it the strict ones."""

    def __init__(
        self,
        root: pathlib.Path,
        api_listen: str = "127.0.0.1:0",
        allow: tuple[str, ...] = (),
        policy: SourcePolicy | None = None,
    ) -> None:
        if policy is None:
            policy = SourcePolicy(import_dirs=(root.parent.resolve() / "in",), allow_private=True)
        self.server = MirrorServer(
            root=root, listen="127.0.0.1:0", api_listen=api_listen, base=BASE, api_allow=allow, policy=policy
        )

    async def __aenter__(self) -> Mirror:
        await self.server.start()
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.http.close()
        await self.server.stop()

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.server.api_port}/api/v1"

    @property
    def files(self) -> str:
        return f"http://127.0.0.1:{self.server.bytes_port}"

    async def post_fetch(self, source: str, model: str = "gemma", version: str = "1") -> tuple[int, Any]:
        body = {"source": source, "model": model, "version": version}
        async with self.http.post(f"{self.api}/fetch", json=body) as r:
            return r.status, await r.json()

    async def wait(self, model: str = "gemma", version: str = "1", state: str = "present") -> FetchStatus:
        for _ in range(500):
            async with self.http.get(f"{self.api}/status/{model}/{version}") as r:
                if r.status == 200:
                    st = FetchStatus.model_validate(await r.json())
                    if st.state == state:
                        return st
                    assert st.state == "fetching", st
            await asyncio.sleep(0.01)
        raise AssertionError(f"{model}/{version} never became {state}")


async def raw_status(port: int, target: str, host: str = "127.0.0.1") -> int:
    """Send ``GET target`` exactly as written; return the status code."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    line = await reader.readline()
    writer.close()
    await writer.wait_closed()
    return int(line.split()[1])


class Upstream:
    """A local HTTP server: a Hugging Face-style resolve route and throttled plain files.

    ``published`` is the ``X-Linked-Etag`` the HEAD answers; ``body`` what GET sends; ``delay_s``
    the pause after each 64 KiB (throttling); ``length`` whether Content-Length is sent.
    """

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.published = f'"{hashlib.sha256(body).hexdigest()}"'
        self.delay_s = 0.0
        self.length = True
        self.ranges: list[str] = []
        self.base = ""

    async def head(self, _: web.Request) -> web.Response:
        # As Hugging Face answers a resolve HEAD for an LFS file, redirects not followed.
        return web.Response(
            status=302,
            headers={"X-Linked-Etag": self.published, "X-Linked-Size": str(len(self.body)),
                     "Location": f"{self.base}/cdn/blob"},
        )  # fmt: skip

    async def get(self, request: web.Request) -> web.StreamResponse:
        rng = request.headers.get("Range", "")
        self.ranges.append(rng)
        start = int(rng.removeprefix("bytes=").rstrip("-")) if rng else 0
        resp = web.StreamResponse(status=206 if start else 200)
        if start:
            resp.headers["Content-Range"] = f"bytes {start}-{len(self.body) - 1}/{len(self.body)}"
        if self.length:
            resp.content_length = len(self.body) - start
        else:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(start, len(self.body), 1 << 16):
            await resp.write(self.body[i : i + (1 << 16)])
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        await resp.write_eof()
        return resp


def public_gguf(where: pathlib.Path, data: bytes) -> pathlib.Path:
    """``where/carried/w.gguf`` holding ``data``, 0644 in a directory others may search (0755:
    pytest's tmp_path itself is 0700), as the mirror publishes only what others could read; the file."""
    d = where / "carried"
    d.mkdir(mode=0o755)
    (d / "w.gguf").write_bytes(data)
    (d / "w.gguf").chmod(0o644)
    return d / "w.gguf"
