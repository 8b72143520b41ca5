"""Group replicas (a profile's ``nodes`` above 1) in the leader's pass: a group whose worker went
or failed fails whole, and is then replaced as any failed replica (:mod:`.restarts`)."""

from __future__ import annotations

import logging
from dataclasses import replace

from llmgw.control.store import ReplicaRow, Store
from llmgw.errors import Conflict
from llmgw.protocol import ReplicaState

log = logging.getLogger(__name__)

#: How a group's error starts when a worker made it fail (the rest names the node and why).
WORKER_FAILED = "group worker on"


def check_members(store: Store, r: ReplicaRow, live: set[str]) -> ReplicaRow:
    """A group replica whose head is live: failed when a worker's node is not (lost, removed)
    or a worker failed, its error naming that node and, for a failed worker, the first line of
    its error (its engine's last lines are on its member entry); a head that already failed
    because its worker went keeps its own first line after that. The whole group is then
    replaced with the usual backoff (:mod:`.restarts`), never half-served."""
    if not r.members or r.err.startswith(WORKER_FAILED):
        return r
    cause = ""
    for m in r.members[1:]:
        if m.node not in live:
            cause = f"{WORKER_FAILED} node {m.node}: the node is not ready (lost or removed)"
            break
        if m.state == ReplicaState.FAILED:
            first = m.err.strip().splitlines()[0] if m.err.strip() else "failed"
            cause = f"{WORKER_FAILED} node {m.node}: {first.removesuffix('; its last lines:')}"
            break
    if not cause:
        return r
    head = r.err.strip().splitlines()[0].removesuffix("; its last lines:") if r.err.strip() else ""
    err = cause + (f"; the head then stopped: {head}" if r.state == ReplicaState.FAILED and head else "")
    try:
        failed = store.update_replica(replace(r, state=ReplicaState.FAILED.value, err=err, endpoint=""))
    except Conflict:
        return r
    log.warning("replica %s: %s; the group is replaced", r.id, err)
    return failed


def where(r: ReplicaRow) -> str:
    """Where a replica runs, for the explanation: its node, or a group's ``a (head) + b + c``."""
    if not r.members:
        return r.node
    return " + ".join([f"{r.node} (head)", *(m.node for m in r.members[1:])])
