"""The ``llmgw`` system user the control plane and the mirror run as (``User=llmgw`` in their units).

Under systemd, and under llmgw's own supervisor when it runs as root (which applies ``User=`` as
systemd does, :func:`llmgw.service.unitfile.credentials`), both run unprivileged: the user
must exist and be able to run llmgw and reach its files before the units start (``useradd``
and ``chown``). :func:`choose_service_user` decides, and says why when it cannot be
done: not root (only root switches users; the program then runs as whoever started it), or the
user cannot run this llmgw (a Python under ``/root``, a directory it cannot enter).
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmgw.errors import ServiceError
from llmgw.service.manager import CommandResult, run_command
from llmgw.service.units import SERVICE_USER

MIRROR_USER = SERVICE_USER
"""The mirror's user; the same ``llmgw`` user as the control plane's."""

HIDDEN_BY_PROTECT_HOME = (Path("/home"), Path("/root"), Path("/run/user"))
"""What ``ProtectHome=true`` in the units hides from the service, under systemd."""

_PROBE = """\
import os, stat, sys, sysconfig
import llmgw
std = {os.path.realpath(sysconfig.get_path(k)) for k in ("stdlib", "platstdlib")}
unread = []
for entry in filter(None, sys.path):  # "": the working directory of "python -c", not an import source
    entry = os.path.realpath(entry)
    if entry in std or entry.startswith(tuple(s + os.sep for s in std)):
        continue
    try:
        mode = os.stat(entry).st_mode
    except FileNotFoundError:
        continue
    except OSError:  # there, but not for this user
        unread.append(entry)
        continue
    if not stat.S_ISDIR(mode):
        continue  # a zip of modules
    for top, dirs, files in os.walk(entry):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for d in dirs:
            if not os.access(os.path.join(top, d), os.R_OK | os.X_OK):
                unread.append(os.path.join(top, d))
        unread.extend(os.path.join(top, f) for f in files if not os.access(os.path.join(top, f), os.R_OK))
if unread:
    print(" ".join(unread[:3]) + (f" and {len(unread) - 3} more" if len(unread) > 3 else ""))
    sys.exit(4)
bad = [p for p in sys.argv[1:] if not os.access(p, os.X_OK if os.path.isdir(p) else os.R_OK)]
print(" ".join(bad))
sys.exit(3 if bad else 0)
"""
"""What :func:`why_user_cannot_run` runs as the user: ``import llmgw``, then every directory and
file on the import path outside the standard library (the venv's site-packages, an editable
install's source) must be readable (compiled caches aside: Python recompiles what it cannot read),
then each path in ``reach``. Importing the control plane and the mirror instead took 0.8-0.9 s of
CPU, an eighth of an offline ``server init`` (7 CPU-s; 2026-12-06, this machine), and named only
the first module that failed; the walk over a 15,000-entry dev venv takes ~0.1 s."""


def user_exists(name: str) -> bool:
    """True when the system has a user called ``name``."""
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def ensure_user(
    name: str = SERVICE_USER, *, runner: Callable[[list[str]], CommandResult] = run_command,
    exists: Callable[[str], bool] = user_exists,
) -> bool:
    """Make the system user ``name`` (no home, no login shell) when missing; True when it was made.

    Raises:
        ServiceError: ``useradd`` failed (its output in the message).
    """
    if exists(name):
        return False
    argv = ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
            "--shell", "/usr/sbin/nologin", name]
    done = runner(argv)
    if done.returncode != 0:
        raise ServiceError(f"{' '.join(argv)}: {done.output.strip()}; create the user {name} by hand")
    return True


def ensure_mirror_user(
    store: Path, *, runner: Callable[[list[str]], CommandResult] = run_command,
    exists: Callable[[str], bool] = user_exists,
) -> bool:
    """Make the ``llmgw`` system user when missing, and give it the mirror's store; True when the
    user was made.

    Raises:
        ServiceError: ``useradd`` or ``chown`` failed (their output in the message).
    """
    made = ensure_user(MIRROR_USER, runner=runner, exists=exists)
    done = runner(["chown", "-R", f"{MIRROR_USER}:{MIRROR_USER}", str(store)])
    if done.returncode != 0:
        raise ServiceError(f"chown -R {MIRROR_USER} {store}: {done.output.strip()}")
    return made


def why_user_cannot_run(name: str, reach: Sequence[Path], *, systemd: bool = False) -> str | None:
    """Why user ``name`` could not run this llmgw as a service, or None when it can.

    Runs this Python as ``name`` (uid, its group and groups, as the supervisor would): it must
    import llmgw and read every file it would import the control plane and the mirror from
    (:data:`_PROBE`), and may enter each directory and read each file in ``reach`` (a ``file:``
    model source the mirror copies, say). Under ``systemd`` the interpreter and the package must
    also not be where ``ProtectHome=true`` hides them (:data:`HIDDEN_BY_PROTECT_HOME`). Needs root.
    """
    python = Path(sys.executable)  # a venv's own: its site-packages come with it
    package = Path(__file__).resolve().parents[1]
    if systemd:
        for what, path in (("Python", python), ("Python", python.resolve()), ("the llmgw package", package)):
            if any(path.is_relative_to(h) for h in HIDDEN_BY_PROTECT_HOME):
                return f"{what} is in {path}, which the units' ProtectHome=true hides from the service"
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return f"there is no user {name}"
    try:
        done = subprocess.run(
            [str(python), "-c", _PROBE, *map(str, reach)],
            capture_output=True, text=True, timeout=60, check=False, cwd="/",
            user=pw.pw_uid, group=pw.pw_gid, extra_groups=os.getgrouplist(name, pw.pw_gid),
            env={"PATH": "/usr/bin:/bin", "HOME": "/"},
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"user {name} cannot run {python}: {getattr(e, 'strerror', None) or e}"
    return _probe_verdict(name, python, done)


def _probe_verdict(name: str, python: Path, done: subprocess.CompletedProcess[str]) -> str | None:
    """Why :data:`_PROBE`'s run ``done`` as ``name`` failed, or None when it passed (exit 3: a path
    of ``reach``; 4: a path on the import path; any other: Python's last line)."""
    if done.returncode == 3:
        return f"user {name} cannot enter or read {done.stdout.strip()}"
    if done.returncode == 4:
        return f"user {name} cannot read what Python imports llmgw from: {done.stdout.strip()}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"user {name} cannot run llmgw with {python}: {last}"
    return None


@dataclass(frozen=True)
class UserChoice:
    """Who the server and mirror units name: ``user`` (None: no ``User=``) and ``why`` not, if not."""

    user: str | None
    why: str = ""
    made: bool = False


def choose_service_user(
    reach: Sequence[Path], *, systemd: bool, euid: int | None = None,
    runner: Callable[[list[str]], CommandResult] = run_command,
    probe: Callable[..., str | None] = why_user_cannot_run,
    exists: Callable[[str], bool] = user_exists,
) -> UserChoice:
    """The user the control plane and mirror units run as: :data:`SERVICE_USER` when it can be.

    Root makes the user when missing (``made``) and checks it can run llmgw and enter ``reach``
    (:func:`why_user_cannot_run`). Not root: no ``User=`` (only root switches users), with that as
    ``why``; under systemd that cannot happen (init needs root to write units).

    Raises:
        ServiceError: under systemd, the user cannot run llmgw (the unit would fail to start) or
            ``useradd`` failed (under the supervisor that is a ``why``: the services run as root).
    """
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return UserChoice(None, f"only root can switch users, and this runs as uid {euid}")
    try:
        made = ensure_user(SERVICE_USER, runner=runner, exists=exists)
    except ServiceError as e:
        if systemd:
            raise
        return UserChoice(None, f"the user could not be made: {e}")
    why = probe(SERVICE_USER, reach, systemd=systemd)
    if why is None:
        return UserChoice(SERVICE_USER, made=made)
    if systemd:
        raise ServiceError(
            f"the control plane and the mirror run as the user {SERVICE_USER} under systemd, but {why}; "
            f"put it where {SERVICE_USER} may read it (llmgw itself: a venv outside /root and /home, made "
            "from a Python outside them, e.g. '/usr/bin/python3 -m venv /opt/llmgw/venv'; a file the "
            "mirror copies: outside /root and /home)"
        )
    return UserChoice(None, why, made)


def chown_tree(path: Path, name: str) -> None:
    """Give ``path`` and everything under it to user ``name`` and its primary group (no symlinks followed).

    Raises:
        ServiceError: the user is missing, or a chown failed.
    """
    try:
        pw = pwd.getpwnam(name)
    except KeyError as e:
        raise ServiceError(f"there is no user {name} to give {path} to") from e
    try:
        os.chown(path, pw.pw_uid, pw.pw_gid, follow_symlinks=False)
        for top, dirs, files in os.walk(path):
            for entry in (*dirs, *files):
                os.chown(os.path.join(top, entry), pw.pw_uid, pw.pw_gid, follow_symlinks=False)
    except OSError as e:
        raise ServiceError(f"giving {path} to {name}: {e}") from e
