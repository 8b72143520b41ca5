"""The mirror's import directories, the setup side: what init and ``mirror add`` pass so that the import
directories a mirror needs are the ones it is given, and nothing more.

- ``server init`` copies a ``file:`` starter and judge into the store and gives its mirror no
  import directory.
- The unit carries them (``--import-dir`` each), and llmgw's supervisor reads them back intact.
- ``llmgw mirror add`` of a file the mirror refuses copies it itself when it may write the store,
  and otherwise says which flag to add. Run by root into a store the mirror's user owns, the copy
  is given to that owner; when it cannot be, nothing is left behind.
"""

from __future__ import annotations

import errno
import os
import pathlib
import time

import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.errors import ApiError
from llmgw.mirror.client import MirrorClient
from llmgw.mirror.models import Manifest
from llmgw.mirror.policy import SourcePolicy
from llmgw.mirror.setup import copy_file
from llmgw.mirror.store import Store
from llmgw.paths import Paths
from llmgw.service.unitfile import parse_unit
from llmgw.service.units import mirror_unit
from tests.helpers.mirrors import ThreadedMirror


def test_the_unit_carries_import_dirs_through_the_supervisors_parser(tmp_path: pathlib.Path) -> None:
    paths = Paths.from_env(tmp_path / "root")
    odd = "/srv/models in/100% $HOME"
    text = mirror_unit(
        paths, "/opt/bin/llmgw", listen=":1", api_listen="127.0.0.1:2", base="b", allow=[], about="test",
        import_dirs=["/srv/import", odd], allow_source_nets=["10.0.0.0/8"],
    )  # fmt: skip
    argv = parse_unit(text).argv
    assert argv[-6:] == ["--import-dir", "/srv/import", "--import-dir", odd, "--allow-source-net", "10.0.0.0/8"]


def test_server_init_copies_its_file_starter_into_the_store_and_gives_the_mirror_no_import_dir(
    tmp_path: pathlib.Path,
) -> None:
    """Init used to make a ``file:`` starter's directory an import directory (an ssh key beside the
    model became importable by anyone reaching the API, and was served when the mirror ran as
    root). Now init copies the one file (as a Hugging Face cache lays it out: a symlink into
    ``blobs``) and the mirror, importing from nowhere, finds it present when asked for the source."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots"
    blobs.mkdir()
    snap.mkdir()
    (blobs / "abc").write_bytes(b"GGUF" + os.urandom(3000))
    (snap / "model.gguf").symlink_to(blobs / "abc")
    (blobs / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    source = f"file:{snap}/model.gguf"
    store = tmp_path / "store"
    copied = copy_file(source, "starter", "1", store_dir=store)
    assert copied.state == "present"
    with ThreadedMirror(store, policy=SourcePolicy(public_only=True)) as mirror, MirrorClient(mirror.api) as c:
        assert c.fetch(source, "starter", "1").state == "present"
        assert c.status("starter", "1").sha256 == copied.sha256
        with pytest.raises(ApiError, match="not inside a directory the mirror imports from") as refused:
            c.fetch(f"file:{blobs}/id_rsa", "key", "1")
        assert refused.value.code == "source_refused"

    paths = Paths.from_env(tmp_path / "root")
    unit = mirror_unit(paths, "/opt/bin/llmgw", listen=":1", api_listen="127.0.0.1:2", base="b", allow=[],
                       about="test", api_token_file=str(paths.admin_token))
    argv = parse_unit(unit).argv
    assert "--import-dir" not in argv
    assert argv[argv.index("--api-token-file") + 1] == str(paths.admin_token)


def test_mirror_add_of_a_refused_file_copies_it_when_the_store_is_writable(tmp_path: pathlib.Path) -> None:
    carried = tmp_path / "carried" / "w.gguf"
    carried.parent.mkdir()
    carried.write_bytes(b"GGUF" + os.urandom(5000))  # mirror add checks a .gguf's magic
    store = tmp_path / "store"
    with ThreadedMirror(store, policy=SourcePolicy()) as mirror:
        r = CliRunner().invoke(
            app, ["mirror", "add", str(carried), "--model", "m", "--version", "1", "--api", mirror.api,
                  "--dir", str(store)],
        )  # fmt: skip
        assert r.exit_code == 0, r.output
        assert f"the mirror does not import from {carried.parent}: copying into {store} directly" in r.output
        with MirrorClient(mirror.api) as c:
            assert c.status("m", "1").state == "present"


NOBODY = 65534
"""``nobody``'s uid and ``nogroup``'s gid on Debian: a store owner that is not root (the mirror's user)."""


def _carried(tmp_path: pathlib.Path) -> pathlib.Path:
    carried = tmp_path / "carried" / "w.gguf"
    carried.parent.mkdir()
    carried.write_bytes(b"GGUF" + os.urandom(5000))  # mirror add checks a .gguf's magic
    return carried


def _add_refused(carried: pathlib.Path, store: pathlib.Path) -> tuple[int, str]:
    """``llmgw mirror add`` of ``carried`` as m/1 through a running mirror that refuses it."""
    with ThreadedMirror(store, policy=SourcePolicy()) as mirror:
        r = CliRunner().invoke(
            app, ["mirror", "add", str(carried), "--model", "m", "--version", "1", "--api", mirror.api,
                  "--dir", str(store)],
        )  # fmt: skip
    return r.exit_code, r.output


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root; CI runs as root")
def test_mirror_add_by_root_gives_the_copy_to_the_stores_owner(tmp_path: pathlib.Path) -> None:
    """Root's direct copy into a store the mirror's user owns (as ``server init`` leaves it) left
    ``m/``, ``m/1/`` and their files root's, so the mirror, running as that user, answered 500
    Permission denied to 'mirror rm'. Each is now the store directory's uid and gid."""
    carried = _carried(tmp_path)
    store = tmp_path / "store"
    store.mkdir()
    os.chown(store, NOBODY, NOBODY)
    code, out = _add_refused(carried, store)
    assert code == 0, out
    for made in (store / "m", store / "m" / "1", store / "m" / "1" / "w.gguf", store / "m" / "1" / "manifest.json"):
        st = made.lstat()
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), made
    assert f"copying into {store} directly, as this user, then given to" in out
    assert os.listdir(store) == ["m"]  # no hidden directory left from the making
    assert sorted(os.listdir(store / "m" / "1")) == ["manifest.json", "w.gguf"]
    assert Store(store).servable("m", "1", "w.gguf") is not None


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root; CI runs as root")
@pytest.mark.parametrize(("refused", "named"), [(1, "/m"), (4, "/m/1/.w.gguf.partial")])
def test_mirror_add_by_root_that_cannot_give_the_copy_away_leaves_nothing(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, refused: int, named: str
) -> None:
    """A chown refused (NFS with root_squash) on the model's directory (the first one made), or on
    the file being copied: one error naming the path and what to do, and the store as it was."""
    carried = _carried(tmp_path)
    store = tmp_path / "store"
    store.mkdir()
    os.chown(store, NOBODY, NOBODY)
    real, calls = os.fchown, []

    def fchown(fd: int, uid: int, gid: int) -> None:
        calls.append(fd)
        if len(calls) == refused:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        real(fd, uid, gid)

    monkeypatch.setattr(os, "fchown", fchown)
    code, out = _add_refused(carried, store)
    assert code != 0
    assert f"{store}{named}" in " ".join(out.split())  # typer may wrap the line
    assert "Operation not permitted" in out
    assert "root_squash" in out
    assert os.listdir(store) == []


def test_mirror_add_of_a_refused_file_names_the_flag_when_it_cannot_write_the_store(
    tmp_path: pathlib.Path,
) -> None:
    """The store this user would copy into is not there (it is the mirror's, on its machine)."""
    carried = tmp_path / "carried" / "w.gguf"
    carried.parent.mkdir()
    carried.write_bytes(b"GGUF" + b"x" * 100)
    with ThreadedMirror(tmp_path / "store", policy=SourcePolicy()) as mirror:
        r = CliRunner().invoke(
            app, ["mirror", "add", str(carried), "--model", "m", "--version", "1", "--api", mirror.api,
                  "--dir", str(tmp_path / "elsewhere")],
        )  # fmt: skip
    assert r.exit_code != 0
    assert f"--import-dir {carried.parent}" in r.output
    assert "as a user who may write" in r.output
    assert not (tmp_path / "store" / "m").exists()


def test_mirror_init_refuses_an_import_dir_that_is_not_there(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    r = CliRunner().invoke(
        app, ["mirror", "init", "--control-plane", "10.0.0.1", "--address", "127.0.0.1",
              "--import-dir", str(tmp_path / "typo")],
        env={"LLMGW_ROOT": str(root)},
    )  # fmt: skip
    assert r.exit_code == 2, r.output
    assert f"--import-dir {tmp_path / 'typo'} is not a directory; create it" in r.output
    assert not Paths.from_env(root).unit("mirror").exists()


def _cut_off(store: pathlib.Path, carried: pathlib.Path) -> None:
    """What a ``llmgw mirror add`` SIGKILLed in the middle of its direct copy leaves in the store: the
    version directory, a ``fetching`` manifest and a partial file (its lock file, whose flock died with
    the process, too)."""
    vdir = Store(store).make_version_dir("m", "1")
    manifest = Manifest(file="w.gguf", source=f"file:{carried.resolve()}", state="fetching", updated_at=time.time(),
                        bytes_done=2000, bytes_total=carried.stat().st_size)
    Store(store).write("m", "1", manifest, durable=True)
    (vdir / ".w.gguf.partial").write_bytes(carried.read_bytes()[:2000])
    (vdir / ".fetch.lock").touch()


def test_a_mirror_add_cut_off_is_shown_removed_and_finished_by_adding_it_again(tmp_path: pathlib.Path) -> None:
    """A new user's finding: ``mirror add`` killed mid-copy (its direct copy into the store) left a
    ``fetching`` manifest and a partial file that the running mirror did not list, answered 404 to
    'mirror rm' for, and a second add failed with an empty reason. Now, over a real mirror and the
    real CLI: the mirror lists the entry as failed, cut off, saying what to do; while a copy holds
    its lock (another process), fetching; a second add finishes it, and the mirror says present
    with its size; one cut off again is removed by 'mirror rm'."""
    carried = _carried(tmp_path)
    store = tmp_path / "store"
    with ThreadedMirror(store, policy=SourcePolicy()) as mirror, MirrorClient(mirror.api) as client:
        _cut_off(store, carried)
        (got,) = [st for st in client.files() if (st.model, st.version) == ("m", "1")]
        assert got.state == "failed", got
        assert "was cut off before it finished" in got.err, got.err
        assert "'llmgw mirror rm m 1'" in got.err, got.err

        lock = Store(store).claim("m", "1")  # a copy running in another process: fetching
        assert lock is not None
        assert client.status("m", "1").state == "fetching"
        Store(store).release("m", "1", lock)

        r = CliRunner().invoke(app, ["mirror", "add", str(carried), "--model", "m", "--version", "1",
                                     "--api", mirror.api, "--dir", str(store)])
        assert r.exit_code == 0, r.output
        st = client.status("m", "1")
        assert (st.state, st.bytes_total) == ("present", carried.stat().st_size), st
        assert f"{carried.stat().st_size} bytes" in r.output
        assert sorted(os.listdir(store / "m" / "1")) == ["manifest.json", "w.gguf"]

        client.delete("m", "1")
        _cut_off(store, carried)
        assert client.status("m", "1").state == "failed"
        assert client.delete("m", "1").state == "failed"  # 'mirror rm' finds it (it answered 404)
        assert not (store / "m").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root; CI runs as root")
@pytest.mark.parametrize("plant", ["partial", "version-dir"])
def test_root_never_writes_through_a_symlink_the_stores_owner_planted(tmp_path: pathlib.Path, plant: str) -> None:
    """A new user's finding: the store's owner (the mirror's user) put a symlink where root's 'mirror
    add' writes its partial file; root copied through it, overwrote the target (a root-only file) and
    gave it to that user. Neither a symlinked partial file nor a symlinked version directory is
    followed: the add fails naming it, and the target is untouched and root's."""
    carried = _carried(tmp_path)
    store = tmp_path / "store"
    store.mkdir()
    os.chown(store, NOBODY, NOBODY)
    victim = tmp_path / "victim"
    victim.write_text("root's secret\n")
    victim.chmod(0o600)
    (store / "m").mkdir()
    os.chown(store / "m", NOBODY, NOBODY)
    if plant == "partial":
        (store / "m" / "1").mkdir()
        os.chown(store / "m" / "1", NOBODY, NOBODY)
        (store / "m" / "1" / ".w.gguf.partial").symlink_to(victim)
    else:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (store / "m" / "1").symlink_to(elsewhere)
    code, out = _add_refused(carried, store)
    assert code != 0, out
    assert "symbolic link" in " ".join(out.split()), out
    assert victim.read_text() == "root's secret\n"
    assert (victim.stat().st_uid, victim.stat().st_mode & 0o777) == (0, 0o600)
    if plant == "version-dir":
        assert list((tmp_path / "elsewhere").iterdir()) == []
