"""A step of the wall clock does not make a running process look like a stranger.

Linux derives the boot time that psutil adds to a process's start ticks from the wall clock as it
is now, so stepping the clock (NTP, a VM's clock sync: a 96 s step was seen on a test machine while
an install ran) moves every ``create_time``. Stepping this machine's clock in a test would disturb
everything else running on it, so the step is simulated where psutil reads the boot time
(``psutil._pslinux.boot_time``, the kernel's ``btime``); the processes, pid files and engine records
are real.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import psutil._pslinux as linux
import pytest

from llmgw.agent.node.records import ReplicaRecord, live_process
from llmgw.proctime import since_boot
from llmgw.protocol import ReplicaSpec
from llmgw.service.files import PidRecord, alive, read_pid, write_pid
from tests.helpers.waits import wait_for

STEP_S = 96.0


def test_pid_files_and_engine_records_survive_a_clock_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pid file and an engine record written before a 96 s step still name their (live) process
    after it; a record of the old kind (no start since boot) is fooled, which is the defect fixed;
    a reused pid (another start) is still told apart."""
    # the record carries the argv the engine was started with, as the runner writes it: the child's
    # /proc cmdline read right after Popen can still be empty, mid-exec (CI at 3e816c8: argv=[])
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    sleeper = subprocess.Popen(argv)
    wait_for("the sleeper exec'd", lambda: psutil.Process(sleeper.pid).cmdline() == argv, 10, 0.01)
    try:
        pid_file = tmp_path / "x.pid"
        written = write_pid(pid_file, sleeper.pid)
        assert len(pid_file.read_text().split()) == 3
        proc = psutil.Process(sleeper.pid)
        spec = ReplicaSpec(id="r", model="m", version="v", profile="cpu", engine="llamacpp",
                           source_url="http://mirror/m/v/f.gguf", file_name="f.gguf", key="k")
        record = ReplicaRecord(id="r", pid=sleeper.pid, create_time=proc.create_time(), since_boot=since_boot(proc),
                               argv=argv, host="127.0.0.1", port=1, key="k", spec=spec, started_at=0.0)
        old_kind = PidRecord(written.pid, written.create_time)
        real = linux.boot_time
        monkeypatch.setattr(linux, "boot_time", lambda: real() + STEP_S)
        assert abs(psutil.Process(sleeper.pid).create_time() - written.create_time - STEP_S) < 0.5  # the step shows
        found = alive(read_pid(pid_file) or old_kind)
        assert found is not None
        assert found.pid == sleeper.pid
        assert live_process(record) is not None
        assert alive(old_kind) is None  # the wall-clock comparison alone: fooled by the step
        reused = PidRecord(written.pid, written.create_time, (written.since_boot or 0) - 1.0)
        assert alive(reused) is None
        assert live_process(record.model_copy(update={"since_boot": (record.since_boot or 0) + 0.01})) is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_since_boot_is_the_kernels_start_ticks() -> None:
    """since_boot is /proc/PID/stat's starttime over the clock tick rate."""
    ticks = int(Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
    assert since_boot(psutil.Process()) == pytest.approx(ticks / os.sysconf("SC_CLK_TCK"), abs=0.011)
