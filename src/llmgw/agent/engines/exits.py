"""Why an engine ended, in words: exit code, signal, and whether the kernel's OOM killer did it.

An engine killed for memory dies of SIGKILL with no last words of its own (its last log line is
often a prompt-cache save, LC #20509), so the evidence is outside it, checked in this order:

1. the memory cgroup's OOM-kill counter went up while the engine ran (engines stay in the agent's
   cgroup): cgroup v2 ``memory.events`` ``oom_kill N``, v1 ``memory.oom_control`` ``oom_kill N``;
2. the kernel log (``dmesg``, when readable) names the pid: ``Killed process <pid>`` /
   ``oom-kill:… pid=<pid>``.

With evidence: ``killed by the kernel's out-of-memory killer (…)``; a SIGKILL without it (no cgroup
counter, no readable kernel log, or the kill came from someone else): ``killed by SIGKILL (possibly
out of memory; …)``.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
DMESG_TIMEOUT_S = 2.0


def _cgroup_files(pid: int | str, root: Path) -> list[Path]:
    """The memory cgroup's counter files of ``pid`` (v2 ``memory.events``, v1 ``memory.oom_control``)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":
            found.append(root / rel / "memory.events")
        elif "memory" in controllers.split(","):
            found.append(root / "memory" / rel / "memory.oom_control")
    return found


def oom_kills(pid: int | str = "self", *, root: Path = CGROUP_ROOT) -> int | None:
    """The OOM-kill count of ``pid``'s memory cgroup, or None when no counter can be read."""
    for path in _cgroup_files(pid, root):
        try:
            text = path.read_text()
        except OSError:
            continue
        m = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
        if m:
            return int(m.group(1))
    return None


def kernel_log_names_oom(pid: int) -> bool | None:
    """Whether ``dmesg`` reports an OOM kill of ``pid``; None when the kernel log cannot be read."""
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=DMESG_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    pattern = re.compile(rf"(Killed process {pid}\b|oom-kill:.*\bpid={pid}\b)")
    return bool(pattern.search(done.stdout))


def oom_evidence(pid: int, kills_before: int | None) -> str | None:
    """A sentence of evidence that ``pid`` was OOM-killed, ``""`` when there is none, None if unknowable.

    ``kills_before``: :func:`oom_kills` read before the engine started.
    """
    after = oom_kills()
    if kills_before is not None and after is not None and after > kills_before:
        return f"the memory cgroup's oom_kill count went from {kills_before} to {after}"
    said = kernel_log_names_oom(pid)
    if said:
        return f"the kernel log says it killed pid {pid}"
    if said is None and (kills_before is None or after is None):
        return None
    return ""


def describe_exit(returncode: int | None, *, oom: str | None = None) -> str:
    """``"with code 1"``, ``"on signal SIGABRT (6)"``, or the SIGKILL/OOM wording of the module doc.

    ``oom``: :func:`oom_evidence`'s answer (only looked at for SIGKILL).
    """
    if returncode is None:
        return "(exit status unknown: it was started by an earlier agent)"
    if returncode >= 0:
        return f"with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "signal"
    if -returncode != signal.SIGKILL:
        return f"on signal {name} ({-returncode})"
    if oom:
        return f"on signal SIGKILL (9): killed by the kernel's out-of-memory killer ({oom})"
    if oom is None:
        return "on signal SIGKILL (9): killed by SIGKILL (possibly out of memory; the kernel log is not readable here)"
    return "on signal SIGKILL (9): killed by SIGKILL (not by the OOM killer, as far as the kernel says)"
