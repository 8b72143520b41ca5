"""Copy-truncate rotation of a log that another process holds open ``O_APPEND``: an engine's log
(:mod:`llmgw.agent.node.logs`) and a supervised service's (:mod:`llmgw.service.supervisor`).

The writer keeps its descriptor: :func:`rotate` renames ``log.(N-1)`` to ``log.N``, copies ``log``
to ``log.1`` and truncates ``log`` to 0, and with ``O_APPEND`` the writer's next line lands at
the new end. Lines written between the copy and the truncate are lost (a window of microseconds
per rotation); that is the price of not owning the writer's pipe (logrotate's ``copytruncate``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path


def rotated(path: Path, keep: int) -> list[Path]:
    """``[path.1, …, path.keep]`` that exist, newest first."""
    return [p for i in range(1, keep + 1) if (p := path.with_name(f"{path.name}.{i}")).exists()]


def rotate(path: Path, *, max_bytes: int, keep: int) -> bool:
    """Copy-truncate ``path`` when it is larger than ``max_bytes``; True when it rotated."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    oldest = path.with_name(f"{path.name}.{keep}")
    oldest.unlink(missing_ok=True)
    for i in range(keep - 1, 0, -1):
        src = path.with_name(f"{path.name}.{i}")
        if src.exists():
            src.rename(path.with_name(f"{path.name}.{i + 1}"))
    shutil.copyfile(path, path.with_name(f"{path.name}.1"))
    os.chmod(path.with_name(f"{path.name}.1"), path.stat().st_mode & 0o777)  # as private as the log
    with contextlib.suppress(FileNotFoundError):
        os.truncate(path, 0)
    return True
