"""Crashes and their backoff: when a failed replica is replaced, and what its successor carries.

The leader's pass (:mod:`llmgw.control.reconcile.leader`, step 3) deletes a ``failed`` replica once
:func:`backoff_s` of its crash count has passed since it failed (10 s doubling to 5 min: a replica
that crashes at start does not restart in a tight loop, one that crashed once is back in 10 s), and
the replica placed in its stead carries ``restarts + 1`` and the error as ``last_error``
(:class:`Carry`). Crashes are forgiven once a replica has been ready for ``backoff_reset_s``
(``ServerConfig.backoff_reset_s``, :data:`BACKOFF_RESET_S` by default): :func:`forgive` sets a ready
replica's ``restarts`` back to 0, and :func:`crashes` counts one that failed after being ready that
long as a first crash, so a crash after weeks of service waits 10 s, not the 5 min its history
would give it. Restarts an operator asks for (``POST /api/v1/replicas/{id}/restart``, which keeps
``restarts`` as it was) are not crashes and are not counted.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace

from llmgw.control.store import ReplicaRow, Store
from llmgw.errors import Conflict
from llmgw.protocol import ReplicaState

log = logging.getLogger(__name__)

#: A failed replica is replaced after 10 s, then 20, 40 … capped at 5 min: a single crash is
#: retried soon, and an engine that keeps crashing is not reloaded every 10 s.
BACKOFF_FIRST_S = 10.0
BACKOFF_MAX_S = 300.0

#: A replica ready this long has its crash count reset, so a crash after weeks of service waits
#: 10 s again, not the 5 min its history would give it (``ServerConfig.backoff_reset_s``).
BACKOFF_RESET_S = 600.0


def backoff_s(restarts: int) -> float:
    """Seconds a failed replica waits before it is replaced: 10 s doubling per restart, at most 300."""
    return min(BACKOFF_FIRST_S * float(2 ** max(restarts, 0)), BACKOFF_MAX_S)


@dataclass(frozen=True)
class Carry:
    """What a replaced replica hands to the replica placed in its stead: its crash count (restarts)
    and its last error."""

    restarts: int
    last_error: str


def crashes(r: ReplicaRow, reset_s: float) -> int:
    """The crashes the backoff counts for ``r``: ``r.restarts``, or 0 when it failed after being
    ready for ``reset_s`` seconds (the reset of :func:`forgive` may not have run yet)."""
    ready_long = r.ready_at is not None and r.updated_at - r.ready_at >= reset_s
    return 0 if r.state == ReplicaState.FAILED and ready_long else r.restarts


def due(r: ReplicaRow, now: float, reset_s: float) -> bool:
    """Whether ``r`` is ``failed`` and its backoff (:func:`backoff_s` of :func:`crashes`) has passed
    at ``now`` (unix seconds)."""
    return r.state == ReplicaState.FAILED and now - r.updated_at >= backoff_s(crashes(r, reset_s))


def forgive(store: Store, replicas: list[ReplicaRow], now: float, reset_s: float) -> list[ReplicaRow]:
    """Reset ``restarts`` of every replica ready for ``reset_s`` seconds at ``now``; returns the
    replicas as now stored. A row that changed meanwhile (:class:`Conflict`) is left for the next pass."""
    out = []
    for r in replicas:
        if r.restarts and r.state == ReplicaState.READY and r.ready_at is not None and now - r.ready_at >= reset_s:
            with contextlib.suppress(Conflict):
                r = store.update_replica(replace(r, restarts=0))  # noqa: PLW2901
                log.info("replica %s: ready for %.0f s; its crash count is reset", r.id, now - (r.ready_at or now))
        out.append(r)
    return out
