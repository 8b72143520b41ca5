"""Freeze the leader's lock holder (issue 19 item 2): ``SIGSTOP`` of the PostgreSQL backend that holds
the control planes' advisory lock, on the real Patroni cluster of tests/helpers/hacluster.py.

To PostgreSQL that backend looks alive (its socket is open, it holds the lock), so before the lease
decided, no control plane could lead for the whole freeze (25 s measured twice). Used by
tests/ha/test_frozen_lock.py and bench/failover.py (``frozen_lock_takeover_s``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from llmgw.control.reconcile.election import APP_LEADER, LOCK_KEY, OP_TIMEOUT_S
from tests.ha.load import agreed_leader, cluster_views
from tests.helpers.hacluster import DATABASE, HACluster
from tests.helpers.waits import wait_for

#: The control planes' lease (``cluster.lease_s``, the default the helpers' installs keep), seconds.
LEASE_S = 5.0
#: Seconds the old leader is watched after ``SIGCONT`` for a claim to its old term: its next renewal
#: (``cluster.renew_s``, 1 s) answered or timed out (the election's ``OP_TIMEOUT_S``, 2 s), whichever
#: statement it was in when frozen; its watchdog (every 0.1 s) has stopped it by then anyway, its last
#: renewal being older than the lease; plus 1 s for a resumed process on a loaded machine to get
#: there (a reviewer's finding). 5 s until 2026-12-06.
AFTER_S = 1.0 + OP_TIMEOUT_S + 1.0


@dataclass
class Freeze:
    """What one freeze showed.

    Attributes:
        old: the leader and term before the freeze.
        pid: the frozen backend: ``pg_locks``' holder of the advisory lock, or with
            ``whole_control_plane`` the frozen control plane's own session of the term (which need not
            hold the lock: after an earlier freeze a follower may have taken the lock the leader had
            not yet taken back, and then that follower takes the term by the lock's path).
        app: its ``application_name`` in ``pg_stat_activity``.
        stepped_down_s: seconds from the freeze until the old leader's ``GET /api/v1/health`` said
            ``leader: false`` (None: it never did while watched).
        takeover_s: seconds from the freeze until every live control plane named one leader in a
            higher term (None: not within the wait).
        new: that leader and term.
        after_lease_s: seconds from the old lease's end (its last ``renewed_at`` + :data:`LEASE_S`)
            to the new term's ``since``, both on the database's clock: what the takeover target
            (≤ 2 s after the lease ends) bounds, free of how often the views are read.
        findings: what went wrong (a view naming the old term's leader after its lease, the old
            leader leading its old term after ``SIGCONT``, the frozen backend left running).
    """

    old: tuple[str, int]
    pid: int
    app: str
    stepped_down_s: float | None = None
    takeover_s: float | None = None
    new: tuple[str, int] | None = None
    after_lease_s: float | None = None
    findings: list[str] = field(default_factory=list)


def lock_holder(cluster: HACluster) -> tuple[int, str] | None:
    """``(pid, application_name)`` of the backend holding the election's advisory lock on the primary,
    None when nobody holds it."""
    with cluster.patroni.connect(DATABASE) as conn:
        row = conn.execute(
            "SELECT l.pid, s.application_name FROM pg_locks l JOIN pg_stat_activity s ON s.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.objid = %s AND l.objsubid = 1 AND l.granted"
            " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (LOCK_KEY,),
        ).fetchone()
    return (int(row[0]), str(row[1])) if row else None


def term_session(cluster: HACluster, leader: str, term: int) -> tuple[int, str] | None:
    """``(pid, application_name)`` of ``leader``'s session leading ``term`` (named by the election's
    ``APP_LEADER`` rule, ``llmgw leader term <term> <name>``), None when it has none."""
    app = f"{APP_LEADER}{term} {leader}"[:63]
    with cluster.patroni.connect(DATABASE) as conn:
        row = conn.execute(
            "SELECT pid, application_name FROM pg_stat_activity WHERE application_name = %s"
            " AND datname = current_database()", (app,),
        ).fetchone()
    return (int(row[0]), str(row[1])) if row else None


def _health(cluster: HACluster, name: str) -> dict[str, object] | None:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        r = httpx.get(f"{cluster.cp(name).admin}/api/v1/health", timeout=1)
        if r.status_code == 200:
            return r.json()  # type: ignore[no-any-return]
    return None


def freeze_lock_holder(
    cluster: HACluster, *, within_s: float = 20, after_s: float = AFTER_S, whole_control_plane: bool = False
) -> Freeze:
    """Freeze the lock holder's backend until a new term is agreed on (``within_s`` at most), then
    ``SIGCONT`` it and watch ``after_s`` seconds more (module docstring). With
    ``whole_control_plane`` the leading control plane's process is frozen instead: its backend stays
    idle and alive, as the server sees a leader cut off by the network (its kernel still answers
    keepalives, so only the lease can end it); its health is then not asked during the freeze.

    Raises:
        AssertionError: no agreed leader before the freeze, or nobody holds the lock.
    """
    old = wait_for("an agreed leader", lambda: agreed_leader(cluster), 30, 0.2)
    if whole_control_plane:
        held = wait_for("the leader's session", lambda: term_session(cluster, *old), 10, 0.2)
    else:
        held = wait_for("the advisory lock's holder", lambda: lock_holder(cluster), 10, 0.2)
    out = Freeze(old, held[0], held[1])
    proc = cluster.cp(old[0]).proc
    assert proc is not None
    frozen_pid = proc.pid if whole_control_plane else out.pid
    skip = old[0] if whole_control_plane else ""
    watching = threading.Event()
    os.kill(frozen_pid, signal.SIGSTOP)
    t0 = time.monotonic()
    # The old leader's health on a thread of its own, every 50 ms: the step-down's time is not
    # delayed by the views' calls below (sequential calls made it up to 2 s late under load).
    stepped = threading.Thread(target=_watch_step_down, args=(cluster, old[0], t0, out, watching), daemon=True)
    if not whole_control_plane:
        stepped.start()
    try:
        lease = _lease(cluster)
        with ThreadPoolExecutor(len(cluster.control_planes)) as pool:
            while time.monotonic() - t0 < within_s:
                now = time.monotonic() - t0
                views = _views(cluster, pool, skip)
                if now > LEASE_S + 1.5:  # the lease has ended (+ the views' 1 s read): nobody names it
                    for name, v in views:
                        if isinstance(v, dict) and (v.get("leader"), v.get("term")) == old:
                            out.findings.append(f"{name} names {old[0]} (term {old[1]}) {now:.1f} s into the freeze")
                got = _agreed(views)
                if got is not None and got[1] > old[1]:
                    out.takeover_s, out.new = time.monotonic() - t0, got
                    break
                time.sleep(0.05)
    finally:
        os.kill(frozen_pid, signal.SIGCONT)
        watching.set()
    if stepped.is_alive():
        stepped.join(2)
    if out.new is not None and lease is not None:
        since = since_of_term(cluster, out.new[1])
        if since is not None:
            out.after_lease_s = since - (lease + LEASE_S)
    resumed = time.monotonic()
    while time.monotonic() - resumed < after_s:
        h = _health(cluster, old[0])
        if h is not None and h.get("leader") and h.get("term") == old[1]:
            out.findings.append(f"{old[0]} leads its old term {old[1]} again after SIGCONT")
        for name, v in cluster_views(cluster).items():
            if isinstance(v, dict) and v.get("leader") and int(v.get("term", 0)) <= old[1]:
                out.findings.append(f"{name} names {v['leader']} in term {v['term']} after SIGCONT")
        time.sleep(0.2)
    try:
        ended = "the frozen session ends (terminated, or closed by its control plane once it runs)"
        wait_for(ended, lambda: _gone(cluster, out.pid), 10, 0.2)
    except AssertionError as e:
        out.findings.append(str(e))
    return out


def _watch_step_down(cluster: HACluster, name: str, t0: float, out: Freeze, stop: threading.Event) -> None:
    """Set ``out.stepped_down_s`` when ``name``'s health first says ``leader: false`` (every 50 ms)."""
    while not stop.is_set() and out.stepped_down_s is None:
        h = _health(cluster, name)
        if h is not None and not h.get("leader"):
            out.stepped_down_s = time.monotonic() - t0
            return
        stop.wait(0.05)


def _lease(cluster: HACluster) -> float | None:
    """The ``cp_leader`` row's ``renewed_at`` (unix seconds, the database's clock) as the freeze
    began: the frozen leader renews no more, so its lease ends at this + :data:`LEASE_S`."""
    with cluster.patroni.connect(DATABASE) as conn:
        row = conn.execute("SELECT renewed_at FROM cp_leader WHERE id = 1").fetchone()
    return float(row[0]) if row else None


def since_of_term(cluster: HACluster, term: int) -> float | None:
    """When ``term`` began (``cp_leader.since``, database clock), None if the row holds another term."""
    with cluster.patroni.connect(DATABASE) as conn:
        row = conn.execute("SELECT since FROM cp_leader WHERE id = 1 AND term = %s", (term,)).fetchone()
    return float(row[0]) if row else None


def _views(cluster: HACluster, pool: ThreadPoolExecutor, skip: str = "") -> list[tuple[str, object]]:
    """Every live control plane's ``GET /api/v1/cluster`` but ``skip``'s (frozen: it cannot answer),
    asked at once (one slow view does not delay the others' sample)."""
    cps = [cp for cp in cluster.live() if cp.name != skip]
    return list(zip([cp.name for cp in cps], pool.map(lambda cp: cp.cluster(timeout=1), cps), strict=True))


def _agreed(views: list[tuple[str, object]]) -> tuple[str, int] | None:
    """One leader and term that every view names, that leader's own view saying it leads (as
    :func:`~tests.ha.load.agreed_leader` asks), else None."""
    by_name = dict(views)
    pairs = {(v.get("leader"), v.get("term")) for v in by_name.values() if isinstance(v, dict)}
    if len(pairs) != 1 or any(not isinstance(v, dict) for v in by_name.values()):
        return None
    leader, term = pairs.pop()
    if not isinstance(leader, str) or not isinstance(term, int) or leader not in by_name:
        return None
    return leader, term


def _gone(cluster: HACluster, pid: int) -> bool:
    with cluster.patroni.connect(DATABASE) as conn:
        return conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone() is None
