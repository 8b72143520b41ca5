"""HA under faults, on real processes (issue 11 item 6): three Patroni members with PostgreSQL 15
(raft, sync mode), three ``llmgw server run`` control planes on the multi-host URL, and one real
agent serving gemma-3-270m on the real llama-server (tests/helpers/hacluster.py). Nothing is mocked.

While :mod:`tests.ha.load` writes catalog entries and chats through the gateway, five faults run one
at a time, each healed before the next:

1. ``kill -9`` the leading control plane (restarted after the new leader is checked);
2. ``kill -9`` the primary's postmaster (Patroni restarts it in place: docs/ha.md §1.4 r3);
3. ``kill -9`` the primary's Patroni and postmaster together: a node crash (the member restarted);
4. ``kill -9`` the primary's Patroni alone: the orphan, its PostgreSQL still a primary; restarted
   as a supervisor would once another member is promoted (after Patroni's ttl, ~20 s: docs/ha.md
   §1.4 s5/r5);
5. ``patronictl switchover``.

After each: one leader every control plane agrees on, in a term above the last one; an
acknowledged catalog write again (within Patroni's ~20 s floor plus 10 s); the database healthy.
At the end: every acknowledged write is on the final primary, the gateway answered ≥ 99% of the
requests through surviving control planes, and at no moment did two control planes lead in one term
(nor two at once for longer than the 5 s lease).

The leader checks read ``GET /api/v1/cluster`` (the election's admin API, PREAMBLE); every finding is
collected and the test fails at the end with all of them, so one run reports every broken property.
About 1.5 minutes on 2 cores (alone, 2026-12-06: 93-94 s and 77 CPU-s with a write every 0.25 s
and a chat every 0.5 s, against 103 s and 110 CPU-s at 0.1 and 0.25; earlier, alone beside another
engineer's benchmark: 92-98 s, the call 75 s, at load 2-3; 111-134 s at load 9-10; 114-123 s at
load 2-4 while fixed sleeps stood between the steps; 142-150 s with 3 other test runs sharing the
cores).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from tests.conftest import Assets, skip_or_fail
from tests.ha.freeze import since_of_term as _since
from tests.ha.load import Load, agreed_leader, cluster_views
from tests.helpers.hacluster import (
    HACluster,
    HAUnavailable,
    catalog_names,
    chat,
    dump,
    gemma_model,
    post_model,
    start_ha_cluster,
)
from tests.helpers.waits import wait_for

pytestmark = [pytest.mark.ha, pytest.mark.e2e]

#: Seconds a database fault may keep writes out: Patroni's promotion floor (~20 s, docs/ha.md §1.4) + 10.
WRITE_OUTAGE_MAX_S = 30
#: Seconds to a new control-plane leader after the leading one is killed (issue 11 target: 2 s).
TAKEOVER_MAX_S = 2
#: Seconds the views may take to agree on one leader after a database fault heals.
AGREE_MAX_S = 30
#: Seconds within which another member is promoted after the primary's Patroni is killed: Patroni's ttl
#: (20 s: docs/ha.md §1.4 measured 19.9-20.3 s) with room; the orphan's Patroni is restarted then.
PROMOTION_MAX_S = 60
#: The control planes' lease (ClusterConfig.lease_s): a stale leader stops acting within it.
LEASE_S = 5
#: The control planes' ``cluster.renew_s`` (ClusterConfig's default; llmgw.control.reconcile.election
#: step 3): a follower looks at the lease and the lock on connecting and then this often, and takes a
#: term only on such a look.
RENEW_S = 1.0
#: How long a restarted control plane is watched, once it serves gemma again, for a takeover it must
#: not make (its election starts when its ``/api/v1/health`` answers, before that: llmgw.control.server
#: binds the admin API last, then runs the election): at least its first look, made on connecting,
#: and the next one a :data:`RENEW_S` later (the leader renews every :data:`RENEW_S`, so its lease never nears its end
#: meanwhile; a takeover shows in the restarted one's own view at once).
FOLLOW_WATCH_S = 2 * RENEW_S
#: Seconds between catalog writes (:class:`tests.ha.load.Writer`): the write outages are measured to
#: this resolution, against a bound of :data:`WRITE_OUTAGE_MAX_S`. 0.25 rather than the bench's 0.1:
#: each write is a model the leader reconciles for the rest of the test (~1,000 at 0.1 s), and the
#: control planes took 30.8 CPU-s over the test at 0.1 against 22.2 at 0.25 (2026-12-06, alone).
WRITE_EVERY_S = 0.25
#: Seconds between chats through the gateway (:class:`tests.ha.load.GatewayClient`): ~200 requests over
#: the test, so the ≥ 99 % bound still fails on a gap of ~1.5 s of refusals. Each one-token answer costs
#: the engine ~50 ms of CPU (gemma-3-270m's 262k-token output layer), 0.2 of a core at 0.25 s.
CHAT_EVERY_S = 0.5
#: Acknowledged writes the test must see at least (a writer that stalled for most of the test would
#: leave every other write check vacuous): about half of what :data:`WRITE_EVERY_S` gives (~200).
MIN_ACKED = 100


@pytest.fixture(scope="module")
def ha(assets: Assets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HACluster]:
    """The cluster with gemma served (``scaling.min`` 1) and answering through every control plane."""
    try:
        cluster = start_ha_cluster(
            tmp_path_factory.mktemp("ha"), llama_server=assets.llama_server, model=assets.model
        )
    except HAUnavailable as e:
        skip_or_fail(str(e))
    try:
        assert cluster.files is not None
        r = post_model(cluster.control_planes[0], gemma_model(cluster.files.url))
        assert r.status_code == 201, r.text
        for cp in cluster.control_planes:
            wait_for(f"gemma answering through {cp.name}", lambda cp=cp: chat(cp, "gemma").status_code == 200, 240, 0.2)
        yield cluster
    finally:
        cluster.stop()


class Findings:
    """What went wrong, collected over the whole test."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def check(self, ok: object, what: str) -> bool:
        """Record ``what`` unless ``ok``."""
        if not ok:
            self.items.append(what)
        return bool(ok)


def _agreed_until(ha: HACluster, until: float) -> set[tuple[str, int]]:
    """Every agreed (leader, term) seen until ``until`` (monotonic), polled every 0.1 s."""
    seen: set[tuple[str, int]] = set()
    while time.monotonic() < until:
        got = agreed_leader(ha)
        if got:
            seen.add(got)
        time.sleep(0.1)
    return seen


def _leader(ha: HACluster, within_s: float, not_: str = "") -> tuple[str, int] | None:
    """The agreed (leader, term), other than ``not_``, within ``within_s`` seconds, or None."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        got = agreed_leader(ha)
        if got and got[0] != not_:
            return got
        time.sleep(0.1)
    return None


def test_faults_one_at_a_time(ha: HACluster) -> None:
    """The five faults of the module docstring under load; all findings reported together."""
    f = Findings()
    load = Load.start(ha, "gemma", write_every_s=WRITE_EVERY_S, chat_every_s=CHAT_EVERY_S)
    terms: list[tuple[str, int]] = []

    measured: list[str] = []
    election = True  # GET /api/v1/cluster answers (else one finding, and no waiting for leaders)

    def after(fault: str, t0: float, not_leader: str = "") -> None:
        """After a fault at ``t0``: writes again, the database healthy, one agreed leader, term up."""
        wait_for(f"{fault}: an acknowledged write", lambda: load.writer.first_ack_after(t0), 60, 0.2)
        ha.patroni.wait_healthy(90)
        healed = time.monotonic()
        gap = load.writer.longest_gap_s(t0, healed)
        f.check(gap <= WRITE_OUTAGE_MAX_S, f"{fault}: writes out for {gap:.1f} s")
        measured.append(f"{fault}: longest write outage {gap:.1f} s; healed at +{healed - t0:.1f} s")
        if not election:
            return
        got = _leader(ha, AGREE_MAX_S, not_leader)
        if f.check(got, f"{fault}: no agreed leader in {AGREE_MAX_S} s: {dump(cluster_views(ha))}") and got:
            if terms:
                f.check(got[1] > terms[-1][1], f"{fault}: term {got[1]} not above {terms[-1][1]}")
            terms.append(got)

    try:
        wait_for("the load under way (a write acknowledged, a chat answered, a leader view)", load.running, 30, 0.1)
        start = _leader(ha, 10)
        views = cluster_views(ha)
        f.check(start, f"start: no agreed leader: {dump(views)}")
        if start:
            terms.append(start)
        elif all(v == "HTTP 404" for v in views.values()):
            election = False  # not merged: every leader check below would only repeat this finding
            f.check(False, "GET /api/v1/cluster answers 404: the leader checks could not run")

        # 1. the leading control plane (cp1 when no leader is known: then the check above failed)
        victim = ha.cp(start[0] if start else "cp1")
        load.rotation.take_out(victim.name)
        t0, killed_at = time.monotonic(), time.time()
        victim.kill9()
        took = _leader(ha, 10, not_=victim.name) if election else None
        if election and f.check(took, f"leader kill: no new leader in 10 s: {dump(cluster_views(ha))}") and took:
            agreed = time.monotonic() - t0
            # The takeover on the database's clock (the new term's ``since``; the database runs on this
            # machine, so its clock is ours): what polling the views adds (up to 1.3 s more at load 7)
            # is not in it.
            since = _since(ha, took[1])
            takeover = since - killed_at if since is not None else agreed
            measured.append(f"leader kill: new leader {took[0]} in term {took[1]} after {takeover:.2f} s "
                            f"(every view agreed at {agreed:.2f} s)")
            f.check(takeover <= TAKEOVER_MAX_S, f"leader kill: takeover took {takeover:.2f} s")
            if terms:
                f.check(took[1] > terms[-1][1], f"leader kill: term {took[1]} not above {terms[-1][1]}")
            terms.append(took)
        victim.start()
        victim.wait_health()
        wait_for(f"{victim.name} serving gemma again", lambda: chat(victim, "gemma").status_code == 200, 60, 0.1)
        serving = time.monotonic()
        load.rotation.put_back(victim.name)
        measured.append(f"leader kill: {victim.name} back in rotation at +{time.monotonic() - t0:.1f} s")
        if election:
            # the restarted one must follow, not take over (a second leader is impossible): every
            # agreed view until FOLLOW_WATCH_S after it served again (its election runs from its health
            # answer, before that; counted from there, a slow restart left the watch empty: a
            # reviewer's finding), and the first one after, names the leader and term it came back to
            expected = terms[-1] if terms else None
            seen = _agreed_until(ha, serving + FOLLOW_WATCH_S)
            again = _leader(ha, 10)
            for got in [*seen, again]:
                f.check(got and got == expected, f"leader kill: after the restart {got}, expected {expected}")

        faults: list[tuple[str, Callable[[], float]]] = [
            ("postmaster kill", postmaster_kill_of(ha)),
            ("node crash", node_crash_of(ha)),
            ("orphaned primary", orphan_of(ha)),
            ("switchover", switchover_of(ha)),
        ]
        for name, fault in faults:
            after(name, fault())  # waits for a sync standby streaming again (wait_healthy)
            # the gateway answering through every control plane before the next fault
            for cp in load.rotation.members():
                try:
                    wait_for(f"{name}: gemma answering through {cp.name}",
                             lambda cp=cp: chat(cp, "gemma").status_code == 200, 30, 0.1)
                except AssertionError as e:
                    f.check(False, str(e))
    finally:
        load.stop()

    # every acknowledged write is on the final primary
    names = catalog_names(ha.patroni)
    lost = sorted(set(load.writer.acked) - names)
    f.check(not lost, f"{len(lost)} acknowledged writes lost: {lost[:20]}")
    # the writer wrote all along: ~200-300 acknowledged at WRITE_EVERY_S over ~95 s, the database
    # faults keeping writes out for up to ~20 s each (198 in a run on 2026-12-06)
    f.check(len(load.writer.acked) > MIN_ACKED, f"only {len(load.writer.acked)} writes acknowledged")
    w = load.writer
    f.check(not w.hung, f"{len(w.hung)} writes had no answer in {w.timeout_s:g} s (expected a fast 503): {w.hung[:5]}")
    gw = load.gateway
    measured.append(f"writes: {len(w.acked)} acknowledged, {len(w.unknown)} unknown ({len(w.refused)} 5xx, "
                    f"{len(w.hung)} hung), slowest answer {w.slowest_s:.1f} s; lost {len(lost)}")
    measured.append(f"gateway: {gw.ok} ok, {gw.failed} failed ({gw.success_pct:.2f}%); terms {terms}")
    print("\n".join(measured))  # shown with -s, and with the failure
    f.check(gw.success_pct >= 99, f"gateway {gw.success_pct:.2f}% of {gw.ok + gw.failed}: {gw.failures[:10]}")
    f.check(gw.ok > 100, f"only {gw.ok} gateway requests answered")
    doubles = load.watch.double_claims()
    f.check(not doubles, f"two leaders in one term: {doubles[:3]}")
    f.check(load.watch.overlap_s() <= LEASE_S + 1, f"two leaders at once for {load.watch.overlap_s():.1f} s")
    if election:
        f.check(not load.watch.errors, f"GET /api/v1/cluster failed: {load.watch.errors[:5]}")
    assert not f.items, "\n".join(f.items)


def postmaster_kill_of(ha: HACluster) -> Callable[[], float]:
    """kill -9 the primary's postmaster (Patroni restarts it in place); the fault returns the kill's
    monotonic time."""

    def fault() -> float:
        p = ha.patroni.primary()
        assert p is not None, "no primary"
        old = p.kill9_postmaster()
        t0 = time.monotonic()
        wait_for(f"Patroni restarting {p.name}'s PostgreSQL", lambda: p.postmaster_pid() not in (None, old), 30)
        return t0

    return fault


def switchover_of(ha: HACluster) -> Callable[[], float]:
    """``patronictl switchover`` to the sync standby; returns when it was asked."""

    def fault() -> float:
        t0 = time.monotonic()
        ha.patroni.switchover()
        return t0

    return fault


def node_crash_of(ha: HACluster) -> Callable[[], float]:
    """kill -9 Patroni and the postmaster of the primary together, restart the member when another
    member is promoted (as a rebooted node would come back); returns the kill's time."""

    def fault() -> float:
        p = ha.patroni.primary()
        assert p is not None
        pm = p.postmaster_pid()
        p.kill9_patroni()
        if pm is not None:
            p.kill9_postmaster()
        t0 = time.monotonic()
        ha.patroni.wait_primary(60, not_=p)
        p.start(ha.patroni.patroni)
        return t0

    return fault


def orphan_of(ha: HACluster) -> Callable[[], float]:
    """kill -9 the primary's Patroni alone and restart it once another member is promoted (a
    supervisor's restart coming after Patroni's ttl, as in docs/ha.md §1.4 s5/r5: a restart before
    the promotion would find the orphan still the leader and keep it); returns the kill's time.
    (Writes go on to the orphan until a replica is promoted: its sync standby still confirms them.)"""

    def fault() -> float:
        p = ha.patroni.primary()
        assert p is not None
        p.kill9_patroni()
        t0 = time.monotonic()
        ha.patroni.wait_primary(PROMOTION_MAX_S, not_=p)
        p.start(ha.patroni.patroni)
        return t0

    return fault
