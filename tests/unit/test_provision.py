"""llama.cpp provisioning against a local HTTP server serving tarballs built here.

The tarballs hold a small script standing in for llama-server (it prints a ``version:`` line the
way llama-server does), so the download → verify → unpack → ``--version`` path runs for real
without the network or a 30 MB archive.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmgw.agent.engines import llamacpp
from llmgw.agent.engines.provision import (
    GPU_ADVICE,
    OFFLINE_ADVICE,
    Provisioner,
    Release,
    _checked_members,
    install_from_file,
    install_release,
    install_root,
)
from llmgw.cli.main import app
from llmgw.config import AgentConfig
from llmgw.errors import EngineError
from llmgw.protocol import ProvisionState

TAG = "b4242"


def fake_server_script(version_line: str = "version: 4242 (feedbee)") -> bytes:
    return f'#!/bin/sh\necho "{version_line}" >&2\n'.encode()


def tarball(members: dict[str, bytes], *, top: str = f"llama-{TAG}") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(f"{top}/{name}" if top else name)
            info.size, info.mode = len(data), 0o755
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def releases(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A plain HTTP server over ``<tmp>/www`` (laid out as ``<tag>/<asset>``); yields (base URL, dir)."""
    www = tmp_path / "www"
    (www / TAG).mkdir(parents=True)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, directory=str(www), **kw)  # type: ignore[arg-type]

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", www
    srv.shutdown()
    srv.server_close()


def publish(www: Path, data: bytes) -> tuple[Release, str]:
    rel = Release(tag=TAG, assets={})
    asset = rel.asset()
    (www / TAG / asset).write_bytes(data)
    return rel, asset


def leftovers(state: Path) -> list[str]:
    root = install_root(state)
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_right_digest_installs_and_the_agent_finds_it(tmp_path: Path, releases: tuple[str, Path]) -> None:
    base, www = releases
    data = tarball({"llama-server": fake_server_script(), "libggml-cpu-x64.so": b"\0"})
    rel, asset = publish(www, data)
    rel = Release(tag=TAG, assets={asset: hashlib.sha256(data).hexdigest()})
    state = tmp_path / "state"
    binary = install_release(state, release=rel, base_url=base)
    assert binary == install_root(state) / TAG / "llama-server"
    assert (binary.parent / "libggml-cpu-x64.so").is_file()  # the directory stays whole ($ORIGIN rpath)
    assert leftovers(state) == [TAG]  # no .part, no unpacking dir
    cfg = AgentConfig.model_validate(
        {"server": "https://x:1", "node_id": "n", "tls": {"ca": "/x", "cert": "/x", "key": "/x"}}
    )
    status, server = llamacpp.probe(cfg, state, path_env="")
    assert server is not None, status.detail
    assert (status.state, status.version, server.binary) == (ProvisionState.INSTALLED, "4242", binary)


def test_wrong_digest_fails_naming_both_and_leaves_nothing(tmp_path: Path, releases: tuple[str, Path]) -> None:
    base, www = releases
    data = tarball({"llama-server": fake_server_script()})
    _, asset = publish(www, data)
    pinned = "ab" * 32
    rel = Release(tag=TAG, assets={asset: pinned})
    state = tmp_path / "state"
    with pytest.raises(EngineError) as e:
        install_release(state, release=rel, base_url=base)
    assert hashlib.sha256(data).hexdigest() in str(e.value)
    assert pinned in str(e.value)
    assert leftovers(state) == []  # nothing unverified on disk, nothing unpacked


def test_wrong_build_inside_is_refused(tmp_path: Path, releases: tuple[str, Path]) -> None:
    base, www = releases
    data = tarball({"llama-server": fake_server_script("version: 1 (old)")})
    _, asset = publish(www, data)
    rel = Release(tag=TAG, assets={asset: hashlib.sha256(data).hexdigest()})
    state = tmp_path / "state"
    with pytest.raises(EngineError, match="--version says '1', expected build 4242"):
        install_release(state, release=rel, base_url=base)
    assert leftovers(state) == []


def test_path_traversal_in_the_archive_is_refused(tmp_path: Path, releases: tuple[str, Path]) -> None:
    base, www = releases
    data = tarball({"../../evil": b"x", "llama-server": fake_server_script()}, top="")
    _, asset = publish(www, data)
    rel = Release(tag=TAG, assets={asset: hashlib.sha256(data).hexdigest()})
    state = tmp_path / "state"
    with pytest.raises(EngineError, match="cannot be unpacked"):
        install_release(state, release=rel, base_url=base)
    assert not (tmp_path / "evil").exists()
    assert leftovers(state) == []


def test_offline_fails_with_advice(tmp_path: Path) -> None:
    rel = Release(tag=TAG, assets={f"llama-{TAG}-bin-ubuntu-x64.tar.gz": "00" * 32})
    with pytest.raises(EngineError) as e:
        install_release(tmp_path, release=rel, base_url="http://127.0.0.1:9")
    assert OFFLINE_ADVICE in str(e.value)
    assert "install-engine --from FILE" in str(e.value)


def test_provisioner_states(tmp_path: Path, releases: tuple[str, Path]) -> None:
    base, www = releases
    data = tarball({"llama-server": fake_server_script()})
    _, asset = publish(www, data)
    rel = Release(tag=TAG, assets={asset: hashlib.sha256(data).hexdigest()})
    done = threading.Event()
    prov = Provisioner(tmp_path, base_url=base, release=rel, on_done=done.set)
    gpu = prov.status(has_nvidia=True)
    assert (gpu.state, gpu.detail) == (ProvisionState.UNSUPPORTED, GPU_ADVICE)
    first = prov.status(has_nvidia=False)
    assert first.state in (ProvisionState.INSTALLING, ProvisionState.INSTALLED)
    assert done.wait(10)
    last = prov.status(has_nvidia=False)
    assert last.state == ProvisionState.INSTALLED, last.detail
    assert last.binary.endswith(f"{TAG}/llama-server")

    offline = Provisioner(tmp_path / "o", base_url="http://127.0.0.1:9", release=rel)
    offline.status(has_nvidia=False)
    offline.wait(10)
    failed = offline.status(has_nvidia=False)
    assert failed.state == ProvisionState.FAILED
    assert "install-engine --from FILE" in failed.detail


def test_install_from_file_binary_and_tarball(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server-cuda"
    binary.write_bytes(fake_server_script("version: 9000 (cuda)"))
    path, version, digest = install_from_file(tmp_path / "s", binary)
    assert (path, version) == (install_root(tmp_path / "s") / "current" / "llama-server", "9000")
    assert digest == hashlib.sha256(binary.read_bytes()).hexdigest()
    tgz = tmp_path / "t.tar.gz"
    tgz.write_bytes(tarball({"bin/llama-server": fake_server_script("version: 9001 (cuda)")}))
    path, version, _ = install_from_file(tmp_path / "s", tgz)
    assert version == "9001"
    assert llamacpp.own_installs(tmp_path / "s")[0] == path  # `current` wins
    junk = tmp_path / "junk"
    junk.write_text("#!/bin/sh\necho hello\n")
    junk.chmod(0o755)
    with pytest.raises(EngineError, match="printed no 'version"):
        install_from_file(tmp_path / "s", junk)
    assert llamacpp.own_installs(tmp_path / "s")[0] == path  # the good install stays


def test_install_engine_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_ROOT", str(tmp_path / "root"))
    binary = tmp_path / "llama-server"
    binary.write_bytes(fake_server_script())
    out = CliRunner().invoke(app, ["agent", "install-engine", "--from", str(binary)])
    assert out.exit_code == 0, out.output
    assert "installed llama-server 4242" in out.output
    out = CliRunner().invoke(app, ["agent", "install-engine", "--from", str(tmp_path / "nope")])
    assert out.exit_code != 0
    assert "is not a file" in out.output


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


@pytest.mark.parametrize(
    ("member", "why"),
    [
        (_member("/etc/cron.d/x"), "outside the destination"),
        (_member("a/../../evil"), "outside the destination"),
        (_member("bin/sh", tarfile.SYMTYPE, "../../../bin/sh"), "links outside"),
        (_member("bin/sh", tarfile.SYMTYPE, "/bin/sh"), "links outside"),
        (_member("bin/hard", tarfile.LNKTYPE, "../outside"), "links outside"),
        (_member("dev/sda", tarfile.BLKTYPE), "device or FIFO"),
        (_member("fifo", tarfile.FIFOTYPE), "device or FIFO"),
        # a chain: l1 -> . passes; l2 -> l1/.. is the destination's parent once l1 is on disk
        (_member("l2", tarfile.SYMTYPE, "l1/.."), "links outside"),
    ],
)
def test_the_checks_for_a_python_without_extraction_filters_refuse_what_the_data_filter_does(
    tmp_path: Path, member: tarfile.TarInfo, why: str
) -> None:
    """``_checked_members`` (used where tarfile has no ``data`` filter: Python before 3.11.4, e.g.
    Debian 12's 3.11.2) refuses each kind of member the filter refuses, and lets a plain layout
    through (a file, a directory, a link inside)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        setuid = _member("llama/llama-server")
        setuid.mode, setuid.uid = 0o4777, 1001
        for ok in (setuid, _member("llama", tarfile.DIRTYPE),
                   _member("llama/server", tarfile.SYMTYPE, "llama-server")):
            tf.addfile(ok)
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tf:
        checked = _checked_members(tf)
        assert [m.name for m in checked] == ["llama/llama-server", "llama", "llama/server"]
        assert all(m.mode & 0o7022 == 0 and m.uid == os.getuid() for m in checked)  # as the filter does
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.addfile(_member("llama/llama-server"))
        tf.addfile(_member("l1", tarfile.SYMTYPE, "."))
        tf.addfile(member)
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tf, pytest.raises(tarfile.TarError, match=why):
        _checked_members(tf)
