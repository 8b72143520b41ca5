"""Engine logs: one file per replica, size-capped and rotated, readable as a tail.

The engine writes ``<agent_state>/replicas/<id>/engine.log`` itself, opened ``O_APPEND`` by the
agent and inherited as stdout/stderr: no pipe through the agent, so an agent that dies or
restarts never blocks or kills an engine with a full or broken pipe. Because the engine holds
the file open, rotation is *copy-truncate* (:func:`rotate`): ``engine.log.(N-1)`` → ``.N``, copy
``engine.log`` → ``engine.log.1``, truncate ``engine.log`` to 0; with ``O_APPEND`` the engine's
next write lands at the new end. Lines written between the copy and the truncate are lost (a
window of microseconds per :data:`MAX_BYTES`); that is the price of not owning the pipe.

The runner calls :func:`rotate` every watch interval; :func:`tail` reads the last lines across
the current file and the rotated ones; :func:`tail_after` those of the current launch.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmgw import logrotate

MAX_BYTES = 10 * 1024 * 1024
"""A log past this size is rotated (10 MiB: days of llama-server output at default verbosity)."""

KEEP = 3
"""Rotated files kept: ``engine.log.1`` … ``engine.log.3``."""


def rotated(path: Path, keep: int = KEEP) -> list[Path]:
    """``[path.1, …, path.keep]`` that exist, newest first."""
    return logrotate.rotated(path, keep)


def rotate(path: Path, *, max_bytes: int = MAX_BYTES, keep: int = KEEP) -> bool:
    """Copy-truncate ``path`` when it is larger than ``max_bytes`` (:func:`llmgw.logrotate.rotate`);
    True when it rotated."""
    return logrotate.rotate(path, max_bytes=max_bytes, keep=keep)


def tail(path: Path, lines: int = 100, *, keep: int = KEEP, max_read: int = 1 << 20) -> list[str]:
    """The last ``lines`` lines of the log, older rotated files first when the current one is short."""
    out: list[str] = []
    for p in [path, *rotated(path, keep)]:
        try:
            with p.open("rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(max(0, size - max_read))
                chunk = fh.read().decode("utf-8", "replace").splitlines()
        except FileNotFoundError:
            continue
        out = chunk + out
        if len(out) >= lines:
            break
    return out[-lines:] if lines > 0 else []


def tail_after(path: Path, offset: int = 0, lines: int = 50) -> str:
    """The last ``lines`` non-empty lines of ``path`` after byte ``offset`` (at most 64 KiB read),
    joined by newlines; ``""`` when it cannot be read. An offset past the end means the file was
    rotated: its last 64 KiB are read. (The runner's ``err`` tail of the current launch.)"""
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(offset if offset <= size else 0, size - 65536))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join([ln for ln in text.splitlines() if ln.strip()][-lines:])


def read_since(path: Path, offset: int, *, max_read: int = 1 << 20) -> tuple[str, int]:
    """What the log holds after byte ``offset`` (at most ``max_read`` bytes) and the offset to ask
    from next. A file shorter than ``offset`` was rotated: it is read from its start.

    Raises:
        FileNotFoundError: there is no log at ``path``.
    """
    with path.open("rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        start = offset if 0 <= offset <= size else 0
        fh.seek(start)
        data = fh.read(max_read)
    return data.decode("utf-8", "replace"), start + len(data)


def answer(path: Path, *, lines: int, offset: int | None) -> tuple[str, int, bool]:
    """A log request's answer: ``(text, next offset, found)``; the last ``lines`` lines when
    ``offset`` is None, else what follows ``offset`` (``llmgw ctl logs --follow``)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "", 0, False
    if offset is None:
        text = "\n".join(tail(path, lines))
        return (text + "\n" if text else ""), size, True
    text, nxt = read_since(path, offset)
    return text, nxt, True
