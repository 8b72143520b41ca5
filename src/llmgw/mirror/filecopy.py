"""Copying a local file into the mirror's store (a ``file:`` source, ``llmgw mirror add``): hashed while
copied, through a hidden partial name, fsynced and renamed, never through a symbolic link the store's
owner planted, and given to the store's owner from the moment it has a name (:func:`copy_into`). The
seam :mod:`llmgw.mirror.fetch` is split along: there, what a fetch does and in which order; here, the
file system work of one copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import pathlib
from collections.abc import Callable
from typing import BinaryIO

from llmgw.errors import MirrorError
from llmgw.mirror.download import CHUNK_BYTES, no_space, partial_path


async def copy_into(
    src: pathlib.Path,
    dest: pathlib.Path,
    progress: Callable[[int, int | None], None],
    opener: Callable[[pathlib.Path], int],
    *,
    owner: tuple[int, int] | None = None,
) -> str:
    """Copy ``src`` (opened by ``opener``, which returns a file descriptor and raises
    :class:`~llmgw.errors.SourceRefused` or OSError) to ``dest`` via a hidden partial name,
    hashing as it goes; return the sha256. ``owner`` (uid, gid; needs root) is given the partial
    file as soon as it is made, so ``dest`` is the owner's from the moment it has its name; a
    chown refused is a :class:`~llmgw.errors.MirrorError` naming the file (the partial file is
    deleted).

    Files are opened on the loop (a few quick syscalls): opened in a worker thread, they would
    leak when the fetch is cancelled meanwhile. Reading, hashing and writing run in a thread.
    """
    try:
        fin = os.fdopen(opener(src), "rb")
    except OSError as e:
        raise MirrorError(
            f"file:{src} cannot be read on the mirror's machine ({e.strerror}); copy the file there first"
        ) from e
    part = partial_path(dest)
    sha = hashlib.sha256()
    done = 0
    try:
        vdir = _open_below(dest.parent, levels=2)
    except OSError as e:
        fin.close()
        raise MirrorError(f"cannot open {dest.parent} without following a symbolic link: {e.strerror or e}; "
                          "the store holds real directories only (remove what is there)") from e
    try:
        try:
            # Never through a symlink the store's owner planted (a root 'mirror add' wrote through one
            # and gave the target away: a new user's finding): opened below the version directory's fd.
            try:
                fout = os.fdopen(os.open(part.name, _PART_FLAGS, 0o644, dir_fd=vdir), "wb")
            except BaseException:
                fin.close()
                raise
            with fin, fout:
                if owner is not None:
                    _give(fout, part, owner)
                size = os.fstat(fin.fileno()).st_size
                progress(0, size)
                while n := await asyncio.to_thread(_copy_step, fin, fout, sha):
                    done += n
                    progress(done, size)
                await asyncio.to_thread(_sync, fout)
        except OSError as e:
            _unlink_below(vdir, part.name)
            if e.errno == errno.ENOSPC:
                raise no_space(dest.parent, f"copying {src} (the disk filled after {done} bytes)", None) from e
            if e.errno == errno.ELOOP:
                raise MirrorError(f"{part} is a symbolic link; the mirror never writes through one (remove it)") from e
            raise
        except BaseException:
            _unlink_below(vdir, part.name)
            raise
        os.replace(part.name, dest.name, src_dir_fd=vdir, dst_dir_fd=vdir)
        os.fsync(vdir)
    finally:
        os.close(vdir)
    return sha.hexdigest()


#: The partial file of a copy: created or truncated, never through a symlink.
_PART_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_below(vdir: pathlib.Path, *, levels: int) -> int:
    """A descriptor of ``vdir``, its last ``levels`` components (model and version) each opened without
    following a symbolic link, below its ancestor's (the store's root). Raises OSError (ELOOP, ENOTDIR)."""
    fd = os.open(vdir.parents[levels - 1], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in vdir.parts[-levels:]:
            below = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlink_below(dir_fd: int, name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


def _give(fh: BinaryIO, path: pathlib.Path, owner: tuple[int, int]) -> None:
    """chown the open file ``fh`` (at ``path``) to ``owner``; MirrorError naming it when refused."""
    try:
        os.fchown(fh.fileno(), *owner)
    except OSError as e:
        raise MirrorError(
            f"cannot give {path} to uid {owner[0]} gid {owner[1]}, the owner of the store: {e.strerror or e}; "
            "where root may not chown there (NFS with root_squash), copy it as that user"
        ) from e


def _copy_step(fin: BinaryIO, fout: BinaryIO, sha: hashlib._Hash) -> int:
    block = fin.read(CHUNK_BYTES)
    if block:
        sha.update(block)
        fout.write(block)
    return len(block)


def _sync(fh: BinaryIO) -> None:
    fh.flush()
    os.fsync(fh.fileno())
