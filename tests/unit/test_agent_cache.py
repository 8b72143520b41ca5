"""The node cache against a real local HTTP server: fetch once, verify, reuse without rehashing."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw.agent.node.cache import NodeCache, digest_record_path, link_local_connector, recorded_digest
from llmgw.errors import MirrorError
from llmgw.protocol import ReplicaSpec
from tests.helpers.net import serve_app

BODY = os.urandom(300_000)
SHA = hashlib.sha256(BODY).hexdigest()


class Mirror:
    def __init__(self) -> None:
        self.gets = 0
        self.base = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.gets += 1
        return web.Response(body=BODY, headers={"X-Checksum-Sha256": SHA})


@pytest.fixture
async def mirror() -> AsyncIterator[Mirror]:
    m = Mirror()
    app = web.Application()
    app.router.add_get("/{tail:.*}", m.handle)
    runner, m.base = await serve_app(app)
    yield m
    await runner.cleanup()


def spec(base: str, sha: str = SHA, **kw: object) -> ReplicaSpec:
    fields: dict[str, object] = {
        "id": "r1",
        "model": "m",
        "version": "v1",
        "profile": "cpu",
        "engine": "llamacpp",
        "source_url": f"{base}/m/v1/w.gguf",
        "sha256": sha,
        "file_name": "w.gguf",
        "key": "k",
    }
    return ReplicaSpec.model_validate(fields | kw)


async def test_fetch_once_then_reuse(tmp_path: Path, mirror: Mirror) -> None:
    cache = NodeCache(tmp_path / "cache")
    async with aiohttp.ClientSession() as session:
        path = await cache.ensure(session, spec(mirror.base))
        assert path == tmp_path / "cache" / "m" / "v1" / "w.gguf"
        assert path.read_bytes() == BODY
        assert recorded_digest(path) == SHA
        again = await cache.ensure(session, spec(mirror.base))
        assert again == path
        assert mirror.gets == 1  # reused: no second download


async def test_present_file_is_hashed_once_and_reused(tmp_path: Path, mirror: Mirror) -> None:
    cache = NodeCache(tmp_path / "cache")
    path = cache.path_for(spec(mirror.base))
    path.parent.mkdir(parents=True)
    path.write_bytes(BODY)  # copied in by hand, no digest record yet
    async with aiohttp.ClientSession() as session:
        assert await cache.ensure(session, spec(mirror.base)) == path
    assert mirror.gets == 0
    assert recorded_digest(path) == SHA


async def test_changed_file_is_fetched_again(tmp_path: Path, mirror: Mirror) -> None:
    cache = NodeCache(tmp_path / "cache")
    async with aiohttp.ClientSession() as session:
        path = await cache.ensure(session, spec(mirror.base))
        path.write_bytes(b"corrupted")  # size/mtime no longer match the record
        assert recorded_digest(path) == ""
        await cache.ensure(session, spec(mirror.base))
    assert path.read_bytes() == BODY
    assert mirror.gets == 2


async def test_the_same_weights_under_another_model_are_linked_not_fetched_again(
    tmp_path: Path, mirror: Mirror
) -> None:
    """A new user's finding: three catalog models on one mirror file made a node hold three copies
    (242 MB each). A spec whose sha256 a cached file already has gets a hard link to it: no
    download, no second copy on disk; each name is its own model's, with its digest recorded."""
    cache = NodeCache(tmp_path / "cache", max_bytes=len(BODY) + 10)  # room for one copy: the two names fit
    async with aiohttp.ClientSession() as session:
        first = await cache.ensure(session, spec(mirror.base))
        cache.release(first)
        other = await cache.ensure(session, spec(mirror.base, model="copy", version="2"))
    assert first.exists()  # its bytes counted once: nothing evicted
    assert mirror.gets == 1
    assert other == tmp_path / "cache" / "copy" / "2" / "w.gguf"
    assert other.read_bytes() == BODY
    assert os.stat(other).st_ino == os.stat(first).st_ino  # one file on disk, two names
    assert recorded_digest(other) == SHA


async def test_a_failed_first_fetch_leaves_no_empty_directories(tmp_path: Path, mirror: Mirror) -> None:
    """A download that fails (a 404, here a wrong digest) left ``cache/<model>/<version>/`` behind, empty."""
    cache = NodeCache(tmp_path / "cache")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(MirrorError):
            await cache.ensure(session, spec(mirror.base, model="ghost", sha="0" * 64))
    assert not (tmp_path / "cache" / "ghost").exists()


async def test_wrong_digest_is_an_error_naming_the_url(tmp_path: Path, mirror: Mirror) -> None:
    cache = NodeCache(tmp_path / "cache")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(MirrorError, match=r"w\.gguf"):
            await cache.ensure(session, spec(mirror.base, sha="0" * 64))
    assert not cache.path_for(spec(mirror.base)).exists()


@pytest.mark.parametrize(("base", "says"), [
    ("http://169.254.169.254", "169.254.169.254 is a link-local address"),
    ("http://[fe80::1%25lo]:8081", "fe80::1 is a link-local address"),
])
async def test_a_link_local_source_is_refused_before_any_connection(tmp_path: Path, base: str, says: str) -> None:
    """A new user's finding: the agent (root) fetched a catalog source at the cloud's metadata address.
    A catalog row from before the control plane refused such sources, or a name that resolves there, is
    refused here, nothing written."""
    cache = NodeCache(tmp_path / "cache")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(MirrorError, match=f"{says}: nodes never download weights from a link-local address"):
            await cache.ensure(session, spec(base))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.gguf*"))


async def test_a_redirect_to_a_link_local_address_is_refused_at_the_connection(tmp_path: Path) -> None:
    """The check before the download reads the source's own host; a redirect (or a DNS answer that
    changes after the check) reached the metadata address all the same (a new user's finding). The
    agent's downloads go through :func:`link_local_connector`, which refuses the address as the
    connection is made: at once, not after the retries a connect time-out gets, nothing written."""
    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("http://169.254.169.254/latest/meta-data/w.gguf")

    app = web.Application()
    app.router.add_get("/{tail:.*}", redirect)
    runner, base = await serve_app(app)
    cache = NodeCache(tmp_path / "cache")
    try:
        async with aiohttp.ClientSession(connector=link_local_connector()) as session:
            started = time.monotonic()
            with pytest.raises(MirrorError, match=r"169\.254\.169\.254 is a link-local address: nodes never download"):
                await cache.ensure(session, spec(base))
            assert time.monotonic() - started < 5
    finally:
        await runner.cleanup()
    assert not any((tmp_path / "cache").rglob("*.gguf*"))


def test_unsafe_names_are_refused(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path)
    for kw in ({"model": ".."}, {"file_name": "../../etc/passwd"}, {"version": ""}):
        with pytest.raises(MirrorError, match="cannot be a file name"):
            cache.path_for(spec("http://x", **kw))


async def test_eviction_keeps_files_in_use(tmp_path: Path, mirror: Mirror) -> None:
    # No digest in the specs: each version is its own download (equal digests are linked, not fetched).
    cache = NodeCache(tmp_path / "cache", max_bytes=len(BODY) + 10)
    async with aiohttp.ClientSession() as session:
        first = await cache.ensure(session, spec(mirror.base, sha="", version="a"))
        second = await cache.ensure(session, spec(mirror.base, sha="", version="b"))
        assert first.exists()  # in use: never evicted
        cache.release(first)
        third = await cache.ensure(session, spec(mirror.base, sha="", version="c"))
    assert not first.exists()
    assert not digest_record_path(first).exists()
    assert second.exists()
    assert third.exists()


async def test_eviction_takes_the_least_recently_used_not_the_oldest_fetched(tmp_path: Path, mirror: Mirror) -> None:
    # No digest in the specs: each version is its own download (equal digests are linked, not fetched).
    cache = NodeCache(tmp_path / "cache", max_bytes=2 * len(BODY) + 10)
    async with aiohttp.ClientSession() as session:
        a = await cache.ensure(session, spec(mirror.base, sha="", version="a"))
        b = await cache.ensure(session, spec(mirror.base, sha="", version="b"))
        cache.release(a)
        cache.release(b)
        os.utime(digest_record_path(a), (1_000, 1_000))  # used long ago ...
        os.utime(digest_record_path(b), (2_000, 2_000))
        assert await cache.ensure(session, spec(mirror.base, sha="", version="a")) == a  # ... and used again now
        cache.release(a)
        c = await cache.ensure(session, spec(mirror.base, sha="", version="c"))
    assert a.exists()
    assert not b.exists()  # the least recently used one went
    assert c.exists()
    assert mirror.gets == 3  # a was reused, not fetched again
