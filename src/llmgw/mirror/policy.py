"""Which sources the mirror may fetch: ``file:`` only from import directories, ``http(s):`` only
to public addresses.

The management API takes a source from any local user (it answers loopback) and the bytes
server then hands what was fetched to anyone. Without this policy a ``file:`` source copied the
admin token, the CA key or ``/proc/self/environ`` into the store, ``/dev/zero`` filled the disk,
and an ``http://127.0.0.1:…`` source made the mirror a proxy into the machine (SSRF).

``file:`` sources (:meth:`SourcePolicy.open_file`), in order:

1. The real path (symlinks followed, :func:`os.path.realpath`) must be inside one of the
   ``--import-dir`` directories, and not inside llmgw's own configuration or state (``deny``:
   ``/etc/llmgw``, ``/var/lib/llmgw``, ``/var/lib/llmgw-agent``, which hold the secrets), even
   when an import directory contains them.
2. It is opened by walking from the import directory one component at a time with
   ``O_NOFOLLOW`` (``openat``), the file itself also ``O_NONBLOCK`` (a FIFO must not hang the
   open): a symlink swapped in after step 1 fails the open instead of being followed (TOCTOU).
3. The opened descriptor is checked again (``fstat``): a regular file (no device, FIFO, socket or
   directory) with one link (a hard link is another name for a file that may live anywhere on
   the filesystem, the admin token included).
4. With ``public_only`` (what ``mirror serve`` uses): the file must be readable by others (o+r)
   and every directory walked from the import directory down, that one included, searchable by
   others (o+x): the mirror imports only what every local user could read already, so a mirror
   that runs as root (when the ``llmgw`` user cannot run the install) never publishes a file
   only root could read (a 0600 ssh key beside the model). ``mirror add`` holds a file carried in
   by hand to the same rule, with the file's own directory as the import directory, on both of
   its paths (:func:`llmgw.mirror.setup.add_file`): it used to copy a 0600 file itself, as root,
   and the mirror then served it to anyone. ``server init``'s own copy of the one ``file:``
   starter or judge named on its command line is not held to it.

``http(s):`` sources, and what ``hf:`` turns into: every address a connection goes to is checked
(:meth:`SourcePolicy.refusal`): loopback, link-local, private, shared, reserved, unspecified and
multicast addresses, and the machine's own addresses, are refused unless ``--allow-source-net``
names a network holding them (``--allow-private-sources`` allows all). The check runs twice:
when the fetch is asked for (:meth:`SourcePolicy.check_url`, a 400 at once), and on every
connection the fetch makes (:meth:`SourcePolicy.connector`: the resolver drops refused
addresses and the socket factory refuses to connect to one), so a redirect to
``http://127.0.0.1/…`` or a DNS answer that changed since fails the fetch too.

Refusals raise :class:`SourceRefused` (a :class:`~llmgw.errors.SourceError`: the API answers 400
``source_refused``) naming the source, the reason and the flag that would allow it.

It does not guarantee anything about a file an operator's import directory holds: everything in
it may be served to anyone who reaches the bytes port, so an import directory is one only people
trusted with that write to. Nor does it stop a parent directory of an import directory being
replaced after start (that takes write access to it).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import os
import pathlib
import socket
import stat
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import psutil

from llmgw.errors import ConfigError, SourceRefused
from llmgw.mirror.refusing import refusing_connector
from llmgw.sourcecheck import Address, carried_ipv4

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(values: Sequence[str], flag: str) -> tuple[Network, ...]:
    """The values of ``flag`` (an IP address or a CIDR network each; host bits allowed) as networks.

    Raises:
        ConfigError: a value is neither, naming ``flag`` and the value.
    """
    out: list[Network] = []
    for v in values:
        try:
            out.append(ipaddress.ip_network(v.strip(), strict=False))
        except ValueError:
            raise ConfigError(f"{flag} '{v}' is not an IP address or network (10.0.0.5, 10.0.0.0/24)") from None
    return tuple(out)


PSEUDO_FS = (pathlib.Path("/proc"), pathlib.Path("/sys"), pathlib.Path("/dev"))
"""Never import directories: their "files" are the kernel's (environment, memory, devices)."""

RESOLVE_TIMEOUT_S = 5.0
"""How long :meth:`SourcePolicy.check_url` waits for DNS; past it the connect-time check decides."""


def _real(p: str | os.PathLike[str]) -> pathlib.Path:
    return pathlib.Path(os.path.realpath(p))


def _inside(path: pathlib.Path, d: pathlib.Path) -> bool:
    return path == d or path.is_relative_to(d)


@dataclass(frozen=True)
class SourcePolicy:
    """What the mirror may fetch. The default allows no ``file:`` source and no private address.

    Attributes:
        import_dirs: real paths of the directories ``file:`` sources may come from.
        deny: real paths no ``file:`` source may come from, import directory or not.
        allow_nets: networks ``http(s):`` connections may reach although not public.
        allow_private: allow every address (``--allow-private-sources``).
        public_only: import only files every local user could read (step 4 of the module docstring).
    """

    import_dirs: tuple[pathlib.Path, ...] = ()
    deny: tuple[pathlib.Path, ...] = ()
    allow_nets: tuple[Network, ...] = ()
    allow_private: bool = False
    public_only: bool = False

    @classmethod
    def build(
        cls,
        *,
        import_dirs: Sequence[str | os.PathLike[str]] = (),
        deny: Sequence[str | os.PathLike[str]] = (),
        allow_nets: Sequence[str] = (),
        allow_private: bool = False,
        public_only: bool = False,
    ) -> SourcePolicy:
        """The policy of ``mirror serve``'s flags.

        An import directory that does not exist (yet, or not for this service: systemd's
        ``ProtectHome=`` hides /home) is kept, and listed by :meth:`missing_dirs` for a warning: a
        mirror that all nodes fetch from must not stay down over it. Its ``file:`` sources fail
        as unreadable until it is there.

        Raises:
            ConfigError: an import directory is not an absolute path, is ``/``, or lies in
                ``/proc``, ``/sys`` or ``/dev``; an ``--allow-source-net`` value is not an IP
                address or network.
        """
        dirs: list[pathlib.Path] = []
        for d in import_dirs:
            given = pathlib.Path(d)
            if not given.is_absolute():
                raise ConfigError(f"--import-dir {d}: give an absolute path (/srv/import)")
            real = _real(given)
            if real == pathlib.Path("/") or any(_inside(real, p) for p in PSEUDO_FS):
                raise ConfigError(
                    f"--import-dir {d}: {real} would let anyone import the system's files or devices; "
                    "give the directory that holds the model files (/srv/import)"
                )
            dirs.append(real)
        nets = parse_networks(allow_nets, "--allow-source-net")
        return cls(tuple(dirs), tuple(_real(p) for p in deny), nets, allow_private, public_only)

    def missing_dirs(self) -> list[pathlib.Path]:
        """The import directories that are not (now) directories."""
        return [d for d in self.import_dirs if not d.is_dir()]

    # --- file: ---

    def open_file(self, path: pathlib.Path, source: str) -> int:
        """Open a ``file:`` source for reading, checked as the module docstring says; returns the fd.

        Raises:
            SourceRefused: outside the import directories, inside a denied one, not a regular
                file, a hard link, or swapped for a symlink while opening.
            OSError: it cannot be opened for another reason (missing, unreadable).
        """
        real = _real(path)
        if any(_inside(real, d) for d in self.deny):
            raise SourceRefused(
                f"{source}: {real} is in llmgw's own configuration or state, which holds its secrets; "
                "the mirror never imports from there"
            )
        home = next((d for d in self.import_dirs if _inside(real, d)), None)
        if home is None:
            where = f"{path}" if real == path else f"{path} (really {real})"
            have = ", ".join(map(str, self.import_dirs)) or "none"
            raise SourceRefused(
                f"{source}: {where} is not inside a directory the mirror imports from (now: {have}); "
                f"copy the file into one, or start the mirror with --import-dir {real.parent}"
            )
        fd = _open_below(home, real.relative_to(home).parts, source if self.public_only else "")
        try:
            _check_opened(fd, real, source, public_only=self.public_only)
        except BaseException:
            os.close(fd)
            raise
        return fd

    # --- http(s): ---

    def refusal(self, ip: Address) -> str:
        """Why a connection to ``ip`` is refused (``"a loopback address"``), or ``""`` when allowed."""
        ip = carried_ipv4(ip)
        if self.allow_private or any(ip in n for n in self.allow_nets):
            return ""
        if not ip.is_global or ip.is_multicast:
            kind = (
                "loopback" if ip.is_loopback
                else "link-local" if ip.is_link_local
                else "unspecified" if ip.is_unspecified
                else "multicast" if ip.is_multicast
                else "private"
            )  # fmt: skip
            return f"a {kind} address"
        if ip in _own_addresses():
            return "this machine's own address"
        return ""

    def refuse_message(self, source: str, host: str, ip: Address, why: str) -> str:
        """The refusal text: ``source``, ``host`` (and ``ip`` when the host is a name), ``why`` (from
        :meth:`refusal`), and the flags that would allow it."""
        ip = carried_ipv4(ip)
        what = f"{ip} is {why}" if host == str(ip) else f"{host} resolves to {ip}, {why}"
        return (
            f"{source}: {what}, which the mirror does not fetch from unless told (a request could "
            "otherwise reach services on this machine or its network); start the mirror with "
            "--allow-source-net <that address or network>, or --allow-private-sources"
        )

    async def check_url(self, url: str, source: str) -> None:
        """Refuse ``url`` at once when its host is, or resolves to, a refused address.

        A host that does not resolve within :data:`RESOLVE_TIMEOUT_S` passes: the download then
        reports the DNS error, and the connect-time check still applies.

        Raises:
            SourceRefused: naming the host, the address and the flag that would allow it.
        """
        host = urllib.parse.urlsplit(url).hostname or ""
        try:
            ips: list[Address] = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                infos = await asyncio.wait_for(
                    asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM),
                    RESOLVE_TIMEOUT_S,
                )
            except (OSError, TimeoutError):
                return
            ips = [ipaddress.ip_address(str(i[4][0]).split("%", 1)[0]) for i in infos]
        for ip in ips:
            if why := self.refusal(ip):
                raise SourceRefused(self.refuse_message(source, host.strip("[]"), ip, why))

    def connector(self) -> aiohttp.TCPConnector:
        """A connector that never connects to a refused address (:func:`~llmgw.mirror.refusing.refusing_connector`:
        checked when each connection is made, so a DNS answer that changes after :meth:`check_url`
        or a redirect to such an address is refused too)."""
        return refusing_connector(self.refusal, lambda host, ip, why: self.refuse_message("the source", host, ip, why))


def _own_addresses() -> set[Address]:
    """Every address on this machine's interfaces (they change, so read at each check)."""
    out: set[Address] = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    out.add(ipaddress.ip_address(a.address.split("%", 1)[0]))
                except ValueError:
                    continue
    return out


def _check_opened(fd: int, real: pathlib.Path, source: str, *, public_only: bool = False) -> None:
    """Refuse an opened descriptor that is not a regular file with one name (and, ``public_only``,
    not readable by others)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SourceRefused(
            f"{source}: {real} is not a regular file (a device, FIFO, socket or directory); give a model file"
        )
    if st.st_nlink != 1:
        raise SourceRefused(
            f"{source}: {real} is a hard link ({st.st_nlink} names), which may be any file on "
            "this filesystem; copy it (cp, not ln) into the import directory"
        )
    if public_only and not st.st_mode & stat.S_IROTH:
        raise SourceRefused(
            f"{source}: {real} is readable only by its owner and group (mode {stat.S_IMODE(st.st_mode):04o}), "
            "and the mirror serves what it holds to anyone who reaches its bytes port, so it would publish "
            "a file other local users cannot read; if it is meant to be served, make it world-readable "
            f"deliberately ('chmod 644 {real}') and try again"
        )


def _check_searchable(fd: int, where: pathlib.Path, source: str) -> None:
    """Refuse a directory (opened as ``fd``) that other users may not search: what it holds is private."""
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if not mode & stat.S_IXOTH:
        raise SourceRefused(
            f"{source}: the directory {where} is closed to other users (mode {mode:04o}), so what it "
            "holds is private, and the mirror serves what it holds to anyone who reaches its bytes port; "
            f"if the file is meant to be served, make the directory searchable deliberately ('chmod o+x "
            f"{where}') or move the file to one that is, and try again"
        )


def _open_below(home: pathlib.Path, parts: Sequence[str], public_for: str = "") -> int:
    """Open ``home/parts…`` for reading without following any symlink below ``home``.

    ``public_for`` (the source, when the policy is ``public_only``): every directory opened,
    ``home`` included, must be searchable by others.

    Raises:
        SourceRefused: a component is (now) a symlink, or a directory is closed to others.
        OSError: missing or unreadable.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(home, flags | os.O_DIRECTORY)
    try:
        for i, part in enumerate(parts):
            if public_for:
                _check_searchable(fd, home.joinpath(*parts[:i]), public_for)
            last = i == len(parts) - 1
            try:
                nxt = os.open(part, flags | (os.O_NONBLOCK if last else os.O_DIRECTORY), dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise SourceRefused(
                        f"{home.joinpath(*parts[: i + 1])} changed into a symlink while the mirror opened it; "
                        "give a plain file inside the import directory"
                    ) from e
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd
