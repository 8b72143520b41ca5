"""Which mirror ``llmgw mirror ls|add|rm`` ask without ``--api``, and the URL ``mirror add`` prints.

A new operator's install made with ``--mirror-api-listen 127.0.0.1:18182``: ``llmgw mirror ls`` asked
127.0.0.1:8082 (``the mirror at http://127.0.0.1:8082 does not answer``) although server.yaml said
``mirror.api: http://127.0.0.1:18182``; and ``mirror add`` printed ``nodes fetch it from
/gemma-copy/v2/…``, a bare path, where ``mirror ls`` gives the URL a model's ``source`` needs.
A real mirror (MirrorServer in a thread, base ``http://m.test:8081``) on an ephemeral port, driven
through the real CLI under ``--root``.
"""

from __future__ import annotations

import os
import pathlib

import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.errors import ConfigError
from llmgw.mirror.client import DEFAULT_API, MirrorClient, local_api
from llmgw.mirror.policy import SourcePolicy
from llmgw.paths import Paths
from tests.helpers.control import Install, make_install
from tests.helpers.mirrors import ThreadedMirror, public_gguf

DATA = b"GGUF" + os.urandom(20_000)


@pytest.fixture
def carried(tmp_path: pathlib.Path) -> pathlib.Path:
    """A 0644 GGUF in a directory others may search (the mirror publishes only what others could read)."""
    return public_gguf(tmp_path, DATA)


def mirror(inst: Install, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["--root", str(inst.root), "mirror", *args])
    return r.exit_code, r.output


def test_ls_and_add_ask_the_mirror_server_yaml_names(tmp_path: pathlib.Path, carried: pathlib.Path) -> None:
    inst = make_install(tmp_path / "root")
    with ThreadedMirror(tmp_path / "store") as m:
        inst.write(mirror={"api": m.api})
        code, out = mirror(inst, "add", str(carried), "--model", "gemma-copy", "--version", "v2")
        assert code == 0, out
        assert f"asking the mirror at {m.api} to copy {carried}" in out
        assert "nodes fetch it from http://m.test:8081/gemma-copy/v2/w.gguf\n" in out
        code, out = mirror(inst, "ls")
        assert code == 0, out
        assert out.startswith("gemma-copy/v2\tpresent\tw.gguf\t")
        assert out.endswith("\thttp://m.test:8081/gemma-copy/v2/w.gguf\n")
        code, out = mirror(inst, "rm", "gemma-copy", "v2", "--force")
        assert code == 0, out
        assert out == "deleted gemma-copy/v2 (w.gguf, was present)\n"
        with MirrorClient(m.api) as c:
            assert c.files() == []


def test_add_copied_directly_prints_the_url_the_running_mirror_serves(
    tmp_path: pathlib.Path, carried: pathlib.Path
) -> None:
    """The reporter's case: the mirror refuses the file's directory, the CLI copies it into the store
    itself (no base URL there), and the mirror serving that store gives the URL."""
    inst = make_install(tmp_path / "root")
    store = tmp_path / "store"
    with ThreadedMirror(store, policy=SourcePolicy()) as m:
        inst.write(mirror={"api": m.api})
        code, out = mirror(inst, "add", str(carried), "--model", "gemma-copy", "--version", "v2", "--dir", str(store))
        assert code == 0, out
        assert f"copying into {store} directly" in out
        assert "nodes fetch it from http://m.test:8081/gemma-copy/v2/w.gguf\n" in out


def test_add_without_a_mirror_says_the_path_is_on_the_bytes_server(
    tmp_path: pathlib.Path, carried: pathlib.Path
) -> None:
    inst = make_install(tmp_path / "root")
    inst.write(mirror={"api": "http://127.0.0.1:9"})  # nothing answers there
    code, out = mirror(inst, "add", str(carried), "--model", "m", "--version", "1", "--dir", str(tmp_path / "s"))
    assert code == 0, out
    assert "the mirror at http://127.0.0.1:9 does not answer: copying into" in out
    assert ("nodes fetch it from /m/1/w.gguf on the mirror's bytes server ('llmgw mirror ls' gives the whole "
            "URL once the mirror runs)\n") in out


def test_local_api_is_server_yaml_s_else_the_default(tmp_path: pathlib.Path) -> None:
    bare = Paths(tmp_path / "bare")
    assert local_api(bare) == DEFAULT_API == "http://127.0.0.1:8082"  # no server.yaml: a mirror's own machine
    inst = make_install(tmp_path / "root")
    assert local_api(inst.paths) == DEFAULT_API  # server.yaml without a mirror block
    inst.write(mirror={"api": "http://127.0.0.1:18182"})
    assert local_api(inst.paths) == "http://127.0.0.1:18182"
    inst.config.write_text("mirror: [not, a, mapping]\n")
    with pytest.raises(ConfigError, match=r"server.yaml: mirror: .* \(or pass --api\)$"):
        local_api(inst.paths)


def test_an_explicit_api_wins(tmp_path: pathlib.Path) -> None:
    inst = make_install(tmp_path / "root")
    inst.write(mirror={"api": "http://127.0.0.1:9"})
    with ThreadedMirror(tmp_path / "store") as m:
        code, out = mirror(inst, "ls", "--api", m.api)
    assert (code, out) == (0, "the mirror holds nothing yet\n")
