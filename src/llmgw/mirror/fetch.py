"""The mirror's fetcher: puts a source into the store as ``model/version``, once.

Each pass of a fetch, in order:

1. ``POST /api/v1/fetch`` reaches :meth:`Fetcher.fetch`. A ``model/version`` that is already
   present is answered at once; one that is being fetched is joined (two requests share one
   download); a failed one is tried again (from the partial file when the source is the same,
   from scratch when it is another). Asking for an existing ``model/version`` from another
   source is a :class:`SourceConflict`: a version names one set of bytes. A new fetch is first
   checked against the :class:`~llmgw.mirror.policy.SourcePolicy` (``file:`` from an import
   directory, ``http(s):`` to a public address): a refusal is a
   :class:`~llmgw.errors.SourceRefused` before anything is written. The same rules hold
   again when the bytes move (the file is opened through the policy; every connection goes
   through its connector), so a swap, a redirect or a changed DNS answer meanwhile fails the fetch.
2. The manifest is written ``fetching`` (durably) before any byte moves, so a restart knows to
   resume it: :meth:`Fetcher.start` relaunches every ``fetching`` manifest it finds.
3. ``hf:`` sources are asked first (``HEAD``, redirects not followed) for the LFS sha256 and size
   Hugging Face publishes (:func:`~llmgw.sourcecheck.hf_published_sha256`); the digest is kept in
   the manifest as ``expected_sha256`` and the download is checked against it. A ``HEAD`` that
   fails is logged and the download goes on unchecked: the GET that follows reports the real error.
4. ``file:`` sources are copied (hashing while copying, into a hidden partial name, fsync,
   rename): how an offline cluster carries a model in. ``http``/``hf`` sources go through
   :func:`~llmgw.mirror.download.download`, which resumes from the partial file and retries with
   backoff.
5. Free disk is checked before the bytes move (the local file's size, the size Hugging Face
   publishes, or the size the server announces before the first byte); too little is a
   :class:`~llmgw.errors.NoSpaceError` naming bytes needed and free, and so is a disk that
   fills meanwhile. Either way the partial file is deleted: nothing half-written stays behind.
6. The manifest becomes ``present`` with size and sha256, or ``failed`` with the error text (a
   digest mismatch names both digests). Progress is kept in memory and written to the manifest
   about once a second; the rate is measured over :data:`RATE_WINDOW_S` and the ETA follows from it.

:meth:`Fetcher.delete` cancels a running fetch and removes the version's directory (file, partial
file, manifest). A ``present`` manifest written into the store by another process (``llmgw mirror
add`` while the mirror was down) is picked up the first time it is asked for or listed.

It does not verify a ``file:`` or plain ``https://`` source against a known digest (none is
given), only records the digest of what arrived; nodes then verify against that.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import pathlib
import shutil
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import aiohttp

from llmgw.errors import LlmgwError, MirrorError, NoSpaceError, SourceConflict, SourceRefused
from llmgw.mirror.download import download, no_space, partial_path
from llmgw.mirror.filecopy import copy_into
from llmgw.mirror.models import NAME_RE, FetchRequest, FetchStatus, Manifest, check_name
from llmgw.mirror.policy import SourcePolicy
from llmgw.mirror.store import Store
from llmgw.sourcecheck import Download, hf_published_sha256, hf_published_size, to_download

log = logging.getLogger(__name__)

RATE_WINDOW_S = 5.0
"""The transfer rate is measured over this many recent seconds."""

PROGRESS_WRITE_S = 1.0
"""Progress reaches the manifest at most this often; state changes are written at once."""

HEAD_TIMEOUT = aiohttp.ClientTimeout(total=30)
"""For the ``HEAD`` that asks Hugging Face for a file's published sha256 and size."""


@dataclass
class _Entry:
    model: str
    version: str
    manifest: Manifest
    task: asyncio.Task[None] | None = None
    samples: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)
    last_write: float = 0.0
    lock: int | None = None  # the version directory's fetch lock while this process fetches (Store.claim)


class Fetcher:
    """Fetches sources into a :class:`Store` and reports their :class:`FetchStatus`.

    Args:
        store: where files and manifests live; what is written there is given to its ``owner``
            when it has one (before it gets its name).
        base: the bytes server's public URL (``--base``); ``FetchStatus.url`` starts with it.
        env: environment for source resolution (``HF_TOKEN``, ``HF_ENDPOINT``); default ``os.environ``.
        clock: monotonic seconds, for the transfer rate and manifest write pacing.
        policy: which sources may be fetched; the default allows no ``file:`` source and no
            private address.
    """

    def __init__(
        self,
        store: Store,
        base: str,
        *,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy: SourcePolicy | None = None,
    ) -> None:
        self.store = store
        self.policy = policy if policy is not None else SourcePolicy()
        self.base = base.rstrip("/")
        self._env = env
        self._clock = clock
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self, *, resume: bool = True) -> None:
        """Load every manifest and resume the fetches a previous run left ``fetching``.

        ``resume=False`` loads without resuming (``llmgw mirror add`` writing into a store whose
        mirror is down must not start that mirror's downloads).
        """
        self._session = aiohttp.ClientSession(connector=self.policy.connector())
        for model, version, manifest in self.store.all():
            entry = _Entry(model, version, manifest)
            self._entries[model, version] = entry
            if manifest.state == "fetching" and resume and not self.store.claimed_elsewhere(model, version):
                log.info("resuming %s/%s from %s", model, version, manifest.source)
                try:
                    self._launch(entry, to_download(manifest.source, env=self._env))
                except SourceRefused as e:  # a 'mirror add' copy cut off, from where this mirror does not import
                    self._fail(entry, MirrorError(f"{_cut_off(model, version)} ({e})"))
                except LlmgwError as e:
                    self._fail(entry, e)

    async def close(self) -> None:
        """Stop running fetches (their manifests stay ``fetching``, resumed next start)."""
        tasks = [e.task for e in self._entries.values() if e.task and not e.task.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def status(self, model: str, version: str) -> FetchStatus | None:
        """The status of ``model/version``, or None when the mirror has never been asked for it."""
        entry = self._entry(model, version)
        return None if entry is None else self._view(entry)

    def files(self) -> list[FetchStatus]:
        """Every ``model/version`` the mirror knows, sorted by model then version."""
        for model, version, _m in self.store.all():
            self._entry(model, version)
        return [self._view(e) for _, e in sorted(self._entries.items())]

    async def wait(self, model: str, version: str) -> FetchStatus | None:
        """Wait until the fetch of ``model/version`` ends; its status then (None when unknown)."""
        entry = self._entry(model, version)
        if entry is None:
            return None
        if entry.task is not None:
            await asyncio.gather(entry.task, return_exceptions=True)
        while entry.manifest.state == "fetching" and entry.task is None and self._elsewhere(entry):
            await asyncio.sleep(0.5)  # another process fetches it: its manifest says when it ends
            entry = self._entry(model, version) or entry
        return self._view(entry)

    async def delete(self, model: str, version: str) -> FetchStatus | None:
        """Cancel the fetch of ``model/version`` if it runs, and delete its file, partial file and
        manifest. Returns its last status, or None when the mirror does not know it.

        Nodes that already hold the file keep their copies; new GETs answer 404 at once.

        Raises:
            MirrorError: the directory cannot be removed (names it and why).
        """
        entry = self._entry(model, version)
        if entry is None:
            return None
        last = self._view(entry)
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
            await asyncio.gather(entry.task, return_exceptions=True)
        del self._entries[model, version]
        vdir = self.store.version_dir(model, version)
        try:
            await asyncio.to_thread(shutil.rmtree, vdir, ignore_errors=False)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise MirrorError(f"cannot delete {vdir}: {e.strerror or e}") from e
        with contextlib.suppress(OSError):
            vdir.parent.rmdir()  # the model's directory, when no other version is left
        log.info("%s/%s deleted (was %s)", model, version, last.state)
        return last

    def _entry(self, model: str, version: str) -> _Entry | None:
        """The known entry, or the manifest on disk when another process wrote it (a ``llmgw mirror
        add`` that copied straight into the store: present, failed, or still or no longer fetching),
        adopted or refreshed; None when there is neither."""
        entry = self._entries.get((model, version))
        if entry is not None and entry.task is not None:
            return entry  # this process fetches it: its memory is ahead of the disk
        if not (NAME_RE.fullmatch(model) and NAME_RE.fullmatch(version)):
            return None
        manifest = self.store.read(model, version)
        if manifest is None:
            return entry
        if entry is None or manifest.updated_at > entry.manifest.updated_at:
            entry = self._entries[model, version] = _Entry(model, version, manifest)
        return entry

    def _elsewhere(self, entry: _Entry) -> bool:
        """Whether another process fetches ``entry`` now (holds its lock: :meth:`Store.claim`)."""
        return self.store.claimed_elsewhere(entry.model, entry.version)

    async def fetch(self, req: FetchRequest) -> tuple[FetchStatus, bool]:
        """Start (or join) fetching ``req.source`` as ``req.model/req.version``.

        Returns:
            ``(status, started)``: ``started`` is False when the file was already present.

        Raises:
            SourceError: the source is not an accepted form.
            MirrorError: the source names no usable file name.
            SourceConflict: the ``model/version`` holds or is fetching another source.
            SourceRefused: the policy does not allow the source (outside the import directories,
                not a regular file, a private address).
        """
        dl = to_download(req.source, env=self._env)
        file = _file_name(req.source, dl)
        if (known := self._known(req)) is not None:
            return known
        await self._check(req.source, dl)
        # Another request may have started this model/version while the check awaited DNS.
        if (known := self._known(req)) is not None:
            return known
        entry = self._entry(req.model, req.version)
        if entry is not None and entry.manifest.source != req.source:
            # Bytes a failed fetch of another source left must not be resumed as this one.
            stale = partial_path(self.store.version_dir(req.model, req.version) / entry.manifest.file)
            stale.unlink(missing_ok=True)
        manifest = Manifest(file=file, source=req.source, state="fetching", updated_at=_now())
        entry = _Entry(req.model, req.version, manifest)
        self._entries[req.model, req.version] = entry
        self._save(entry, durable=True)
        try:
            self._launch(entry, dl)
        except (OSError, MirrorError) as e:
            self._fail(entry, e)
        return self._view(entry), True

    def _known(self, req: FetchRequest) -> tuple[FetchStatus, bool] | None:
        """The answer for a ``model/version`` already present or fetching; None when it is new or failed.

        Raises:
            SourceConflict: it holds or is fetching another source.
        """
        entry = self._entry(req.model, req.version)
        if entry is None or entry.manifest.state == "failed" or self._gone(entry):
            return None  # a present file deleted from the store is fetched again, not reported present
        cut_off = entry.manifest.state == "fetching" and entry.task is None and not self._elsewhere(entry)
        if cut_off and entry.manifest.source == req.source:
            return None  # its process died: fetched again, resuming its partial bytes
        if entry.manifest.source != req.source:
            raise SourceConflict(
                f"{req.model}/{req.version} is already {entry.manifest.state} from "
                f"{entry.manifest.source}, not {req.source}; give the new source a new version"
            )
        return self._view(entry), entry.manifest.state != "present"

    async def _check(self, source: str, dl: Download) -> None:
        """Refuse a source the policy does not allow (:class:`~llmgw.errors.SourceRefused`).

        A ``file:`` that is missing or unreadable passes here: the copy reports it as ``failed``.
        """
        if dl.kind != "file":
            await self.policy.check_url(dl.url, source)
            return
        assert dl.path is not None  # noqa: S101 - to_download sets it for kind "file"
        try:
            fd = self.policy.open_file(dl.path, source)
        except SourceRefused:
            raise
        except OSError:
            return
        os.close(fd)

    # --- running one fetch ---

    def _launch(self, entry: _Entry, dl: Download) -> None:
        """Run the fetch of ``entry`` as a task holding its version directory's lock (released when it
        ends). Raises MirrorError when another process holds the lock (it fetches the same)."""
        self.store.make_version_dir(entry.model, entry.version)
        lock = self.store.claim(entry.model, entry.version)
        if lock is None:
            raise MirrorError(f"{entry.model}/{entry.version} is being fetched by another process (a 'llmgw "
                              "mirror add', or the mirror); wait for it, or stop it first")
        entry.lock = lock
        entry.task = asyncio.create_task(self._run(entry, dl), name=f"fetch {entry.model}/{entry.version}")

        def release(_task: asyncio.Task[None]) -> None:
            if entry.lock is not None:
                self.store.release(entry.model, entry.version, entry.lock)
                entry.lock = None

        entry.task.add_done_callback(release)

    async def _run(self, entry: _Entry, dl: Download) -> None:
        dest = self.store.version_dir(entry.model, entry.version) / entry.manifest.file
        checked_space = False

        def progress(done: int, total: int | None) -> None:
            nonlocal checked_space
            m = entry.manifest
            m.bytes_done, m.bytes_total = done, total
            now = self._clock()
            entry.samples.append((now, done))
            while entry.samples and entry.samples[0][0] < now - RATE_WINDOW_S:
                entry.samples.popleft()
            if total is not None and not checked_space:
                checked_space = True
                _check_space(dest.parent, total - done, f"{entry.model}/{entry.version}/{m.file}")
            if now - entry.last_write >= PROGRESS_WRITE_S:
                self._save(entry, durable=False)

        try:
            self.store.make_version_dir(entry.model, entry.version)
            if dl.kind == "file":
                assert dl.path is not None  # noqa: S101 - to_download sets it for kind "file"
                sha = await copy_into(
                    dl.path, dest, progress, lambda p: self.policy.open_file(p, entry.manifest.source),
                    owner=self.store.owner,
                )
            else:
                if dl.kind == "hf" and not entry.manifest.expected_sha256:
                    await self._ask_hf(entry, dl, dest)
                sha = await download(
                    self._http(), dl.url, dest, headers=dl.headers, progress=progress,
                    expected_sha256=entry.manifest.expected_sha256,
                )
                if self.store.owner is not None:  # before the manifest says present
                    os.chown(dest, *self.store.owner, follow_symlinks=False)
            size = dest.stat().st_size
        except asyncio.CancelledError:
            self._save(entry, durable=False)
            raise
        except NoSpaceError as e:
            partial_path(dest).unlink(missing_ok=True)
            self._fail(entry, e)
            return
        except (LlmgwError, OSError) as e:
            self._fail(entry, e)
            return
        except Exception as e:  # a bug must still end as "failed", never as a fetch stuck "fetching"
            log.exception("fetching %s/%s", entry.model, entry.version)
            self._fail(entry, e)
            return
        m = entry.manifest
        m.state, m.sha256, m.size, m.err = "present", sha, size, ""
        m.bytes_done = m.bytes_total = size
        entry.samples.clear()
        self._save(entry, durable=True)
        log.info("%s/%s present: %s, %d bytes, sha256 %s", entry.model, entry.version, m.file, size, sha)

    async def _ask_hf(self, entry: _Entry, dl: Download, dest: pathlib.Path) -> None:
        """HEAD the resolve URL for the published LFS sha256 and size; keep the digest in the
        manifest (durably, so a resumed fetch checks it too) and check the disk against the size."""
        try:
            async with self._http().head(
                dl.url, headers=dl.headers, allow_redirects=False, timeout=HEAD_TIMEOUT
            ) as resp:
                if resp.status >= 400:
                    log.warning("HEAD %s answered %d; the download is checked against nothing published",
                                dl.url, resp.status)
                    return
                sha, size = hf_published_sha256(resp.headers), hf_published_size(resp.headers)
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("HEAD %s failed (%s); the download is checked against nothing published", dl.url, e)
            return
        if size is None and resp.status == 200:
            size = resp.content_length
        if sha:
            entry.manifest.expected_sha256 = sha
            self._save(entry, durable=True)
            log.info("%s publishes sha256 %s", dl.url, sha)
        if size is not None:
            have = partial_path(dest).stat().st_size if partial_path(dest).exists() else 0
            _check_space(dest.parent, size - have, f"{entry.model}/{entry.version}/{entry.manifest.file}")

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise MirrorError("the fetcher is not started; call Fetcher.start() first")
        return self._session

    def _fail(self, entry: _Entry, e: BaseException) -> None:
        m = entry.manifest
        m.state, m.err = "failed", str(e) or type(e).__name__
        entry.samples.clear()
        log.warning("fetching %s/%s failed: %s", entry.model, entry.version, m.err)
        try:
            self._save(entry, durable=True)
        except OSError:
            log.exception("cannot record the failure of %s/%s", entry.model, entry.version)

    def _save(self, entry: _Entry, *, durable: bool) -> None:
        entry.manifest.updated_at = _now()
        entry.last_write = self._clock()
        self.store.write(entry.model, entry.version, entry.manifest, durable=durable)

    def _gone(self, entry: _Entry) -> bool:
        """Whether ``entry``'s manifest says ``present`` but the store no longer serves its file
        (deleted, truncated or replaced by hand): the bytes port answers 404 for it."""
        m = entry.manifest
        return (m.state == "present" and (entry.task is None or entry.task.done())
                and self.store.servable(entry.model, entry.version, m.file) is None)

    def _view(self, entry: _Entry) -> FetchStatus:
        m = entry.manifest
        if m.state == "fetching" and entry.task is None and not self._elsewhere(entry):
            m = m.model_copy(update={"state": "failed", "err": _cut_off(entry.model, entry.version)})
        elif self._gone(entry):
            m = m.model_copy(update={"state": "failed", "bytes_done": 0, "err": _missing(entry, self.store)})
        return FetchStatus(
            model=entry.model,
            version=entry.version,
            file=m.file,
            source=m.source,
            state=m.state,
            bytes_done=m.bytes_done,
            bytes_total=m.bytes_total,
            sha256=m.sha256,
            url=f"{self.base}/{entry.model}/{entry.version}/{m.file}",
            err=m.err,
            rate_bytes_per_s=(rate := self._rate(entry)),
            eta_s=_eta(m, rate),
            expected_sha256=m.expected_sha256,
        )

    def _rate(self, entry: _Entry) -> float:
        """Bytes per second over the last RATE_WINDOW_S seconds; 0 when nothing moved lately."""
        if entry.manifest.state != "fetching" or len(entry.samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = entry.samples[0], entry.samples[-1]
        if t1 - t0 <= 0 or self._clock() - t1 > RATE_WINDOW_S:
            return 0.0
        return (b1 - b0) / (t1 - t0)


def _cut_off(model: str, version: str) -> str:
    """What a fetch whose process ended before it did (a ``llmgw mirror add`` interrupted) reads as."""
    return (f"the copy into {model}/{version} was cut off before it finished (its process ended); add it again to "
            f"finish it, or 'llmgw mirror rm {model} {version}'")


def _missing(entry: _Entry, store: Store) -> str:
    """What a ``present`` file that is no longer in the store reads as (:meth:`Fetcher._gone`)."""
    path = store.version_dir(entry.model, entry.version) / entry.manifest.file
    return (f"{path} is missing or not the file the manifest names (deleted or changed by hand), so nodes get 404; "
            f"add it again ('llmgw mirror add FILE --model {entry.model} --version {entry.version}') or "
            f"'llmgw mirror rm {entry.model} {entry.version}'")


def _eta(m: Manifest, rate: float) -> float | None:
    """Seconds left at ``rate``: 0 once present, None while size or rate is unknown."""
    if m.state == "present":
        return 0.0
    if m.state != "fetching" or not m.bytes_total or rate <= 0:
        return None
    return max(0.0, (m.bytes_total - m.bytes_done) / rate)


def _file_name(source: str, dl: Download) -> str:
    """The file's name in the store: the last segment of the source's path."""
    if dl.path is not None:
        name = dl.path.name
    else:
        name = urllib.parse.unquote(urllib.parse.urlsplit(dl.url).path.rsplit("/", 1)[-1])
    try:
        return check_name(name, "file name")
    except ValueError as e:
        raise MirrorError(f"cannot store {source}: {e}") from None


def _check_space(directory: pathlib.Path, needed: int, what: str) -> None:
    """Raise :class:`NoSpaceError` when ``directory``'s filesystem has less than ``needed`` free."""
    if needed > shutil.disk_usage(directory).free:
        raise no_space(directory, what, needed)


def _now() -> datetime:
    return datetime.now(UTC)
