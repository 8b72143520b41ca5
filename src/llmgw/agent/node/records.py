"""Replica records: what the agent writes about each engine it launched, so it can find it again.

Engines outlive the agent: each runs in its own session (``start_new_session=True``), and the
agent's unit has ``KillMode=process``, so restarting the agent leaves them serving. A restarted
agent reads ``<agent_state>/replicas/<id>/record.json`` and *adopts* an engine only when the pid is
alive **and** its start time (psutil ``create_time``) **and** its command line equal the record's:
a pid alone is reused by the kernel, and killing or trusting a stranger would be worse than
starting the replica again. A record that does not match is dropped.

Layout of ``<agent_state>/replicas/<id>/``: ``record.json`` (0600: it holds the replica's key),
``api-key`` (0600, passed with ``--api-key-file``), ``engine.log`` (the engine's stdout+stderr).

Stopping (:func:`stop_process_group`): SIGTERM to the engine's process group, up to
:data:`STOP_GRACE_S` for it to exit, then SIGKILL to the group. llama-server notices SIGTERM only
between batches, so a long prefill on a slow CPU can delay it by minutes (LC #18237) and a wedged
decode can ignore it (LC #27388): the grace is bounded and SIGKILL always follows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import time
from pathlib import Path
from typing import IO

import psutil
from pydantic import BaseModel, Field, ValidationError

from llmgw.atomicfile import write_atomic
from llmgw.proctime import same_start
from llmgw.protocol import ReplicaSpec

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL (llama-server stops only between batches; llama-swap waits 5 s)."""

CREATE_TIME_TOLERANCE_S = 0.005
"""create_time comes from /proc start ticks (1/100 s): a different process differs by ≥ 0.01 s."""


class ReplicaRecord(BaseModel):
    """One launched engine, as ``record.json`` holds it.

    Attributes:
        id: the replica id.
        pid: the engine's pid, also its process group id (new session).
        create_time: psutil's ``create_time`` of that pid (unix seconds).
        since_boot: its start in seconds since boot (:func:`llmgw.proctime.since_boot`), to tell pid
            reuse through a step of the wall clock; None in a record written before it was kept.
        argv: the exact command line launched.
        host: the address it listens on; port: its port.
        key: the API key it requires.
        spec: the ReplicaSpec it was started for.
        started_at: when it was launched (unix seconds).
        cpus: the cores it is pinned to (empty: unpinned), claimed again on adoption.
    """

    id: str
    pid: int
    create_time: float
    since_boot: float | None = None
    argv: list[str]
    host: str
    port: int
    key: str
    spec: ReplicaSpec
    started_at: float
    cpus: list[int] = Field(default_factory=list)


def replicas_dir(agent_state: Path) -> Path:
    """``<agent_state>/replicas``: one directory per replica."""
    return agent_state / "replicas"


def replica_dir(agent_state: Path, replica_id: str) -> Path:
    """``<agent_state>/replicas/<id>``; the id must be a plain name (it comes from the control plane).

    Raises:
        ValueError: the id is empty, ``.``/``..`` or contains a path separator.
    """
    if not replica_id or replica_id in {".", ".."} or "/" in replica_id or "\0" in replica_id:
        raise ValueError(f"replica id {replica_id!r} cannot be a directory name")
    return replicas_dir(agent_state) / replica_id


PRIVATE_DIR_MODE = 0o700
"""The agent's state directory and each replica's: engines' keys, records and logs are root's alone."""
PRIVATE_FILE_MODE = 0o600
"""Engine logs (prompts and answers when an engine logs them), key files, records."""


def private_dir(path: Path) -> Path:
    """Make ``path`` (and missing parents) and give it mode 0700, whatever the umask or an older
    agent left (before, a node started by hand had a 0755 state directory); returns ``path``.

    Raises:
        OSError: it cannot be made or its mode set (not the agent's own directory).
    """
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != PRIVATE_DIR_MODE:
        os.chmod(path, PRIVATE_DIR_MODE)
    return path


def open_log(path: Path) -> IO[bytes]:
    """``path`` open for appending, mode 0600 (an older agent's 0644 log is set to 0600 too); a
    symlink in its place is not followed.

    Raises:
        OSError: it cannot be opened (``ELOOP`` for a symlink).
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def write_private(path: Path, data: str) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename) with mode 0600."""
    write_atomic(path, data, 0o600)


def write_record(agent_state: Path, record: ReplicaRecord) -> Path:
    """Write ``record.json`` for ``record`` atomically; returns its path."""
    path = replica_dir(agent_state, record.id) / "record.json"
    write_private(path, record.model_dump_json(indent=2))
    return path


#: The directories of ended replicas (their logs) kept: the newest :data:`KEEP_ENDED` of them, and
#: any younger than :data:`KEEP_ENDED_S`. Before, every replica a node ever ran kept its directory
#: (12 for 3 live ones after a morning: a new user's finding).
KEEP_ENDED = 20
KEEP_ENDED_S = 7 * 86400.0


def drop_record(agent_state: Path, replica_id: str, *, now: float | None = None) -> None:
    """Remove a replica's record and key file (its log stays for whoever looks into a failure), and
    the directories of replicas ended long ago (:func:`prune_ended`)."""
    d = replica_dir(agent_state, replica_id)
    for name in ("record.json", "api-key"):
        with contextlib.suppress(FileNotFoundError):
            (d / name).unlink()
    prune_ended(agent_state, time.time() if now is None else now)


def prune_ended(agent_state: Path, now: float, *, keep: int = KEEP_ENDED, keep_s: float = KEEP_ENDED_S) -> list[Path]:
    """Delete the directories of ended replicas (no ``record.json``) beyond the newest ``keep`` and
    older than ``keep_s`` (by their last change, unix seconds); returns what went."""
    root = replicas_dir(agent_state)
    ended = []
    for d in root.iterdir() if root.is_dir() else []:
        with contextlib.suppress(OSError):
            if d.is_dir() and not d.is_symlink() and not (d / "record.json").exists():
                ended.append((max(f.stat().st_mtime for f in [d, *d.iterdir()]), d))
    gone = []
    for changed, d in sorted(ended, reverse=True)[keep:]:
        if now - changed > keep_s:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    if gone:
        log.info("removed the directories of %d replicas ended over %.0f days ago", len(gone), keep_s / 86400)
    return gone


def instance_id(agent_state: Path) -> str:
    """This node's agent instance id (``<agent_state>/instance``, created on first use).

    The control plane refuses a *second* agent presenting a live node id (another machine with a
    copied certificate, HTTP 409). The id lives with the state, not with the process, so an agent
    restarted or upgraded on the same machine is the same instance and re-registers at once,
    reporting the engines it adopted, instead of waiting out the hold.
    """
    path = agent_state / "instance"
    try:
        found = path.read_text().strip()
    except FileNotFoundError:
        found = ""
    if not found:
        found = secrets.token_hex(8)
        write_private(path, found + "\n")
    return found


def load_records(agent_state: Path) -> list[ReplicaRecord]:
    """Every readable record; unreadable ones are logged and skipped (never raised)."""
    root = replicas_dir(agent_state)
    records = []
    for path in sorted(root.glob("*/record.json")) if root.is_dir() else []:
        try:
            records.append(ReplicaRecord.model_validate_json(path.read_text()))
        except (OSError, ValidationError) as e:
            log.warning("replica record %s is unreadable, ignored: %s", path, e)
    return records


def live_process(record: ReplicaRecord) -> psutil.Process | None:
    """The engine of ``record`` if it is still that very process, else None.

    Same pid, same start time (within :data:`CREATE_TIME_TOLERANCE_S`) and same command line;
    a zombie does not count.
    """
    try:
        proc = psutil.Process(record.pid)
        if not same_start(proc, record.since_boot, record.create_time, CREATE_TIME_TOLERANCE_S):
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        if proc.cmdline() != record.argv:
            return None
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return proc


def adoptable(agent_state: Path) -> list[ReplicaRecord]:
    """Records whose engine is still running; the records of the others are dropped."""
    keep = []
    for record in load_records(agent_state):
        if live_process(record) is not None:
            keep.append(record)
        else:
            log.info(
                "replica %s: engine pid %d is gone (or is another process now); record dropped",
                record.id,
                record.pid,
            )
            drop_record(agent_state, record.id)
    return keep


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) succeeds while any member exists, zombies included: look closer.
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.ZombieProcess, PermissionError):
            continue
    return False


def stop_process_group(
    pid: int,
    *,
    grace_s: float = STOP_GRACE_S,
    reap: bool = True,
    poll_s: float = 0.1,
) -> bool:
    """SIGTERM the process group led by ``pid``, SIGKILL it after ``grace_s``; True if anything was signalled.

    The engine was started with ``start_new_session=True``, so its group id is its pid and the
    group holds it and any children. ``reap``: also ``waitpid`` the leader when it is our child
    (else it stays a zombie). Blocks up to ``grace_s`` plus a moment; run it in a thread from
    async code.
    """
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if reap:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        if not _group_alive(pid):
            return True
        time.sleep(poll_s)
    log.warning("engine pid %d did not exit %.0f s after SIGTERM; sending SIGKILL", pid, grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    end = time.monotonic() + 5.0
    while time.monotonic() < end:
        if reap:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        if not _group_alive(pid):
            break
        time.sleep(poll_s)
    return True


def stop_all_engines(agent_state: Path, *, grace_s: float = STOP_GRACE_S) -> list[int]:
    """Stop every recorded engine that is still the process it was; returns the pids stopped.

    Every record is removed afterwards, matched or not. Used by ``llmgw service stop agent
    --engines`` and by tests to guarantee no engine is left. Records of another process (pid
    reused) are dropped without signalling anything.
    """
    stopped = []
    for record in load_records(agent_state):
        if live_process(record) is not None and stop_process_group(record.pid, grace_s=grace_s):
            stopped.append(record.pid)
        drop_record(agent_state, record.id)
    return stopped
