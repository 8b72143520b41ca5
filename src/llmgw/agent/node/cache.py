"""The node's model cache: weights fetched from the mirror once, verified, reused by every start.

Layout: ``<agent_state>/cache/<model>/<version>/<file>``, and beside each file
``.<file>.sha256`` holding ``<sha256> <size> <mtime_ns>``: a file whose size and mtime still
match its digest record is not rehashed on every start (a 70 GB file takes minutes to hash).

:meth:`NodeCache.ensure`, in order:

1. The file is there and its digest record matches its size and mtime → its recorded digest is
   compared with the spec's (when the spec has one) → reused.
2. The file is there without a (matching) record and the spec has a digest → hashed once; equal
   → recorded and reused.
3. Otherwise :func:`llmgw.mirror.download.download` fetches it (resuming a partial file, verifying
   the spec's sha256 or the mirror's ``X-Checksum-Sha256``) and its digest is recorded.

Two replicas of one file wait on one download (a lock per path). When ``cache_max_gb`` is set,
least recently used files (by the record's mtime, touched on each use) are evicted after a
download until the cache fits, never a file in use or the one just fetched. Not guaranteed: a
file changed in place with the same size and mtime is not noticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import urllib.parse
from pathlib import Path

import aiohttp

from llmgw.errors import MirrorError
from llmgw.mirror.download import download
from llmgw.mirror.refusing import refusing_connector
from llmgw.protocol import ReplicaSpec
from llmgw.sourcecheck import LINK_LOCAL_FIX, Address, link_local

log = logging.getLogger(__name__)

HASH_CHUNK = 1 << 20


def _safe_part(value: str, what: str) -> str:
    if not value or value in {".", ".."} or "/" in value or "\\" in value or "\0" in value:
        raise MirrorError(f"replica {what} {value!r} cannot be a file name in the node cache")
    return value


#: Seconds a source's host may take to resolve before the download goes ahead (and reports it).
RESOLVE_TIMEOUT_S = 5.0


async def refuse_link_local(url: str) -> None:
    """Refuse ``url`` when its host is, or resolves to, a link-local address (:func:`llmgw.sourcecheck.link_local`:
    a cloud's metadata service; the control plane refuses a literal one at add, a name is only known
    here). A host that does not resolve within :data:`RESOLVE_TIMEOUT_S` passes: the download says why.

    Raises:
        MirrorError: naming the URL, the host and the address.
    """
    host = urllib.parse.urlsplit(url).hostname or ""
    addresses = [host]
    if link_local(host) is None:
        try:
            infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, None), RESOLVE_TIMEOUT_S)
        except (OSError, TimeoutError):
            infos = []
        addresses = [str(info[4][0]) for info in infos]
    for address in addresses:
        if (ip := link_local(address)) is not None:
            named = f"{ip} is" if address == host else f"{host} resolves to {ip},"
            raise MirrorError(f"{url}: {named} a link-local address: {LINK_LOCAL_FIX}")


def _link_local_refusal(ip: Address) -> str:
    return "a link-local address" if link_local(str(ip)) is not None else ""


def _link_local_message(host: str, ip: Address, why: str) -> str:
    named = f"{ip} is" if host == str(ip) else f"{host} resolves to {ip},"
    return f"{named} {why}: {LINK_LOCAL_FIX}"


def link_local_connector() -> aiohttp.TCPConnector:
    """The connector of the agent's downloads: it never connects to a link-local address, checked as
    each connection is made (:func:`~llmgw.mirror.refusing.refusing_connector`), so neither a DNS
    answer that changes after :func:`refuse_link_local` nor a redirect reaches a cloud's metadata
    service."""
    return refusing_connector(_link_local_refusal, _link_local_message)


def sha256_file(path: Path) -> str:
    """The sha256 (hex) of a file, read in 1 MiB blocks (blocking)."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(HASH_CHUNK):
            h.update(block)
    return h.hexdigest()


def digest_record_path(path: Path) -> Path:
    """Where the digest of ``path`` is recorded: ``.<name>.sha256`` beside it."""
    return path.parent / f".{path.name}.sha256"


def recorded_digest(path: Path) -> str:
    """The recorded sha256 of ``path`` if the record still matches its size and mtime, else ``""``."""
    try:
        digest, size, mtime_ns = digest_record_path(path).read_text().split()
        st = path.stat()
    except (OSError, ValueError):
        return ""
    if int(size) != st.st_size or int(mtime_ns) != st.st_mtime_ns:
        return ""
    return digest


def record_digest(path: Path, digest: str) -> None:
    """Record ``digest`` for ``path`` with its current size and mtime."""
    st = path.stat()
    digest_record_path(path).write_text(f"{digest} {st.st_size} {st.st_mtime_ns}\n")


class NodeCache:
    """Weights on this node, under ``root`` (``<agent_state>/cache``).

    Args:
        root: the cache directory.
        max_bytes: evict least recently used files past this total; None keeps everything.
    """

    def __init__(self, root: Path, *, max_bytes: int | None = None) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._locks: dict[Path, asyncio.Lock] = {}
        self.in_use: set[Path] = set()

    def path_for(self, spec: ReplicaSpec) -> Path:
        """``<root>/<model>/<version>/<file>`` for a spec.

        Raises:
            MirrorError: a part is not a plain file name (``..``, a slash).
        """
        return (
            self.root
            / _safe_part(spec.model, "model")
            / _safe_part(spec.version, "version")
            / _safe_part(spec.file_name, "file name")
        )

    async def ensure(self, session: aiohttp.ClientSession, spec: ReplicaSpec) -> Path:
        """The local path of the spec's weights, fetched and verified if needed; bytes already cached
        under another model or version with the spec's sha256 are linked, not fetched again.

        Raises:
            MirrorError: the download failed or the digest does not match (message names the URL);
                the URL's host is or resolves to a link-local address (:func:`refuse_link_local`).
        """
        path = self.path_for(spec)
        lock = self._locks.setdefault(path, asyncio.Lock())
        async with lock:
            want = spec.sha256.lower()
            have = await asyncio.to_thread(self._present_digest, path, want)
            if have and (not want or have == want):
                log.info("cache: %s is present (sha256 %s), reused", path, have[:12])
            elif want and (same := await asyncio.to_thread(self._linked_copy, path, want)) is not None:
                log.info("cache: %s holds the same bytes (sha256 %s): linked as %s, not fetched again",
                         same, want[:12], path)
            else:
                await refuse_link_local(spec.source_url)
                log.info("cache: fetching %s into %s", spec.source_url, path)
                made = [d for d in (path.parent.parent, path.parent) if not d.exists()]
                path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    digest = await download(session, spec.source_url, path, expected_sha256=want)
                except BaseException:
                    for d in reversed(made):  # a failed first fetch leaves no empty directories
                        with contextlib.suppress(OSError):
                            d.rmdir()
                    raise
                await asyncio.to_thread(record_digest, path, digest)
                log.info("cache: %s fetched (sha256 %s)", path, digest[:12])
            with contextlib.suppress(OSError):
                os.utime(digest_record_path(path))  # last use, for eviction
            self.in_use.add(path)
            if self.max_bytes is not None:
                await asyncio.to_thread(self.evict, keep={path})
            return path

    def release(self, path: Path) -> None:
        """Mark ``path`` as no longer used by a running replica (eviction may take it)."""
        self.in_use.discard(path)

    def _linked_copy(self, path: Path, want: str) -> Path | None:
        """Give ``path`` the bytes of a cached file whose recorded sha256 is ``want`` (another model
        or version with the same weights: a node held three 242 MB copies of one mirror file under
        three model names, a new user's finding), as a hard link (no copy, no disk); the file linked,
        or None when none is cached (or it cannot be linked: another filesystem)."""
        for rec in self.root.glob("*/*/.*.sha256"):
            have = rec.parent / rec.name[1 : -len(".sha256")]
            if have == path or recorded_digest(have) != want:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                path.unlink(missing_ok=True)  # a stale file of that name (its digest did not match)
                os.link(have, path)
            except OSError:
                return None
            record_digest(path, want)
            return have
        return None

    @staticmethod
    def _present_digest(path: Path, want: str) -> str:
        if not path.is_file():
            return ""
        digest = recorded_digest(path)
        if digest or not want:
            # No spec digest and no record: cannot tell a whole file from a stale one; fetch again.
            return digest
        digest = sha256_file(path)
        record_digest(path, digest)
        return digest

    def evict(self, keep: set[Path]) -> list[Path]:
        """Delete least recently used files until the cache fits ``max_bytes``; returns what went.
        Names linked to one file (the same weights under two models: :meth:`_linked_copy`) count
        its bytes once, and deleting one of them frees them only when it was the last."""
        if self.max_bytes is None:
            return []
        files = []
        names: dict[tuple[int, int], int] = {}  # (device, inode) -> names of it in the cache
        total = 0
        for rec in self.root.glob("*/*/.*.sha256"):
            f = rec.parent / rec.name[1 : -len(".sha256")]
            try:
                st, used = f.stat(), rec.stat().st_mtime
            except OSError:
                continue
            inode = (st.st_dev, st.st_ino)
            if inode not in names:
                total += st.st_size
            names[inode] = names.get(inode, 0) + 1
            files.append((used, f, rec, st.st_size, inode))
        gone = []
        for _, f, rec, size, inode in sorted(files):
            if total <= self.max_bytes:
                break
            if f in keep or f in self.in_use:
                continue
            with contextlib.suppress(OSError):
                f.unlink()
                rec.unlink()
                names[inode] -= 1
                total -= size if names[inode] == 0 else 0
                gone.append(f)
                log.info("cache: evicted %s (%d bytes) to stay under %d", f, size, self.max_bytes)
        return gone
