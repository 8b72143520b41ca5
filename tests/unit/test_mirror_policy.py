"""The attacks on the mirror's management API, over real HTTP against a real
MirrorServer (127.0.0.1 ephemeral ports, in-process) and a real ``llmgw mirror serve`` process.

Each attack asks the mirror to fetch something it must not (a secret outside the import
directories, a symlink or hard link out of one, a FIFO, a device, an ``http://`` source on
loopback or redirecting there) and checks the 400 that names what to do, and that the bytes
port then serves nothing. The bytes port itself serves only what a manifest lists.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import psutil
import pytest
from aiohttp import web

from llmgw.errors import ConfigError, SourceRefused, UnreachableError
from llmgw.mirror.client import MirrorClient, read_token
from llmgw.mirror.download import partial_path
from llmgw.mirror.models import Manifest
from llmgw.mirror.policy import SourcePolicy, _open_below
from llmgw.mirror.store import Store
from llmgw.paths import Paths
from tests.helpers.mirrors import Mirror, raw_status

DATA = os.urandom(200_000)
SHA = hashlib.sha256(DATA).hexdigest()
SECRET = b"admin-token-0123456789"


@dataclass
class World:
    """``etc/admin-token`` (a secret, outside), ``import/ok.gguf`` (a model, inside)."""

    tmp: pathlib.Path
    etc: pathlib.Path
    token: pathlib.Path
    imp: pathlib.Path
    model: pathlib.Path

    def policy(self, **kw: Any) -> SourcePolicy:
        return SourcePolicy.build(import_dirs=[self.imp], **kw)


@pytest.fixture
def world(tmp_path: pathlib.Path) -> World:
    etc, imp = tmp_path / "etc", tmp_path / "import"
    etc.mkdir()
    imp.mkdir()
    token = etc / "admin-token"
    token.write_bytes(SECRET)
    model = imp / "ok.gguf"
    model.write_bytes(DATA)
    return World(tmp_path, etc, token, imp, model)


@pytest.fixture
async def mirror(world: World) -> AsyncIterator[Mirror]:
    async with Mirror(world.tmp / "store", policy=world.policy()) as m:
        yield m


async def refused(m: Mirror, source: str, *says: str, model: str = "x") -> str:
    """POST the source; assert a 400 ``source_refused`` saying ``says`` and nothing stored or served."""
    status, body = await asyncio.wait_for(m.post_fetch(source, model, "1"), 20)
    assert status == 400, body
    assert body["error"]["code"] == "source_refused", body
    msg = str(body["error"]["message"])
    for s in says:
        assert s in msg, msg
    assert not (m.server.root / model).exists()
    async with m.http.get(f"{m.api}/status/{model}/1") as r:
        assert r.status == 404
    name = source.rstrip("/").rsplit("/", 1)[-1]
    assert await raw_status(m.server.bytes_port, f"/{model}/1/{name}") == 404
    return msg


# --- file: ---


async def test_a_secret_outside_the_import_dirs_is_refused(mirror: Mirror, world: World) -> None:
    msg = await refused(mirror, f"file:{world.token}", str(world.token), f"--import-dir {world.etc}")
    assert f"now: {world.imp}" in msg


async def test_without_import_dirs_no_file_is_imported(world: World) -> None:
    async with Mirror(world.tmp / "store", policy=SourcePolicy()) as m:
        await refused(m, f"file:{world.model}", "now: none", f"--import-dir {world.imp}")


async def test_symlinks_out_of_an_import_dir_are_refused(mirror: Mirror, world: World) -> None:
    (world.imp / "evil.gguf").symlink_to(world.token)
    await refused(mirror, f"file:{world.imp}/evil.gguf", f"really {world.token}")
    (world.imp / "sub").symlink_to(world.etc, target_is_directory=True)
    await refused(mirror, f"file:{world.imp}/sub/admin-token", f"really {world.token}")
    (world.imp / "zero.gguf").symlink_to("/dev/zero")
    await refused(mirror, f"file:{world.imp}/zero.gguf", "really /dev/zero")


async def test_devices_and_kernel_files_are_refused(mirror: Mirror) -> None:
    await refused(mirror, "file:/dev/zero", "/dev/zero is not inside")
    await refused(mirror, "file:/proc/self/environ", "is not inside")


async def test_a_fifo_in_an_import_dir_is_refused_at_once(mirror: Mirror, world: World) -> None:
    """Opening a FIFO for reading blocks until a writer comes; the mirror must not hang on it."""
    os.mkfifo(world.imp / "pipe.gguf")
    await refused(mirror, f"file:{world.imp}/pipe.gguf", "is not a regular file")


async def test_a_hard_link_to_a_secret_is_refused(mirror: Mirror, world: World) -> None:
    os.link(world.token, world.imp / "hl.gguf")
    await refused(mirror, f"file:{world.imp}/hl.gguf", "is a hard link (2 names)", "cp, not ln")


async def test_llmgw_state_is_refused_even_inside_an_import_dir(world: World) -> None:
    policy = SourcePolicy.build(import_dirs=[world.tmp], deny=[world.etc])
    async with Mirror(world.tmp / "store", policy=policy) as m:
        await refused(m, f"file:{world.token}", "llmgw's own configuration or state")


async def test_a_file_in_an_import_dir_is_imported_and_served(mirror: Mirror, world: World) -> None:
    status, _ = await mirror.post_fetch(f"file:{world.model}", "m", "1")
    assert status == 202
    assert (await mirror.wait("m", "1")).sha256 == SHA
    async with mirror.http.get(f"{mirror.files}/m/1/ok.gguf") as r:
        assert await r.read() == DATA


def test_a_symlink_swapped_in_while_opening_is_not_followed(world: World) -> None:
    """The open walks from the import directory with O_NOFOLLOW: the check-then-open race cannot
    be won by replacing a checked component with a symlink (here it is one from the start)."""
    (world.imp / "late.gguf").symlink_to(world.token)
    with pytest.raises(SourceRefused, match="changed into a symlink"):
        _open_below(world.imp.resolve(), ("late.gguf",))
    (world.imp / "d").symlink_to(world.etc, target_is_directory=True)
    with pytest.raises(SourceRefused, match="changed into a symlink"):
        _open_below(world.imp.resolve(), ("d", "admin-token"))


@pytest.mark.parametrize(
    ("value", "says"),
    [("/", "would let anyone import"), ("/proc", "would let anyone import"), ("/dev/shm", "would let anyone"),
     ("relative/dir", "give an absolute path")],
)  # fmt: skip
def test_import_dir_values_are_checked(value: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        SourcePolicy.build(import_dirs=[value])


def test_a_missing_import_dir_is_kept_and_listed(world: World) -> None:
    """It may be a mount not there yet; the mirror warns and keeps serving the nodes."""
    p = SourcePolicy.build(import_dirs=[world.imp, world.tmp / "later"])
    assert p.missing_dirs() == [world.tmp / "later"]
    with pytest.raises(FileNotFoundError):
        p.open_file(world.tmp / "later" / "m.gguf", "file:later")


# --- http(s): ---


@pytest.fixture
async def loopback_server() -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTP server on 127.0.0.1 holding a "secret"; returns its base URL and the paths asked."""
    hits: list[str] = []

    async def secret(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(body=SECRET)

    app = web.Application()
    app.router.add_get("/{name}", secret)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", hits
    await runner.cleanup()


async def test_an_http_source_on_loopback_is_refused(
    mirror: Mirror, loopback_server: tuple[str, list[str]]
) -> None:
    base, hits = loopback_server
    port = base.rsplit(":", 1)[1]
    await refused(mirror, f"{base}/admin.gguf", "127.0.0.1 is a loopback address", "--allow-private-sources")
    await refused(mirror, f"http://localhost:{port}/admin.gguf", "localhost resolves to", "--allow-source-net")
    await refused(mirror, "http://169.254.169.254/latest.gguf", "169.254.169.254 is a link-local address")
    await refused(mirror, "http://10.1.2.3/m.gguf", "10.1.2.3 is a private address")
    await refused(mirror, "http://[::ffff:127.0.0.1]/m.gguf", "127.0.0.1, a loopback address")
    # IPv4-compatible and NAT64 forms carry an IPv4 address too (Python takes them as global: a
    # security tester's finding; a NAT64 gateway would connect 64:ff9b::a9fe:a9fe to the metadata service)
    await refused(mirror, "http://[::7f00:1]/m.gguf", "127.0.0.1, a loopback address")
    await refused(mirror, "http://[64:ff9b::a9fe:a9fe]/m.gguf", "169.254.169.254, a link-local address")
    await refused(mirror, "http://[2002:a00:1::1]/m.gguf", "10.0.0.1, a private address")
    assert hits == []


async def test_hf_endpoint_on_loopback_is_refused(
    mirror: Mirror, loopback_server: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", loopback_server[0])
    await refused(mirror, "hf:org/repo/m.gguf", "127.0.0.1 is a loopback address", model="h")
    assert loopback_server[1] == []


async def test_allowed_networks_are_fetched(world: World, loopback_server: tuple[str, list[str]]) -> None:
    base, hits = loopback_server
    async with Mirror(world.tmp / "store", policy=world.policy(allow_nets=["127.0.0.1"])) as m:
        assert (await m.post_fetch(f"{base}/w.gguf", "w", "1"))[0] == 202
        st = await m.wait("w", "1")
    assert st.sha256 == hashlib.sha256(SECRET).hexdigest()
    assert hits == ["/w.gguf"]


async def test_a_redirect_to_loopback_fails_the_fetch(
    world: World, loopback_server: tuple[str, list[str]]
) -> None:
    """An allowed server (127.0.0.2, named by --allow-source-net) redirects to 127.0.0.1, which is
    not allowed: the connection is never made, and the fetch fails at once (no retries)."""
    target, hits = loopback_server
    asked: list[str] = []

    async def redirect(request: web.Request) -> web.Response:
        asked.append(request.path)
        raise web.HTTPFound(f"{target}/admin.gguf")

    app = web.Application()
    app.router.add_get("/{name}", redirect)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.2", 0).start()
    try:
        source = f"http://127.0.0.2:{runner.addresses[0][1]}/m.gguf"
        async with Mirror(world.tmp / "store", policy=world.policy(allow_nets=["127.0.0.2/32"])) as m:
            assert (await m.post_fetch(source, "r", "1"))[0] == 202
            st = await m.wait("r", "1", state="failed")
            assert await raw_status(m.server.bytes_port, "/r/1/m.gguf") == 404
    finally:
        await runner.cleanup()
    assert "127.0.0.1 is a loopback address" in st.err
    assert "--allow-source-net" in st.err
    assert hits == []
    assert asked == ["/m.gguf"]  # one try: a refusal is not retried


def test_own_and_private_addresses_are_refused_public_ones_pass() -> None:
    p = SourcePolicy()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                assert p.refusal(ipaddress.ip_address(a.address.split("%")[0])), a.address
    for ip in ["100.64.0.1", "0.0.0.0", "::1", "fe80::1", "fd00::1", "224.0.0.1", "192.168.1.1"]:
        assert p.refusal(ipaddress.ip_address(ip)), ip
    assert p.refusal(ipaddress.ip_address("8.8.8.8")) == ""
    assert SourcePolicy(allow_private=True).refusal(ipaddress.ip_address("127.0.0.1")) == ""


# --- the bytes port ---


async def test_the_bytes_port_serves_only_manifest_entries(mirror: Mirror, world: World) -> None:
    await mirror.post_fetch(f"file:{world.model}", "m", "1")
    await mirror.wait("m", "1")
    root = mirror.server.root
    vdir = root / "m" / "1"
    (vdir / "stray.gguf").write_bytes(b"dropped in by hand")
    partial_path(vdir / "next.gguf").write_bytes(b"half")
    # A manifest whose listed file is a symlink to a file inside the store that no manifest lists.
    (root / "n" / "1").mkdir(parents=True)
    (root / "n" / "1" / "ok.gguf").symlink_to(vdir / "stray.gguf")
    # A version directory that is a symlink to another one.
    (root / "v").mkdir()
    (root / "v" / "1").symlink_to(vdir, target_is_directory=True)
    now = datetime.now(UTC)
    for model in ("n", "v"):
        Store(root).write(
            model, "1", Manifest(file="ok.gguf", source="file:/x", state="present", updated_at=now), durable=False
        )
    port = mirror.server.bytes_port
    assert await raw_status(port, "/m/1/ok.gguf") == 200
    for target in ["/m/1/manifest.json", "/m/1/stray.gguf", f"/m/1/{partial_path(vdir / 'next.gguf').name}",
                   "/n/1/ok.gguf", "/v/1/ok.gguf", "/m/1", "/m"]:  # fmt: skip
        assert await raw_status(port, target) == 404, target


# --- a real process ---


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def serve_process(world: World) -> Iterator[str]:
    api = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "mirror", "serve", "--dir", str(world.tmp / "store"),
         "--listen", f"127.0.0.1:{_free_port()}", "--api-listen", f"127.0.0.1:{api}", "--base", "http://x:8081",
         "--import-dir", str(world.imp)],
        env={**os.environ, "LLMGW_ROOT": str(world.tmp / "root")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{api}"
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.e2e
def test_mirror_serve_process_refuses_and_imports(world: World, serve_process: str) -> None:
    with MirrorClient(serve_process, timeout=5) as c:
        deadline = time.monotonic() + 30
        while True:
            try:
                c.health()
                break
            except UnreachableError:
                assert time.monotonic() < deadline, "mirror serve never answered"
                time.sleep(0.1)
    # mirror serve made its management API token (LLMGW_ROOT's etc/llmgw/mirror-token): send it.
    token = read_token(Paths.from_env(world.tmp / "root").etc / "mirror-token")
    auth = {"Authorization": f"Bearer {token}"}
    with MirrorClient(serve_process, timeout=5, token=token) as c:
        url = f"{serve_process}/api/v1/fetch"
        r = httpx.post(url, json={"source": f"file:{world.token}", "model": "s", "version": "1"}, headers=auth,
                       timeout=10)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "source_refused"
        assert f"--import-dir {world.etc}" in r.json()["error"]["message"]
        r = httpx.post(url, json={"source": "http://127.0.0.1:9/m.gguf", "model": "h", "version": "1"},
                       headers=auth, timeout=10)
        assert r.status_code == 400, r.text
        assert "--allow-private-sources" in r.json()["error"]["message"]
        assert c.fetch(f"file:{world.model}", "m", "1").state in ("fetching", "present")
        for _ in range(300):
            if (st := c.status("m", "1")).state != "fetching":
                break
            time.sleep(0.05)
        assert (st.state, st.sha256) == ("present", SHA)
