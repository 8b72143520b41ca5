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
import stat
from pathlib import Path


def rotated(path: Path, keep: int) -> list[Path]:
    """``[path.1, …, path.keep]`` that exist, newest first."""
    return [p for i in range(1, keep + 1) if (p := path.with_name(f"{path.name}.{i}")).exists()]


def rotate(path: Path, *, max_bytes: int, keep: int, inode: tuple[int, int] | None = None) -> bool:
    """Copy-truncate ``path`` when it is larger than ``max_bytes``; True when it rotated.

    No symbolic link is followed, nothing but a regular file is read or truncated, and ``path.1`` is
    made afresh (``O_EXCL``): the rotation may run as root in a directory another user can reach (a
    supervisor's, whose parent is the service user's), and a planted ``NAME.log.1`` link made root
    write wherever it pointed (a new user's finding). ``inode`` (device, inode): rotate only the file
    the caller has open, not one put in its place.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size <= max_bytes:
        return False
    if inode is not None and (st.st_dev, st.st_ino) != inode:
        return False
    with contextlib.suppress(FileNotFoundError):
        path.with_name(f"{path.name}.{keep}").unlink()  # unlink never follows a link
    for i in range(keep - 1, 0, -1):
        src = path.with_name(f"{path.name}.{i}")
        with contextlib.suppress(FileNotFoundError):
            src.rename(path.with_name(f"{path.name}.{i + 1}"))  # a link is moved as a link
    first = path.with_name(f"{path.name}.1")
    with contextlib.suppress(FileNotFoundError):
        first.unlink()
    src_fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        opened = os.fstat(src_fd)
        if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            return False
        dst_fd = os.open(first, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         stat.S_IMODE(st.st_mode))  # as private as the log
        with os.fdopen(dst_fd, "wb") as dst, os.fdopen(os.dup(src_fd), "rb") as src_file:
            shutil.copyfileobj(src_file, dst)
        # truncated through a descriptor of the very file copied, opened for writing without a link
        with contextlib.suppress(FileNotFoundError):
            w = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                now = os.fstat(w)
                if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                    os.ftruncate(w, 0)
            finally:
                os.close(w)
    finally:
        os.close(src_fd)
    return True
