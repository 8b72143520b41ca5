"""Copy-truncate rotation (llmgw/logrotate.py) never writes through a symbolic link: it runs as root
in the supervisor's directory, whose parent the service user owns, so that user could put links
there (a new user's finding: a dangling ``NAME.log.1`` link made root write an 11 MB file of the
user's choosing wherever it pointed)."""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.logrotate import rotate


def _log(tmp_path: Path, size: int = 5000) -> Path:
    log = tmp_path / "server.log"
    log.write_bytes(b"x" * (size - 1) + b"\n")
    log.chmod(0o600)
    return log


def test_a_planted_link_is_moved_or_removed_never_written_through(tmp_path: Path) -> None:
    log = _log(tmp_path)
    victim = tmp_path / "victim"
    (tmp_path / "server.log.1").symlink_to(victim)  # dangling: exists() is False, so it was never moved
    (tmp_path / "server.log.3").symlink_to(tmp_path / "other-victim")
    assert rotate(log, max_bytes=1000, keep=3)
    assert not victim.exists()
    assert not (tmp_path / "other-victim").exists()
    first = tmp_path / "server.log.1"
    assert not first.is_symlink()
    assert first.read_bytes().endswith(b"\n")
    assert first.stat().st_size == 5000
    assert oct(first.stat().st_mode & 0o777) == oct(0o600)
    assert log.stat().st_size == 0
    assert (tmp_path / "server.log.2").is_symlink()  # the planted link, moved as a link


def test_a_log_that_is_a_link_or_another_file_is_not_rotated(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    real = _log(tmp_path / "a")
    link = tmp_path / "server.log"
    link.symlink_to(real)
    assert not rotate(link, max_bytes=1000, keep=3)  # a link in the log's place: left alone
    assert real.stat().st_size == 5000
    other = _log(tmp_path / "b")  # a directory swapped in: a file the caller does not hold open
    held = os.stat(real)
    assert not rotate(other, max_bytes=1000, keep=3, inode=(held.st_dev, held.st_ino))
    assert other.stat().st_size == 5000
    mine = os.stat(other)
    assert rotate(other, max_bytes=1000, keep=3, inode=(mine.st_dev, mine.st_ino))
    assert other.stat().st_size == 0
