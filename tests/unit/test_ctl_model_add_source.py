"""``llmgw ctl model add`` says when the new model's source cannot be read as a GGUF file (a new
user's report: a 404 source and a non-GGUF file were added silently, and their replicas then
failed). Through the real CLI against a real control plane (``serve`` in a thread, SQLite) and a
real HTTP server for the sources; nothing mocked."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from aiohttp import web
from typer.testing import CliRunner

from llmgw.cli.main import app
from tests.helpers.control import Install, make_install
from tests.helpers.gateway import ServerThread
from tests.unit.test_ctl_model_rm import ThreadedControlPlane


@pytest.fixture
def cp(tmp_path: pathlib.Path) -> Iterator[Install]:
    inst = make_install(tmp_path)
    with ThreadedControlPlane(inst):
        yield inst


@pytest.fixture
def files() -> Iterator[str]:
    """A file server: ``/junk.gguf`` is 3 bytes that are not GGUF; every other path is a 404."""
    async def junk(_: web.Request) -> web.Response:
        return web.Response(body=b"abc")

    app_ = web.Application()
    app_.router.add_get("/junk.gguf", junk)
    servers = ServerThread()
    port = servers.serve(app_)
    yield f"http://127.0.0.1:{port}"
    servers.close()


def _add(inst: Install, name: str, source: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["--root", str(inst.root), "ctl", "model", "add", "--name", name,
                                 "--source", source, "--cpu-cores", "1"])
    return r.exit_code, r.output


def test_a_source_that_is_missing_or_not_gguf_is_said_at_add(cp: Install, files: str) -> None:
    code, out = _add(cp, "gone", f"{files}/nope.gguf")
    assert code == 0, out  # added: the file may be carried in next
    assert "added gone" in out
    assert "!! gone: its source cannot be read as a GGUF file" in out
    assert "404" in out
    code, out = _add(cp, "junk", f"{files}/junk.gguf")
    assert code == 0, out
    assert "!! junk: its source cannot be read as a GGUF file" in out
