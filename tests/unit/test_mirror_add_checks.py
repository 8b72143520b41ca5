"""What ``llmgw mirror add`` refuses before anything is copied, and what ``llmgw mirror rm`` refuses
before anything is deleted. A new user found each of these let through:

- a 0600 file (root's, the command run with sudo) copied into the store and served to anyone on the
  bytes port, although docs/operating.md says the mirror never publishes what only its owner could
  read, and the mirror's own refusal advised ``sudo llmgw mirror add`` to get round it;
- a bad ``--model``/``--version`` printed a pydantic traceback;
- a file named ``.gguf`` that was not a GGUF was stored and served;
- ``mirror rm`` deleted weights a catalog model's source pointed at, saying nothing.
"""

from __future__ import annotations

import os
import pathlib

import httpx
import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.mirror.client import MirrorClient
from llmgw.mirror.policy import SourcePolicy
from llmgw.mirror.store import Store
from tests.helpers.control import TOKEN, make_install
from tests.helpers.mirrors import ThreadedMirror, public_gguf
from tests.helpers.net import free_port
from tests.unit.test_ctl_model_rm import ThreadedControlPlane

DATA = b"GGUF" + os.urandom(50_000)


def llmgw(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["mirror", *args])
    return r.exit_code, r.output


@pytest.fixture
def carried(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory others may search (pytest's tmp_path itself is 0700), holding a 0644 GGUF w.gguf."""
    return public_gguf(tmp_path, DATA).parent


def nowhere() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_a_file_only_its_owner_can_read_is_refused_on_the_direct_path(
    tmp_path: pathlib.Path, carried: pathlib.Path
) -> None:
    secret = carried / "s.gguf"
    secret.write_bytes(DATA)
    secret.chmod(0o600)
    store = tmp_path / "store"
    code, out = llmgw("add", str(secret), "--model", "sec", "--version", "1", "--api", nowhere(), "--dir", str(store))
    assert code == 2, out
    assert f"{secret} is readable only by its owner and group (mode 0600)" in out
    assert f"chmod 644 {secret}" in out
    assert "sudo" not in out  # the old advice to get round the check
    assert "copying into" not in out  # refused before either path is tried
    assert not store.exists()

    # a 0644 file in a directory closed to others is just as private
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    os.chmod(private, 0o700)
    (private / "p.gguf").write_bytes(DATA)
    (private / "p.gguf").chmod(0o644)
    code, out = llmgw("add", str(private / "p.gguf"), "--model", "p", "--version", "1",
                      "--api", nowhere(), "--dir", str(store))  # fmt: skip
    assert code == 2, out
    assert f"the directory {private} is closed to other users (mode 0700)" in out
    assert not store.exists()

    # once made world-readable on purpose it is added
    secret.chmod(0o644)
    code, out = llmgw("add", str(secret), "--model", "sec", "--version", "1", "--api", nowhere(), "--dir", str(store))
    assert code == 0, out
    assert Store(store).servable("sec", "1", "s.gguf") is not None


def test_a_file_only_its_owner_can_read_is_refused_through_the_running_mirror(
    tmp_path: pathlib.Path, carried: pathlib.Path
) -> None:
    """The mirror here imports from tmp_path without the public-only rule: mirror add's own check
    refuses the file before asking it, and the fallback copy (which the mirror's refusal used to
    lead to, as root) never runs."""
    secret = carried / "s.gguf"
    secret.write_bytes(DATA)
    secret.chmod(0o600)
    store = tmp_path / "store"
    with ThreadedMirror(store, policy=SourcePolicy(import_dirs=(tmp_path.resolve(),))) as mirror:
        code, out = llmgw("add", str(secret), "--model", "sec", "--version", "1", "--api", mirror.api,
                          "--dir", str(store))  # fmt: skip
        assert code == 2, out
        assert "readable only by its owner and group (mode 0600)" in out
        assert "asking the mirror" not in out
        with MirrorClient(mirror.api) as c:
            assert c.files() == []
    assert Store(store).servable("sec", "1", "s.gguf") is None


@pytest.mark.parametrize(
    ("flags", "field", "value"),
    [
        (["--model", "Bad Name/../x", "--version", "1"], "--model", "Bad Name/../x"),
        (["--model", "ok", "--version", "../.."], "--version", "../.."),
    ],
)
def test_a_bad_name_is_one_line_naming_the_flag_before_anything_is_copied(
    tmp_path: pathlib.Path, carried: pathlib.Path, flags: list[str], field: str, value: str
) -> None:
    store = tmp_path / "store"
    r = CliRunner().invoke(app, ["mirror", "add", str(carried / "w.gguf"), *flags, "--api", nowhere(),
                                 "--dir", str(store)])  # fmt: skip
    assert r.exit_code == 2, r.output  # bad input, as the CLI's other input errors
    assert isinstance(r.exception, SystemExit)  # not a pydantic ValidationError escaping
    assert r.output.strip().splitlines() == [
        f"Error: {field} '{value}' must be 1-128 of A-Z a-z 0-9 . _ -, start with a letter or digit, "
        "and not be 'manifest.json'"
    ]
    assert not store.exists()


@pytest.mark.parametrize(("flags", "field", "value"), [
    (["--model", "Big_Model", "--version", "1"], "--model", "Big_Model"),
    (["--model", "big", "--version", "V1"], "--version", "V1"),
])
def test_a_name_no_catalog_entry_could_refer_to_is_refused(
    tmp_path: pathlib.Path, carried: pathlib.Path, flags: list[str], field: str, value: str
) -> None:
    """A new user's finding: the mirror took ``Big_Model/V1`` (its path rule), which no model.yaml
    could then name (the catalog's rule: lowercase). New names follow the catalog's rule."""
    store = tmp_path / "store"
    r = CliRunner().invoke(app, ["mirror", "add", str(carried / "w.gguf"), *flags, "--api", nowhere(),
                                 "--dir", str(store)])  # fmt: skip
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [
        f"Error: '{value}' is not a valid {field}: 1-63 characters: lowercase letters, digits, '.', '_' or '-', "
        "starting with a letter or digit"
    ]
    assert not store.exists()


def test_a_gguf_without_the_magic_is_refused_other_files_are_not(
    tmp_path: pathlib.Path, carried: pathlib.Path
) -> None:
    store = tmp_path / "store"
    bad = carried / "bad.gguf"
    bad.write_bytes(b"<html>404 Not Found</html>")
    code, out = llmgw("add", str(bad), "--model", "bad", "--version", "1", "--api", nowhere(), "--dir", str(store))
    assert code == 2, out
    assert f"{bad} is not a GGUF file (it does not start with the bytes 'GGUF')" in out
    assert not store.exists()

    tok = carried / "tokenizer.json"
    tok.write_text('{"version": "1.0"}')
    code, out = llmgw("add", str(tok), "--model", "tok", "--version", "1", "--api", nowhere(), "--dir", str(store))
    assert code == 0, out
    assert Store(store).servable("tok", "1", "tokenizer.json") is not None


def _rm_is_refused(mirror: ThreadedMirror, says: str) -> None:
    """``mirror rm m 1`` exits 1 saying ``says`` and what --force does, and the entry stays."""
    code, out = llmgw("rm", "m", "1", "--api", mirror.api)
    assert code == 1, out
    assert says in " ".join(out.split()), out
    assert "--force" in out
    with MirrorClient(mirror.api) as c:
        assert c.status("m", "1").state == "present"


def test_rm_refuses_weights_a_catalog_model_uses_unless_forced(
    tmp_path: pathlib.Path, carried: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a real control plane (``serve`` in a thread, SQLite) whose catalog has two models on
    the entry (its URL, and the same path with the host spelled otherwise) and one on another."""
    inst = make_install(tmp_path / "cp")
    monkeypatch.setenv("LLMGW_ROOT", str(inst.root))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with ThreadedControlPlane(inst), ThreadedMirror(tmp_path / "store") as mirror:
        for name, source in (("chat-a", "http://m.test:8081/m/1/w.gguf"),
                             ("chat-b", "http://mirror.lan:8081/m/1/w.gguf"), ("other", "http://m.test:8081/n/1/w.gguf")):
            body = {"name": name, "source": source, "profiles": [{"name": "cpu"}]}
            assert httpx.post(inst.admin + "/api/v1/models", json=body, headers=auth).status_code == 201
        assert llmgw("add", str(carried / "w.gguf"), "--model", "m", "--version", "1", "--api", mirror.api)[0] == 0
        _rm_is_refused(mirror, "m/1 is the weights of catalog models chat-a, chat-b")

        for name in ("chat-a", "chat-b"):
            assert httpx.delete(f"{inst.admin}/api/v1/models/{name}", headers=auth).status_code == 204
        code, out = llmgw("rm", "m", "1", "--api", mirror.api)
        assert code == 0, out
        assert "deleted m/1 (w.gguf, was present)" in out

        assert llmgw("add", str(carried / "w.gguf"), "--model", "m", "--version", "2", "--api", mirror.api)[0] == 0
        body = {"name": "c", "source": "http://m.test:8081/m/2/w.gguf", "profiles": [{"name": "cpu"}]}
        assert httpx.post(inst.admin + "/api/v1/models", json=body, headers=auth).status_code == 201
        code, out = llmgw("rm", "m", "2", "--api", mirror.api, "--force")
        assert code == 0, out
        assert "deleted m/2" in out


def test_rm_without_a_control_plane_to_ask_needs_force(
    tmp_path: pathlib.Path, carried: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root with no server.yaml (a mirror on its own machine): it cannot check, so it says so."""
    monkeypatch.setenv("LLMGW_ROOT", str(tmp_path / "root"))
    store = tmp_path / "store"
    with ThreadedMirror(store) as mirror:
        assert llmgw("add", str(carried / "w.gguf"), "--model", "m", "--version", "1", "--api", mirror.api)[0] == 0
        _rm_is_refused(mirror, "could not check whether a catalog model uses m/1")
        code, out = llmgw("rm", "m", "1", "--api", mirror.api, "--force")
        assert code == 0, out
