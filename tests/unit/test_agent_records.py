"""Replica records and adoption: only the very process that was launched is adopted or stopped.

Real processes (``sleep``) in their own sessions, as engines are launched; every test leaves none.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from llmgw.agent.node.records import (
    ReplicaRecord,
    adoptable,
    drop_record,
    live_process,
    load_records,
    replica_dir,
    replicas_dir,
    stop_all_engines,
    stop_process_group,
    write_record,
)
from llmgw.protocol import ReplicaSpec

SPEC = ReplicaSpec(
    id="r1",
    model="m",
    version="v",
    profile="cpu",
    engine="llamacpp",
    source_url="http://mirror/m/v/f.gguf",
    file_name="f.gguf",
    key="k",
)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    # Until the child has exec'd, its command line is the forking Python's: a record taken then
    # names another program than the one running a moment later (seen under load).
    deadline = time.monotonic() + 10
    while psutil.Process(proc.pid).cmdline() != ["sleep", "60"] and time.monotonic() < deadline:
        time.sleep(0.01)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _children(proc: subprocess.Popen[bytes], within_s: float = 10.0) -> list[psutil.Process]:
    """``proc``'s children, once the shell has forked them: a fixed sleep before reading them (or
    before signalling a shell whose ``trap`` comes first) was a guess a loaded machine can miss."""
    deadline = time.monotonic() + within_s
    while not (children := psutil.Process(proc.pid).children()):
        assert time.monotonic() < deadline, f"the shell {proc.pid} started no child within {within_s} s"
        time.sleep(0.01)
    return children


def record_for(proc: subprocess.Popen[bytes], rid: str = "r1", **kw: object) -> ReplicaRecord:
    p = psutil.Process(proc.pid)
    fields: dict[str, object] = {
        "id": rid,
        "pid": proc.pid,
        "create_time": p.create_time(),
        "argv": p.cmdline(),
        "host": "127.0.0.1",
        "port": 1234,
        "key": "k",
        "spec": SPEC.model_copy(update={"id": rid}),
        "started_at": time.time(),
    }
    return ReplicaRecord.model_validate(fields | kw)


def test_record_roundtrip_is_private(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    rec = record_for(sleeper)
    path = write_record(tmp_path, rec)
    assert path == tmp_path / "replicas" / "r1" / "record.json"
    assert path.stat().st_mode & 0o777 == 0o600  # it holds the replica's key
    assert load_records(tmp_path) == [rec]
    assert not list(path.parent.glob(".record.json.*"))  # no temp file left


def test_live_process_matches_pid_start_time_and_cmdline(sleeper: subprocess.Popen[bytes]) -> None:
    rec = record_for(sleeper)
    assert live_process(rec) is not None
    assert live_process(rec.model_copy(update={"create_time": rec.create_time - 5})) is None
    assert live_process(rec.model_copy(update={"argv": ["sleep", "61"]})) is None


def test_reused_pid_is_not_adopted_nor_killed(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    # The record says "this pid", but the process there started at another time: pid reuse.
    write_record(tmp_path, record_for(sleeper, create_time=psutil.Process(sleeper.pid).create_time() - 100))
    assert adoptable(tmp_path) == []
    assert not (replica_dir(tmp_path, "r1") / "record.json").exists()  # dropped
    assert sleeper.poll() is None  # and the stranger lives on


def test_matching_record_is_adopted(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    rec = record_for(sleeper)
    write_record(tmp_path, rec)
    assert adoptable(tmp_path) == [rec]


def test_dead_engine_record_is_dropped(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)  # alive while its record is made
    rec = record_for(proc)
    proc.kill()
    proc.wait()
    write_record(tmp_path, rec)
    assert adoptable(tmp_path) == []
    assert load_records(tmp_path) == []


def test_unreadable_record_is_skipped(tmp_path: Path) -> None:
    d = replica_dir(tmp_path, "bad")
    d.mkdir(parents=True)
    (d / "record.json").write_text("{not json")
    assert load_records(tmp_path) == []


def test_replica_dir_refuses_paths(tmp_path: Path) -> None:
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError, match="cannot be a directory name"):
            replica_dir(tmp_path, bad)


def test_stop_all_engines_stops_recorded_groups_only(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    # The engine and a child of it in its group (vLLM keeps workers there).
    engine = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        members = _children(engine)
        write_record(tmp_path, record_for(engine, "e1"))
        write_record(tmp_path, record_for(sleeper, "stranger", create_time=0.0))
        assert stop_all_engines(tmp_path, grace_s=5) == [engine.pid]
        engine.wait(timeout=5)
        assert not any(m.is_running() and m.status() != psutil.STATUS_ZOMBIE for m in members)
        assert sleeper.poll() is None
        assert load_records(tmp_path) == []
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


def test_sigkill_after_grace(tmp_path: Path) -> None:
    stubborn = subprocess.Popen(
        ["sh", "-c", "trap '' TERM; sleep 60 & wait; sleep 60"], start_new_session=True
    )
    _children(stubborn)  # its trap is set: the shell forks only after it
    started = time.monotonic()
    assert stop_process_group(stubborn.pid, grace_s=0.5, reap=False)
    assert stubborn.wait(timeout=5) == -9
    assert time.monotonic() - started < 5


def test_stop_of_a_gone_group_is_false() -> None:
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait()
    assert stop_process_group(proc.pid, grace_s=0.1) is False


def test_the_directories_of_replicas_ended_long_ago_go_when_a_record_is_dropped(tmp_path: Path) -> None:
    """A new user's finding: every replica a node ever ran kept its directory (12 for 3 live ones).
    Dropping a record now removes the ended ones beyond the newest 20 that are over 7 days old; a
    live replica's directory (its record) and the recent ones stay."""
    now = time.time()
    root = replicas_dir(tmp_path)
    for i in range(30):  # ended replicas, the newest first: r00 ended 0 days ago, r29 29 days ago
        d = root / f"r{i:02d}"
        d.mkdir(parents=True)
        (d / "engine.log").write_text("a log\n")
        for f in (d / "engine.log", d):
            os.utime(f, (now - i * 86400, now - i * 86400))
    live = root / "live"
    live.mkdir()
    (live / "record.json").write_text("{}")
    os.utime(live, (now - 90 * 86400, now - 90 * 86400))
    (root / "r00" / "record.json").write_text("{}")  # the one being dropped
    drop_record(tmp_path, "r00", now=now)
    left = sorted(p.name for p in root.iterdir())
    assert left == ["live", *(f"r{i:02d}" for i in range(20))]  # 20 newest ended kept (r00-r19)
    assert not (root / "r00" / "record.json").exists()
