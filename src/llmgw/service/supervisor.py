"""llmgw's own supervisor, for machines without systemd (containers, CI, laptops).

The unit file is the single source of truth: :func:`parse_unit` reads its ``ExecStart=``,
``Environment=``, ``Restart=``, ``RestartSec=``, ``TimeoutStopSec=``,
``StartLimitBurst=``/``StartLimitIntervalSec=``, ``User=``, ``Group=``, ``SupplementaryGroups=``
and ``UMask=``, and ignores the rest: Protect*, limits and the like are systemd's to enforce and
are not enforced here.

``User=``/``Group=`` are applied as systemd applies them (:func:`credentials`): a supervisor
running as root starts the program with that user's uid, the group's gid (the user's own group
when ``Group=`` is absent), the user's groups from the group database plus
``SupplementaryGroups=`` and nothing of root's, and ``HOME``/``USER``/``LOGNAME``/``SHELL`` set
for that user; the privileges are dropped in the child before exec (``setgroups``, ``setgid``,
``setuid``). A supervisor that is not root cannot switch users: it runs the program as itself and
says so in the log.

One supervisor process per service (``python -m llmgw.service.supervisor NAME --unit U --dir D``,
started detached by :class:`llmgw.service.manager.SupervisorManager`). Its loop:

1. take ``NAME.lock`` (flock) or exit 3: there is only ever one; write ``NAME.pid``;
2. start the program (environment: :func:`~llmgw.service.unitfile.service_env`, i.e. for a
   ``User=`` it switches to, only what systemd would give (PATH, the locale, the user's HOME,
   USER, LOGNAME, SHELL, the unit's ``Environment=``), none of the supervisor's own (root's); run
   as the supervisor's own user, its environment plus ``Environment=``; and a new
   ``INVOCATION_ID`` for each start, as systemd sets; working directory ``/``; stdin
   ``/dev/null``; stdout and stderr appended to ``NAME.log``, which the program inherits open,
   so a program running as another user needs no right to the file; user, groups and umask from
   the unit); write ``NAME.child.pid`` and the state ``running``;
3. wait for the program to end or for SIGTERM/SIGINT (a signal wakes it at once through a pipe,
   SIGCHLD included); meanwhile ``NAME.log`` is rotated past :data:`LOG_MAX_BYTES` (copy-truncate,
   :mod:`llmgw.logrotate`: the program keeps writing to its descriptor), keeping
   ``NAME.log.1``-``.3``: the control plane writes an access line per request there, and the file
   grew without bound (a new user's finding; systemd's journal has its own limits);
4. program ended: ``Restart=`` decides as systemd does (``on-failure``: a non-zero exit or death by
   a signal other than HUP, INT, TERM, PIPE). No restart: state ``stopped`` (clean) or ``failed``,
   and the supervisor exits. Restart: wait ``RestartSec`` (doubled for each further failure in a
   row that came within 10 s of its start, up to a minute: :func:`restart_delay`) and go to 2,
   unless the program has started ``StartLimitBurst`` times within ``StartLimitIntervalSec``
   (systemd's defaults: 5 in 10 s), in which case it gives up as ``failed``;
5. SIGTERM: send SIGTERM to the program itself only (``KillMode=process``: the agent's engines live
   in their own sessions and must outlive it), wait up to ``TimeoutStopSec`` (default
   :data:`~llmgw.service.unitfile.STOP_TIMEOUT`), then SIGKILL;
   remove both pid files, write ``stopped`` and exit.

Not guaranteed: a supervisor killed with SIGKILL leaves its program running and its pid files
behind; the files then read as stale (see :mod:`llmgw.service.files`) and
``SupervisorManager.stop``/``start`` end that orphaned program first.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import secrets
import select
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from types import FrameType
from typing import BinaryIO

import psutil

from llmgw import logrotate
from llmgw.errors import ServiceError
from llmgw.service.files import ServiceFiles, SupervisorState, open_log, private_dir, write_pid, write_state
from llmgw.service.unitfile import UnitSpec, credentials, parse_unit, service_env

CLEAN_SIGNALS = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE})
"""Deaths by these signals count as a clean end, as systemd counts them for ``Restart=``."""

EXEC_FAILED = 203
"""The exit status recorded when the program cannot be executed at all (systemd's EXIT_EXEC)."""

ALREADY_RUNNING = 3
"""The supervisor's exit status when another one holds the lock."""

#: A service's ``NAME.log`` is rotated past this size (10 MiB: ~35,000 access lines), checked every
#: :data:`LOG_CHECK_S`; :data:`LOG_KEEP` rotated files are kept (40 MiB in all at most).
LOG_MAX_BYTES = 10 * 1024 * 1024
LOG_KEEP = 3
LOG_CHECK_S = 10.0

STABLE_S = 10.0
"""Seconds a program must run for its next failure to count as new: a shorter run doubles the wait
before the next start (systemd's StartLimitIntervalSec default, 10 s, as the measure of "at once")."""

MAX_RESTART_DELAY_S = 60.0
"""The longest wait between starts of a program that keeps failing at once, in seconds."""


def restart_delay(restart_sec: float, quick_failures: int) -> float:
    """Seconds to wait before the next start: ``restart_sec`` (the unit's RestartSec) after the first
    failure in a row that came within :data:`STABLE_S` of its start, then doubled for each further
    one, up to :data:`MAX_RESTART_DELAY_S` (never below ``restart_sec``). systemd 254's
    RestartSteps/RestartMaxDelaySec grow the delay the same way; without it a server.yaml typo
    restarted the control plane every ~3 s for as long as nobody looked (24 starts in 70 s, about
    1 CPU-second each; a new user's report, 2026-12-05).

    >>> [restart_delay(2.0, n) for n in (0, 1, 2, 3, 6, 7)]
    [2.0, 2.0, 4.0, 8.0, 60.0, 60.0]
    """
    if quick_failures <= 1:
        return restart_sec
    grown: float = restart_sec * 2.0 ** (quick_failures - 1)
    return max(restart_sec, min(grown, MAX_RESTART_DELAY_S))


def should_restart(policy: str, returncode: int) -> bool:
    """Whether ``Restart=policy`` starts a program again that ended with ``returncode``.

    ``returncode`` as :mod:`subprocess` gives it: negative for death by that signal.
    """
    by_signal = returncode < 0
    clean = returncode == 0 or (by_signal and -returncode in CLEAN_SIGNALS)
    return {
        "no": False,
        "always": True,
        "on-success": clean,
        "on-failure": not clean,
        "on-abnormal": by_signal and not clean,
        "on-abort": by_signal and not clean,
        "on-watchdog": False,
    }[policy]


def describe_exit(returncode: int) -> str:
    """``exit code 1``, ``killed by SIGKILL``: how a program ended, for status and the log."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(eq=False)
class Supervisor:
    """Runs one unit's program under the loop in this module's docstring; see :meth:`run`.
    ``log_max_bytes``/``log_check_s``: the log's rotation (:data:`LOG_MAX_BYTES`, :data:`LOG_CHECK_S`)."""

    name: str
    spec: UnitSpec
    files: ServiceFiles
    _: KW_ONLY
    clock: Callable[[], float] = time.time
    log_max_bytes: int = LOG_MAX_BYTES
    log_check_s: float = LOG_CHECK_S
    _stopping: bool = field(default=False, init=False)
    _restarts: int = field(default=0, init=False)
    _log: BinaryIO | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._wake_r, self._wake_w = os.pipe()

    # --- signals -------------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            self._stopping = True

    def _install_signals(self) -> None:
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def _pause(self, seconds: float) -> None:
        """Sleep up to ``seconds``, woken early by any signal (a stop, or a child's end)."""
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select([self._wake_r], [], [], max(seconds, 0.0))
            if ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 512)

    # --- output ----------------------------------------------------------------------------------

    def say(self, message: str) -> None:
        """Append a supervisor line, ``<time> llmgw-supervisor[pid]: message``, to the log."""
        if self._log is None:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.clock()))
        self._log.write(f"{stamp} llmgw-supervisor[{os.getpid()}]: {message}\n".encode())
        self._log.flush()

    def _state(self, state: str, *, since: float | None = None, detail: str = "") -> None:
        write_state(self.files, SupervisorState(state, self._restarts, since, detail))

    # --- the loop ----------------------------------------------------------------------------------

    def _launch(self) -> subprocess.Popen[bytes] | None:
        try:
            who = credentials(self.spec)
        except ServiceError as e:
            self.say(f"cannot start {shlex.join(self.spec.argv)}: {e}")
            return None
        if who.note:
            self.say(who.note)
        try:
            proc = subprocess.Popen(
                self.spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=service_env(self.spec, who, os.environ) | {"INVOCATION_ID": secrets.token_hex(16)},
                cwd="/",
                user=who.user,
                group=who.group,
                extra_groups=who.extra_groups,
                umask=-1 if self.spec.umask is None else self.spec.umask,
            )
        except (OSError, subprocess.SubprocessError) as e:
            as_user = f" as {self.spec.user}" if who.user is not None else ""
            self.say(f"cannot start {shlex.join(self.spec.argv)}{as_user}: {e}")
            return None
        try:
            since: float | None = write_pid(self.files.child_pid, proc.pid).create_time
        except psutil.Error:  # gone already; its end is read by the wait that follows
            since = None
        self._state("running", since=since)
        as_user = f" as {self.spec.user} (uid {who.user})" if who.user is not None else ""
        self.say(f"started pid {proc.pid}{as_user}: {shlex.join(self.spec.argv)}")
        return proc

    def _wait(self, proc: subprocess.Popen[bytes]) -> int | None:
        """The program's return code once it ends, or None when a stop was asked first; rotates the
        log every :data:`LOG_CHECK_S` meanwhile (step 3)."""
        checked = time.monotonic()
        while True:
            rc = proc.poll()
            if rc is not None:
                return rc
            if self._stopping:
                return None
            if time.monotonic() - checked >= self.log_check_s:
                checked = time.monotonic()
                try:
                    assert self._log is not None  # noqa: S101  (run() opened it before the loop)
                    mine = os.fstat(self._log.fileno())  # never a file put in its place
                    if logrotate.rotate(self.files.log, max_bytes=self.log_max_bytes, keep=LOG_KEEP,
                                        inode=(mine.st_dev, mine.st_ino)):
                        self.say(f"{self.files.log.name} rotated past {self.log_max_bytes} bytes")
                except OSError as e:
                    self.say(f"{self.files.log.name} could not be rotated: {e}")
            self._pause(min(1.0, self.log_check_s))

    def _terminate(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM the program itself (not its group), SIGKILL after TimeoutStopSec; reap it."""
        self._state("stopping")
        if proc.poll() is None:
            self.say(f"stopping pid {proc.pid} (SIGTERM)")
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.spec.stop_timeout
            while proc.poll() is None and time.monotonic() < deadline:
                self._pause(min(0.2, deadline - time.monotonic()))
            if proc.poll() is None:
                self.say(f"pid {proc.pid} did not end in {self.spec.stop_timeout:g}s; SIGKILL")
                proc.kill()
        self.say(f"pid {proc.pid} ended: {describe_exit(proc.wait())}")

    def _start_limit_hit(self, starts: deque[float]) -> bool:
        """Whether ``starts`` (monotonic times) hold StartLimitBurst within StartLimitIntervalSec."""
        now = time.monotonic()
        while starts and now - starts[0] > self.spec.start_limit_interval:
            starts.popleft()
        return len(starts) >= self.spec.start_limit_burst

    def _lock(self) -> BinaryIO | None:
        handle = self.files.lock.open("ab")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        return handle

    def run(self) -> int:
        """Supervise until stopped or given up; 0, or :data:`ALREADY_RUNNING` when another holds the lock."""
        private_dir(self.files.dir)
        lock = self._lock()
        if lock is None:
            print(f"llmgw-{self.name} is already supervised", file=sys.stderr)
            return ALREADY_RUNNING
        self._install_signals()
        final = SupervisorState("failed", detail="the supervisor itself failed; see the log")
        with lock, open(open_log(self.files.log), "ab") as self._log:
            self._state("starting")  # before the pid file: a new pid never pairs with an old state
            write_pid(self.files.pid, os.getpid())
            try:
                final = self._loop()
            finally:
                self.files.child_pid.unlink(missing_ok=True)
                self.files.pid.unlink(missing_ok=True)
                write_state(self.files, final)
                self.say(f"supervisor exits: {final.state}, {final.detail}")
        return 0

    def _loop(self) -> SupervisorState:
        """Steps 2-5 of the module docstring; returns the state to leave behind."""
        starts: deque[float] = deque()
        quick = 0  # failures in a row, each within STABLE_S of its start
        while not self._stopping:
            started = time.monotonic()
            starts.append(started)
            proc = self._launch()
            if proc is None:
                rc = EXEC_FAILED
            else:
                waited = self._wait(proc)
                if waited is None:
                    self._terminate(proc)
                    break
                rc = waited
            self.files.child_pid.unlink(missing_ok=True)
            how = "could not be executed (see the log)" if proc is None else describe_exit(rc)
            if not should_restart(self.spec.restart, rc):
                self.say(f"program ended: {how}; Restart={self.spec.restart}, not restarting")
                clean = not should_restart("on-failure", rc)
                return SupervisorState("stopped" if clean else "failed", self._restarts, None, how)
            if self._start_limit_hit(starts):
                detail = (
                    f"{how}; started {len(starts)} times within "
                    f"{self.spec.start_limit_interval:g}s, gave up (StartLimitBurst)"
                )
                self.say(f"program ended: {detail}")
                return SupervisorState("failed", self._restarts, None, detail)
            self._restarts += 1
            quick = quick + 1 if time.monotonic() - started < STABLE_S else 0
            delay = restart_delay(self.spec.restart_sec, quick)
            detail = f"{how}; restarting in {delay:g}s"
            if quick > 1:
                detail += (f" (it failed {quick} times in a row within {STABLE_S:g}s of starting; "
                           f"'llmgw service logs {self.name}' says why)")
            self.say(f"program ended: {detail}")
            self._state("restarting", detail=detail)
            deadline = time.monotonic() + delay
            while not self._stopping and time.monotonic() < deadline:
                self._pause(deadline - time.monotonic())
        return SupervisorState("stopped", self._restarts, None, "stopped on request")


def main(argv: list[str] | None = None) -> int:
    """``python -m llmgw.service.supervisor NAME --unit PATH --dir DIR``: supervise in the foreground."""
    parser = argparse.ArgumentParser(prog="python -m llmgw.service.supervisor")
    parser.add_argument("name", help="the service name (server, agent, mirror)")
    parser.add_argument("--unit", required=True, type=Path, help="the unit file to run")
    parser.add_argument("--dir", required=True, type=Path, help="where pid files, log and state go")
    args = parser.parse_args(argv)
    try:
        spec = parse_unit(args.unit.read_text())
        private_dir(args.dir)
    except (OSError, ServiceError) as e:
        print(f"Error: {args.unit}: {e}", file=sys.stderr)
        return 2
    return Supervisor(args.name, spec, ServiceFiles(args.dir, args.name)).run()


if __name__ == "__main__":
    sys.exit(main())
