"""The llmgw system user (made through the command runner seam: no useradd here), the choice of
who runs the services, the supervisor's own directory, and the owners and modes init sets."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from llmgw.errors import ServiceError
from llmgw.paths import Paths
from llmgw.serverinit.secure import lock_down, root_secrets, service_secrets
from llmgw.service.files import private_dir
from llmgw.service.manager import CommandResult
from llmgw.service.users import _PROBE, choose_service_user, ensure_mirror_user, why_user_cannot_run


def test_a_missing_user_is_made_and_given_the_store(tmp_path: Path) -> None:
    ran: list[list[str]] = []

    def runner(argv: list[str]) -> CommandResult:
        ran.append(argv)
        return CommandResult(0, "")

    assert ensure_mirror_user(tmp_path, runner=runner, exists=lambda _: False) is True
    assert ran[0][:2] == ["useradd", "--system"]
    assert ran[0][-1] == "llmgw"
    assert ran[1] == ["chown", "-R", "llmgw:llmgw", str(tmp_path)]


def test_an_existing_user_is_only_given_the_store(tmp_path: Path) -> None:
    ran: list[list[str]] = []
    assert ensure_mirror_user(tmp_path, runner=lambda a: ran.append(a) or CommandResult(0, ""),
                              exists=lambda _: True) is False
    assert ran == [["chown", "-R", "llmgw:llmgw", str(tmp_path)]]


def test_a_failing_useradd_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ServiceError, match="create the user llmgw by hand"):
        ensure_mirror_user(tmp_path, runner=lambda a: CommandResult(1, "useradd: permission denied"),
                           exists=lambda _: False)


def test_not_root_runs_as_itself_and_says_why(tmp_path: Path) -> None:
    choice = choose_service_user([tmp_path], systemd=False, euid=1000)
    assert choice.user is None
    assert "only root can switch users" in choice.why


def test_a_user_that_cannot_run_llmgw_is_not_used_and_why_is_said(tmp_path: Path) -> None:
    made: list[list[str]] = []

    def probe(name: str, reach: list[Path], *, systemd: bool) -> str | None:
        return f"user {name} cannot enter or read {reach[0]}"

    choice = choose_service_user([tmp_path], systemd=False, euid=0, runner=lambda a: made.append(a) or
                                 CommandResult(0, ""), probe=probe)
    assert choice.user is None
    assert choice.why == f"user llmgw cannot enter or read {tmp_path}"
    # Under systemd the unit would fail to start: init stops with the reason instead.
    with pytest.raises(ServiceError, match="run as the user llmgw under systemd, but user llmgw cannot enter or read"):
        choose_service_user([tmp_path], systemd=True, euid=0, runner=lambda a: CommandResult(0, ""), probe=probe)


@pytest.mark.skipif(os.geteuid() != 0, reason="running a probe as another user needs root; CI runs as root")
def test_the_probe_runs_as_the_user_for_real(tmp_path: Path) -> None:
    """The probe really runs as the user: nobody cannot enter a 0700 directory of root's, and
    here it may not even run this venv's Python (under /root); either way the reason names it."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    why = why_user_cannot_run("nobody", [locked])
    assert why is not None
    assert f"cannot enter or read {locked}" in why or "cannot run" in why


@pytest.mark.skipif(os.geteuid() != 0, reason="running a probe as another user needs root; CI runs as root")
def test_the_probe_names_a_file_on_the_import_path_the_user_cannot_read() -> None:
    """The probe reads the import path rather than importing the control plane: a package with one
    file only root may read (as pip under ``umask 077`` leaves them) is named, a compiled cache
    is not (Python compiles again what it cannot read), and the rest of the path passes."""
    top = Path(tempfile.mkdtemp(prefix="llmgw-probe-"))  # tmp_path's parents are root's, 0700
    site = top / "site"
    (site / "pkg" / "__pycache__").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("")
    (site / "pkg" / "__pycache__" / "x.pyc").write_bytes(b"")
    (site / "pkg" / "__pycache__" / "x.pyc").chmod(0o600)
    for d in (top, site, site / "pkg"):
        d.chmod(0o755)
    nobody = pwd.getpwnam("nobody")

    def probe() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=30, check=False, cwd="/",
            user=nobody.pw_uid, group=nobody.pw_gid, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)},
        )

    try:
        done = probe()
        if done.returncode != 0 and "llmgw" in done.stderr:
            pytest.skip(f"nobody cannot run this venv's Python here: {done.stderr.strip().splitlines()[-1]}")
        assert (done.returncode, done.stdout.strip()) == (0, "")
        (site / "pkg" / "data.json").write_text("{}")
        (site / "pkg" / "data.json").chmod(0o600)
        done = probe()
        assert (done.returncode, done.stdout.strip()) == (4, str(site / "pkg" / "data.json"))
        top.chmod(0o700)  # the entry itself out of reach
        done = probe()
        assert (done.returncode, done.stdout.strip()) == (4, str(site))
    finally:
        shutil.rmtree(top)


def test_private_dir_refuses_someone_elses(tmp_path: Path) -> None:
    """The supervisor's directory sits in a directory the llmgw user owns: one that user swapped
    in would let it pick the pids root signals and the files root appends logs to."""
    d = tmp_path / "services"
    private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    d.chmod(0o777)
    private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(ServiceError, match="not a directory"):
        private_dir(link)
    if os.geteuid() == 0:
        os.chown(d, 65534, 65534)
        with pytest.raises(ServiceError, match="belongs to uid 65534"):
            private_dir(d)


def test_lock_down_sets_modes_and_owners(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    for f in (*service_secrets(paths), *root_secrets(paths), paths.server_config, paths.database):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x")
        f.chmod(0o644)
    paths.agent_state.mkdir(parents=True)
    lock_down(paths, None)
    for f in (*service_secrets(paths), *root_secrets(paths), paths.database):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert stat.S_IMODE(paths.server_config.stat().st_mode) == 0o640
    assert stat.S_IMODE(paths.state.stat().st_mode) == 0o700
    assert stat.S_IMODE(paths.agent_state.stat().st_mode) == 0o700
    if os.geteuid() == 0:
        lock_down(paths, "nobody")
        nobody = pwd.getpwnam("nobody")
        assert paths.admin_token.stat().st_uid == nobody.pw_uid
        assert paths.database.stat().st_uid == nobody.pw_uid
        assert (paths.pki / "ca-key.pem").stat().st_uid == 0
        assert paths.server_config.stat().st_gid == nobody.pw_gid


def test_a_user_that_cannot_be_made_falls_back_under_the_supervisor_only(tmp_path: Path) -> None:
    def runner(argv: list[str]) -> CommandResult:
        return CommandResult(127, "useradd: not found")

    def probe(name: str, reach: list[Path], *, systemd: bool) -> str | None:
        return None

    def missing(_name: str) -> bool:
        return False

    choice = choose_service_user([tmp_path], systemd=False, euid=0, runner=runner, probe=probe, exists=missing)
    assert choice.user is None
    assert "the user could not be made: useradd" in choice.why
    with pytest.raises(ServiceError, match="create the user llmgw by hand"):
        choose_service_user([tmp_path], systemd=True, euid=0, runner=runner, probe=probe, exists=missing)
