"""The supervisor's files for one service, and pid files that survive crashes and pid reuse.

Under ``paths.supervisor`` (``/var/lib/llmgw/services``), for service ``NAME``:

- ``NAME.pid``: the supervisor's pid and its start time; ``NAME.child.pid``: the child's.
  Each holds ``<pid>``, ``<psutil create_time>`` and ``<seconds from boot to its start>`` (what
  tells it from a reused pid through a step of the wall clock: :mod:`llmgw.proctime`), a line each,
  so the first line is what tools expect of a pid file.
- ``NAME.log``: the child's stdout and stderr, appended, with the supervisor's own lines.
- ``NAME.state.json``: what the supervisor last said (:class:`SupervisorState`).
- ``NAME.lock``: held (``flock``) by the one running supervisor; the kernel drops it when it dies.

The directory is root's (or whoever runs the supervisor), mode 0700, and :func:`private_dir`
refuses one that is not: it sits in the control plane's state directory, which the unprivileged
``llmgw`` user owns, and a directory that user swapped in would let it name the pids root signals
and the files root appends logs to. Logs are opened 0600 without following symlinks (:func:`open_log`).

A pid file is believed only while its process is alive, is not a zombie, and started when the
file says (within :data:`CREATE_TIME_SLACK`): a file left by a crash, or a pid the kernel has since
given to another program, reads as no process at all.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from llmgw.errors import ServiceError
from llmgw.proctime import same_start, since_boot

CREATE_TIME_SLACK = 1.0
"""Seconds two readings of one process's start time may differ by: psutil adds the boot time,
which the kernel reports in whole seconds and which can move by one under clock adjustment."""


@dataclass(frozen=True)
class ServiceFiles:
    """Where the supervisor of service ``name`` keeps its files, in ``dir``."""

    dir: Path
    name: str

    @property
    def pid(self) -> Path:
        """``NAME.pid``: the supervisor's own pid file."""
        return self.dir / f"{self.name}.pid"

    @property
    def child_pid(self) -> Path:
        """``NAME.child.pid``: the supervised program's pid file."""
        return self.dir / f"{self.name}.child.pid"

    @property
    def log(self) -> Path:
        """``NAME.log``: the program's output and the supervisor's lines, appended."""
        return self.dir / f"{self.name}.log"

    @property
    def state(self) -> Path:
        """``NAME.state.json``: the supervisor's last :class:`SupervisorState`."""
        return self.dir / f"{self.name}.state.json"

    @property
    def lock(self) -> Path:
        """``NAME.lock``: flocked by the running supervisor, so there is only ever one."""
        return self.dir / f"{self.name}.lock"


@dataclass(frozen=True)
class PidRecord:
    """A process as a pid file names it: ``pid``, its start time (unix seconds) and its start in
    seconds since boot (:func:`llmgw.proctime.since_boot`; None in a file written before it was kept),
    which is what tells it from a reused pid (a step of the wall clock moves the unix time)."""

    pid: int
    create_time: float
    since_boot: float | None = None


@dataclass(frozen=True)
class SupervisorState:
    """What the supervisor writes to ``NAME.state.json`` at each change.

    Attributes:
        state: ``starting``, ``running``, ``restarting`` (waiting RestartSec), ``stopping``,
            ``stopped`` (ended cleanly or on request) or ``failed`` (gave up).
        restarts: how many times the program was started again after it ended.
        since: when the current program started (unix s), or None.
        detail: how the last program ended, or why the supervisor gave up.
    """

    state: str
    restarts: int = 0
    since: float | None = None
    detail: str = ""


def private_dir(path: Path) -> None:
    """Make ``path`` (mode 0700) when missing, and check it is this process's own.

    Raises:
        ServiceError: ``path`` is a symlink or not a directory, belongs to another user, or others
            may write to it (``chmod 700`` or remove it, as the message says).
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError as e:
        raise ServiceError(f"the supervisor's directory {path}: {e}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise ServiceError(f"the supervisor's directory {path} is not a directory (a symlink?); remove it")
    if st.st_uid != os.geteuid():
        raise ServiceError(
            f"the supervisor's directory {path} belongs to uid {st.st_uid}, not to uid {os.geteuid()} "
            "that runs the supervisor; remove it (another user may have put it there)"
        )
    if st.st_mode & 0o022:
        os.chmod(path, 0o700)


def open_log(path: Path) -> int:
    """Open ``path`` for appending (made 0600; a symlink is refused) and return the descriptor.

    Raises:
        OSError: it cannot be opened (ELOOP for a symlink).
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    if os.fstat(fd).st_mode & 0o077:
        os.fchmod(fd, 0o600)
    return fd


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def write_pid(path: Path, pid: int) -> PidRecord:
    """Record process ``pid`` with its start time in ``path`` (atomically) and return the record.

    Raises:
        psutil.NoSuchProcess: the process has already gone.
    """
    proc = psutil.Process(pid)
    record = PidRecord(pid, proc.create_time(), since_boot(proc))
    _atomic_write(path, f"{record.pid}\n{record.create_time:.3f}\n{record.since_boot:.2f}\n")
    return record


def read_pid(path: Path) -> PidRecord | None:
    """The record in ``path``, or None when the file is missing or does not start with two numbers
    (a third, the start since boot, is read when there)."""
    try:
        fields = path.read_text().split()
        pid, created = fields[:2]
        return PidRecord(int(pid), float(created), float(fields[2]) if len(fields) > 2 else None)
    except (OSError, ValueError):
        return None


def alive(record: PidRecord) -> psutil.Process | None:
    """The process ``record`` names, when it still runs and is the same one; else None."""
    try:
        proc = psutil.Process(record.pid)
        if not same_start(proc, record.since_boot, record.create_time, CREATE_TIME_SLACK):
            return None  # the pid was reused
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.Error:
        return None
    return proc


def read_live(path: Path) -> psutil.Process | None:
    """The live process ``path`` names; None for a missing, unreadable or stale pid file."""
    record = read_pid(path)
    return alive(record) if record else None


def write_state(files: ServiceFiles, state: SupervisorState) -> None:
    """Write ``state`` to ``files.state`` atomically."""
    _atomic_write(files.state, json.dumps(asdict(state)) + "\n")


def read_state(files: ServiceFiles) -> SupervisorState | None:
    """The last state the supervisor wrote, or None when there is none or it is unreadable."""
    try:
        raw = json.loads(files.state.read_text())
        return SupervisorState(
            state=str(raw["state"]),
            restarts=int(raw.get("restarts", 0)),
            since=float(raw["since"]) if raw.get("since") is not None else None,
            detail=str(raw.get("detail", "")),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
