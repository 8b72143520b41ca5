"""Who is calling the gateway: API keys from the store and from ``gateway.keys_file``, as :class:`Caller`\\ s.

The hot path never reaches the database. :class:`Callers` holds a dict from a key's SHA-256 to its
:class:`Caller`, rebuilt by the accounting loop (:mod:`llmgw.control.gateway.accounting`) from
:meth:`~llmgw.control.store.base.Store.list_keys` every ``SYNC_S`` (0.5 s): a key revoked or rotated on
any control plane is refused on every one within about a second (the poll plus the store call). The
control plane whose admin API made the change does not wait for its poll: the API hands the written
row to :meth:`Callers.put` before it answers (:mod:`llmgw.control.api.keys`), so a key made there
works there, and a key revoked there is refused there, from the API's answer on. A read of the
stored keys that began before such a put may predate the write; it is not used (the next one is). An
expired key is refused from the first request after ``expires_at`` (checked against the wall clock
on each lookup, ~0.1 µs). A lookup is one SHA-256 of the presented key (~0.7 µs) and one dict probe,
so it takes the same time for every wrong key.

Keys from ``gateway.keys_file`` keep working (installs from before keys were stored): they have no
limits and are named ``keys-file`` in usage, metrics and the access log.

**Bounded staleness** (``stale_after_s``; the control plane uses :data:`KEYS_STALE_S`, 5 s): a control
plane that cannot read the keys from the database (cut off from it, or its store calls stuck) cannot
learn of a revocation made on another one. Once its last successful read of the stored keys is older
than the bound, every *stored* key is answered 503 ``keys_unavailable`` with ``Retry-After`` (the
client retries, or goes to another control plane) instead of being let in on a table that may be
stale; the next successful read lets them in again. Keys from ``gateway.keys_file`` and loopback
clients without a key do not depend on the database and are unaffected. So a revoked key works on a
cut-off control plane for at most ``stale_after_s`` plus one sync (0.5 s) after its last good read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field

from llmgw.apikeys import FILE_CALLER_NAME, LOOPBACK_CALLER_NAME
from llmgw.control.gateway.keys import GatewayKeys, digest
from llmgw.control.store.rows import ApiKeyRow
from llmgw.guard.config import key_id

#: Seconds after the last successful read of the stored keys past which they are refused with 503
#: (module docstring): 10 syncs of 0.5 s, so a store call that is slow once (a failover's first
#: seconds, a busy database) does not refuse keys, while a revocation is honoured within ~5.5 s.
KEYS_STALE_S = 5.0
#: ``Retry-After`` (seconds) on the 503 for stale keys: about one sync, or time to try another
#: control plane.
STALE_RETRY_AFTER_S = 2


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated client: its name and what it may do.

    Attributes:
        name: the key's name (a label value for usage and metrics; from the store, never request text).
        models: the model names or aliases it may use; None for every model.
        rpm: requests per minute, None for no limit.
        tpm: tokens (prompt + completion) per minute, None for no limit.
        budget_tokens: tokens per ``budget_period`` (``day`` or ``month``, UTC), None for no budget.
        expires_at: unix seconds after which the key is refused; None never.
        priority: the key's band in the gateway's queue (0-9, higher served first,
            :mod:`llmgw.control.gateway.queue`); 0 for keys from the keys file (one key a line, no
            fields) and loopback clients.
    """

    name: str
    models: frozenset[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    budget_tokens: int | None = None
    budget_period: str = ""
    expires_at: float | None = None
    priority: int = 0

    @property
    def limited(self) -> bool:
        """Whether any limit or budget applies (the limiter skips callers without one)."""
        return self.rpm is not None or self.tpm is not None or self.budget_tokens is not None

    @property
    def counts_tokens(self) -> bool:
        """Whether tokens count against a limit (``tpm`` or a budget): then what a request may use is
        held while it is in flight (:meth:`~llmgw.control.gateway.limits.Limiter.admit`)."""
        return self.tpm is not None or self.budget_tokens is not None


FILE_CALLER = Caller(FILE_CALLER_NAME)
LOOPBACK_CALLER = Caller(LOOPBACK_CALLER_NAME)


def caller_of(row: ApiKeyRow) -> Caller:
    """The :class:`Caller` of a stored key."""
    return Caller(
        name=row.name,
        models=frozenset(row.models) if row.models else None,
        rpm=row.rpm,
        tpm=row.tpm,
        budget_tokens=row.budget_tokens,
        budget_period=row.budget_period if row.budget_tokens is not None else "",
        expires_at=row.expires_at,
        priority=row.priority,
    )


@dataclass(eq=False, repr=False)
class Callers:
    """Key digest → :class:`Caller`, for the stored keys and the keys file.

    Args:
        file_keys: ``gateway.keys_file``'s keys (followed as the file changes), or a fixed set.
        clock: wall-clock seconds, for expiry (injected for tests).
        stale_after_s: seconds after the last :meth:`set_rows` past which stored keys are
            :meth:`stale` (module docstring); None: never (no store behind them).
        monotonic: monotonic seconds, for staleness (injected for tests).
    """

    file_keys: GatewayKeys
    _: KW_ONLY
    clock: Callable[[], float] = time.time
    stale_after_s: float | None = None
    monotonic: Callable[[], float] = time.monotonic
    by_name: dict[str, Caller] = field(default_factory=dict, init=False)
    #: How many :meth:`put` calls there were: a reader takes it before reading the stored keys and
    #: gives it to :meth:`set_rows` (``since``), which drops a read that a put overtook.
    writes: int = field(default=0, init=False)
    _read_at: float = field(init=False)
    _rows: dict[str, ApiKeyRow] = field(default_factory=dict, init=False)
    _stored: dict[bytes, Caller] = field(default_factory=dict, init=False)
    #: Digests of revoked stored keys: refused even when the keys file has the same secret (it made a
    #: revoked key a keys-file key, with no limits, a new user's finding).
    _revoked: frozenset[bytes] = field(default=frozenset(), init=False)
    _seen: tuple[tuple[str, int], ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        self._read_at = self.monotonic()

    def set_rows(self, rows: Iterable[ApiKeyRow], *, since: int | None = None) -> bool:
        """Use these stored keys from now on (revoked ones left out); True when anything changed.

        Cheap when nothing changed: rows are compared by (name, revision) first. Call it after every
        successful read of the stored keys, changed or not: it restarts the staleness clock.

        Args:
            rows: every stored key, by name (:meth:`~llmgw.control.store.base.Store.list_keys`).
            since: :attr:`writes` as it was when the read began. When a :meth:`put` came since, the
                read may be from before that write: it is not used (False; the staleness clock
                still restarts: the store answered). None: use the rows whatever came since.
        """
        self._read_at = self.monotonic()
        if since is not None and since != self.writes:
            return False
        rows = list(rows)
        seen = tuple((r.name, r.revision) for r in rows)
        if seen == self._seen:
            return False
        self._use({r.name: r for r in rows})
        return True

    def put(self, row: ApiKeyRow) -> bool:
        """Use one stored key as this control plane just wrote it (made, changed, rotated or revoked),
        without waiting for the next read of every key; True when it was used.

        A row older than the one held (a lower revision: another control plane changed the key since,
        and it was read already) is not used (False). Reads that began before this call are not used
        either (:meth:`set_rows`' ``since``). Costs a rebuild of the table (admin writes are rare).
        """
        self.writes += 1
        held = self._rows.get(row.name)
        if held is not None and held.revision > row.revision:
            return False
        self._use(dict(sorted({**self._rows, row.name: row}.items())))
        return True

    def _use(self, rows: dict[str, ApiKeyRow]) -> None:
        """Rebuild the lookup tables from ``rows`` (name → row, by name), revoked keys left out."""
        live = [r for r in rows.values() if r.revoked_at is None]
        self._stored = {bytes.fromhex(r.digest): caller_of(r) for r in live}
        self._revoked = frozenset(bytes.fromhex(r.digest) for r in rows.values() if r.revoked_at is not None)
        self.by_name = {r.name: caller_of(r) for r in live}
        self._rows = rows
        self._seen = tuple((r.name, r.revision) for r in rows.values())

    def lookup(self, key: str) -> Caller | None:
        """The caller presenting ``key`` (a bearer key as sent), or None when it is not a valid key:
        unknown, revoked, or expired. A stored key's revocation or expiry holds even when the keys
        file has the same secret (the file does not bring it back, without limits)."""
        d = digest(key)
        caller = self._stored.get(d)
        if caller is not None:
            if caller.expires_at is not None and caller.expires_at <= self.clock():
                return None
            return caller
        return FILE_CALLER if d not in self._revoked and d in self.file_keys.digests() else None

    def stale(self, caller: Caller) -> float | None:
        """Seconds since the stored keys were last read, when ``caller`` is a stored key's and that is
        past ``stale_after_s`` (it may have been revoked since: refuse it with 503); else None."""
        if self.stale_after_s is None or caller is FILE_CALLER or caller is LOOPBACK_CALLER:
            return None
        age = self.monotonic() - self._read_at
        return age if age > self.stale_after_s else None

    def may_use(self, caller: Caller, requested: str, model: str, resolve: Callable[[str], str | None]) -> bool:
        """Whether ``caller`` may use the model the client asked as ``requested`` (resolved to ``model``).

        A key's ``models`` may hold names or aliases: the request is allowed when it names one of them
        or when one of them resolves (``resolve``: name or alias → catalog name) to the same model.
        """
        allowed = caller.models
        if allowed is None or requested in allowed or model in allowed:
            return True
        return any(resolve(m) == model for m in allowed)


def presented_key_id(headers: Mapping[str, str]) -> str:
    """The id (:func:`llmgw.guard.config.key_id`) of the key the request was let in with, for the
    inspector's policies: its ``Authorization: Bearer`` key, else its ``x-api-key`` (as
    the gateway's ``authenticate`` takes them); "" without one. Only the bearer key was read, so a key
    sent as ``x-api-key`` escaped every policy scoped to it with ``keys:`` (a new user's finding)."""
    scheme, _, key = headers.get("Authorization", "").partition(" ")
    key = key.strip()
    if scheme.lower() == "bearer" and key:
        return key_id(key)
    x_key = headers.get("x-api-key", "").strip()
    return key_id(x_key) if x_key else ""
