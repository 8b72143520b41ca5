"""The gateway's API keys: ``gateway.keys_file``, re-read when it changes and on SIGHUP.

The file holds one key per line; blank lines and lines starting with ``#`` are skipped. A key is
1-1024 visible ASCII characters (``!`` to ``~``, no spaces): what a client can send in an
``Authorization: Bearer`` header. Anything else on a line is an error that names the line, never its
content (it may be a secret).

Mechanism: :meth:`GatewayKeys.digests` is asked on every request. At most once a second
(``check_every_s``) it ``stat``\\s the file (one system call, ~2 µs) and compares inode, device,
size, mtime and ctime with what it last read; only a difference makes it read the file again. So a
key removed from the file is refused from the first request at most a second after the change,
and a busy gateway costs the disk one ``stat`` a second. :meth:`GatewayKeys.reload` re-reads it
unconditionally (the control plane calls it on SIGHUP).

A file that cannot be read or holds an invalid line keeps the last good keys: the error is logged
once per version of the file (ERROR, naming the file, the line and the keys still in use), and
the next change or SIGHUP tries again. A read whose file changed while it was read (an editor
writing in place) is not used; the next check reads the finished file. At startup the same errors
are a :class:`~llmgw.errors.ConfigError` (there are no last good keys to keep).

Keys are held as SHA-256 digests, so a lookup takes the same time for every wrong key.

Not guaranteed: that a request already past the key check when a key is removed is stopped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from llmgw.bearer import sent_bytes
from llmgw.errors import ConfigError

log = logging.getLogger(__name__)

#: How often the request path looks at the file (s): "a removed key is refused within a second".
CHECK_EVERY_S = 1.0
#: A keys file larger than this is refused (it would be read on the event loop).
MAX_FILE_BYTES = 1 << 20
MAX_KEY_CHARS = 1024

_Signature = tuple[int, int, int, int, int]


def digest(key: str) -> bytes:
    """The SHA-256 of a key as sent (its bytes: :func:`llmgw.bearer.sent_bytes`), the form keys are
    compared in."""
    return hashlib.sha256(sent_bytes(key)).digest()


def parse_keys(text: str, path: Path) -> set[str]:
    """The keys in a keys file's ``text`` (see the module docstring).

    Raises:
        ConfigError: a line is not a key; the message names ``path`` and the line number.
    """
    keys: set[str] = set()
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if len(s) > MAX_KEY_CHARS or not all("!" <= c <= "~" for c in s):
            raise ConfigError(
                f"gateway.keys_file {path}: line {n} is not a key (one key per line: 1-{MAX_KEY_CHARS} "
                "visible ASCII characters, no spaces; '#' starts a comment line)"
            )
        keys.add(s)
    return keys


def _signature(st: os.stat_result) -> _Signature:
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _read(path: Path) -> tuple[_Signature, set[str]]:
    """The file's signature and keys. Raises ConfigError (unreadable, too big, not UTF-8, bad line)."""
    try:
        with path.open("rb") as f:
            before = os.fstat(f.fileno())
            if before.st_size > MAX_FILE_BYTES:
                raise ConfigError(
                    f"gateway.keys_file {path} is {before.st_size} bytes; a keys file holds at most "
                    f"{MAX_FILE_BYTES} bytes"
                )
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError as e:
        raise ConfigError(
            f"gateway.keys_file {path} does not exist; create it with one key per line or remove the setting"
        ) from e
    except OSError as e:
        raise ConfigError(
            f"gateway.keys_file {path} cannot be read ({e.strerror}); let the control plane's user read it "
            "(it runs as 'llmgw' on an installed server) or remove the setting"
        ) from e
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"gateway.keys_file {path} is not UTF-8 text: line {line} has byte 0x{data[e.start]:02x}; "
            "a key is visible ASCII characters"
        ) from e
    return _signature(before), parse_keys(text, path)


class GatewayKeys:
    """The keys clients may send, from a file (reloaded, see the module docstring) or fixed.

    Args:
        path: ``gateway.keys_file``; None for a fixed set (``initial``) that never changes.
        initial: the keys when ``path`` is None; ignored otherwise.
        clock: monotonic seconds (injected for tests).
        check_every_s: the longest a change to the file goes unnoticed on the request path.

    Raises:
        ConfigError: ``path`` cannot be read or is invalid (at construction only).
    """

    def __init__(
        self,
        path: Path | None,
        *,
        initial: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
        check_every_s: float = CHECK_EVERY_S,
    ) -> None:
        self.path = path
        self._clock = clock
        self._every = check_every_s
        self._checked = clock()
        self._seen: _Signature | str | None = None
        self._failure: str | None = None
        keys = set(initial)
        if path is not None:
            self._seen, keys = _read(path)
        self._digests = frozenset(digest(k) for k in keys if k)
        self.count = len(self._digests)

    def digests(self) -> frozenset[bytes]:
        """The current keys' digests; looks at the file first when the last look is a second old."""
        if self.path is not None and (now := self._clock()) - self._checked >= self._every:
            self._checked = now
            self._look()
        return self._digests

    def reload(self, why: str = "SIGHUP") -> bool:
        """Re-read the file now, whatever its stat says; True when new keys are in use.

        ``why`` goes into the log line. Errors are logged (the last good keys stay), never raised.
        """
        if self.path is None:
            log.info("gateway keys: no gateway.keys_file is configured; nothing to reload (%s)", why)
            return False
        self._checked = self._clock()
        return self._load(why)

    def _look(self) -> None:
        assert self.path is not None  # noqa: S101 - only called with a path
        try:
            seen: _Signature | str = _signature(os.stat(self.path))
        except OSError as e:
            seen = f"stat: {e.strerror}"
        if seen != self._seen:
            self._seen = seen
            self._load("it changed")

    def _load(self, why: str) -> bool:
        assert self.path is not None  # noqa: S101 - only called with a path
        try:
            seen, keys = _read(self.path)
            if _signature(os.stat(self.path)) != seen:
                self._seen = None  # being written: the next look reads the finished file
                return False
        except (ConfigError, OSError) as e:
            if str(e) != self._failure:
                log.error("%s; still using the %d keys loaded before (%s)", e, self.count, why)  # noqa: TRY400
            self._failure = str(e)
            return False
        self._seen, self._failure = seen, None
        self._digests = frozenset(digest(k) for k in keys)
        self.count = len(self._digests)
        log.info("gateway.keys_file %s reloaded (%s): %d keys", self.path, why, self.count)
        return True
