"""A frozen lock holder on the real Patroni cluster (issue 19 item 2): three Patroni members with
PostgreSQL 15 (raft, sync mode) and three ``llmgw server run`` control planes on the multi-host URL
(tests/helpers/hacluster.py; no agent: leadership is what is tested). Nothing is mocked.

``SIGSTOP`` of the PostgreSQL backend that holds the control planes' advisory lock (found in
``pg_locks``/``pg_stat_activity``): PostgreSQL sees it alive, so the lock never frees. Before the
lease decided, the leader stepped down at ~5 s and nobody took over for the whole freeze. Now: the
old leader stops acting once its hung renewal times out (2 s, well within its lease), a follower
takes a higher term within 2 s of the lease's end (database clock: the old ``renewed_at`` + lease to
the new ``since``), every control plane names it within lease + 2 s of the freeze (the old leader's
health and the views sampled on threads of their own, so the figures are not those of a slow poll),
no view names the old term's leader once its lease has ended, and after ``SIGCONT`` the old term
never leads again (watched 3 s: its next renewal answered or timed out), its writes are refused and
the frozen backend exits (it was terminated). The second test freezes the leading control plane's
process instead (its backend idle and alive: the server's view of a leader cut off by the network).
The two share one cluster: about 34 s for both on 2 cores, its start included (32-34 s alone with
the control planes starting while the standbys bootstrap, 39-41 s at load ~4; 37-38 s at load
3.7-6.5, 2026-12-06, before that overlap; 41-44 s with the 5 s watch after ``SIGCONT`` that tests/ha/freeze.py's
``AFTER_S`` replaced; 47 s at load 3-4, 2026-12-03).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llmgw.control.store import open_store
from llmgw.errors import Fenced
from tests.conftest import skip_or_fail
from tests.ha.freeze import LEASE_S, freeze_lock_holder
from tests.helpers.hacluster import HACluster, HAUnavailable, dump, start_ha_cluster

pytestmark = [pytest.mark.ha, pytest.mark.e2e]


@pytest.fixture(scope="module")
def ha(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HACluster]:
    """The cluster without an agent (see the module docstring), shared by the two tests: each freezes
    whoever leads when it starts (``freeze_lock_holder`` waits for an agreed leader first), and the
    first leaves every control plane running (12 s of start and 5 s of stop saved)."""
    try:
        cluster = start_ha_cluster(tmp_path_factory.mktemp("ha"))
    except HAUnavailable as e:
        skip_or_fail(str(e))
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_frozen_lock_holder_is_taken_over_within_lease_plus_2_s(ha: HACluster) -> None:
    frozen = freeze_lock_holder(ha, within_s=LEASE_S + 10)
    print(frozen)
    leader, term = frozen.old
    logs = {cp.name: cp.log_tail(8) for cp in ha.control_planes}
    assert frozen.stepped_down_s is not None, f"{leader} never stopped leading: {dump(logs)}"
    # Its hung renewal times out after OP_TIMEOUT_S (2 s) and it steps down; the watchdog would at LEASE_S.
    assert frozen.stepped_down_s <= LEASE_S + 1, f"{leader} led {frozen.stepped_down_s:.1f} s into the freeze"
    assert frozen.takeover_s is not None, f"nobody took over while the lock holder was frozen: {dump(logs)}"
    assert frozen.after_lease_s is not None, frozen
    assert frozen.after_lease_s <= 2, frozen  # the takeover target, on the database's clock
    assert frozen.takeover_s <= LEASE_S + 2, f"takeover took {frozen.takeover_s:.1f} s"
    assert frozen.new is not None
    assert frozen.new[1] > term
    assert frozen.findings == []
    assert frozen.app == f"llmgw leader term {term} {leader}", (frozen.app, frozen.old)  # the term's session
    store = open_store(ha.patroni.store_url())
    try:
        with pytest.raises(Fenced):
            store.fenced(term).delete_explanation("nothing")
    finally:
        store.close()


def test_a_frozen_leading_control_plane_is_taken_over_within_lease_plus_2_s(ha: HACluster) -> None:
    """The leading control plane's process frozen: its backend stays idle and alive, holding the
    lock, as the server sees a leader cut off by the network (its kernel still answers keepalives).
    Before, nobody led until it ran again; now the others take over after its lease, and once it
    runs again it never leads its old term and its session ends. The lock need not be its own: after
    the first test's freeze a follower may take the freed lock before the new leader takes it back
    (CI saw it once); that follower then takes the term by the lock's path at the lease's end, and the
    frozen leader's session is closed by its control plane when it runs again, not terminated."""
    frozen = freeze_lock_holder(ha, within_s=LEASE_S + 10, whole_control_plane=True)
    print(frozen)
    leader, term = frozen.old
    logs = {cp.name: cp.log_tail(8) for cp in ha.control_planes}
    assert frozen.takeover_s is not None, f"nobody took over while {leader} was frozen: {dump(logs)}"
    assert frozen.after_lease_s is not None, frozen
    assert frozen.after_lease_s <= 2, frozen  # the takeover target, on the database's clock
    assert frozen.takeover_s <= LEASE_S + 2, f"takeover took {frozen.takeover_s:.1f} s"
    assert frozen.new is not None
    assert frozen.new[1] > term
    assert frozen.new[0] != leader
    assert frozen.findings == []
