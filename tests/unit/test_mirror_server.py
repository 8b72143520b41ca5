"""The mirror served in-process on 127.0.0.1 ephemeral ports: fetch, serve bytes, guard the API.

Every test talks HTTP to a real MirrorServer over a temp store; path-escape tests send raw request
lines so no client normalises the path first.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import pathlib
import socket
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw.errors import PortInUseError
from llmgw.mirror.download import partial_path
from llmgw.mirror.models import FetchStatus, Manifest
from llmgw.mirror.server import MirrorServer
from llmgw.mirror.store import Store
from tests.helpers.mirrors import BASE, Mirror, raw_status

DATA = os.urandom(300_000)
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def src(tmp_path: pathlib.Path) -> pathlib.Path:
    p = tmp_path / "in" / "model.gguf"
    p.parent.mkdir()
    p.write_bytes(DATA)
    return p


@pytest.fixture
async def mirror(tmp_path: pathlib.Path) -> AsyncIterator[Mirror]:
    async with Mirror(tmp_path / "store") as m:
        yield m


async def test_fetch_file_source_then_serve_with_range(
    mirror: Mirror, src: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    status, body = await mirror.post_fetch(f"file:{src}")
    assert status == 202
    assert body["state"] in ("fetching", "present")
    st = await mirror.wait()
    assert st.sha256 == SHA
    assert st.bytes_done == st.bytes_total == len(DATA)
    assert st.url == f"{BASE}/gemma/1/model.gguf"
    assert st.percent() == 100
    manifest = json.loads((mirror.server.root / "gemma" / "1" / "manifest.json").read_text())
    assert manifest["state"] == "present"
    assert manifest["size"] == len(DATA)
    assert manifest["sha256"] == SHA

    status, body = await mirror.post_fetch(f"file:{src}")  # already there
    assert status == 200
    assert body["state"] == "present"

    url = f"{mirror.files}/gemma/1/model.gguf"
    async with mirror.http.get(url) as r:
        assert r.status == 200
        assert await r.read() == DATA
    async with mirror.http.get(url, headers={"Range": "bytes=1000-1999"}) as r:
        assert r.status == 206
        assert r.headers["Content-Range"] == f"bytes 1000-1999/{len(DATA)}"
        assert await r.read() == DATA[1000:2000]
    async with mirror.http.head(url) as r:
        assert r.status == 200
        assert r.headers["X-Checksum-Sha256"] == SHA
        assert r.headers["ETag"] == f'"{SHA}"'
        assert int(r.headers["Content-Length"]) == len(DATA)
    async with mirror.http.get(url, headers={"If-None-Match": f'"{SHA}"'}) as r:
        assert r.status == 304
    async with mirror.http.get(url, headers={"If-Range": '"other"', "Range": "bytes=0-9"}) as r:
        assert r.status == 200  # another version named: the whole file
        assert len(await r.read()) == len(DATA)
    async with mirror.http.get(url, headers={"If-Range": f'"{SHA}"', "Range": "bytes=0-9"}) as r:
        assert r.status == 206
        assert await r.read() == DATA[:10]
    await asyncio.sleep(0.1)  # an error after the body went out is logged once the handler's task ends
    # a new user's finding: every GET logged an ERROR traceback (aiohttp prepared the file response a
    # second time after the handler had, and its sendfile asserted), and no access line
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []

    async with mirror.http.get(f"{mirror.api}/files") as r:
        files = [FetchStatus.model_validate(x) for x in await r.json()]
    assert [(f.model, f.version, f.state) for f in files] == [("gemma", "1", "present")]


async def test_http_source_through_download_and_shared(mirror: Mirror, src: pathlib.Path) -> None:
    """A mirror fetching from a slow HTTP server: two requests share one download."""
    gate = asyncio.Event()
    hits: list[str | None] = []

    async def slow(request: web.Request) -> web.StreamResponse:
        hits.append(request.headers.get("Range"))
        resp = web.StreamResponse()
        resp.content_length = len(DATA)
        await resp.prepare(request)
        await resp.write(DATA[:1000])
        await gate.wait()
        await resp.write(DATA[1000:])
        return resp

    app = web.Application()
    app.router.add_get("/models/m.gguf", slow)
    upstream = TestServer(app, host="127.0.0.1")
    await upstream.start_server()
    try:
        source = str(upstream.make_url("/models/m.gguf"))
        s1, b1 = await mirror.post_fetch(source)
        s2, b2 = await mirror.post_fetch(source)
        assert (s1, s2) == (202, 202)
        assert b1["file"] == b2["file"] == "m.gguf"
        assert (await mirror.post_fetch("file:/elsewhere/m.gguf"))[0] == 409
        async with mirror.http.get(f"{mirror.files}/gemma/1/m.gguf") as r:
            assert r.status == 503  # still fetching: not served; the node is told to come back
            assert r.headers["Retry-After"] == "2"
            assert "still downloading into the mirror" in await r.text()
        gate.set()
        st = await mirror.wait()
        assert st.sha256 == SHA
        assert hits == [None]
    finally:
        await upstream.close()


async def test_mirror_from_mirror_verifies_checksum(mirror: Mirror, src: pathlib.Path) -> None:
    await mirror.post_fetch(f"file:{src}")
    await mirror.wait()
    status, _ = await mirror.post_fetch(f"{mirror.files}/gemma/1/model.gguf", "copy", "2")
    assert status == 202
    st = await mirror.wait("copy", "2")
    assert st.sha256 == SHA


async def test_failures_are_reported_and_retryable(
    mirror: Mirror, src: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    missing = tmp_path / "in" / "later.gguf"
    await mirror.post_fetch(f"file:{missing}", "m", "1")
    st = await mirror.wait("m", "1", "failed")
    assert "cannot be read" in st.err
    assert str(missing) in st.err
    missing.write_bytes(DATA)
    assert (await mirror.post_fetch(f"file:{missing}", "m", "1"))[0] == 202
    assert (await mirror.wait("m", "1")).sha256 == SHA


async def test_not_enough_disk_is_a_failure_naming_bytes(mirror: Mirror) -> None:
    async def huge(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = 10**18
        await resp.prepare(request)
        await resp.write(b"x")
        return resp

    app = web.Application()
    app.router.add_get("/huge.gguf", huge)
    upstream = TestServer(app, host="127.0.0.1")
    await upstream.start_server()
    try:
        await mirror.post_fetch(str(upstream.make_url("/huge.gguf")))
        st = await mirror.wait(state="failed")
    finally:
        await upstream.close()
    assert f"needs {10**18} more bytes" in st.err
    assert "bytes free" in st.err


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"source": "s3://b/m.gguf", "model": "m", "version": "1"}, 400, "bad_source"),
        ({"source": "file:/x/m.gguf", "model": "../etc", "version": "1"}, 400, "invalid_request"),
        ({"source": "file:/x/m.gguf", "model": "m"}, 400, "invalid_request"),
        ({"source": "file:/x/manifest.json", "model": "m", "version": "1"}, 400, "bad_source"),
    ],
)
async def test_fetch_rejects_bad_requests(
    mirror: Mirror, body: dict[str, str], status: int, code: str
) -> None:
    async with mirror.http.post(f"{mirror.api}/fetch", json=body) as r:
        assert r.status == status
        assert (await r.json())["error"]["code"] == code


async def test_unknown_status_is_404_json(mirror: Mirror) -> None:
    async with mirror.http.get(f"{mirror.api}/status/nope/1") as r:
        assert r.status == 404
        err = (await r.json())["error"]
    assert err["code"] == "not_found"
    assert "nope/1" in err["message"]
    async with mirror.http.get(f"{mirror.api}/health") as r:
        assert await r.json() == {"status": "ok"}


async def test_no_path_leaves_the_store(mirror: Mirror, src: pathlib.Path, tmp_path: pathlib.Path) -> None:
    await mirror.post_fetch(f"file:{src}")
    await mirror.wait()
    root = mirror.server.root
    secret = tmp_path / "secret.gguf"
    secret.write_bytes(b"secret")
    # A version whose "present" file is a symlink out of the store.
    vdir = root / "evil" / "1"
    vdir.mkdir(parents=True)
    (vdir / "secret.gguf").symlink_to(secret)
    Store(root).write(
        "evil",
        "1",
        Manifest(file="secret.gguf", source="file:/x", state="present", updated_at=datetime.now(UTC)),
        durable=False,
    )
    (root / "gemma" / "1" / ".hidden").write_bytes(b"x")
    port = mirror.server.bytes_port
    assert await raw_status(port, "/gemma/1/model.gguf") == 200
    for target in [
        "/gemma/1/../1/model.gguf",
        "/gemma/1/../../../secret.gguf",
        "/gemma/1/%2e%2e/%2e%2e/secret.gguf",
        "/gemma%2F1/model.gguf",
        "/gemma/1%2fmodel.gguf/x",
        "/gemma/1/..%2F..%2Fsecret.gguf",
        "/evil/1/secret.gguf",
        "/gemma/1/manifest.json",
        "/gemma/1/.hidden",
        f"/gemma/1/{partial_path(pathlib.Path('model.gguf')).name}",
        "/gemma/1/other.gguf",
    ]:
        assert await raw_status(port, target) == 404, target


async def test_half_written_file_is_not_served(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "store"
    vdir = root / "m" / "1"
    vdir.mkdir(parents=True)
    (vdir / "w.gguf").write_bytes(DATA[:100])  # bytes at the final name, but the manifest says fetching
    (vdir / partial_path(pathlib.Path("w.gguf")).name).write_bytes(DATA[:100])
    Store(root).write(
        "m",
        "1",
        Manifest(
            file="w.gguf", source="http://127.0.0.1:9/w.gguf", state="fetching", updated_at=datetime.now(UTC)
        ),
        durable=False,
    )
    async with Mirror(root) as m, m.http.get(f"{m.files}/m/1/w.gguf") as r:
        assert r.status == 503  # not served: "still downloading", never the bytes
        assert await r.read() != DATA[:100]


async def test_status_survives_restart_and_fetching_resumes(
    tmp_path: pathlib.Path, src: pathlib.Path
) -> None:
    root = tmp_path / "store"
    async with Mirror(root) as m:
        await m.post_fetch(f"file:{src}")
        before = await m.wait()
    # A fetch a killed mirror left half done: the manifest says fetching.
    Store(root).write(
        "later",
        "1",
        Manifest(
            file="model.gguf",
            source=f"file:{src}",
            state="fetching",
            bytes_done=5,
            updated_at=datetime.now(UTC),
        ),
        durable=False,
    )
    async with Mirror(root) as m:
        async with m.http.get(f"{m.api}/status/gemma/1") as r:
            assert FetchStatus.model_validate(await r.json()) == before
        assert (await m.wait("later", "1")).sha256 == SHA
        async with m.http.get(f"{m.files}/later/1/model.gguf") as r:
            assert await r.read() == DATA


async def test_api_answers_only_loopback_and_allowed(tmp_path: pathlib.Path) -> None:
    for allow, want in [((), 403), (("127.0.0.2",), 200), (("127.0.0.0/24",), 200)]:
        async with Mirror(tmp_path / "store", api_listen="0.0.0.0:0", allow=allow) as m:
            conn = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            url = f"http://127.0.0.1:{m.server.api_port}/api/v1/health"
            async with aiohttp.ClientSession(connector=conn) as other, other.get(url) as r:
                assert r.status == want, allow
                body = await r.json()
            if want == 403:
                assert body["error"]["code"] == "forbidden"
                assert "--api-allow 127.0.0.2" in body["error"]["message"]
            async with m.http.get(f"{m.api}/health") as r:  # from 127.0.0.1: always
                assert r.status == 200


async def test_port_in_use_names_port_and_flag(tmp_path: pathlib.Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for listen, api, flag in [
            (f"127.0.0.1:{port}", "127.0.0.1:0", "--listen"),
            ("127.0.0.1:0", f"127.0.0.1:{port}", "--api-listen"),
        ]:
            server = MirrorServer(root=tmp_path / "s", listen=listen, api_listen=api, base=BASE)
            with pytest.raises(PortInUseError) as ei:
                await server.start()
            assert str(port) in str(ei.value)
            assert flag in str(ei.value)


async def test_refetch_from_another_source_does_not_resume_stale_bytes(
    tmp_path: pathlib.Path, src: pathlib.Path
) -> None:
    root = tmp_path / "store"
    vdir = root / "x" / "1"
    vdir.mkdir(parents=True)
    (vdir / partial_path(pathlib.Path("model.gguf")).name).write_bytes(b"junk from the old source")
    Store(root).write(
        "x", "1",
        Manifest(file="model.gguf", source="http://old.test/model.gguf", state="failed", err="gone",
                 updated_at=datetime.now(UTC)),
        durable=False,
    )  # fmt: skip
    async with Mirror(root) as m:
        await m.post_fetch(f"file:{src}")
        await m.wait()
        status, _ = await m.post_fetch(f"{m.files}/gemma/1/model.gguf", "x", "1")
        assert status == 202
        assert (await m.wait("x", "1")).sha256 == SHA
