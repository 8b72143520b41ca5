"""The mirror's fetches against real local upstreams: Hugging Face digests, wrong bytes, delete,
progress with ETA, a disk that fills (a real 8 MiB tmpfs), and nodes asking while the mirror is
still downloading. Each test runs a real MirrorServer on 127.0.0.1 ephemeral ports in-process.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from llmgw.agent.node.cache import NodeCache
from llmgw.mirror.models import FetchStatus
from llmgw.mirror.policy import SourcePolicy
from llmgw.mirror.server import MirrorServer
from llmgw.protocol import ReplicaSpec
from llmgw.sourcecheck import hf_published_sha256, hf_published_size
from tests.helpers.mirrors import Upstream

DATA = os.urandom(1_500_000)
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream(DATA)
    app = web.Application()
    app.router.add_route("HEAD", "/{org}/{repo}/resolve/main/{file}", up.head)
    app.router.add_get("/{org}/{repo}/resolve/main/{file}", up.get, allow_head=False)
    app.router.add_get("/files/{name}", up.get)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    up.base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield up
    await runner.cleanup()


class Mirror:
    def __init__(self, root: pathlib.Path, imports: pathlib.Path | None = None) -> None:
        # The upstreams are on loopback; file: sources come from ``imports`` (default the store's parent).
        policy = SourcePolicy(import_dirs=((imports or root.parent).resolve(),), allow_private=True)
        self.server = MirrorServer(
            root=root, listen="127.0.0.1:0", api_listen="127.0.0.1:0", base="", policy=policy
        )

    async def __aenter__(self) -> Mirror:
        await self.server.start()
        self.server.fetcher.base = f"http://127.0.0.1:{self.server.bytes_port}"
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.http.close()
        await self.server.stop()

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.server.api_port}/api/v1"

    async def fetch(self, source: str, model: str = "m", version: str = "1") -> tuple[int, Any]:
        body = {"source": source, "model": model, "version": version}
        async with self.http.post(f"{self.api}/fetch", json=body) as r:
            return r.status, await r.json()

    async def status(self, model: str = "m", version: str = "1") -> FetchStatus | None:
        async with self.http.get(f"{self.api}/status/{model}/{version}") as r:
            return FetchStatus.model_validate(await r.json()) if r.status == 200 else None

    async def until(self, pred: Any, model: str = "m", version: str = "1") -> FetchStatus:
        for _ in range(1000):
            st = await self.status(model, version)
            if st is not None and pred(st):
                return st
            await asyncio.sleep(0.01)
        raise AssertionError(f"status never matched: {st}")

    async def get_status_code(self, url: str) -> int:
        async with self.http.get(url) as r:
            return r.status


@pytest.fixture
async def mirror(tmp_path: pathlib.Path) -> AsyncIterator[Mirror]:
    async with Mirror(tmp_path / "store") as m:
        yield m


def leftovers(root: pathlib.Path) -> list[str]:
    """Every file in the store except manifests: what a failed fetch must not leave behind."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "manifest.json")


# --- Hugging Face ---


def test_hf_headers_give_the_lfs_sha256_only() -> None:
    assert hf_published_sha256({"X-Linked-Etag": f'"{SHA}"', "ETag": '"abc"'}) == SHA
    assert hf_published_sha256({"ETag": f'W/"{SHA.upper()}"'}) == SHA
    assert hf_published_sha256({"ETag": '"' + "a" * 40 + '"'}) == ""  # a git blob id, not a sha256
    assert hf_published_sha256({}) == ""
    assert hf_published_size({"X-Linked-Size": "253"}) == 253
    assert hf_published_size({"X-Linked-Size": "x"}) is None


async def test_hf_source_is_checked_against_the_published_sha256(
    mirror: Mirror, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", upstream.base)
    code, _ = await mirror.fetch("hf:org/repo/w.gguf")
    assert code == 202
    st = await mirror.until(lambda s: s.state != "fetching")
    assert st.state == "present", st.err
    assert st.expected_sha256 == SHA
    assert st.sha256 == SHA
    assert st.eta_s == 0
    async with mirror.http.get(st.url) as r:
        assert await r.read() == DATA


async def test_upstream_serving_wrong_bytes_fails_naming_both_digests_and_serves_nothing(
    mirror: Mirror, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", upstream.base)
    upstream.body = DATA[:-1] + bytes([DATA[-1] ^ 1])  # same size, one bit off
    wrong = hashlib.sha256(upstream.body).hexdigest()
    await mirror.fetch("hf:org/repo/w.gguf")
    st = await mirror.until(lambda s: s.state != "fetching")
    assert st.state == "failed"
    assert SHA in st.err
    assert wrong in st.err
    assert await mirror.get_status_code(st.url) == 404
    assert leftovers(mirror.server.store.root) == []


async def test_git_blob_etag_is_not_taken_for_a_digest(
    mirror: Mirror, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", upstream.base)
    upstream.published = '"' + "b" * 40 + '"'
    await mirror.fetch("hf:org/repo/w.gguf")
    st = await mirror.until(lambda s: s.state != "fetching")
    assert (st.state, st.expected_sha256, st.sha256) == ("present", "", SHA)


# --- progress, cancel and delete ---


async def test_progress_has_rate_and_eta_then_delete_cancels(mirror: Mirror, upstream: Upstream) -> None:
    upstream.delay_s = 0.05  # ~1.3 MB/s: about a second for the file
    await mirror.fetch(f"{upstream.base}/files/w.gguf")
    st = await mirror.until(lambda s: s.rate_bytes_per_s > 0 and s.eta_s is not None and s.bytes_done > 200_000)
    assert st.state == "fetching"
    assert st.eta_s is not None
    assert 0 < st.eta_s < 30
    assert st.progress_text().endswith(" s left"), st.progress_text()
    assert await mirror.get_status_code(st.url) == 503  # still arriving: nodes are told to come back

    async with mirror.http.delete(f"{mirror.api}/files/m/1") as r:
        assert r.status == 200
        assert (await r.json())["state"] == "fetching"
    assert await mirror.status() is None
    assert not (mirror.server.store.root / "m").exists()
    assert await mirror.get_status_code(st.url) == 404
    async with mirror.http.delete(f"{mirror.api}/files/m/1") as r:
        assert r.status == 404
    # asked again, it starts over and completes
    await mirror.fetch(f"{upstream.base}/files/w.gguf")
    upstream.delay_s = 0
    st = await mirror.until(lambda s: s.state != "fetching")
    assert (st.state, st.sha256) == ("present", SHA)


def test_eta_text() -> None:
    st = FetchStatus(model="m", version="1", file="f", source="s", state="fetching", bytes_done=50,
                     bytes_total=100, rate_bytes_per_s=2e6, eta_s=200.4)  # fmt: skip
    assert st.eta_text() == "3 min 20 s"
    assert st.progress_text() == "50%, 2.0 MB/s, 3 min 20 s left"
    assert st.model_copy(update={"eta_s": 3725}).eta_text() == "1 h 02 min"
    assert st.model_copy(update={"eta_s": None, "rate_bytes_per_s": 0}).progress_text() == "50%"


# --- a disk that fills ---


@pytest.fixture
def small_fs(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    """An 8 MiB tmpfs (needs root), or the directory in LLMGW_SMALL_FS on a small filesystem."""
    if given := os.environ.get("LLMGW_SMALL_FS"):
        yield pathlib.Path(given)
        return
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(d)],
                       capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot mount an 8 MiB tmpfs here ({r.stderr.strip()}); set LLMGW_SMALL_FS to a small fs")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)


@pytest.mark.parametrize("announced", [True, False], ids=["size-announced", "chunked"])
async def test_disk_that_fills_fails_clearly_without_a_partial_file(
    small_fs: pathlib.Path, upstream: Upstream, announced: bool
) -> None:
    upstream.body = os.urandom(12 << 20)  # 12 MiB into 8 MiB
    upstream.length = announced
    async with Mirror(small_fs / "store") as mirror:
        await mirror.fetch(f"{upstream.base}/files/big.gguf")
        st = await mirror.until(lambda s: s.state != "fetching")
        assert st.state == "failed"
        assert "bytes free" in st.err, st.err
        if announced:
            assert f"needs {12 << 20} more bytes" in st.err  # checked before any byte moved
        else:
            assert "disk filled" in st.err
        assert leftovers(mirror.server.store.root) == []
        assert await mirror.get_status_code(st.url) == 404


async def test_file_source_larger_than_the_disk_fails_before_copying(
    small_fs: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    big = tmp_path / "big.gguf"
    big.write_bytes(os.urandom(9 << 20))
    async with Mirror(small_fs / "store", imports=tmp_path) as mirror:
        await mirror.fetch(f"file:{big}")
        st = await mirror.until(lambda s: s.state != "fetching")
        assert st.state == "failed"
        assert f"needs {9 << 20} more bytes" in st.err
        assert leftovers(mirror.server.store.root) == []


# --- a file deleted from the store by hand ---


async def test_a_present_file_deleted_by_hand_reads_failed_and_is_added_again(
    mirror: Mirror, tmp_path: pathlib.Path
) -> None:
    src = tmp_path / "w.gguf"
    src.write_bytes(DATA)
    await mirror.fetch(f"file:{src}")
    st = await mirror.until(lambda s: s.state != "fetching")
    assert st.state == "present", st.err
    stored = mirror.server.store.version_dir("m", "1") / "w.gguf"
    stored.unlink()  # an operator freeing space, or a bad cleanup
    assert await mirror.get_status_code(st.url) == 404
    gone = await mirror.status()
    assert gone is not None
    # It said "present" (mirror ls, and 'mirror add' said done without copying) while nodes got 404.
    assert gone.state == "failed"
    assert str(stored) in gone.err
    assert "llmgw mirror add" in gone.err
    code, body = await mirror.fetch(f"file:{src}")  # what 'llmgw mirror add' asks
    assert code == 202, body
    st = await mirror.until(lambda s: s.state != "fetching")
    assert st.state == "present", st.err
    assert stored.read_bytes() == DATA
    async with mirror.http.get(st.url) as r:
        assert r.status == 200
        assert await r.read() == DATA


# --- nodes asking while the mirror is still downloading ---


def _spec(url: str, node: str) -> ReplicaSpec:
    return ReplicaSpec.model_validate({
        "id": f"r-{node}", "model": "m", "version": "1", "profile": "cpu", "engine": "llamacpp",
        "source_url": url, "sha256": SHA, "file_name": "w.gguf", "key": "k",
    })  # fmt: skip


async def test_two_nodes_fetching_while_the_mirror_downloads_each_get_the_verified_file(
    mirror: Mirror, upstream: Upstream, tmp_path: pathlib.Path
) -> None:
    upstream.delay_s = 0.03  # the mirror needs ~0.7 s; the nodes ask at once
    _, body = await mirror.fetch(f"{upstream.base}/files/w.gguf")
    url = body["url"]
    nodes = [NodeCache(tmp_path / f"node{i}") for i in (1, 2)]
    async with aiohttp.ClientSession() as session:
        paths = await asyncio.wait_for(
            asyncio.gather(*(n.ensure(session, _spec(url, str(i))) for i, n in enumerate(nodes))), 30
        )
    for p in paths:
        assert p.read_bytes() == DATA
    assert (await mirror.until(lambda s: s.state == "present")).sha256 == SHA
    assert [r for r in upstream.ranges if r] == []  # the mirror downloaded once, uninterrupted
    assert len(upstream.ranges) == 1
