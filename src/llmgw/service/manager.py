"""Install, start, stop and inspect llmgw's services: through systemd, or llmgw's own supervisor.

:func:`pick_manager` chooses: systemd when it is PID 1 and the install is not under ``LLMGW_ROOT``,
else :class:`SupervisorManager` (containers, CI, laptops, tests). Both read the same unit file,
``paths.unit(name)``, so a service is described once.

The sequence for putting a service in place works on either::

    changed = manager.install("agent", agent_unit(paths, llmgw_binary()))
    manager.start("agent")            # systemd: enable --now; supervisor: no-op when running
    if changed:
        manager.restart("agent")      # the running one still has the old unit

Errors: everything here raises :class:`~llmgw.errors.ServiceError` (systemctl's or journalctl's
output, a missing unit, a supervisor that would not start), with the cause chained.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from llmgw import logrotate
from llmgw.errors import ServiceError
from llmgw.paths import Paths, exists_or_hidden
from llmgw.service.files import (
    ServiceFiles,
    SupervisorState,
    open_log,
    private_dir,
    read_live,
    read_state,
    write_state,
)
from llmgw.service.supervisor import ALREADY_RUNNING, LOG_KEEP
from llmgw.service.unitfile import STOP_TIMEOUT, parse_unit
from llmgw.service.units import check_service, unit_name, write_unit

#: The supervisor's states that a live supervisor leaves behind only when it ends without writing its
#: last one: killed (SIGKILL, the OOM killer) with its program, or the machine went down under it.
UNENDED = ("starting", "running", "restarting", "stopping")


def _unended(name: str, state: SupervisorState) -> str:
    """The detail of a service whose supervisor and program are gone without a stop recorded
    (``state.state`` in :data:`UNENDED`): a crash, not a stop, as ``systemctl`` would say failed."""
    return (f"not running, and no stop was recorded (it was {state.state}): its supervisor ended "
            f"without a word (killed, or the machine restarted); 'llmgw service start {name}'")


STATES = ("running", "stopped", "failed", "unknown")

STOP_GRACE = 5.0
"""Seconds a stopping supervisor has beyond its program's TimeoutStopSec before it is SIGKILLed."""


@dataclass(frozen=True)
class ServiceStatus:
    """One service as its manager sees it.

    Attributes:
        name: ``server``, ``agent`` or ``mirror``.
        state: ``running``; ``stopped``; ``failed`` (ended badly, gave up, or waiting to restart:
            see ``detail``); ``unknown`` (no unit installed, or a state this code does not know).
        pid: the program's pid while it runs, else None.
        since: when the program started (running) or the state last changed (systemd), unix s.
        restarts: how often it was restarted after ending (systemd's NRestarts, or the supervisor's).
        detail: a short reason: how it ended, ``restarting in 2s``, ``not installed``.
    """

    name: str
    state: str
    pid: int | None = None
    since: float | None = None
    restarts: int = 0
    detail: str = ""


class ServiceManager(Protocol):
    """What ``server init`` and ``llmgw service`` need of a service manager.

    ``kind`` is ``"systemd"`` or ``"supervisor"``. Names are ``server``, ``agent``, ``mirror``; any
    other raises :class:`ServiceError`.
    """

    kind: str

    def install(self, name: str, body: str) -> bool:
        """Write the unit (``write_unit``: a different old copy kept as .bak); True when it changed."""
        ...

    def start(self, name: str) -> bool:
        """Start the service (systemd also enables it); False when it was already running."""
        ...

    def restart(self, name: str) -> None:
        """Stop and start it again, picking up a changed unit."""
        ...

    def stop(self, name: str) -> bool:
        """Stop it; False when it was not running."""
        ...

    def status(self, name: str) -> ServiceStatus:
        """Its :class:`ServiceStatus`."""
        ...

    def logs(self, name: str, lines: int = 50) -> str:
        """Its last ``lines`` lines of output."""
        ...

    def follow(self, name: str, lines: int = 50) -> Iterator[str]:
        """Its last ``lines`` lines, then what it writes, as it writes it; ends on Ctrl-C."""
        ...


# --- systemd -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommandResult:
    """A finished command: its exit status and its stdout and stderr together."""

    returncode: int
    output: str


Runner = Callable[[list[str]], CommandResult]
"""Runs an argv to completion; the seam :class:`SystemdManager` is tested through."""


def run_command(argv: list[str], timeout: float = 120.0) -> CommandResult:
    """Run ``argv`` (no shell) and return its :class:`CommandResult`.

    Raises:
        ServiceError: the program is missing, or it ran past ``timeout`` seconds.
    """
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ServiceError(f"{' '.join(argv)}: {e}") from e
    return CommandResult(done.returncode, done.stdout + done.stderr)


def _wall_from_monotonic(usec: str) -> float | None:
    """A systemd ``…TimestampMonotonic`` (µs of CLOCK_MONOTONIC, Python's monotonic clock) as unix s."""
    try:
        value = int(usec)
    except ValueError:
        return None
    if value <= 0:
        return None
    return time.time() - (time.monotonic() - value / 1e6)


class SystemdManager:
    """Services as systemd units ``llmgw-<name>.service`` in ``paths.systemd_units``.

    Every systemctl/journalctl call goes through ``runner`` (default :func:`run_command`).
    """

    kind = "systemd"

    def __init__(self, paths: Paths, runner: Runner = run_command) -> None:
        self.paths = paths
        self.runner = runner

    def _run(self, *argv: str) -> CommandResult:
        result = self.runner(list(argv))
        if result.returncode != 0:
            raise ServiceError(f"{' '.join(argv)}: exit status {result.returncode}: {result.output.strip()}")
        return result

    def install(self, name: str, body: str) -> bool:
        """Write the unit; ``systemctl daemon-reload`` when it changed."""
        check_service(name)
        changed = write_unit(self.paths.unit(name), body)
        if changed:
            self._run("systemctl", "daemon-reload")
        return changed

    def start(self, name: str) -> bool:
        """``systemctl enable --now llmgw-<name>``; False when ``is-active`` said it already ran."""
        unit = unit_name(name)
        was_active = self.runner(["systemctl", "is-active", "--quiet", unit]).returncode == 0
        self._run("systemctl", "enable", "--now", unit)
        return not was_active

    def restart(self, name: str) -> None:
        """``systemctl restart llmgw-<name>``."""
        self._run("systemctl", "restart", unit_name(name))

    def stop(self, name: str) -> bool:
        """``systemctl stop llmgw-<name>`` (it stays enabled); False when it was not active."""
        unit = unit_name(name)
        was_active = self.runner(["systemctl", "is-active", "--quiet", unit]).returncode == 0
        self._run("systemctl", "stop", unit)
        return was_active

    def status(self, name: str) -> ServiceStatus:
        """From ``systemctl show``: ActiveState/SubState mapped onto :data:`STATES`."""
        unit = unit_name(name)
        props = "LoadState,ActiveState,SubState,MainPID,NRestarts,Result,ExecMainStatus"
        props += ",ExecMainStartTimestampMonotonic,StateChangeTimestampMonotonic"
        out = self._run("systemctl", "show", unit, f"--property={props}").output
        p = dict(line.partition("=")[::2] for line in out.splitlines() if "=" in line)
        restarts = int(p.get("NRestarts") or 0)
        pid = int(p.get("MainPID") or 0) or None
        changed = _wall_from_monotonic(p.get("StateChangeTimestampMonotonic", ""))
        active, sub, result = p.get("ActiveState", ""), p.get("SubState", ""), p.get("Result", "")
        how = result if result != "exit-code" else f"exit code {p.get('ExecMainStatus', '?')}"
        if p.get("LoadState") == "not-found":
            return ServiceStatus(name, "unknown", detail=f"not installed: no {unit}.service")
        restarting = active == "activating" and sub == "auto-restart"
        if active in ("active", "reloading", "deactivating", "activating") and not restarting:
            since = _wall_from_monotonic(p.get("ExecMainStartTimestampMonotonic", "")) or changed
            return ServiceStatus(name, "running", pid, since, restarts, "" if sub == "running" else sub)
        if restarting:
            return ServiceStatus(name, "failed", None, changed, restarts, f"{how}; restarting")
        if active == "failed":
            return ServiceStatus(name, "failed", None, changed, restarts, how)
        if active == "inactive":
            return ServiceStatus(name, "stopped", None, changed, restarts, "")
        return ServiceStatus(name, "unknown", pid, changed, restarts, f"ActiveState={active} SubState={sub}")

    def logs(self, name: str, lines: int = 50) -> str:
        """``journalctl -u llmgw-<name> -n <lines> --no-pager``."""
        return self._run("journalctl", "-u", unit_name(name), "-n", str(lines), "--no-pager").output

    def follow(self, name: str, lines: int = 50) -> Iterator[str]:
        """``journalctl -f``'s lines as it prints them."""
        argv = ["journalctl", "-u", unit_name(name), "-n", str(lines), "-f", "--no-pager"]
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        except OSError as e:
            raise ServiceError(f"{' '.join(argv)}: {e}") from e
        try:
            assert proc.stdout is not None  # noqa: S101  (PIPE was asked for)
            yield from proc.stdout
        finally:
            proc.terminate()
            proc.wait()


# --- llmgw's own supervisor -------------------------------------------------------------------------

_launched: dict[int, subprocess.Popen[bytes]] = {}
"""Supervisors this process started, so it can reap them (a long-lived caller, such as a test)."""


def _reap() -> None:
    """Collect supervisors this process started that have ended since (no zombies left behind)."""
    for pid, proc in list(_launched.items()):
        if proc.poll() is not None:
            del _launched[pid]


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _wait_gone(proc: psutil.Process, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``proc`` to end (a zombie counts); True when it did."""
    deadline = time.monotonic() + timeout
    while not _gone(proc):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    launched = _launched.pop(proc.pid, None)
    if launched is not None:
        launched.poll()
    return True


def _end(proc: psutil.Process, timeout: float) -> None:
    """SIGTERM ``proc``, SIGKILL it after ``timeout`` seconds, wait for it to go."""
    try:
        proc.send_signal(signal.SIGTERM)
        if not _wait_gone(proc, timeout):
            proc.kill()
            _wait_gone(proc, 5.0)
    except psutil.NoSuchProcess:
        pass


def tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of ``path``, and of its rotated copies (``path.1``…, the
    supervisor's :data:`~llmgw.service.supervisor.LOG_KEEP`) when it has fewer since it was
    rotated (read from the end; "" when missing or lines <= 0)."""
    chunks: list[bytes] = []  # newest last; counted as read, not re-counted (a million lines took 8.8 s)
    found = 0
    for p in [path, *logrotate.rotated(path, LOG_KEEP)]:
        if lines <= 0 or found > lines:
            break
        try:
            f = p.open("rb")
        except FileNotFoundError:
            continue
        with f:
            pos = f.seek(0, 2)
            while pos > 0 and found <= lines:
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                block = f.read(step)
                found += block.count(b"\n")
                chunks.insert(0, block)
    data = b"".join(chunks)
    kept = data.splitlines()[-lines:] if lines > 0 else []
    return b"".join(line + b"\n" for line in kept).decode(errors="replace")


def _may_read(directory: Path) -> bool:
    """Whether this process may list ``directory`` and read what is in it."""
    return os.access(directory, os.R_OK | os.X_OK)


class SupervisorManager:
    """Services under llmgw's own supervisor (:mod:`llmgw.service.supervisor`), one per service.

    Files (pid files, ``NAME.log``, state) live in ``paths.supervisor``; the unit is read from
    ``paths.unit(name)``. A supervisor being stopped has the unit's TimeoutStopSec (15 s by
    default) to end its program, plus :data:`STOP_GRACE`, before it is SIGKILLed itself;
    ``start_timeout`` bounds waiting for a new one to start its program.
    """

    kind = "supervisor"

    def __init__(self, paths: Paths, *, start_timeout: float = 10.0) -> None:
        self.paths = paths
        self.start_timeout = start_timeout

    def files(self, name: str) -> ServiceFiles:
        """The supervisor's files for ``name``."""
        check_service(name)
        _reap()
        return ServiceFiles(self.paths.supervisor, name)

    def install(self, name: str, body: str) -> bool:
        """Write the unit; the supervisor reads it at its next start."""
        check_service(name)
        return write_unit(self.paths.unit(name), body)

    def start(self, name: str) -> bool:
        """Launch a detached supervisor for ``name`` and wait until it has started the program.

        Returns False, doing nothing, when a supervisor for it already runs. A program left running
        by a supervisor that died (SIGKILL, OOM) is ended first, so two never run at once.

        Raises:
            ServiceError: no unit, a unit the supervisor cannot read, or a supervisor that exited
                at once (the message carries its last log lines).
        """
        files = self.files(name)
        unit = self.paths.unit(name)
        try:
            parse_unit(unit.read_text())
        except FileNotFoundError as e:
            raise ServiceError(f"no unit for {name} at {unit}; 'llmgw server init' writes it") from e
        except (OSError, ServiceError) as e:
            raise ServiceError(f"{unit}: {e}") from e
        private_dir(files.dir)
        if read_live(files.pid) is not None:
            return False
        orphan = read_live(files.child_pid)
        if orphan is not None:
            _end(orphan, self._stop_timeout(name))
        argv = [sys.executable, "-m", "llmgw.service.supervisor", name, "--unit", str(unit)]
        argv += ["--dir", str(files.dir)]
        try:
            log = open_log(files.log)
        except OSError as e:
            if e.errno == errno.ELOOP:  # said only "[Errno 40] Too many levels of symbolic links"
                raise ServiceError(f"the log {files.log} is a symbolic link, which the supervisor never writes "
                                   "through (it runs as root); remove the link: the log is kept there, rotated") from e
            raise ServiceError(f"the log {files.log}: {e}") from e
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, cwd="/"
            )
        finally:
            os.close(log)
        _launched[proc.pid] = proc
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            rc = proc.poll()
            if rc == ALREADY_RUNNING:
                return False
            if rc is not None:
                if rc == 0:  # it ran the program, which ended already; status says how
                    return True
                raise ServiceError(
                    f"the supervisor for {name} exited with status {rc}:\n{tail(files.log, 10)}"
                )
            state = read_state(files)
            live = read_live(files.pid)
            if live is not None and live.pid == proc.pid and state is not None and state.state != "starting":
                return True
            time.sleep(0.05)
        raise ServiceError(f"the supervisor for {name} did not start its program in {self.start_timeout:g}s")

    def stop(self, name: str) -> bool:
        """SIGTERM the supervisor and wait for it (it ends the program); False when none ran.

        A supervisor that does not end within TimeoutStopSec + :data:`STOP_GRACE` is SIGKILLed; a
        program whose supervisor is gone is ended directly (SIGTERM, TimeoutStopSec, SIGKILL).
        Stale pid files are removed.
        """
        files = self.files(name)
        if not files.dir.exists():
            return False
        private_dir(files.dir)
        timeout = self._stop_timeout(name)
        stopped = False
        supervisor = read_live(files.pid)
        if supervisor is not None:
            stopped = True
            _end(supervisor, timeout + STOP_GRACE)
        orphan = read_live(files.child_pid)
        if orphan is not None:
            stopped = True
            _end(orphan, timeout)
        files.pid.unlink(missing_ok=True)
        files.child_pid.unlink(missing_ok=True)
        state = read_state(files)
        if stopped and state is not None and state.state in UNENDED:  # a supervisor SIGKILLed, or gone before
            write_state(files, SupervisorState("stopped", state.restarts, None, "stopped on request"))
        return stopped

    def _stop_timeout(self, name: str) -> float:
        """The unit's TimeoutStopSec, or :data:`STOP_TIMEOUT` when the unit is gone or unreadable."""
        try:
            return parse_unit(self.paths.unit(name).read_text()).stop_timeout
        except (OSError, ServiceError):
            return STOP_TIMEOUT

    def restart(self, name: str) -> None:
        """Stop, then start (which reads the unit again)."""
        self.stop(name)
        self.start(name)

    def status(self, name: str) -> ServiceStatus:
        """From the pid files (believed only when live) and the supervisor's state file; "unknown",
        saying why, when this user may not read them (root's supervisor keeps them mode 0700: a
        running service read as "stopped")."""
        files = self.files(name)
        if not _may_read(files.dir) and exists_or_hidden(files.dir):
            return ServiceStatus(name, "unknown", detail=f"cannot read {files.dir} as uid {os.geteuid()}: "
                                 "run 'llmgw service status' as root")
        return self._status(name, files)

    def _status(self, name: str, files: ServiceFiles) -> ServiceStatus:
        state = read_state(files)
        restarts = state.restarts if state else 0
        supervisor = read_live(files.pid)
        child = read_live(files.child_pid)
        if supervisor is None:
            return self._unsupervised(name, state, child)
        if state is not None and state.state == "restarting":
            return ServiceStatus(name, "failed", None, None, restarts, state.detail)
        pid = child.pid if child is not None else None
        since = state.since if state and state.since else (child.create_time() if child else None)
        detail = "" if state is None or state.state == "running" else state.state
        return ServiceStatus(name, "running", pid, since, restarts, detail)

    def _unsupervised(self, name: str, state: SupervisorState | None, child: psutil.Process | None) -> ServiceStatus:
        """The status of ``name`` with no supervisor alive: its program left behind (failed), not
        installed (unknown), ended as :data:`UNENDED` says (failed), or stopped."""
        restarts = state.restarts if state else 0
        if child is not None:
            detail = f"its supervisor is gone; 'llmgw service stop {name}' ends pid {child.pid}"
            return ServiceStatus(name, "failed", child.pid, child.create_time(), restarts, detail)
        unit = self.paths.unit(name)
        if not unit.exists():
            return ServiceStatus(name, "unknown", detail=f"not installed: no {unit.name}")
        if state is not None and state.state == "failed":
            return ServiceStatus(name, "failed", None, None, restarts, state.detail)
        if state is not None and state.state in UNENDED:
            return ServiceStatus(name, "failed", None, None, restarts, _unended(name, state))
        return ServiceStatus(name, "stopped", None, None, restarts, state.detail if state else "")

    def logs(self, name: str, lines: int = 50) -> str:
        """The last ``lines`` lines of ``NAME.log``."""
        return tail(self.files(name).log, lines)

    def follow(self, name: str, lines: int = 50, poll: float = 0.5) -> Iterator[str]:
        """The last ``lines`` lines of ``NAME.log``, then what is appended, polled every ``poll`` s."""
        path = self.files(name).log
        pos = path.stat().st_size if path.exists() else 0
        yield tail(path, lines)
        while True:
            size = path.stat().st_size if path.exists() else 0
            if size < pos:  # rotated (copy-truncate): what came after pos is in NAME.log.1, then from 0
                rest = _read_from(path.with_name(f"{path.name}.1"), pos)
                if rest:
                    yield rest
                pos = 0
            if size == pos:
                time.sleep(poll)
                continue
            with path.open("rb") as f:
                f.seek(pos)
                chunk = f.read(size - pos)
            pos = size
            yield chunk.decode(errors="replace")


def _read_from(path: Path, pos: int) -> str:
    """What ``path`` holds after byte ``pos`` ("" when it is missing or no longer)."""
    try:
        with path.open("rb") as f:
            f.seek(pos)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def pick_manager(
    paths: Paths, *, init_comm: Path = Path("/proc/1/comm"), runner: Runner = run_command
) -> ServiceManager:
    """:class:`SystemdManager` when ``init_comm`` says systemd is PID 1 and ``paths`` is not
    prefixed (a prefixed install's units are not systemd's to run); else :class:`SupervisorManager`.
    """
    try:
        pid1 = init_comm.read_text().strip()
    except OSError:
        pid1 = ""
    if pid1 == "systemd" and not paths.prefixed:
        return SystemdManager(paths, runner)
    return SupervisorManager(paths)
