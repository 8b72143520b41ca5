"""The mirror as real processes: ``llmgw mirror serve`` killed mid-download and restarted, and
``llmgw mirror init`` starting a mirror under llmgw's supervisor that ``server init --mirror``
then accepts.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from aiohttp import web
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.errors import UnreachableError
from llmgw.mirror.client import MirrorClient
from llmgw.mirror.download import partial_path
from llmgw.mirror.models import FetchStatus
from llmgw.paths import Paths
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.steps import ServerInit, serveryaml
from llmgw.serverinit.steps import mirror as mirror_step
from llmgw.service.manager import SupervisorManager
from tests.helpers.mirrors import Upstream
from tests.helpers.net import free_port

pytestmark = pytest.mark.e2e

DATA = os.urandom(8 << 20)
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def slow_upstream() -> Iterator[Upstream]:
    """:class:`Upstream` serving DATA at about 3 MB/s, in a thread with its own event loop."""
    up = Upstream(DATA)
    up.delay_s = 0.02
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    app_ = web.Application()
    app_.router.add_get("/files/{name}", up.get)
    runner = web.AppRunner(app_)

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()

    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    up.base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield up
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def serve(store: pathlib.Path, api_port: int, token_file: pathlib.Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw", "mirror", "serve", "--dir", str(store),
         "--listen", f"127.0.0.1:{free_port()}", "--api-listen", f"127.0.0.1:{api_port}",
         "--base", "http://m.test:8081", "--allow-source-net", "127.0.0.1",  # the upstream is on loopback
         "--api-token-file", str(token_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def wait_status(c: MirrorClient, done: object, limit_s: float = 60) -> FetchStatus:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            st = c.status("m", "1")
            if done(st):  # type: ignore[operator]
                return st
        except UnreachableError:
            pass
        time.sleep(0.05)
    raise AssertionError("the status never matched")


def test_mirror_killed_mid_download_resumes_after_restart(
    tmp_path: pathlib.Path, slow_upstream: Upstream
) -> None:
    store, api = tmp_path / "store", free_port()
    token_file = tmp_path / "mirror-token"
    token_file.write_text("t0ken-of-this-test\n")
    client = MirrorClient(f"http://127.0.0.1:{api}", timeout=2, token="t0ken-of-this-test")
    proc = serve(store, api, token_file)
    try:
        wait_status_health(client)
        client.fetch(f"{slow_upstream.base}/files/w.gguf", "m", "1")
        st = wait_status(client, lambda s: s.bytes_done >= 2 << 20)
        assert st.state == "fetching"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        part = partial_path(store / "m" / "1" / "w.gguf")
        kept = part.stat().st_size
        assert 0 < kept < len(DATA)

        proc = serve(store, api, token_file)
        st = wait_status(client, lambda s: s.state != "fetching")
        assert st.state == "present", st.err
        assert st.sha256 == SHA
        assert hashlib.sha256((store / "m" / "1" / "w.gguf").read_bytes()).hexdigest() == SHA
        assert not part.exists()
        resumed = [r for r in slow_upstream.ranges if r]
        assert resumed, "the restarted mirror started over instead of resuming"
        assert int(resumed[-1].removeprefix("bytes=").rstrip("-")) >= kept
    finally:
        client.close()
        proc.kill()
        proc.wait()


def wait_status_health(c: MirrorClient) -> None:
    for _ in range(200):
        try:
            c.health()
        except UnreachableError:
            time.sleep(0.05)
        else:
            return
    raise AssertionError("mirror serve never answered")


def test_mirror_init_starts_a_mirror_that_server_init_accepts(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    paths = Paths.from_env(root)
    bytes_port, api_port = free_port(), free_port()
    try:
        r = CliRunner().invoke(
            app,
            ["mirror", "init", "--control-plane", "10.9.8.7", "--address", "127.0.0.1",
             "--listen", f"127.0.0.1:{bytes_port}", "--api-listen", f"127.0.0.1:{api_port}",
             "--import-dir", str(tmp_path)],
            env={"LLMGW_ROOT": str(root)},
        )  # fmt: skip
        assert r.exit_code == 0, r.output
        url = f"http://127.0.0.1:{api_port}"
        assert f"sudo llmgw server init --mirror {url}" in r.output
        unit = paths.unit("mirror").read_text()
        assert "--api-allow 10.9.8.7" in unit
        assert f"--import-dir {tmp_path.resolve()}" in unit
        assert paths.mirror_store.is_dir()
        with MirrorClient(url) as c:
            c.health()

        out = io.StringIO()
        init = ServerInit(paths, InitOptions(mirror_url=url), SupervisorManager(paths), out=out)
        serveryaml.run(init.ctx)
        mirror_step.use_remote(init.ctx)
        assert f"server.yaml points at the mirror at {url}" in out.getvalue()
        assert f"api: {url}" in paths.server_config.read_text()
    finally:
        SupervisorManager(paths).stop("mirror")
