"""Model sources: which strings name weights llmgw can fetch, and how.

A catalog ``source`` is one of three forms:

- ``hf:ORG/REPO/FILE`` — a file in a Hugging Face model repository, at ``main``. ``FILE`` may hold
  slashes (``hf:org/repo/q4/model.gguf``). It becomes
  ``{HF_ENDPOINT or https://huggingface.co}/ORG/REPO/resolve/main/FILE``, with
  ``Authorization: Bearer <token>`` when a token is found (``HF_TOKEN``, else the token file that
  ``huggingface-cli login`` writes: ``$HF_HOME/token`` or ``~/.cache/huggingface/token``).
  aiohttp drops the header when Hugging Face redirects to its CDN on another host.
  Hugging Face publishes the sha256 of an LFS file: a ``HEAD`` of the resolve URL, redirects not
  followed, answers ``X-Linked-Etag`` (else ``ETag``) holding it, and ``X-Linked-Size`` its size
  (huggingface_hub's ``get_hf_file_metadata`` reads the same headers). A file kept in git itself
  has a 40-hex git blob id there instead, which is no sha256: :func:`hf_published_sha256` returns
  ``""`` for it and the download is then checked against nothing published.
- ``https://…`` or ``http://…`` — fetched as is.
- ``file:/abs/path`` (or ``file:///abs/path``) — a file already on the mirror's machine: how an
  offline cluster carries a model in. The mirror copies it; nothing is downloaded.

Anything else raises :class:`~llmgw.errors.SourceError` naming the source, the reason and the
accepted forms. Only the form is checked here: whether the file exists or the URL answers is
found out when the mirror fetches it.
"""

from __future__ import annotations

import ipaddress
import os
import pathlib
import re
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from llmgw.errors import SourceError

HF_DEFAULT_ENDPOINT = "https://huggingface.co"

FORMS = "hf:ORG/REPO/FILE, https://HOST/PATH, http://HOST/PATH or file:/ABSOLUTE/PATH"
"""The accepted forms, as error messages quote them."""

Kind = Literal["file", "http", "hf"]


@dataclass(frozen=True)
class Download:
    """How to fetch one source.

    Attributes:
        kind: ``"file"`` (copy ``path``), ``"http"`` or ``"hf"`` (GET ``url`` with ``headers``).
        url: the URL to GET; for ``file`` the path as a ``file://`` URI, for messages.
        path: the local file for ``file``; ``None`` otherwise.
        headers: request headers, e.g. the Hugging Face ``Authorization``; kept out of ``repr``.
    """

    kind: Kind
    url: str
    path: pathlib.Path | None = None
    headers: dict[str, str] = field(default_factory=dict, repr=False)


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def hf_published_sha256(headers: Mapping[str, str]) -> str:
    """The LFS sha256 (lower-case hex) a Hugging Face resolve answer publishes, or ``""``.

    ``headers`` are those of a ``HEAD`` of the resolve URL without following redirects:
    ``X-Linked-Etag``, else ``ETag``, with ``W/`` and quotes stripped. Only a 64-hex value is a
    sha256 (a git blob id is 40 hex and is ignored). Lookups are case-insensitive when ``headers``
    is (aiohttp's and httpx's are).
    """
    raw = headers.get("X-Linked-Etag") or headers.get("ETag") or ""
    tag = raw.strip().removeprefix("W/").strip('"').lower()
    return tag if _SHA256_HEX.fullmatch(tag) else ""


def hf_published_size(headers: Mapping[str, str]) -> int | None:
    """The file's size a Hugging Face resolve ``HEAD`` publishes (``X-Linked-Size``), or None."""
    try:
        return int(headers.get("X-Linked-Size", ""))
    except ValueError:
        return None


def is_download(source: str) -> bool:
    """Whether ``source`` has one of the accepted forms (see the module docstring)."""
    try:
        to_download(source, env={}, home=pathlib.Path("/nonexistent"))
    except SourceError:
        return False
    return True


def to_download(
    source: str, *, env: Mapping[str, str] | None = None, home: pathlib.Path | None = None
) -> Download:
    """Turn a catalog source into a :class:`Download`.

    Args:
        source: ``hf:ORG/REPO/FILE``, ``https://…``, ``http://…`` or ``file:/abs/path``.
        env: the environment to read ``HF_ENDPOINT``, ``HF_TOKEN`` and ``HF_HOME`` from
            (default ``os.environ``).
        home: the home directory holding ``.cache/huggingface/token`` (default the user's).

    Raises:
        SourceError: "cannot turn SOURCE into a download: REASON; use one of …".
    """
    env = os.environ if env is None else env
    s = source.strip()
    if s.startswith("hf:"):
        return _hf(source, s[3:], env, home)
    if s.startswith("file:"):
        return _file(source, s)
    scheme = s.partition(":")[0].lower()
    if scheme in ("http", "https"):
        parts = urllib.parse.urlsplit(s)
        if not parts.hostname:
            raise _bad(source, "the URL has no host")
        if not parts.path.strip("/"):
            raise _bad(source, "the URL names no file")
        return Download(kind="http", url=s)
    if not s:
        raise _bad(source, "it is empty")
    raise _bad(source, f"'{scheme}:' is not a source scheme" if ":" in s else "it has no scheme")


def _hf(source: str, rest: str, env: Mapping[str, str], home: pathlib.Path | None) -> Download:
    segs = rest.split("/")
    if len(segs) < 3:
        raise _bad(source, "hf: needs ORG/REPO/FILE, three parts at least")
    if any(not p for p in segs):
        raise _bad(source, "it has an empty part between slashes")
    if any(p in (".", "..") for p in segs):
        raise _bad(source, "'.' and '..' are not allowed in an hf: path")
    org, repo, file = segs[0], segs[1], "/".join(segs[2:])
    endpoint = (env.get("HF_ENDPOINT") or HF_DEFAULT_ENDPOINT).rstrip("/")
    url = f"{endpoint}/{org}/{repo}/resolve/main/{urllib.parse.quote(file, safe='/')}"
    token = _hf_token(env, home)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return Download(kind="hf", url=url, headers=headers)


def _hf_token(env: Mapping[str, str], home: pathlib.Path | None) -> str:
    """HF_TOKEN, else the token file huggingface-cli writes; ``""`` when neither is there."""
    if token := env.get("HF_TOKEN", "").strip():
        return token
    if hf_home := env.get("HF_HOME"):
        candidates = [pathlib.Path(hf_home) / "token"]
    else:
        candidates = [(home or pathlib.Path.home()) / ".cache" / "huggingface" / "token"]
    for path in candidates:
        try:
            return path.read_text().strip()
        except OSError:
            continue
    return ""


def _file(source: str, s: str) -> Download:
    rest = s[len("file:") :]
    if rest.startswith("//"):
        parts = urllib.parse.urlsplit(s)
        if parts.netloc not in ("", "localhost"):
            raise _bad(source, f"file: URLs name this machine only, not '{parts.netloc}'")
        rest = parts.path
    rest = urllib.parse.unquote(rest)
    path = pathlib.PurePosixPath(rest)
    if not path.is_absolute():
        raise _bad(source, "a file: path must be absolute (file:/srv/in/model.gguf)")
    if ".." in path.parts:
        raise _bad(source, "'..' is not allowed in a file: path")
    if rest.endswith("/"):
        raise _bad(source, "it names a directory, not a file")
    real = pathlib.Path(rest)
    return Download(kind="file", url=real.as_uri(), path=real)


def _bad(source: str, reason: str) -> SourceError:
    return SourceError(f"cannot turn '{source}' into a download: {reason}; use one of {FORMS}")


Address = ipaddress.IPv4Address | ipaddress.IPv6Address

#: NAT64's well-known prefix (RFC 6052): a NAT64 gateway connects ``64:ff9b::a.b.c.d`` to ``a.b.c.d``.
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def carried_ipv4(ip: Address) -> Address:
    """``ip``, or the IPv4 address an IPv6 one carries: IPv4-mapped (``::ffff:a.b.c.d``),
    IPv4-compatible (``::a.b.c.d``, deprecated), NAT64's prefix (:data:`NAT64`) and 6to4
    (``2002::/16``). Each refusal of loopback, private or link-local addresses asks about this one:
    Python 3.11 takes ``::7f00:1`` and ``64:ff9b::a9fe:a9fe`` as global addresses, and only the
    mapped form was unwrapped (a security tester's finding)."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return ip
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in NAT64 or (int(ip) >> 32 == 0 and int(ip) > 1):  # ::a.b.c.d, but not :: or ::1
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour or ip


def host_address(host: str) -> Address | None:
    """``host`` (a URL's host) as the address a resolver makes of it, or None for a name: IPv6 in
    brackets (a zone dropped), and IPv4 in every form ``inet_aton`` reads (``0xa9fea9fe``,
    ``2852039166``, ``169.254.43518``), as the agent's resolver does."""
    text = host.strip("[]").split("%", 1)[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    if not text or not all(c.isalnum() or c == "." for c in text) or not text.isascii():
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(text))
    except OSError:
        return None


def link_local(host: str) -> Address | None:
    """``host`` (a URL's host, or an address a name resolved to) as an address when it is link-local
    (169.254.0.0/16, fe80::/10, or carried in IPv6: :func:`carried_ipv4`), else None. Clouds serve
    instance metadata and credentials there (169.254.169.254, fd00:ec2::254 aside); no mirror lives
    there, so nodes, which fetch a catalog source as root, refuse it (a new user pointed a model's
    source at http://169.254.169.254/x and the agent fetched it; ``http://0xa9fea9fe/`` passed the
    admin API's check, a security tester's finding)."""
    ip = host_address(host)
    if ip is None:
        return None
    ip = carried_ipv4(ip)
    return ip if ip.is_link_local else None


LINK_LOCAL_FIX = "nodes never download weights from a link-local address (a cloud's metadata service lives there); " \
    "use the mirror's URL ('llmgw mirror ls')"
"""The end of the refusal of a link-local source, for the control plane's and the agent's messages."""
