"""``llmgw`` as a child process, the processes an install started, and what in its tree is exposed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from tests.conftest import Assets
from tests.helpers.net import free_port

LISTEN_FLAGS = ("--admin-listen", "--agent-listen", "--gateway-listen", "--mirror-listen", "--mirror-api-listen")
"""``server init``'s one flag per port."""


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 10) -> None:
    """SIGTERM ``proc``, and SIGKILL it if it is still running after ``grace_s`` seconds; reaped either
    way (:func:`stop_processes` of one)."""
    stop_processes([proc], grace_s)


def stop_processes(procs: list[subprocess.Popen[Any]], grace_s: float = 10) -> None:
    """SIGTERM each of ``procs`` once, wait up to ``grace_s`` seconds in all for them to exit, SIGKILL
    those still running; all reaped. For a test's own llama-servers, stopped together.

    One SIGTERM, never two: llama-server takes a second SIGINT/SIGTERM as "terminating immediately"
    and calls ``exit(1)`` from its signal handler (tools/server/server.cpp, ``signal_handler``), which
    can deadlock in the exit handlers while its other threads still shut down: every thread waits on a
    futex until SIGKILL. tests/e2e/test_routing_e2e.py's teardown signalled its three twice (a
    ``terminate()`` each, then this helper's): one of them hung its full 10 s in 1 of 2 runs
    (2026-12-05), 0 in 3 since. The SIGKILL after the grace stays: one that had a burst of requests cut
    short was seen hanging in its shutdown after a single SIGTERM too (2026-12-04, after
    tests/e2e/test_guard_e2e.py: still there 12 minutes later, every thread waiting on a futex)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def llmgw(root: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m llmgw ARGS`` with ``LLMGW_ROOT=root``; text output captured, never raises on exit code."""
    env = {**os.environ, "LLMGW_ROOT": str(root)}
    return subprocess.run(
        [sys.executable, "-m", "llmgw", *args], env=env, capture_output=True, text=True, timeout=timeout,
        check=False,
    )


def listen_args(skip: tuple[str, ...] = ()) -> list[str]:
    """``--*-listen 127.0.0.1:PORT`` for every init listener not in ``skip``, each on a free port."""
    out: list[str] = []
    for flag in LISTEN_FLAGS:
        if flag not in skip:
            out += [flag, f"127.0.0.1:{free_port()}"]
    return out


def processes_under(root: Path) -> list[psutil.Process]:
    """Every live process started for this install: its argv or environment names the root."""
    found = []
    for p in psutil.process_iter(["cmdline", "pid"]):
        if p.pid == os.getpid():
            continue
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            env = p.environ() if str(root) not in cmd else {}
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if str(root) in cmd or env.get("LLMGW_ROOT") == str(root):
            found.append(p)
    return found


def stop_install(root: Path) -> None:
    """``service stop --engines`` for ``root``, then kill whatever it left."""
    llmgw(root, "service", "stop", "--engines", timeout=120)
    for p in processes_under(root):
        p.kill()


def stop_installs(*roots: Path) -> None:
    """:func:`stop_install` for each of ``roots`` at the same time: members of one Patroni cluster
    stopped one after the other each wait out the raft quorum the others took with them (retry_timeout,
    4 s, twice for the last), 14.5 s for two installs stopped in turn."""
    with ThreadPoolExecutor(len(roots)) as pool:
        list(pool.map(stop_install, roots))


#: The cores ``server init`` plans with in the tests that run it (``--cpus``): one, as the tests
#: that start an engine themselves or through a profile give it (``--threads 1``, ``cpu_cores: 1``).
#: With a thread per core (2 here), llama.cpp's threads wait for each other at every step, and on
#: a machine the suite keeps busy that is ruinous: the nine tests of test_gateway_engine.py took
#: 56 s with 2 threads and 15 s with 1 beside two busy loops (2026-12-05). Alone, 384 tokens cost
#: 11.1 CPU-s with 2 threads and 7.8 with 1 (42% more, for 70 against 49 tokens/s).
ENGINE_CORES = 1


@contextmanager
def offline_init(tmp_path: Path, assets: Assets) -> Iterator[tuple[Path, list[str]]]:
    """``(root, args)``: the arguments of an offline ``server init`` of the test assets (node
    ``e2e-node``, starter alias ``gemma``, planned with :data:`ENGINE_CORES`, every port free); the
    install is stopped afterwards."""
    root = tmp_path / "root"
    args = [
        "server", "init", "--offline", "--host", "127.0.0.1", "--node-id", "e2e-node",
        "--starter-source", f"file:{assets.model}", "--starter-alias", "gemma",
        "--llama-server", str(assets.llama_server), "--cpus", str(ENGINE_CORES), *listen_args(),
    ]
    try:
        yield root, args
    finally:
        stop_install(root)


SECRET_NAMES = {"admin-token", "client-keys", "llmgw.db", "llmgw.db-wal", "llmgw.db-shm", "record.json", "api-key"}
"""Files that hold a secret wherever they are: tokens, keys, the store (replica keys), replica records."""


def exposed(root: Path) -> list[str]:
    """What in an install's tree another local user could read or change: a secret
    (:data:`SECRET_NAMES`, ``*-key.pem``, a supervisor log) readable by group or others, a state
    directory that is not 0700, and any directory group or others may write."""
    found = []
    state_dirs = {root / "var/lib/llmgw", root / "var/lib/llmgw-agent", root / "var/lib/llmgw/services"}
    for top, dirs, names in os.walk(root):
        for d in dirs:
            path = Path(top) / d
            mode = path.lstat().st_mode & 0o777
            if mode & 0o022:
                found.append(f"{path}: directory mode {mode:o}, writable by group or others")
            if path in state_dirs and mode != 0o700:
                found.append(f"{path}: state directory mode {mode:o}, not 700")
        for n in names:
            path = Path(top) / n
            log = path.parent.name == "services" and n.endswith(".log")
            secret = n in SECRET_NAMES or n.endswith("-key.pem") or log
            mode = path.lstat().st_mode & 0o777
            if secret and mode & 0o077:
                found.append(f"{path}: secret with mode {mode:o}, readable by group or others")
    return found
