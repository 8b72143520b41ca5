"""Writing a file so a crash leaves the old one or the new one, never half of either.

Every file llmgw writes whole (configs, tokens, keys, certificates, manifests, replica records)
goes through :func:`write_atomic`: a temp file in the same directory, fsync, chmod, rename over the
target, fsync of the directory. Downloads, which are written over minutes, have their own
partial-file scheme (:mod:`llmgw.mirror.download`) ending in the same rename.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it survives a power cut (best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(
    path: Path, data: str | bytes, mode: int = 0o644, *, durable: bool = True, owner: tuple[int, int] | None = None
) -> None:
    """Replace ``path`` with ``data`` (str is UTF-8 encoded) at ``mode``, atomically.

    ``durable`` fsyncs the file and its directory; progress records that are rewritten every
    second pass False and accept losing the last one in a power cut. Parent directories are made.
    ``owner`` (uid, gid; needs root) is given the temp file before the rename, so the file has
    that owner from the moment it has its name.

    Raises:
        OSError: the directory cannot be written, or ``owner`` cannot be given the file (chown
            refused); nothing is left behind but what was there.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            if owner is not None:
                os.fchown(fh.fileno(), *owner)
            fh.write(data.encode() if isinstance(data, str) else data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)
