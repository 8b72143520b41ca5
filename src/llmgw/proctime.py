"""When a process started, in a form that still names it after the wall clock is stepped.

psutil's ``create_time`` is the process's start in clock ticks since boot (``/proc/PID/stat``) plus
the boot time, and Linux derives the boot time (``btime`` in ``/proc/stat``) from the wall clock as
it is now: when the clock is stepped (NTP, a virtual machine's clock sync), every process's
``create_time`` moves by the step. Seen on a test machine: a 96 s step made the service manager
take every running service for stopped (pid files compared within a second), so ``llmgw service
stop`` stopped nothing and a second ``server init`` refused its own control plane's ports as
"another program's". :func:`since_boot` is the start in seconds since boot, which no clock step
moves; the records that must tell "the same process" from "a reused pid" (the service manager's
pid files, the agent's engine records) keep it beside the wall-clock time.
"""

from __future__ import annotations

import psutil

#: Two starts this close (s) are the same process: /proc counts starts in ticks of 1/100 s, so two
#: processes given the same pid differ by at least one tick.
SAME_START_S = 0.005


def since_boot(proc: psutil.Process) -> float:
    """Seconds from the machine's boot to ``proc``'s start (one clock tick's resolution, 0.01 s):
    its ``create_time`` less the boot time, both as the wall clock says now, so a step of the clock
    cancels out.

    Raises:
        psutil.Error: the process is gone or cannot be read (as ``create_time``).
    """
    return proc.create_time() - psutil.boot_time()


def same_start(proc: psutil.Process, recorded_since_boot: float | None, recorded_wall: float, slack_s: float) -> bool:
    """Whether ``proc`` started when a record says: by :func:`since_boot` when the record has it
    (within :data:`SAME_START_S`), else by wall-clock ``create_time`` within ``slack_s`` (a record
    written before the start since boot was kept, which a clock step can still fool).

    Raises:
        psutil.Error: the process is gone or cannot be read.
    """
    if recorded_since_boot is not None:
        return abs(since_boot(proc) - recorded_since_boot) <= SAME_START_S
    return abs(proc.create_time() - recorded_wall) <= slack_s
