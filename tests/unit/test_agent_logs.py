"""Engine log rotation (copy-truncate with an O_APPEND writer) and the tail across rotated files."""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.agent.node.logs import rotate, rotated, tail


def test_copy_truncate_keeps_n_and_the_writer_continues(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # as the engine holds it
    try:
        for round_ in range(5):
            os.write(fd, b"".join(f"r{round_} line {i}\n".encode() for i in range(20)))
            assert rotate(log, max_bytes=100, keep=3)
        os.write(fd, b"after\n")
    finally:
        os.close(fd)
    assert [p.name for p in rotated(log)] == ["engine.log.1", "engine.log.2", "engine.log.3"]
    assert log.read_bytes() == b"after\n"  # O_APPEND: written at the new end, no hole
    assert (tmp_path / "engine.log.1").read_text().startswith("r4 line 0")
    assert (tmp_path / "engine.log.3").read_text().startswith("r2 line 0")
    assert not (tmp_path / "engine.log.4").exists()
    assert tail(log, 3) == ["r4 line 18", "r4 line 19", "after"]
    assert not rotate(log, max_bytes=100)  # small: left alone
    assert not rotate(tmp_path / "missing.log")
