"""The mirror's store on disk: ``<dir>/<model>/<version>/<file>`` plus ``manifest.json`` beside it.

- The manifest is the truth about a file: only ``state: present`` files are served, so bytes that
  are still arriving (or a file someone dropped in by hand) never reach a node.
- Partial bytes live under a hidden name (``.<file>.partial``) that no request can name, and are
  renamed onto ``<file>`` only when whole and verified.
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
import logging
import pathlib
import stat

from pydantic import ValidationError

from llmgw.atomicfile import write_atomic
from llmgw.mirror.models import MANIFEST, NAME_RE, Manifest

log = logging.getLogger(__name__)


class Store:
    """The files under one mirror directory.

    Args:
        root: the store directory (``--dir``); created if missing.
    """

    def __init__(self, root: pathlib.Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root.resolve()

    def version_dir(self, model: str, version: str) -> pathlib.Path:
        """``<root>/<model>/<version>``; names are checked by the caller (FetchRequest)."""
        return self.root / model / version

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
            OSError: the directory cannot be written (the caller reports it).
        """
        vdir = self.version_dir(model, version)
        write_atomic(vdir / MANIFEST, manifest.model_dump_json(indent=2) + "\n", 0o644, durable=durable)

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
