"""How an engine's end is described: codes, signals, and OOM evidence from a (fake) cgroup tree."""

from __future__ import annotations

import signal
from pathlib import Path

from llmgw.agent.engines.exits import describe_exit, oom_kills


def fake_cgroups(root: Path, count: int) -> None:
    """Counter files for this process's cgroup paths, as the kernel lays them out (v1 and v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":
            d = root / rel
            d.mkdir(parents=True, exist_ok=True)
            (d / "memory.events").write_text(f"low 0\nhigh 0\nmax 2\noom 1\noom_kill {count}\n")
        elif "memory" in controllers.split(","):
            d = root / "memory" / rel
            d.mkdir(parents=True, exist_ok=True)
            (d / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {count}\n")


def test_oom_kills_reads_the_cgroup_counter(tmp_path: Path) -> None:
    assert oom_kills(root=tmp_path) is None  # nothing readable: unknown, not zero
    fake_cgroups(tmp_path, 3)
    assert oom_kills(root=tmp_path) == 3


def test_describe_exit() -> None:
    assert describe_exit(1) == "with code 1"
    assert describe_exit(None).startswith("(exit status unknown")
    assert describe_exit(-signal.SIGABRT) == "on signal SIGABRT (6)"
    kill = -signal.SIGKILL
    oom = describe_exit(kill, oom="the memory cgroup's oom_kill count went from 0 to 1")
    assert oom == (
        "on signal SIGKILL (9): killed by the kernel's out-of-memory killer "
        "(the memory cgroup's oom_kill count went from 0 to 1)"
    )
    assert "killed by SIGKILL (possibly out of memory" in describe_exit(kill, oom=None)
    assert "not by the OOM killer" in describe_exit(kill, oom="")
