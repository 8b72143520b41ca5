"""How fast the dashboard's login may be guessed: exponential backoff on wrong tokens, counted per
client address, for all addresses together, and per known browser (a device cookie).

The rule (docs/operating.md, "The dashboard"):

- Every wrong token counts against *keys*. A browser presenting a valid device cookie (given by
  this cluster at a successful login, :class:`DeviceCookies`) counts against that browser alone;
  any other login counts against its client address (the socket's peer; IPv6 by its /64) and
  against the global key shared by all addresses.
- A key's first ``free`` wrong tokens cost nothing; the n-th one after them closes the key for
  ``base_s * 2**(n-1)`` seconds, at most ``cap_s`` (1, 2, 4, ... 60 s by default). While any of a
  login's keys is closed, the login is answered 429 with ``Retry-After`` and its token is neither
  compared nor counted, so a guesser's long-run pace is one guess per ``cap_s`` per address, and
  one per ``cap_s`` for all addresses together (:data:`GLOBAL`).
- A key is forgotten ``forget_s`` after its last wrong token (15 min); a right token forgets the
  address's (or the browser's) count, not the global one.

What it does not guarantee, and why the operator is never locked out for good: an attacker who keeps
guessing keeps its address and the global key closed, which also closes them to an operator with no
device cookie (say, the same loopback address over an SSH tunnel); each wait is at most ``cap_s``,
but the attacker may take the next free slot first. A browser that has logged in before (within
:data:`DEVICE_TTL_S`) is counted on its own key, which an attacker without that cookie cannot
touch, so it logs in whatever the attack (the device-cookie scheme of OWASP's "Slow Brute Force
Protection"). Counts live in the control plane's memory: a restart forgets them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

GLOBAL = "all"
"""The key every login without a device cookie counts against."""

DEVICE_TTL_S = 30 * 86400
"""How long a device cookie is good for (seconds): a month without a login and the browser is a
stranger again."""


@dataclass
class _Count:
    wrong: int = 0
    last: float = 0.0
    closed_until: float = 0.0


@dataclass(frozen=True)
class Rule:
    """One backoff: ``free`` wrong tokens, then waits of ``base_s``, doubling, at most ``cap_s``
    (seconds)."""

    free: int
    base_s: float = 1.0
    cap_s: float = 60.0

    def wait_after(self, wrong: int) -> float:
        """Seconds the key stays closed after its ``wrong``-th wrong token (0 while free)."""
        over = wrong - self.free
        if over <= 0:
            return 0.0
        return min(self.cap_s, self.base_s * float(2 ** min(over - 1, 32)))


@dataclass
class LoginThrottle:
    """The counts of :mod:`this module's <llmgw.control.ui.throttle>` rule, in memory.

    Keys are strings: ``addr:<address>``, ``device:<id>`` and :data:`GLOBAL`. ``per_key`` applies to
    addresses and devices, ``shared`` to :data:`GLOBAL`. At most ``max_keys`` keys are kept (the
    oldest goes first): an attacker with many addresses still meets the global key.

    Use :meth:`closed_for` then, in the same step (no ``await`` between: the check and the count
    must not interleave with another login), :meth:`wrong` or :meth:`right`.
    """

    per_key: Rule = field(default_factory=lambda: Rule(free=5))
    shared: Rule = field(default_factory=lambda: Rule(free=20))
    forget_s: float = 900.0
    max_keys: int = 4096
    clock: Callable[[], float] = time.monotonic
    _counts: dict[str, _Count] = field(default_factory=dict)

    def closed_for(self, keys: Sequence[str]) -> float:
        """Seconds until every one of ``keys`` is open again (0: the login may be checked)."""
        now = self.clock()
        waits = [c.closed_until - now for k in keys if (c := self._counts.get(k)) is not None]
        return max([0.0, *waits])

    def wrong(self, keys: Sequence[str]) -> float:
        """Count a wrong token against ``keys``; returns the longest wait it started (seconds)."""
        now = self.clock()
        self._forget(now)
        longest = 0.0
        for key in keys:
            c = self._counts.pop(key, None) or _Count()
            c.wrong += 1
            c.last = now
            wait = (self.shared if key == GLOBAL else self.per_key).wait_after(c.wrong)
            c.closed_until = now + wait
            longest = max(longest, wait)
            self._counts[key] = c  # re-inserted: the dict stays in order of last wrong token
        while len(self._counts) > self.max_keys:
            oldest = next(k for k in self._counts if k != GLOBAL)
            del self._counts[oldest]
        return longest

    def right(self, keys: Sequence[str]) -> None:
        """A right token: forget the counts of ``keys`` but the global one."""
        for key in keys:
            if key != GLOBAL:
                self._counts.pop(key, None)

    def _forget(self, now: float) -> None:
        for key in [k for k, c in self._counts.items() if now - c.last > self.forget_s]:
            del self._counts[key]


def address_key(remote: str | None) -> str:
    """The key of a client address: ``addr:`` and the address; an IPv6 address by its /64 (one
    host usually holds a whole /64); unparsable or missing addresses share ``addr:?``."""
    try:
        ip = ipaddress.ip_address(remote or "")
    except ValueError:
        return "addr:?"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return f"addr:{ip.ipv4_mapped}"
        return f"addr:{ipaddress.ip_network((ip, 64), strict=False)}"
    return f"addr:{ip}"


def retry_after(seconds: float) -> str:
    """``Retry-After``'s value: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(seconds)))


@dataclass(frozen=True)
class DeviceCookies:
    """Signed cookies naming a browser that logged in: ``<id>.<expires>.<mac>``, the id random
    (96 bits), ``expires`` unix seconds, the mac HMAC-SHA256 over both under a key derived from
    the admin token (so every control plane of a cluster accepts it, a restart keeps it, and a new
    admin token ends them all). They carry no right: only which throttle key a login counts on."""

    secret: bytes
    ttl_s: float = DEVICE_TTL_S
    wall: Callable[[], float] = time.time

    @classmethod
    def from_admin_token(cls, token: str) -> DeviceCookies:
        """The cookies of the cluster whose admin token is ``token``."""
        return cls(hmac.new(token.encode(), b"llmgw dashboard device cookie v1", hashlib.sha256).digest())

    def _mac(self, body: str) -> str:
        digest = hmac.new(self.secret, body.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def issue(self) -> str:
        """A new cookie value, good for ``ttl_s`` seconds."""
        body = f"{secrets.token_urlsafe(12)}.{int(self.wall() + self.ttl_s)}"
        return f"{body}.{self._mac(body)}"

    def device(self, value: str | None) -> str | None:
        """The device id a cookie value names, or None when it is absent, forged or expired."""
        if not value or value.count(".") != 2:
            return None
        ident, expires, mac = value.split(".")
        if not hmac.compare_digest(mac.encode(), self._mac(f"{ident}.{expires}").encode()):
            return None
        if not expires.isdigit() or int(expires) < self.wall():
            return None
        return ident
