"""download(): resume from a partial file and after a cut connection, digest checks, retries.

Runs against a real aiohttp server on 127.0.0.1 whose handlers count requests and can cut a body.
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw.errors import MirrorError
from llmgw.mirror.download import CHECKSUM_HEADER, download, partial_path

DATA = bytes(range(256)) * 4096  # 1 MiB, not all one byte
SHA = hashlib.sha256(DATA).hexdigest()


@dataclass
class Seen:
    ranges: list[str | None] = field(default_factory=list)
    cuts_left: int = 0
    fail_5xx: int = 0
    send_sha: str = ""


SEEN = web.AppKey("seen", Seen)


def _start(request: web.Request) -> int:
    rng = request.headers.get("Range")
    return int(rng.removeprefix("bytes=").rstrip("-")) if rng else 0


async def _serve(request: web.Request) -> web.StreamResponse:
    seen: Seen = request.app[SEEN]
    seen.ranges.append(request.headers.get("Range"))
    if seen.fail_5xx:
        seen.fail_5xx -= 1
        return web.Response(status=503)
    start = _start(request)
    resp = web.StreamResponse(status=206 if start else 200)
    if start:
        resp.headers["Content-Range"] = f"bytes {start}-{len(DATA) - 1}/{len(DATA)}"
    if seen.send_sha:
        resp.headers[CHECKSUM_HEADER] = seen.send_sha
    resp.content_length = len(DATA) - start
    await resp.prepare(request)
    body = DATA[start:]
    if seen.cuts_left:
        seen.cuts_left -= 1
        await resp.write(body[: len(body) // 3])
        assert request.transport is not None
        request.transport.close()  # flushes what was written, then cuts
        return resp
    await resp.write(body)
    await resp.write_eof()
    return resp


async def _no_range(request: web.Request) -> web.Response:
    request.app[SEEN].ranges.append(request.headers.get("Range"))
    return web.Response(body=DATA)


async def _missing(_: web.Request) -> web.Response:
    return web.Response(status=404)


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, Seen]]:
    app = web.Application()
    seen = Seen()
    app[SEEN] = seen
    app.router.add_get("/f", _serve)
    app.router.add_get("/norange", _no_range)
    app.router.add_get("/missing", _missing)
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    try:
        yield str(srv.make_url("")).rstrip("/"), seen
    finally:
        await srv.close()


async def test_plain_download_returns_sha_and_reports_progress(
    server: tuple[str, Seen], tmp_path: pathlib.Path
) -> None:
    base, _ = server
    dest = tmp_path / "sub" / "m.gguf"
    calls: list[tuple[int, int | None]] = []
    async with aiohttp.ClientSession() as s:
        got = await download(s, f"{base}/f", dest, progress=lambda d, t: calls.append((d, t)))
    assert got == SHA
    assert dest.read_bytes() == DATA
    assert not partial_path(dest).exists()
    assert calls[-1] == (len(DATA), len(DATA))


async def test_resumes_from_existing_partial(server: tuple[str, Seen], tmp_path: pathlib.Path) -> None:
    base, seen = server
    dest = tmp_path / "m.gguf"
    partial_path(dest).write_bytes(DATA[:1000])
    async with aiohttp.ClientSession() as s:
        got = await download(s, f"{base}/f", dest, expected_sha256=SHA)
    assert got == SHA
    assert seen.ranges == ["bytes=1000-"]
    assert dest.read_bytes() == DATA


async def test_resumes_after_cut_connection(server: tuple[str, Seen], tmp_path: pathlib.Path) -> None:
    base, seen = server
    seen.cuts_left = 2
    dest = tmp_path / "m.gguf"
    async with aiohttp.ClientSession() as s:
        got = await download(s, f"{base}/f", dest, expected_sha256=SHA)
    assert got == SHA
    assert dest.read_bytes() == DATA
    assert len(seen.ranges) == 3
    assert seen.ranges[0] is None
    assert all(r is not None and r != "bytes=0-" for r in seen.ranges[1:])


async def test_retries_5xx(server: tuple[str, Seen], tmp_path: pathlib.Path) -> None:
    base, seen = server
    seen.fail_5xx = 2
    async with aiohttp.ClientSession() as s:
        assert await download(s, f"{base}/f", tmp_path / "m") == SHA
    assert len(seen.ranges) == 3


async def test_gives_up_after_retries_keeping_partial(
    server: tuple[str, Seen], tmp_path: pathlib.Path
) -> None:
    base, seen = server
    seen.cuts_left = 10
    dest = tmp_path / "m"
    async with aiohttp.ClientSession() as s:
        with pytest.raises(MirrorError, match="failed after 2 tries"):
            await download(s, f"{base}/f", dest, retries=1)
    assert not dest.exists()
    assert 0 < partial_path(dest).stat().st_size < len(DATA)


async def test_wrong_expected_digest_deletes_partial(
    server: tuple[str, Seen], tmp_path: pathlib.Path
) -> None:
    base, _ = server
    dest = tmp_path / "m"
    wrong = "0" * 64
    async with aiohttp.ClientSession() as s:
        with pytest.raises(MirrorError) as ei:
            await download(s, f"{base}/f", dest, expected_sha256=wrong)
    assert SHA in str(ei.value)
    assert wrong in str(ei.value)
    assert not dest.exists()
    assert not partial_path(dest).exists()


async def test_server_checksum_header_is_verified(server: tuple[str, Seen], tmp_path: pathlib.Path) -> None:
    base, seen = server
    seen.send_sha = "f" * 64
    async with aiohttp.ClientSession() as s:
        with pytest.raises(MirrorError, match=f"X-Checksum-Sha256 is {'f' * 64}"):
            await download(s, f"{base}/f", tmp_path / "m")
    seen.send_sha = SHA
    async with aiohttp.ClientSession() as s:
        assert await download(s, f"{base}/f", tmp_path / "m") == SHA


async def test_server_without_range_support_starts_over(
    server: tuple[str, Seen], tmp_path: pathlib.Path
) -> None:
    base, _ = server
    dest = tmp_path / "m"
    partial_path(dest).write_bytes(b"stale bytes")
    async with aiohttp.ClientSession() as s:
        assert await download(s, f"{base}/norange", dest) == SHA
    assert dest.read_bytes() == DATA


async def test_404_is_final(server: tuple[str, Seen], tmp_path: pathlib.Path) -> None:
    base, _ = server
    async with aiohttp.ClientSession() as s:
        with pytest.raises(MirrorError, match="answered 404"):
            await download(s, f"{base}/missing", tmp_path / "m")
