"""Installing llama.cpp on a node: a pinned release, verified before anything is unpacked.

:data:`LLAMACPP_RELEASE` is the one table: the tag (``b<N>``, llama.cpp's build number) and the
SHA-256 of each asset the agent may download. llama.cpp publishes no checksum files; GitHub
computes a SHA-256 for every release asset and serves it as ``"digest"`` in
``GET /repos/ggml-org/llama.cpp/releases/tags/<tag>``. Copy it from there.

What a node gets (:func:`plan`):

- **CPU node** (no NVIDIA GPU): ``llama-b<N>-bin-ubuntu-x64.tar.gz`` (``-vulkan-`` when asked)
  from ``<base>/<tag>/<asset>`` (base: GitHub releases, overridable for mirrors and tests).
- **NVIDIA node**: ``unsupported``. Upstream publishes no Linux CUDA build (LC #18748); the
  operator provides one: ``engines.llamacpp.binary`` in agent.yaml, or
  ``llmgw agent install-engine --from FILE``.

:func:`install_release`, in this order: stream the asset to a ``.part`` file while hashing it;
compare with the pinned digest and, on a mismatch, delete the file and fail naming both digests
(nothing unverified is unpacked, run or left on disk); unpack with tarfile's ``data`` filter (no
absolute paths, links out, devices; the same checks by hand on a Python without it) into a
temporary directory; run ``llama-server --version`` and check the build number; rename the
directory to ``<agent_state>/engines/llamacpp/b<N>/``. A failure at any step leaves no partial
install. Offline (the base URL does not answer), the install fails with the same advice as a GPU
node, so the operator knows the two ways out.

:func:`install_from_file` is ``llmgw agent install-engine --from FILE``: a llama-server binary
or a tarball holding one, installed as ``<agent_state>/engines/llamacpp/current/`` (which the
agent prefers over downloaded builds). The operator vouches for the file; its SHA-256 is printed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import tarfile
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

import httpx

from llmgw.agent.engines import llamacpp
from llmgw.errors import EngineError
from llmgw.protocol import EngineStatus, ProvisionState

log = logging.getLogger(__name__)

GITHUB_RELEASES = "https://github.com/ggml-org/llama.cpp/releases/download"

@dataclass(frozen=True)
class Release:
    """A pinned llama.cpp release: ``tag`` (``b<N>``) and ``assets`` (file name → SHA-256 hex)."""

    tag: str
    assets: dict[str, str]

    @property
    def build(self) -> str:
        """The build number ``--version`` prints (``"11194"`` for ``b11194``)."""
        return self.tag.removeprefix("b")

    def asset(self, variant: str = "") -> str:
        """``llama-b<N>-bin-ubuntu-x64.tar.gz`` (``variant="vulkan"``: ``…-ubuntu-vulkan-x64…``)."""
        mid = f"ubuntu-{variant}-x64" if variant else "ubuntu-x64"
        return f"llama-{self.tag}-bin-{mid}.tar.gz"


LLAMACPP_RELEASE = Release(
    # The digests are the ``digest`` GitHub publishes for each release asset (releases API),
    # as pinned for this tag by another project that downloads and checks them (ClikCode's
    # runtime table: CPU 17,014,362 bytes, Vulkan 30,955,864 bytes). They could not be fetched
    # from here (no internet); a download that does not match is refused, naming both digests.
    tag="b11194",
    assets={
        "llama-b11194-bin-ubuntu-x64.tar.gz": "527c09064f3c89e4b6e1008a641e31903a04ccdd1c69abd0752acbbd4e1905f6",
        "llama-b11194-bin-ubuntu-vulkan-x64.tar.gz": "e4f8163eaf2e4d45639238a6fbc09f559e4ff5c0e7d612088a282ed128359c5e",
    },
)

GPU_ADVICE = (
    "llmgw does not download CUDA builds of llama.cpp (recent releases publish ubuntu-cuda tarballs "
    "with a separate CUDA runtime archive; not pinned here yet): put a CUDA llama-server on this node with "
    "'llmgw agent install-engine --from FILE' (a binary or a tarball) or set engines.llamacpp.binary "
    "in agent.yaml"
)
OFFLINE_ADVICE = (
    "install it by hand: 'llmgw agent install-engine --from FILE' with llama-server or its release "
    "tarball, or set engines.llamacpp.binary in agent.yaml"
)
DOWNLOAD_TIMEOUT = httpx.Timeout(30.0, read=120.0)
"""Connect/read limits of the download (a release tarball is ~30 MB)."""


def install_root(agent_state: Path) -> Path:
    """``<agent_state>/engines/llamacpp``: one directory per installed build."""
    return agent_state / "engines" / llamacpp.ENGINE


def plan(*, has_nvidia: bool, release: Release = LLAMACPP_RELEASE, variant: str = "") -> EngineStatus | None:
    """None when this node can download ``release``; else the ``unsupported`` status to report."""
    if has_nvidia:
        return EngineStatus(engine=llamacpp.ENGINE, state=ProvisionState.UNSUPPORTED, detail=GPU_ADVICE)
    if release.asset(variant) not in release.assets:
        return EngineStatus(
            engine=llamacpp.ENGINE,
            state=ProvisionState.UNSUPPORTED,
            detail=f"no pinned asset {release.asset(variant)} in release {release.tag}; {OFFLINE_ADVICE}",
        )
    return None


def _check_version(binary: Path, build: str) -> str:
    try:
        done = llamacpp.run_probe([str(binary), "--version"])
    except (OSError, subprocess.SubprocessError) as e:
        raise EngineError(f"{binary} does not run: {e}") from e
    version = llamacpp.parse_version(f"{done.stdout}\n{done.stderr}")
    if build and version != build:
        raise EngineError(f"{binary} --version says '{version or '(nothing)'}', expected build {build}")
    return version


def _find_binary(root: Path) -> Path | None:
    for p in sorted(root.rglob(llamacpp.BINARY_NAME), key=lambda p: len(p.parts)):
        if p.is_file():
            return p
    return None


def _checked_members(tf: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """The members of ``tf``, checked and made safe to unpack, for a Python without
    tarfile's extraction filters (PEP 706; they came in 3.11.4, and Debian 12's python3 is 3.11.2).
    Stricter than the ``data`` filter where a check by name alone could be fooled: no name or link
    target may be absolute or hold ``..`` at all (then every link leads down from its own directory,
    so no chain of links leaves the destination: ``l1 -> .`` then ``l2 -> l1/..`` passed a check of
    resolved names, links not being on disk yet). Each member's owner becomes this process's and its
    mode loses setuid, setgid, sticky and group/other write, as the filter does.

    Raises:
        tarfile.TarError: an absolute or ``..`` name or link target, or a device or FIFO.
    """
    members = tf.getmembers()
    for m in members:
        if m.name.startswith("/") or ".." in m.name.split("/"):
            raise tarfile.TarError(f"{m.name!r} would be written outside the destination")
        if m.isdev() or m.isfifo():
            raise tarfile.TarError(f"{m.name!r} is a device or FIFO")
        if (m.issym() or m.islnk()) and (m.linkname.startswith("/") or ".." in m.linkname.split("/")):
            raise tarfile.TarError(f"{m.name!r} links outside the destination: {m.linkname!r}")
        m.uid, m.gid, m.uname, m.gname = os.getuid(), os.getgid(), "", ""
        m.mode &= 0o755
    return members


def _unpack(tarball: Path, into: Path) -> Path:
    """Unpack safely into ``into`` (tarfile's ``data`` filter, or :func:`_checked_members` where
    this Python has none); returns the directory that holds ``llama-server`` (flattened).

    Raises:
        EngineError: the tarball cannot be read, would write outside ``into``, or holds no
            llama-server.
    """
    try:
        with tarfile.open(tarball) as tf:
            if hasattr(tarfile, "data_filter"):
                tf.extractall(into, filter="data")
            else:  # Python 3.11.0-3.11.3
                tf.extractall(into, members=_checked_members(tf))  # noqa: S202 - checked
    except (tarfile.TarError, OSError) as e:
        raise EngineError(f"{tarball.name} cannot be unpacked: {e}") from e
    binary = _find_binary(into)
    if binary is None:
        raise EngineError(f"{tarball.name} holds no {llamacpp.BINARY_NAME}")
    binary.chmod(binary.stat().st_mode | 0o755)
    return binary.parent


def _place(src_dir: Path, dest: Path) -> None:
    """Move ``src_dir`` to ``dest`` (replacing it) with renames only."""
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    src_dir.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def _stream(url: str, dest: Path, client: httpx.Client) -> str:
    """Stream ``url`` into ``dest``; returns the sha256 of what was written."""
    h = hashlib.sha256()
    try:
        with client.stream("GET", url, follow_redirects=True) as resp:
            if resp.status_code != 200:
                raise EngineError(f"{url} answered {resp.status_code}; {OFFLINE_ADVICE}")
            with dest.open("wb") as out:
                for chunk in resp.iter_bytes(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
    except httpx.HTTPError as e:
        raise EngineError(f"{url} cannot be downloaded: {type(e).__name__}: {e}; {OFFLINE_ADVICE}") from e
    return h.hexdigest()


def download_verified(url: str, dest: Path, want_sha256: str, *, client: httpx.Client) -> str:
    """Stream ``url`` into ``dest`` while hashing; returns the digest when it equals ``want_sha256``.

    Raises:
        EngineError: HTTP error, unreachable, or a digest mismatch (naming both digests); ``dest`` is
            removed in every failure, so no unverified byte stays on disk.
    """
    want = want_sha256.lower()
    try:
        got = _stream(url, dest, client)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    if got != want:
        dest.unlink(missing_ok=True)
        raise EngineError(
            f"{url}: sha256 {got} does not match the pinned {want}; the download was deleted, "
            "nothing was installed"
        )
    return got


def install_release(
    agent_state: Path,
    *,
    release: Release = LLAMACPP_RELEASE,
    variant: str = "",
    base_url: str = GITHUB_RELEASES,
    client: httpx.Client | None = None,
) -> Path:
    """Download, verify, unpack and check ``release`` (see the module docstring); returns the binary.

    Raises:
        EngineError: unreachable, digest mismatch, bad archive, or a binary whose ``--version``
            is not the release's build; nothing is left behind.
    """
    asset = release.asset(variant)
    want = release.assets.get(asset)
    if want is None:
        raise EngineError(f"no pinned digest for {asset} in release {release.tag}")
    root = install_root(agent_state)
    root.mkdir(parents=True, exist_ok=True)
    part = root / f".{asset}.part"
    work = root / f".{release.tag}.unpacking"
    shutil.rmtree(work, ignore_errors=True)
    url = f"{base_url.rstrip('/')}/{release.tag}/{asset}"
    own = client is None
    c = client or httpx.Client(timeout=DOWNLOAD_TIMEOUT)
    try:
        log.info("llamacpp: downloading %s", url)
        download_verified(url, part, want, client=c)
        try:
            work.mkdir()
            bindir = _unpack(part, work)
            _check_version(bindir / llamacpp.BINARY_NAME, release.build)
            dest = root / release.tag
            _place(bindir, dest)
        finally:
            part.unlink(missing_ok=True)
            shutil.rmtree(work, ignore_errors=True)
    finally:
        if own:
            c.close()
    log.info("llamacpp: %s installed in %s", release.tag, dest)
    return dest / llamacpp.BINARY_NAME


def install_from_file(agent_state: Path, source: Path) -> tuple[Path, str, str]:
    """Install a llama-server binary or a tarball holding one as ``…/llamacpp/current``.

    Returns ``(binary, version, sha256 of the file)``.

    Raises:
        EngineError: the file is missing, not a llama-server, not runnable, or a bad archive.
    """
    if not source.is_file():
        raise EngineError(f"{source} is not a file; give a llama-server binary or its release tarball")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    root = install_root(agent_state)
    root.mkdir(parents=True, exist_ok=True)
    work = root / ".current.unpacking"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        if tarfile.is_tarfile(source):
            bindir = _unpack(source, work)
        else:
            bindir = work / "bin"
            bindir.mkdir()
            shutil.copy2(source, bindir / llamacpp.BINARY_NAME)
            (bindir / llamacpp.BINARY_NAME).chmod(0o755)
        version = _check_version(bindir / llamacpp.BINARY_NAME, "")
        if not version:
            raise EngineError(f"{source}: '--version' printed no 'version: …' line; is it llama-server?")
        _place(bindir, root / "current")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return root / "current" / llamacpp.BINARY_NAME, version, digest


@dataclass(eq=False)
class Provisioner:
    """Installs llama.cpp once in a background thread and says where it stands (:meth:`status`).

    Args:
        agent_state: the agent's state dir.
        base_url: where release assets are fetched from (GitHub releases by default).
        on_done: called (from the thread) when an install ends, either way.
    """

    agent_state: Path
    _: KW_ONLY
    base_url: str = GITHUB_RELEASES
    release: Release = LLAMACPP_RELEASE
    variant: str = ""
    on_done: Callable[[], None] = lambda: None
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _status: EngineStatus | None = field(default=None, init=False)

    def status(self, *, has_nvidia: bool) -> EngineStatus:
        """The status to report while no llama-server is usable; starts the install the first time."""
        refused = plan(has_nvidia=has_nvidia, release=self.release, variant=self.variant)
        if refused is not None:
            return refused
        with self._lock:
            if self._thread is None:
                url = f"{self.base_url.rstrip('/')}/{self.release.tag}/{self.release.asset(self.variant)}"
                self._status = EngineStatus(
                    engine=llamacpp.ENGINE,
                    version=self.release.build,
                    state=ProvisionState.INSTALLING,
                    detail=f"downloading {url}",
                )
                self._thread = threading.Thread(target=self._run, name="llamacpp-provision", daemon=True)
                self._thread.start()
            return self._status or refused_status("install not started")

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for a started install to end (tests, CLI)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            binary = install_release(
                self.agent_state, release=self.release, variant=self.variant, base_url=self.base_url
            )
            status = EngineStatus(
                engine=llamacpp.ENGINE,
                version=self.release.build,
                state=ProvisionState.INSTALLED,
                detail=f"{binary} (installed by the agent)",
                binary=str(binary),
            )
        except EngineError as e:
            log.error("llamacpp: install failed: %s", e)  # noqa: TRY400 - the message is the story
            detail = str(e) if OFFLINE_ADVICE in str(e) else f"{e}; {OFFLINE_ADVICE}"
            status = EngineStatus(engine=llamacpp.ENGINE, state=ProvisionState.FAILED, detail=detail)
        with self._lock:
            self._status = status
        with contextlib.suppress(Exception):
            self.on_done()


def refused_status(detail: str) -> EngineStatus:
    """A ``failed`` llama.cpp status with ``detail``."""
    return EngineStatus(engine=llamacpp.ENGINE, state=ProvisionState.FAILED, detail=detail)
