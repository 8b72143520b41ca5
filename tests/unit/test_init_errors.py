"""Bad input to ``server init``: a clear error, a non-zero exit, nothing half-written."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

import pytest

from tests.helpers.init import init_cli, written


def test_a_starter_that_is_not_gguf_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"<html>not a model</html>")
    root = tmp_path / "root"
    code, out = init_cli(root, "--starter-source", f"file:{bad}")
    assert code == 2
    assert "is not a GGUF file (it does not start with the bytes 'GGUF')" in out
    assert written(root) == []


def test_a_missing_starter_file_is_named(tmp_path: Path) -> None:
    code, out = init_cli(tmp_path / "root", "--starter-source", f"file:{tmp_path}/nope.gguf")
    assert code == 2
    assert f"{tmp_path}/nope.gguf does not exist" in out


def test_a_source_that_cannot_be_downloaded_is_refused(tmp_path: Path) -> None:
    code, out = init_cli(tmp_path / "root", "--starter-source", "ftp://x/y.gguf")
    assert code == 2
    assert "cannot turn" in out


def test_a_llama_server_that_is_not_there_is_named(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 100)
    code, out = init_cli(tmp_path / "root", "--starter-source", f"file:{model}", "--llama-server", "/no/llama-server")
    assert code == 2
    assert "--llama-server /no/llama-server is not an executable file" in out


def test_a_taken_port_is_named_with_its_flag(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 100)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, out = init_cli(tmp_path / "root", "--starter-source", f"file:{model}",
                          "--gateway-listen", f"127.0.0.1:{port}")
    assert code == 2
    assert f"port {port} (gateway-listen) is already taken by another program" in out
    assert "--gateway-listen" in out
    assert written(tmp_path / "root") == []


def test_every_taken_port_is_named_at_once(tmp_path: Path) -> None:
    """A new user's finding: a second install beside the first learnt of its taken ports one run at a
    time (five defaults: up to five runs). All of them, with their flags, in one refusal."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 100)
    with socket.socket() as a, socket.socket() as g:
        for s in (a, g):
            s.bind(("127.0.0.1", 0))
            s.listen()
        admin, gateway = a.getsockname()[1], g.getsockname()[1]
        code, out = init_cli(tmp_path / "root", "--starter-source", f"file:{model}",
                          "--admin-listen", f"127.0.0.1:{admin}", "--gateway-listen", f"127.0.0.1:{gateway}")
    assert code == 2
    said = " ".join(out.split())
    assert f"ports {admin} (admin-listen), {gateway} (gateway-listen) are already taken by other programs" in said
    assert "--admin-listen HOST:PORT --gateway-listen HOST:PORT" in said
    assert written(tmp_path / "root") == []


def test_two_inits_at_once_are_refused(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 100)
    root = tmp_path / "root"
    lock = root / "var/lib/llmgw/init.lock"
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242")
        code, out = init_cli(root, "--starter-source", f"file:{model}")
    finally:
        os.close(fd)
    assert code == 4
    assert "another 'llmgw server init' is running (pid 4242" in out


def test_a_broken_server_yaml_stops_init_and_is_left_as_it_was(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 100)
    root = tmp_path / "root"
    conf = root / "etc/llmgw/server.yaml"
    conf.parent.mkdir(parents=True)
    conf.write_text("admin_listen: [\n")
    code, out = init_cli(root, "--starter-source", f"file:{model}")
    assert code == 2
    assert "server.yaml: not valid YAML" in out
    assert conf.read_text() == "admin_listen: [\n"


@pytest.mark.parametrize("field", ["bogus: 1\n"])
def test_an_unknown_field_is_named(tmp_path: Path, field: str) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 100)
    root = tmp_path / "root"
    conf = root / "etc/llmgw/server.yaml"
    conf.parent.mkdir(parents=True)
    conf.write_text("tls: {ca: a, cert: b, key: c}\n" + field)
    code, out = init_cli(root, "--starter-source", f"file:{model}")
    assert code == 2
    assert "server.yaml: bogus: unknown field; remove it or check its spelling" in out
