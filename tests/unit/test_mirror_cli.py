"""``llmgw mirror add / rm / ls / init`` through the real CLI, and ``server init --mirror`` refusing
a mirror that does not answer. The running mirror is a real MirrorServer in a background thread.
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib

import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.errors import MirrorError
from llmgw.mirror.client import MirrorClient
from llmgw.mirror.store import Store
from llmgw.paths import Paths
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.steps import ServerInit
from llmgw.serverinit.steps import mirror as mirror_step
from llmgw.service.manager import SupervisorManager
from tests.helpers.mirrors import ThreadedMirror
from tests.helpers.net import free_port

DATA = b"GGUF" + os.urandom(200_000)  # a .gguf must start with the magic (mirror add checks it)
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def weights(tmp_path: pathlib.Path) -> pathlib.Path:
    """A world-readable .gguf in a directory others may search (pytest's tmp_path itself is 0700)."""
    p = tmp_path / "carried" / "w.gguf"
    p.parent.mkdir(mode=0o755)
    p.write_bytes(DATA)
    p.chmod(0o644)
    return p


def llmgw(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["mirror", *args])
    return r.exit_code, r.output


def test_add_without_a_running_mirror_copies_into_the_store(
    tmp_path: pathlib.Path, weights: pathlib.Path
) -> None:
    store = tmp_path / "store"
    code, out = llmgw("add", str(weights), "--model", "m", "--version", "1",
                      "--api", f"http://127.0.0.1:{free_port()}", "--dir", str(store))  # fmt: skip
    assert code == 0, out
    assert "does not answer: copying into" in out
    assert f"sha256 {SHA}" in out
    found = Store(store).servable("m", "1", "w.gguf")
    assert found is not None
    assert found[1].sha256 == SHA
    assert found[0].read_bytes() == DATA
    # a mirror started later serves it and reports it
    with ThreadedMirror(store) as mirror, MirrorClient(mirror.api) as c:
        st = c.status("m", "1")
        assert (st.state, st.sha256) == ("present", SHA)
        assert [f.model for f in c.files()] == ["m"]


def test_add_through_a_running_mirror_then_ls_and_rm(tmp_path: pathlib.Path, weights: pathlib.Path) -> None:
    with ThreadedMirror(tmp_path / "store") as mirror:
        code, out = llmgw("add", str(weights), "--model", "m", "--version", "1", "--api", mirror.api)
        assert code == 0, out
        assert "asking the mirror at" in out
        with MirrorClient(mirror.api) as c:
            assert c.status("m", "1").sha256 == SHA

        code, out = llmgw("ls", "--api", mirror.api)
        assert code == 0, out
        # the last column is the URL a model's source names (docs/operating.md; a new user found none)
        assert f"m/1\tpresent\tw.gguf\t{SHA[:16]}\thttp://m.test:8081/m/1/w.gguf" in out

        code, out = llmgw("rm", "m", "1", "--api", mirror.api, "--force")  # no control plane to ask here
        assert code == 0, out
        assert "deleted m/1 (w.gguf, was present)" in out
        assert not (tmp_path / "store" / "m").exists()

        code, out = llmgw("rm", "m", "1", "--api", mirror.api, "--force")
        assert code == 1
        assert "404" in out
        assert "m/1 is not in the mirror; 'llmgw mirror ls' lists what is" in out  # the next step too


def test_add_of_a_missing_file_or_another_source_is_refused(
    tmp_path: pathlib.Path, weights: pathlib.Path
) -> None:
    store, api = str(tmp_path / "store"), f"http://127.0.0.1:{free_port()}"
    missing = str(tmp_path / "nope.gguf")
    code, out = llmgw("add", missing, "--model", "m", "--version", "1", "--api", api, "--dir", store)
    assert code != 0
    assert "is not a file" in out
    assert llmgw("add", str(weights), "--model", "m", "--version", "1", "--api", api, "--dir", store)[0] == 0
    other = weights.parent / "other.gguf"
    other.write_bytes(b"GGUF other")
    code, out = llmgw("add", str(other), "--model", "m", "--version", "1", "--api", api, "--dir", store)
    assert code != 0
    assert "give the new source a new version" in out


def test_init_needs_a_control_plane_address(tmp_path: pathlib.Path) -> None:
    r = CliRunner().invoke(
        app, ["mirror", "init", "--control-plane", "not-an-ip", "--address", "127.0.0.1"],
        env={"LLMGW_ROOT": str(tmp_path)},
    )  # fmt: skip
    assert r.exit_code != 0
    assert "--api-allow 'not-an-ip' is not an IP address" in r.output


def test_server_init_with_a_mirror_that_does_not_answer_says_how_to_set_one_up(tmp_path: pathlib.Path) -> None:
    paths = Paths.from_env(tmp_path)
    url = f"http://127.0.0.1:{free_port()}"
    init = ServerInit(paths, InitOptions(mirror_url=url), SupervisorManager(paths), out=io.StringIO())
    with pytest.raises(MirrorError) as e:
        mirror_step.use_remote(init.ctx)
    assert f"the mirror at {url} does not answer" in str(e.value)
    assert "On that machine: sudo llmgw mirror init --control-plane <this machine's address>" in str(e.value)
