"""The mirror's store on disk: ``<dir>/<model>/<version>/<file>`` plus ``manifest.json`` beside it.

- The manifest is the truth about a file: only ``state: present`` files are served, so bytes that
  are still arriving (or a file someone dropped in by hand) never reach a node.
- Partial bytes live under a hidden name (``.<file>.partial``) that no request can name, and are
  renamed onto ``<file>`` only when whole and verified.
- What root writes into a store another user owns (``llmgw mirror add`` with sudo, into the
  store ``server init`` gave the mirror's user) is given to that owner (:func:`store_owner`)
  before it gets its name: directories are made under a hidden name, given and renamed into
  place; files are given while still hidden (temp or partial names). The mirror, running as that
  user, can then replace and delete all of it, and a crash leaves nothing of root's in view.
- Manifests are written atomically (temp file, ``os.replace``); state changes are fsynced, progress
  updates are not (losing the last second of progress in a crash costs nothing: the download
  resumes from the partial file's length, not from the manifest).
- :meth:`Store.servable` resolves a request to a path only when every segment is a plain name,
  the manifest says ``present`` for exactly that file, and that file is a regular file (not a
  symlink, device or FIFO) of the manifest's size. Nothing else in the store is ever served: not
  the manifest, not a partial file, not a file dropped beside the listed one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import pathlib
import stat
import tempfile

from pydantic import ValidationError

from llmgw.atomicfile import write_atomic
from llmgw.mirror.models import MANIFEST, NAME_RE, Manifest

log = logging.getLogger(__name__)

#: A version directory's fetch lock (:meth:`Store.claim`): held by the process copying or downloading
#: into it, so another can tell a live fetch from one whose process died (a name no file may have:
#: names start with a letter or digit).
LOCK = ".fetch.lock"


class Store:
    """The files under one mirror directory.

    Args:
        root: the store directory (``--dir``); created if missing.
        owner: ``(uid, gid)`` every directory and manifest this object makes is given (needs root;
            :func:`store_owner`); None: they are this process's.
    """

    def __init__(self, root: pathlib.Path, *, owner: tuple[int, int] | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root.resolve()
        self.owner = owner

    def version_dir(self, model: str, version: str) -> pathlib.Path:
        """``<root>/<model>/<version>``; names are checked by the caller (FetchRequest)."""
        return self.root / model / version

    def make_version_dir(self, model: str, version: str) -> pathlib.Path:
        """Make ``<root>/<model>/<version>`` where missing and return it.

        With an ``owner``, each missing level is made under a hidden name, given to the owner and
        renamed into place, so a crash leaves no directory of this process's under a served name.

        Raises:
            OSError: a directory cannot be made, or given to the owner (chown refused).
        """
        vdir = self.version_dir(model, version)
        if self.owner is None:
            vdir.mkdir(parents=True, exist_ok=True)
            return vdir
        for d in (vdir.parent, vdir):
            if d.is_symlink():  # the store's owner could point a level anywhere root may write
                raise OSError(errno.ELOOP, "a symbolic link where the store holds a directory", str(d))
            if not d.is_dir():
                _make_owned_dir(d, self.owner)
        return vdir

    def manifest_path(self, model: str, version: str) -> pathlib.Path:
        return self.version_dir(model, version) / MANIFEST

    def read(self, model: str, version: str) -> Manifest | None:
        """The manifest of ``model/version``, or None when there is none or it is unreadable."""
        path = self.manifest_path(model, version)
        try:
            return Manifest.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValidationError) as e:
            log.warning("ignoring unreadable manifest %s: %s", path, e)
            return None

    def write(self, model: str, version: str, manifest: Manifest, *, durable: bool) -> None:
        """Replace the manifest atomically; ``durable`` fsyncs it and its directory (state changes).

        Raises:
            OSError: the directory cannot be written, or the manifest or a directory made for it
                cannot be given to ``owner`` (the caller reports it).
        """
        vdir = self.make_version_dir(model, version)
        write_atomic(
            vdir / MANIFEST, manifest.model_dump_json(indent=2) + "\n", 0o644, durable=durable, owner=self.owner
        )

    def claim(self, model: str, version: str) -> int | None:
        """Take ``model/version``'s fetch lock (``flock`` on ``<version dir>/.fetch.lock``, made 0644:
        any user may open it to test or take it; the owner of the directory may delete it), for as
        long as a fetch into it runs: the descriptor (:meth:`release` it), or None when another process
        holds it (a ``llmgw mirror add`` copying, or the mirror).

        Raises:
            OSError: the lock file cannot be made or opened (its version directory is missing).
        """
        lock = self.version_dir(model, version) / LOCK
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self, model: str, version: str, fd: int) -> None:
        """Let go of a lock :meth:`claim` took, and remove its file (nothing is left behind a fetch)."""
        with contextlib.suppress(OSError):
            (self.version_dir(model, version) / LOCK).unlink()
        os.close(fd)

    def claimed_elsewhere(self, model: str, version: str) -> bool:
        """Whether another process holds ``model/version``'s fetch lock (:meth:`claim`) now."""
        try:
            fd = os.open(self.version_dir(model, version) / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False  # no lock file: nothing ever fetched here while locking, or it is gone
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def all(self) -> list[tuple[str, str, Manifest]]:
        """Every ``(model, version, manifest)`` in the store, sorted by model then version."""
        out: list[tuple[str, str, Manifest]] = []
        for path in sorted(self.root.glob(f"*/*/{MANIFEST}")):
            model, version = path.parent.parent.name, path.parent.name
            if not (NAME_RE.fullmatch(model) and NAME_RE.fullmatch(version)):
                continue
            if (m := self.read(model, version)) is not None:
                out.append((model, version, m))
        return out

    def fetching(self, model: str, version: str, file: str) -> tuple[int, int | None] | None:
        """``(bytes_done, bytes_total)`` when ``model/version/file`` is being fetched, else None."""
        if not all(NAME_RE.fullmatch(s) for s in (model, version, file)) or file == MANIFEST:
            return None
        manifest = self.read(model, version)
        if manifest is None or manifest.state != "fetching" or manifest.file != file:
            return None
        return manifest.bytes_done, manifest.bytes_total

    def servable(self, model: str, version: str, file: str) -> tuple[pathlib.Path, Manifest] | None:
        """The real path and manifest of a file nodes may GET, or None (the server answers 404).

        None when a segment is not a plain name (``..``, an encoded slash, a hidden partial file),
        when the manifest is missing or not ``present`` or names another file, when the file is
        missing, a symlink (wherever it points, or in a symlinked directory) or not a regular
        file, or when its size is not the manifest's.
        """
        if not all(NAME_RE.fullmatch(s) for s in (model, version, file)) or file == MANIFEST:
            return None
        manifest = self.read(model, version)
        if manifest is None or manifest.state != "present" or manifest.file != file:
            return None
        path = self.version_dir(model, version) / file
        with contextlib.suppress(OSError):
            st = path.lstat()
            in_place = path.parent.resolve(strict=True) == path.parent  # no symlinked directory
            if in_place and stat.S_ISREG(st.st_mode) and manifest.size in (None, st.st_size):
                return path, manifest
        return None


def store_owner(root: pathlib.Path) -> tuple[int, int] | None:
    """The ``(uid, gid)`` to give what this process writes into the store ``root``: the store
    directory's own, when this process is root and the store belongs to another user or group
    (``server init`` gives it to the mirror's user, which runs the mirror and must be able to
    replace and delete what is added). None when not root (nothing changes: the files are this
    user's), when the store is root's own, or when it does not exist yet.
    """
    if os.geteuid() != 0:
        return None
    try:
        st = root.stat()
    except OSError:
        return None
    ids = (st.st_uid, st.st_gid)
    return None if ids == (os.geteuid(), os.getegid()) else ids


def _make_owned_dir(path: pathlib.Path, owner: tuple[int, int]) -> None:
    """Make the directory ``path`` (mode 0755; its parent exists) owned by ``owner`` from the moment
    it has its name: made under a hidden temp name, given through a descriptor (a name swapped for
    a symlink meanwhile is not followed), renamed into place. Another process making ``path``
    meanwhile wins; ours is removed.

    Raises:
        OSError: it cannot be made or given (chown refused); the temp directory is removed.
    """
    tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, 0o755)
            os.fchown(fd, *owner)
        except OSError as e:
            e.filename = e.filename or str(path)
            raise
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.rmdir()
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY) and path.is_dir():
            return
        raise
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.rmdir()
        raise
