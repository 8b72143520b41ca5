"""``llmgw ctl model rm NAME --delete-weights`` deletes the mirror entry the
model's source points to, and only when no other catalog model uses it.

A real control plane (``serve`` in a thread, its admin API on 127.0.0.1) and a real mirror
(MirrorServer in a thread), driven through the real CLI.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from llmgw.adminclient import AdminClient
from llmgw.cli.main import app
from llmgw.control.server import serve
from llmgw.mirror.client import MirrorClient
from llmgw.mirror.models import FetchStatus
from llmgw.mirror.usage import entry_for
from tests.helpers.control import TOKEN, Install, make_install
from tests.helpers.mirrors import ThreadedMirror


@pytest.fixture
def install(tmp_path: pathlib.Path) -> Install:
    return make_install(tmp_path)


class ThreadedControlPlane:
    """``serve()`` of the install's server.yaml on its own event loop in a thread."""

    def __init__(self, inst: Install) -> None:
        self.inst = inst
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedControlPlane:
        self.thread.start()

        async def start() -> None:
            self.stop = asyncio.Event()
            started: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self.task = asyncio.create_task(
                serve(self.inst.config, self.inst.paths, stop=self.stop, on_started=started.set_result)
            )
            await asyncio.wait([self.task, started], timeout=30, return_when=asyncio.FIRST_COMPLETED)
            if self.task.done():
                self.task.result()

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(40)
        return self

    def __exit__(self, *_: object) -> None:
        async def end() -> None:
            self.stop.set()
            await asyncio.wait_for(self.task, 10)

        asyncio.run_coroutine_threadsafe(end(), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def world(install: Install, tmp_path: pathlib.Path) -> Iterator[tuple[Install, MirrorClient]]:
    with ThreadedMirror(tmp_path / "store") as mirror:
        install.write(mirror={"api": mirror.api})
        with ThreadedControlPlane(install), MirrorClient(mirror.api) as client:
            yield install, client


def _put(client: MirrorClient, tmp: pathlib.Path, model: str, file: str) -> FetchStatus:
    src = tmp / file
    src.write_bytes(os.urandom(1000))
    client.fetch(f"file:{src}", model, "1")
    for _ in range(500):
        st = client.status(model, "1")
        if st.state == "present":
            return st
    raise AssertionError(f"{model}/1 never became present")


def _add(admin: AdminClient, name: str, source: str) -> None:
    admin.post("/api/v1/models", {"name": name, "source": source, "profiles": [{"name": "cpu"}]})


def _rm(inst: Install, name: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["--root", str(inst.root), "ctl", "model", "rm", name, "--delete-weights"])
    return r.exit_code, r.output


def test_delete_weights_deletes_what_the_source_points_to_and_only_when_unused(
    world: tuple[Install, MirrorClient], tmp_path: pathlib.Path
) -> None:
    inst, mirror = world
    admin = AdminClient(f"http://127.0.0.1:{inst.ports['admin']}", TOKEN)
    shared = _put(mirror, tmp_path, "shared", "w.gguf")
    judge_file = _put(mirror, tmp_path, "judge-file", "j.gguf")
    decoy = _put(mirror, tmp_path, "judge", "other.gguf")  # named like the model, used by nobody here
    _add(admin, "a", shared.url)
    _add(admin, "b", shared.url)
    _add(admin, "judge", judge_file.url)

    code, out = _rm(inst, "a")
    assert code == 0, out
    assert "removed a" in out
    assert "kept shared/1 (w.gguf) in the mirror: b uses it too" in out
    assert mirror.status("shared", "1").state == "present"

    code, out = _rm(inst, "b")
    assert code == 0, out
    assert f"deleted shared/1 (w.gguf) from the mirror at {mirror.api_url}" in out
    assert [f.model for f in mirror.files()] == ["judge", "judge-file"]

    code, out = _rm(inst, "judge")
    assert code == 0, out
    assert "deleted judge-file/1 (j.gguf)" in out
    assert [(f.model, f.sha256) for f in mirror.files()] == [("judge", decoy.sha256)]
    assert [m["name"] for m in admin.get("/api/v1/models")] == []


def test_a_source_that_is_not_in_the_mirror_deletes_nothing(
    world: tuple[Install, MirrorClient], tmp_path: pathlib.Path
) -> None:
    inst, mirror = world
    admin = AdminClient(f"http://127.0.0.1:{inst.ports['admin']}", TOKEN)
    kept = _put(mirror, tmp_path, "c", "c.gguf")
    _add(admin, "c", "http://elsewhere.test:8081/x/1/c.gguf")
    code, out = _rm(inst, "c")
    assert code == 0, out
    assert "is not a file of the mirror" in out
    assert [f.url for f in mirror.files()] == [kept.url]


def test_entry_for_matches_url_path_then_source() -> None:
    def st(model: str, file: str, source: str) -> FetchStatus:
        return FetchStatus(model=model, version="1", file=file, source=source, state="present",
                           url=f"http://m.test:8081/{model}/1/{file}")  # fmt: skip

    files = [st("a", "a.gguf", "hf:o/r/a.gguf"), st("b", "b.gguf", "file:/in/b.gguf")]
    assert entry_for("http://m.test:8081/a/1/a.gguf", files) == files[0]
    assert entry_for("http://10.0.0.5:8081/b/1/b.gguf", files) == files[1]  # the host spelled otherwise
    assert entry_for("hf:o/r/a.gguf", files) == files[0]
    assert entry_for("http://m.test:8081/a/2/a.gguf", files) is None


def test_rm_by_alias_names_the_model_and_deletes_its_weights(
    world: tuple[Install, MirrorClient], tmp_path: pathlib.Path
) -> None:
    """``ctl model rm gc`` printed ``removed gc; …``, the alias alone, and with ``--delete-weights`` it
    counted the model itself among the others using its file (its name is not ``gc``), so kept it."""
    inst, mirror = world
    admin = AdminClient(f"http://127.0.0.1:{inst.ports['admin']}", TOKEN)
    st = _put(mirror, tmp_path, "gemma-copy", "g.gguf")
    admin.post("/api/v1/models", {"name": "gemma-copy", "aliases": ["gc"], "source": st.url,
                                  "profiles": [{"name": "cpu"}]})
    code, out = _rm(inst, "gc")
    assert code == 0, out
    assert out.splitlines() == [
        "removed gemma-copy (alias gc); its replicas stop at their nodes' next heartbeat",
        f"deleted gemma-copy/1 (g.gguf) from the mirror at {mirror.api_url}",
    ]
    assert admin.get("/api/v1/models") == []
    assert mirror.files() == []
