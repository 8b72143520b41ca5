"""An orphaned primary under busy control planes (issue 19 item 3), on real processes: three Patroni
members with PostgreSQL 15 (raft, sync mode, ttl 20; tests/helpers/hacluster.py), three ``llmgw
server run`` control planes on the multi-host URL with ``server init``'s store settings, no agent
(the probes send heartbeats themselves).

Four writers per control plane add catalog entries through it, and a probe per control plane reads
(``GET /api/v1/models``), beats (``POST /agent/v1/heartbeat`` over mTLS) and calls the admin API
(``GET /api/v1/nodes``). Then the primary's Patroni is SIGKILLed and its PostgreSQL **left running**
for the rest of the test: the orphan. A standby is promoted after Patroni's ttl (~20 s); from then on
the orphan's commits wait for a synchronous standby that never comes back.

Before the fix those commits held every store thread for as long as the orphan lived, so reads,
heartbeats and admin calls answered 503 on every control plane (47 s and 107 s measured in the
issue; here to the end of the test). Now each control plane must answer all three, and acknowledge
writes again, within :data:`RECOVER_S` of the promotion, and the longest write outage over all
control planes (``orphan_write_outage_s`` in bench/failover.py) stays within
:data:`WRITE_OUTAGE_MAX_S`. No acknowledged write may be lost.

About a minute on 2 cores (52-55 s and 40-45 CPU-s alone with a write every 0.5 s, against 55 s and 67
CPU-s every 0.25 s, 2026-12-06; 52 s alone with the watch ending 16 s after the promotion, 2026-12-05;
95 s at load 5-7 with a fixed 25 s watch, 2026-12-03).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import skip_or_fail
from tests.ha.load import OrphanLoad, Probe, orphan_run
from tests.helpers.hacluster import DATABASE, HACluster, HAUnavailable, start_ha_cluster

pytestmark = [pytest.mark.ha, pytest.mark.e2e]

#: Seconds after the promotion within which every control plane answers reads, heartbeats and admin
#: calls and acknowledges writes again: the API deadline (5 s) that ends a stuck commit, a
#: reconnect, and one probe round.
RECOVER_S = 12
#: Seconds after the promotion within which each control plane acknowledges a write again: a write
#: in flight at the promotion waits out its 5 s deadline before its call is ended, then the writer's
#: next connection tries the members (2 s connect timeout each) with the orphan last. Measured 0.4-6.5 s,
#: once 12.1 s on the CI machine (2026-12-03); the issue's bound is the outage below (≤ 30 s).
WRITE_RECOVER_S = 20
#: Seconds between one writer's writes. Once the orphan's commits hang (at the promotion), each writer
#: is stuck in its next write within this, so every store thread is still held as in the issue; a
#: write is a model every control plane's routing table then carries to the end of the test (739
#: acknowledged at 0.5 s in a run on 2026-12-06).
WRITE_EVERY_S = 0.5
#: The issue's target for the longest write outage with 4 writers per control plane.
WRITE_OUTAGE_MAX_S = 30
#: Seconds the test watches after the promotion at most, the orphan alive all along: past
#: :data:`WRITE_RECOVER_S` with room for the probes' 3 successes after :data:`RECOVER_S` (before the
#: fix every probe failed to the end of the watch, whatever its length; 35 s until 2026-12-03).
WATCH_S = 25
#: Seconds past :data:`RECOVER_S` the watch goes on at least, so that a control plane that answers
#: again and then fails again is seen (8 probe rounds): the watch ends there once every control plane
#: has also acknowledged a write since the promotion (:func:`_settled`), at ~16 s instead of 25 s in
#: most runs (writes were back 0.4-6.5 s after the promotion).
HOLD_S = 4


@pytest.fixture
def ha(tmp_path: Path) -> Iterator[HACluster]:
    """Patroni and three control planes, no agent."""
    try:
        cluster = start_ha_cluster(tmp_path)
    except HAUnavailable as e:
        skip_or_fail(str(e))
    try:
        yield cluster
    finally:
        cluster.stop()


def _settled(load: OrphanLoad, promoted: float) -> bool:
    """Whether all the test checks for has been seen: :data:`HOLD_S` past :data:`RECOVER_S`, every
    probe's calls answered 3 times since :data:`RECOVER_S`, a write acknowledged through each
    control plane since the promotion."""
    recovered = promoted + RECOVER_S
    return (
        time.monotonic() >= recovered + HOLD_S
        and all(p.successes_after(kind, recovered) >= 3 for p in load.probes.values() for kind in Probe.KINDS)
        and all(load.first_ack_after(name, promoted) is not None for name in load.writers)
    )


def test_an_orphaned_primary_does_not_stall_busy_control_planes(ha: HACluster) -> None:
    load, killed, promoted, ended, new = orphan_run(ha, writers=4, watch_s=WATCH_S, settled=_settled,
                                                    every_s=WRITE_EVERY_S)
    findings: list[str] = []
    measured = [f"promoted {promoted - killed:.1f} s after the kill"]
    for name, probe in load.probes.items():
        for kind in Probe.KINDS:
            last = probe.last_failure(kind)
            if last is not None:
                measured.append(f"{name} {kind}: last failure sent at +{last[0] - promoted:.1f} s after promotion")
            if last is not None and last[0] > promoted + RECOVER_S:
                findings.append(f"{name} {kind} still failed {last[0] - promoted:.1f} s after the promotion: {last[1]}")
            if probe.successes_after(kind, promoted + RECOVER_S) < 3:
                findings.append(f"{name} {kind}: fewer than 3 successes after promotion + {RECOVER_S} s")
        first = load.first_ack_after(name, promoted)
        measured.append(f"{name} writes: first ack {first - promoted:.1f} s after promotion" if first
                        else f"{name} writes: none acknowledged after the promotion")
        if first is None or first - promoted > WRITE_RECOVER_S:
            findings.append(f"{name}: no write acknowledged within {WRITE_RECOVER_S} s of the promotion")
    outage = load.longest_gap_s(killed, ended)
    measured.append(f"orphan_write_outage_s {outage:.1f}; watched {ended - promoted:.1f} s after the promotion")
    if outage > WRITE_OUTAGE_MAX_S:
        findings.append(f"writes out for {outage:.1f} s (target ≤ {WRITE_OUTAGE_MAX_S} s)")
    acked = load.acked()
    with ha.patroni.connect(DATABASE, member=new) as conn:  # not the orphan: it still says read-write
        names = {r[0] for r in conn.execute("SELECT name FROM models").fetchall()}
    lost = sorted(set(acked) - names)
    measured.append(f"{len(acked)} writes acknowledged, {len(lost)} lost")
    if lost:
        findings.append(f"{len(lost)} acknowledged writes lost: {lost[:10]}")
    print("\n".join(measured))
    logs = [f"--- {cp.name}\n{cp.log_tail(25)}" for cp in ha.control_planes if any(cp.name in f for f in findings)]
    assert not findings, "\n".join(findings + measured + logs)
