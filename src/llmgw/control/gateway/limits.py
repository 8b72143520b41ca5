"""Rate limits and token budgets per key, held cluster-wide: the gateway's admission step.

Per key with limits (:class:`~llmgw.control.gateway.callers.Caller`): ``rpm`` requests and ``tpm``
tokens (prompt + completion) per minute, and ``budget_tokens`` per UTC day or month.

Mechanism. Minutes are fixed windows (unix seconds // 60): a key limited to 600 rpm is admitted 600
requests per calendar minute, however fast it is driven (``bench/limits.py``). The count a decision
reads is this control plane's own count, exact and in memory, plus what the *other* control planes
had written to the store at the last sync (:mod:`llmgw.control.gateway.accounting`, every 0.5 s:
each control plane adds its deltas to ``rate_windows`` and reads the others' sums). So with several
control planes a limit holds within what the others admitted since their last flush, about one
second of traffic, as the issue asks ("within 10% plus one second"). Tokens are known only when an
answer ends: a request is admitted while the tokens used, plus those its key's requests in flight
may use (their prompt's characters / 4 and their ``max_tokens``, held from admission to the end, as
OpenAI's own limiter counts them), are below the limit, so ``tpm`` and budgets go over by at most the
one request admitted last.

Admitted requests count, refused ones do not. Budgets read ``usage_daily`` (every control plane's
tokens, as of the last sync) plus this control plane's tokens not yet synced.

Over a limit: 429 in OpenAI's shape (``code`` ``rate_limit_exceeded``; a spent budget is
``insufficient_quota``, as OpenAI says for an exhausted quota), ``Retry-After`` (whole seconds to the
window's or period's end), and the headers OpenAI's clients read, on every answer to a limited key:
``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests``, ``x-ratelimit-reset-requests``
(e.g. ``12s``, ``1m0s``) and the same three for ``-tokens`` (``tpm``, or the budget when no ``tpm``).

Cost (timeit, this 2-core machine): a key without limits costs one attribute test; one with rpm and tpm
1.6 µs to admit (the header strings are most of it), 0.45 µs to spend.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from llmgw.control.gateway.callers import Caller

WINDOW_S = 60


def window_of(now: float) -> int:
    """The unix second the minute holding ``now`` starts at."""
    return int(now // WINDOW_S) * WINDOW_S


def day_of(now: float) -> str:
    """The UTC day of ``now`` as ``YYYY-MM-DD`` (the usage table's key)."""
    return _day_text(int(now // 86400))


@functools.lru_cache(maxsize=4)
def _day_text(day: int) -> str:
    """Day ``day`` since the epoch as text; kept, since every request asks (``strftime`` ~2 µs a call)."""
    return time.strftime("%Y-%m-%d", time.gmtime(day * 86400))


def period_start(period: str, now: float) -> str:
    """The first UTC day (``YYYY-MM-DD``) of the ``day`` or ``month`` holding ``now``."""
    day = day_of(now)
    return day[:8] + "01" if period == "month" else day


def period_end(period: str, now: float) -> float:
    """Unix seconds at which the ``day`` or ``month`` holding ``now`` ends (UTC)."""
    t = datetime.fromtimestamp(now, UTC)
    if period == "month":
        return datetime(t.year + (t.month == 12), t.month % 12 + 1, 1, tzinfo=UTC).timestamp()
    return datetime(t.year, t.month, t.day, tzinfo=UTC).timestamp() + 86400


def reset_text(seconds: float) -> str:
    """A reset delay the way OpenAI writes it: ``850ms``, ``12s``, ``1m30s``, ``3h2m0s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    s = math.ceil(seconds)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    return f"{m}m{sec}s" if m else f"{sec}s"


@dataclass(slots=True)
class _Minute:
    """One key's counts in one minute window: this control plane's own, and the others' as last read."""

    window: int
    requests: int = 0
    tokens: int = 0
    others_requests: int = 0
    others_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a request is not admitted: the 429's ``code``, message and headers (Retry-After included)."""

    code: str
    message: str
    headers: dict[str, str]


@dataclass
class Limiter:
    """Counts per key and decides admission (see the module docstring).

    Args:
        clock: wall-clock seconds (injected for tests).

    The accounting loop feeds it: :meth:`set_others` (the other control planes' counts per window)
    and :meth:`set_budget_base` (tokens per key and day from the store), and takes :meth:`take_deltas`
    (this control plane's counts since the last take) to write them.
    """

    clock: Callable[[], float] = time.time
    _minutes: dict[str, _Minute] = field(default_factory=dict)
    _pending: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (key, window) -> [req, tok]
    _day_tokens: dict[tuple[str, str], int] = field(default_factory=dict)  # (key, day) -> tokens, store
    _unsynced: dict[str, int] = field(default_factory=dict)  # key -> tokens not yet in _day_tokens
    _syncing: dict[str, int] = field(default_factory=dict)  # key -> tokens being written now
    _inflight: dict[str, int] = field(default_factory=dict)  # key -> tokens held by its requests in flight

    def _minute(self, key: str, now: float) -> _Minute:
        w = window_of(now)
        m = self._minutes.get(key)
        if m is None or m.window != w:
            m = self._minutes[key] = _Minute(w)
        return m

    def admit(self, caller: Caller, hold: int = 0, need: int = 0) -> tuple[Refused | None, dict[str, str]]:
        """Admit (and count) one request of ``caller``, or refuse it. ``hold``: the tokens it may use
        (:func:`~llmgw.control.gateway.body.reserved_tokens`), held against the key's ``tpm`` and
        budget until :meth:`release`, so that requests sent at once cannot all be admitted on tokens
        not yet counted (8 parallel requests of 150 tokens were all admitted against a budget of 200:
        1,472 tokens served, a security tester's finding); the tokens of the requests in flight count
        as used, so a burst goes over by at most one request. ``need``: what its input will cost for
        certain; a request whose input does not fit in what is left is refused (one embeddings
        request of 5,888 tokens was served on a tpm of 200 and a budget of 500, the same tester).

        Returns ``(None, headers)`` when admitted (``headers``: the ``x-ratelimit-*`` to send, empty
        for a caller without limits), or ``(Refused, {})``.
        """
        if not caller.limited:
            return None, {}
        now = self.clock()
        m = self._minute(caller.name, now)
        reset = m.window + WINDOW_S - now
        held = self._inflight.get(caller.name, 0)
        used_req = m.requests + m.others_requests
        used_tok = m.tokens + m.others_tokens + held
        headers: dict[str, str] = {}
        # (limit, used, unit, its name, what this request adds now): a request counts when admitted,
        # its tokens only when it ends
        per_minute = (
            (caller.rpm, used_req, "requests", "requests per minute (RPM)", 1),
            (caller.tpm, used_tok, "tokens", "tokens per minute (TPM)", 0),
        )
        for limit, used, unit, name, adds in per_minute:
            if limit is None:
                continue
            big = unit == "tokens" and need > 0 and used + need > limit
            if used >= limit or big:
                flight = f" ({held} held by requests in flight)" if held and unit == "tokens" else ""
                flight += f", and this request's input is about {need} tokens" if big else ""
                return self._refuse(
                    "rate_limit_exceeded",
                    f"Rate limit reached for key '{caller.name}' on {name}: limit {limit}, used {used}{flight}. "
                    f"Please try again in {reset_text(reset)}.",
                    reset, caller, used_req, used_tok,
                ), {}
            headers[f"x-ratelimit-limit-{unit}"] = str(limit)
            headers[f"x-ratelimit-remaining-{unit}"] = str(limit - used - adds)
            headers[f"x-ratelimit-reset-{unit}"] = reset_text(reset)
        if caller.budget_tokens is not None:
            spent = self.budget_used(caller, now) + held
            ends = period_end(caller.budget_period, now) - now
            if spent >= caller.budget_tokens or (need > 0 and spent + need > caller.budget_tokens):
                flight = f", {held} of them held by requests in flight" if held else ""
                flight += f"; this request's input is about {need} tokens" if spent < caller.budget_tokens else ""
                return self._refuse(
                    "insufficient_quota",
                    f"key '{caller.name}' has used its budget of {caller.budget_tokens} tokens per "
                    f"{caller.budget_period} ({spent} used{flight}); it renews in {reset_text(ends)} (UTC), or "
                    "ask an operator to raise it ('llmgw ctl key')",
                    ends, caller, used_req, used_tok,
                ), {}
            if caller.tpm is None:
                headers["x-ratelimit-limit-tokens"] = str(caller.budget_tokens)
                headers["x-ratelimit-remaining-tokens"] = str(caller.budget_tokens - spent)
                headers["x-ratelimit-reset-tokens"] = reset_text(ends)
        m.requests += 1
        if hold > 0 and caller.counts_tokens:
            self._inflight[caller.name] = held + hold
        p = self._pending.get((caller.name, m.window))
        if p is None:
            self._pending[(caller.name, m.window)] = [1, 0]
        else:
            p[0] += 1
        return None, headers

    def _refuse(
        self, code: str, message: str, reset: float, caller: Caller, used_req: int, used_tok: int
    ) -> Refused:
        headers = {"Retry-After": str(max(1, math.ceil(reset)))}
        if caller.rpm is not None:
            headers["x-ratelimit-limit-requests"] = str(caller.rpm)
            headers["x-ratelimit-remaining-requests"] = str(max(0, caller.rpm - used_req))
            headers["x-ratelimit-reset-requests"] = reset_text(reset if code != "insufficient_quota" else 0)
        if caller.tpm is not None:
            headers["x-ratelimit-limit-tokens"] = str(caller.tpm)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, caller.tpm - used_tok))
            headers["x-ratelimit-reset-tokens"] = reset_text(reset)
        elif caller.budget_tokens is not None and code == "insufficient_quota":
            # a budget without tpm: its three, as on the answers before (they were missing here only)
            headers["x-ratelimit-limit-tokens"] = str(caller.budget_tokens)
            headers["x-ratelimit-remaining-tokens"] = "0"
            headers["x-ratelimit-reset-tokens"] = reset_text(reset)
        return Refused(code, message, headers)

    def release(self, caller: Caller, hold: int) -> None:
        """Give back the ``hold`` tokens :meth:`admit` held for a request of ``caller`` that ended
        (what it used is counted by :meth:`spend`)."""
        if hold <= 0 or not caller.counts_tokens:
            return
        left = self._inflight.get(caller.name, 0) - hold
        if left > 0:
            self._inflight[caller.name] = left
        else:
            self._inflight.pop(caller.name, None)

    def budget_used(self, caller: Caller, now: float) -> int:
        """Tokens ``caller`` used in its budget period so far: the store's sums (every control plane,
        as of the last sync) plus this control plane's tokens not yet written."""
        since = period_start(caller.budget_period, now)
        base = sum(t for (k, d), t in self._day_tokens.items() if k == caller.name and d >= since)
        return base + self._unsynced.get(caller.name, 0) + self._syncing.get(caller.name, 0)

    def spend(self, caller: Caller, tokens: int) -> None:
        """Count ``tokens`` (prompt + completion) that a request of ``caller`` used, when it ended."""
        if not caller.limited or tokens <= 0:
            return
        now = self.clock()
        m = self._minute(caller.name, now)
        m.tokens += tokens
        p = self._pending.get((caller.name, m.window))
        if p is None:
            self._pending[(caller.name, m.window)] = [0, tokens]
        else:
            p[1] += tokens
        if caller.budget_tokens is not None:
            self._unsynced[caller.name] = self._unsynced.get(caller.name, 0) + tokens

    # -- the accounting loop's side ---------------------------------------------------------------
    def take_deltas(self) -> list[tuple[str, int, int, int]]:
        """This control plane's counts since the last take, as ``(key, window, requests, tokens)``;
        its unsynced budget tokens move to "being written" until :meth:`set_budget_base`."""
        out = [(k, w, r, t) for (k, w), (r, t) in self._pending.items()]
        self._pending = {}
        for k, t in self._unsynced.items():
            self._syncing[k] = self._syncing.get(k, 0) + t
        self._unsynced = {}
        return out

    def give_back(self, deltas: list[tuple[str, int, int, int]]) -> None:
        """Deltas from :meth:`take_deltas` that could not be written: keep them for the next sync."""
        for k, w, r, t in deltas:
            p = self._pending.setdefault((k, w), [0, 0])
            p[0] += r
            p[1] += t
        for k, t in self._syncing.items():
            self._unsynced[k] = self._unsynced.get(k, 0) + t
        self._syncing = {}

    def set_others(self, totals: Mapping[tuple[str, int], tuple[int, int]]) -> None:
        """The other control planes' ``(requests, tokens)`` per ``(key, window)`` as just read."""
        now = self.clock()
        w = window_of(now)
        for key, m in self._minutes.items():
            if m.window == w:
                m.others_requests, m.others_tokens = totals.get((key, w), (0, 0))
        for (key, win), (r, t) in totals.items():
            if win == w and key not in self._minutes:
                self._minutes[key] = _Minute(w, others_requests=r, others_tokens=t)

    def set_budget_base(self, day_tokens: Mapping[tuple[str, str], int]) -> None:
        """Tokens per ``(key, day)`` over every control plane, read after this one's deltas were written."""
        self._day_tokens = dict(day_tokens)
        self._syncing = {}
