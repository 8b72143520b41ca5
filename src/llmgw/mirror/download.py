"""Resumable, verified HTTP downloads: the one way llmgw pulls bytes over HTTP.

Mechanism, in order:

1. Bytes land in ``dest.parent / ".{dest.name}.partial"``, never at ``dest``. When a partial file is
   already there (an earlier run was cut), its bytes are hashed first and the download continues
   from its end with ``Range: bytes=N-``.
2. Each response is streamed to the partial file while the sha256 is computed over the same
   chunks, so a multi-gigabyte file is read once. Writing and hashing run in a worker thread
   (both release the GIL), so the event loop keeps serving while a download runs.
3. Connection errors, cut bodies, timeouts and 5xx answers are retried up to ``retries`` times with
   growing pauses, each try resuming where the file ends. A 503 with ``Retry-After`` (the mirror
   saying the file is still arriving there) is waited out instead, for up to ``busy_wait_s`` in
   all, without using up a retry. A server that ignores ``Range`` (200
   instead of 206) or answers for another offset starts the file over. 4xx is final.
4. The digest is checked against ``expected_sha256``, else against the server's
   ``X-Checksum-Sha256`` header when it sends one (the llmgw mirror does). A mismatch deletes the
   partial file: resuming a wrong file would only make it wrong again.
5. The file is fsynced, renamed onto ``dest`` with ``os.replace`` (atomic on one filesystem) and the
   directory fsynced, so after a crash ``dest`` is either absent or whole.

It does not guarantee that a server which changes the file between two tries is noticed, unless a
digest is known (expected or sent); the mirror always knows one.

A disk that fills while writing (``ENOSPC``) ends the download with :class:`NoSpaceError` and
deletes the partial file: the space goes back at once and no half file is left for anyone to see.

Errors: :class:`~llmgw.errors.MirrorError` for a final HTTP status, retries used up, a digest
mismatch, a connection the session's policy refused (:class:`RefusedConnection`, never retried),
or a local write failure; each names the URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import pathlib
import re
import shutil
from collections.abc import Callable
from typing import BinaryIO

import aiohttp

from llmgw.atomicfile import fsync_dir
from llmgw.errors import MirrorError, NoSpaceError

CHECKSUM_HEADER = "X-Checksum-Sha256"
"""Response header carrying the file's sha256 (hex); the mirror sends it, and it is verified."""

CHUNK_BYTES = 1 << 20
"""Bytes per read/hash/write step: 1 MiB keeps thread hand-offs rare and memory flat."""

BACKOFF_S = (0.2, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Pause before retry 1, 2, …; the last repeats. Short first: a cut connection usually resumes at once."""

TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
"""No overall limit (a 70 GB file takes long); a connection that stays silent 120 s is retried."""

_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
_UNSATISFIED_RANGE = re.compile(r"bytes\s+\*/(\d+)")


def no_space(directory: pathlib.Path, what: str, needed: int | None) -> NoSpaceError:
    """A :class:`NoSpaceError` naming ``what``, the bytes ``needed`` (when known) and the bytes free."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = 0
    need = f"needs {needed} more bytes" if needed is not None else "did not fit"
    return NoSpaceError(
        f"{what} {need} but {directory} has {free} bytes free; free some space there "
        "(or give the mirror another --dir) and ask again"
    )


class RefusedConnection(OSError):
    """A connection a policy refused before it was made (the mirror's private-address rule).

    Raised from a resolver or socket factory; :func:`download` fails at once with its message
    instead of retrying, since asking again meets the same rule.
    """


class _Retry(Exception):
    """One try failed in a way the next try may fix."""


class _Busy(Exception):
    """The server asked to come back after ``after_s`` seconds (503 with Retry-After)."""

    def __init__(self, message: str, after_s: float) -> None:
        super().__init__(message)
        self.after_s = after_s


def partial_path(dest: pathlib.Path) -> pathlib.Path:
    """Where the bytes of ``dest`` gather until they are whole and verified."""
    return dest.parent / f".{dest.name}.partial"


class _Partial:
    """The open partial file, its length and the sha256 of its bytes so far."""

    def __init__(self, path: pathlib.Path, fh: BinaryIO) -> None:
        self.path = path
        self.fh = fh
        self.sha = hashlib.sha256()
        self.done = 0

    @classmethod
    def open(cls, path: pathlib.Path) -> _Partial:
        """Open (or create) the partial file. Opening is one quick syscall, done on the loop: a
        file opened in a worker thread would leak if the download were cancelled meanwhile."""
        path.parent.mkdir(parents=True, exist_ok=True)
        return cls(path, open(path, "a+b"))  # lives across tries; closed by close()

    def hash_existing(self) -> None:
        """Hash the bytes an earlier run left (blocking: run in a worker thread)."""
        self.fh.seek(0)
        while block := self.fh.read(CHUNK_BYTES):
            self.sha.update(block)
            self.done += len(block)

    def restart(self) -> None:
        """Throw the bytes away: the server will send the file from its start."""
        self.fh.truncate(0)
        self.sha = hashlib.sha256()
        self.done = 0

    def absorb(self, chunk: bytes) -> None:
        """Append ``chunk`` and add it to the digest (run in a worker thread)."""
        self.fh.write(chunk)  # "a+b": every write appends
        self.sha.update(chunk)
        self.done += len(chunk)

    def finish(self) -> None:
        """Flush and fsync, so the rename that follows publishes bytes that are on disk."""
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def close(self) -> None:
        self.fh.close()


async def download(
    session: aiohttp.ClientSession,
    url: str,
    dest: pathlib.Path,
    *,
    expected_sha256: str = "",
    headers: dict[str, str] | None = None,
    progress: Callable[[int, int | None], None] | None = None,
    retries: int = 5,
    busy_wait_s: float = 6 * 3600,
) -> str:
    """Download ``url`` to ``dest``, resuming a partial file, and return the file's sha256 (hex).

    Args:
        session: the aiohttp session to use (the caller owns it and its connection pool).
        url: an ``http://`` or ``https://`` URL.
        dest: the final path; its parent is created. A half-written file is never at ``dest``.
        expected_sha256: hex digest the file must have; empty to trust the server's
            ``X-Checksum-Sha256`` header when it sends one, else accept what arrives.
        headers: extra request headers (for example ``Authorization`` for Hugging Face).
        progress: called as ``progress(bytes_done, bytes_total_or_None)`` after each chunk.
        retries: how many more tries after the first, on connection errors, cut bodies and 5xx.
        busy_wait_s: how long in all to keep waiting on 503 + ``Retry-After`` answers (a mirror
            still downloading the file); default 6 h, about a 70 GB file at 25 MB/s.

    Raises:
        MirrorError: a 4xx answer, retries used up, the digest does not match (the partial file is
            deleted), or the file cannot be written. A partial file that got no byte is not kept.
    """
    try:
        part = _Partial.open(partial_path(dest))
    except OSError as e:
        raise MirrorError(f"cannot write {partial_path(dest)} for {url}: {e}") from e
    server_sha = ""
    try:
        try:
            await asyncio.to_thread(part.hash_existing)
        except OSError as e:
            raise MirrorError(f"cannot read {part.path} for {url}: {e}") from e
        attempt = 0
        busy_until: float | None = None
        while True:
            try:
                server_sha = await _one_try(session, url, part, headers or {}, progress) or server_sha
                break
            except _Busy as e:
                now = asyncio.get_running_loop().time()
                busy_until = now + busy_wait_s if busy_until is None else busy_until
                if now >= busy_until:
                    raise MirrorError(f"{url} was still busy after {busy_wait_s:.0f} s: {e}") from e
                await asyncio.sleep(min(e.after_s, busy_until - now))
            except _Retry as e:
                attempt += 1
                if attempt > retries:
                    raise MirrorError(
                        f"downloading {url} failed after {attempt} tries: {e.__cause__ or e}; "
                        f"{part.done} bytes are kept in {part.path} and the next try resumes there"
                    ) from e
                await asyncio.sleep(BACKOFF_S[min(attempt - 1, len(BACKOFF_S) - 1)])
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    part.close()
                    part.path.unlink(missing_ok=True)
                    raise no_space(
                        dest.parent, f"{url} (the disk filled after {part.done} bytes; partial file deleted)",
                        None,
                    ) from e
                raise MirrorError(f"cannot write {part.path} for {url}: {e}") from e
        digest = part.sha.hexdigest()
        want = (expected_sha256 or server_sha).lower()
        if want and want != digest:
            part.close()
            part.path.unlink(missing_ok=True)
            source = "expected" if expected_sha256 else f"the server's {CHECKSUM_HEADER}"
            raise MirrorError(
                f"{url}: downloaded {part.done} bytes with sha256 {digest}, but {source} is {want}; "
                "the partial file was deleted, so the next try starts over"
            )
        try:
            await asyncio.to_thread(part.finish)
            part.close()
            os.replace(part.path, dest)
            fsync_dir(dest.parent)
        except OSError as e:
            raise MirrorError(f"cannot move {part.path} to {dest}: {e}") from e
        return digest
    finally:
        part.close()
        if part.done == 0:  # nothing arrived (refused, a 4xx, no answer): no empty file left behind
            with contextlib.suppress(OSError):
                part.path.unlink(missing_ok=True)


async def _one_try(
    session: aiohttp.ClientSession,
    url: str,
    part: _Partial,
    headers: dict[str, str],
    progress: Callable[[int, int | None], None] | None,
) -> str:
    """One request from ``part.done`` onwards; returns the server's sha256 header or ``""``."""
    # identity: a compressed body would make Content-Length disagree with the bytes on disk.
    req = {"Accept-Encoding": "identity", **headers}
    if part.done:
        req["Range"] = f"bytes={part.done}-"
    try:
        async with session.get(url, headers=req, timeout=TIMEOUT) as resp:
            server_sha = resp.headers.get(CHECKSUM_HEADER, "").strip().lower()
            if resp.status == 416 and part.done:
                # The partial file may already be whole: the server says how long the file is.
                m = _UNSATISFIED_RANGE.match(resp.headers.get("Content-Range", ""))
                if m and int(m.group(1)) == part.done:
                    return server_sha
                await asyncio.to_thread(part.restart)
                raise _Retry(f"{url} refused the range from byte {part.done}; starting over")
            if resp.status == 503 and (after := _retry_after(resp)) is not None:
                text = (await resp.text()).strip()[:200]
                raise _Busy(f"{url} answered 503: {text or resp.reason}", after)
            if resp.status >= 500:
                raise _Retry(f"{url} answered {resp.status} {resp.reason}")
            if resp.status >= 400:
                raise MirrorError(f"{url} answered {resp.status} {resp.reason}; check the source and access")
            total = _total(resp, part)
            if resp.status == 200 and part.done:
                await asyncio.to_thread(part.restart)  # the server ignored Range: take the whole file
            if progress:
                progress(part.done, total)
            async for chunk in resp.content.iter_chunked(CHUNK_BYTES):
                await asyncio.to_thread(part.absorb, chunk)
                if progress:
                    progress(part.done, total)
            if total is not None and part.done != total:
                raise _Retry(f"{url} ended at byte {part.done} of {total}")
            return server_sha
    except aiohttp.ClientConnectorError as e:
        if isinstance(e.os_error, RefusedConnection):
            raise MirrorError(f"{url}: {e.os_error.strerror or e.os_error}") from e
        raise _Retry(f"{url}: {type(e).__name__}: {e}") from e
    except (aiohttp.ClientError, TimeoutError) as e:
        raise _Retry(f"{url}: {type(e).__name__}: {e}") from e


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    """``Retry-After`` in seconds (the delta form, capped at 60 s), or None when absent or a date."""
    try:
        return min(60.0, max(0.1, float(resp.headers.get("Retry-After", ""))))
    except ValueError:
        return None


def _total(resp: aiohttp.ClientResponse, part: _Partial) -> int | None:
    """The whole file's length from a 200 or 206 answer, or None when the server does not say."""
    if resp.status == 206:
        m = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
        if not m or int(m.group(1)) != part.done:
            # An answer for another offset cannot be appended; ask again for the whole file.
            part.restart()
            raise _Retry(f"{resp.url} answered a range that does not start at byte {part.done}")
        return None if m.group(3) == "*" else int(m.group(3))
    if resp.content_length is None:
        return None
    return resp.content_length

