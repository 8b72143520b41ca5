"""MirrorClient (sync httpx) against a real mirror running in a background thread, plus `mirror serve`.

The mirror runs its own event loop in a thread so the synchronous client can call it over real
HTTP; malformed answers go through the client's transport seam (httpx.MockTransport).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.errors import ApiError, UnreachableError
from llmgw.mirror.client import MirrorClient
from llmgw.mirror.models import FetchStatus
from tests.helpers.mirrors import ThreadedMirror

DATA = os.urandom(100_000)
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def mirror(tmp_path: pathlib.Path) -> Iterator[ThreadedMirror]:
    with ThreadedMirror(tmp_path / "store") as m:
        yield m


def _wait(c: MirrorClient, model: str, version: str) -> FetchStatus:
    for _ in range(500):
        st = c.status(model, version)
        if st.state != "fetching":
            return st
        time.sleep(0.01)
    raise AssertionError("still fetching")


def test_fetch_status_files(mirror: ThreadedMirror, tmp_path: pathlib.Path) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(DATA)
    with MirrorClient(mirror.api) as c:
        c.health()
        with pytest.raises(ApiError) as ei:
            c.status("gemma", "1")
        assert ei.value.status == 404
        assert ei.value.code == "not_found"
        first = c.fetch(f"file:{src}", "gemma", "1")
        assert first.model == "gemma"
        st = _wait(c, "gemma", "1")
        assert st.state == "present"
        assert st.sha256 == SHA
        assert st.url == "http://m.test:8081/gemma/1/m.gguf"
        assert c.fetch(f"file:{src}", "gemma", "1").state == "present"
        assert [f.sha256 for f in c.files()] == [SHA]


def test_api_errors_carry_status_and_code(mirror: ThreadedMirror) -> None:
    with MirrorClient(mirror.api) as c, pytest.raises(ApiError) as ei:
        c.fetch("s3://bucket/m.gguf", "m", "1")
    assert ei.value.status == 400
    assert ei.value.code == "bad_source"
    assert "cannot turn 's3://bucket/m.gguf' into a download" in str(ei.value)


def test_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        with MirrorClient(f"http://127.0.0.1:{port}", timeout=2) as c, pytest.raises(UnreachableError) as ei:
            c.health()
    assert f"127.0.0.1:{port} does not answer" in str(ei.value)


def test_malformed_answers_through_transport_seam() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/health":
            return httpx.Response(200, json={"status": "starting"})
        return httpx.Response(200, json={"model": "m"})

    with MirrorClient("http://mirror", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(UnreachableError, match="health check"):
            c.health()
        with pytest.raises(ApiError, match="cannot read"):
            c.status("m", "1")


def test_cli_port_in_use_is_an_error_naming_the_flag(tmp_path: pathlib.Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = CliRunner().invoke(
            app,
            ["mirror", "serve", "--dir", str(tmp_path), "--listen", f"127.0.0.1:{port}",
             "--api-listen", "127.0.0.1:0", "--base", "http://x:8081"],
            env={"LLMGW_ROOT": str(tmp_path / "root")},  # its token file goes there, not to /etc/llmgw
        )  # fmt: skip
    assert r.exit_code == 2, r.output
    assert f"Error: --listen 127.0.0.1:{port}: port {port} is already in use" in r.output
