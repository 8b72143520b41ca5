"""Leader election and fencing on a real PostgreSQL 15 (tests/helpers/postgres.py) and on SQLite.

Each test runs two or three :class:`PgElection` objects, each on its own real connection, against a
database of its own, with a short lease and renewal (``lease_s`` 2, ``renew_s`` 0.2) so faults
settle in about a second; the algorithm is the one the control plane runs with 5 s / 1 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

from llmgw.control.reconcile.election import LOCK_KEY, PgElection, SoloElection, while_leading
from llmgw.control.store import Store, default_url, open_store
from llmgw.errors import Fenced
from tests.helpers.postgres import Cluster
from tests.helpers.waits import until

LEASE_S = 2.0
RENEW_S = 0.2
OP_S = 1.0


def _libpq(url: str) -> dict[str, object]:
    u = sa.make_url(url)
    return {"host": u.host, "port": u.port, "user": u.username, "dbname": u.database, "autocommit": True}


@contextlib.asynccontextmanager
async def running(url: str, *names: str, op_s: float = OP_S) -> AsyncIterator[list[PgElection]]:
    """``PgElection`` objects named ``names`` contending on ``url`` until the block ends."""
    stop = asyncio.Event()
    els = [PgElection(url, n, lease_s=LEASE_S, renew_s=RENEW_S, op_timeout_s=op_s) for n in names]
    tasks = [asyncio.create_task(e.run(stop)) for e in els]
    try:
        yield els
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)


@pytest.fixture
def pg_url(pg_cluster: Cluster) -> str:
    """A migrated database of this test's own (advisory locks are per database)."""
    url = pg_cluster.new_database()
    open_store(url).close()
    return url


def leaders(els: list[PgElection]) -> list[PgElection]:
    return [e for e in els if e.leading]


async def one_leader(els: list[PgElection], within_s: float = 5) -> PgElection:
    async def pred() -> PgElection | None:
        now = leaders(els)
        assert len(now) <= 1, f"two leaders: {[e.name for e in now]}"
        return now[0] if now else None

    got: PgElection = await until("one leader", pred, within_s=within_s, every_s=0.02)
    return got


async def test_exactly_one_of_three_leads_and_its_term_is_in_the_database(pg_url: str) -> None:
    async with running(pg_url, "a", "b", "c") as els:
        leader = await one_leader(els)
        for _ in range(30):  # 1.5 s of renewals: still exactly one, the same
            await asyncio.sleep(0.05)
            assert leaders(els) == [leader]
        store = open_store(pg_url)
        try:
            row = store.leader()
        finally:
            store.close()
        assert (row.term, row.holder) == (leader.term, leader.name)
        assert row.term >= 1
        assert row.renewed_at > row.since  # renewed by writing


async def test_the_election_connection_sets_its_own_keepalives_on_both_ends(pg_url: str) -> None:
    """Issue 19 item 2: a leader cut off by the network must be noticed by the server (which then
    ends its session and lock), whatever the URL or the server's defaults say: the session's own
    ``tcp_keepalives_*`` as the server reads them, and the client's libpq parameters."""
    url = pg_url + ("&" if "?" in pg_url else "?") + "keepalives_idle=600"
    async with running(url, "a") as (el,):
        await one_leader([el])
        shown = {}
        for name in ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count", "tcp_user_timeout"):
            row = await el._op(f"SHOW {name}", {})  # the election's own connection
            assert row is not None
            shown[name] = row[0]
        assert shown == {"tcp_keepalives_idle": "2", "tcp_keepalives_interval": "1",
                         "tcp_keepalives_count": "2", "tcp_user_timeout": "4000"}
        assert el.kwargs["keepalives_idle"] == "2"


async def test_killed_connection_hands_leadership_over_with_a_higher_term(pg_url: str) -> None:
    async with running(pg_url, "a", "b") as els:
        first = await one_leader(els)
        term = first.term
        pid = first.backend_pid
        assert pid is not None
        with psycopg.connect(**_libpq(pg_url)) as admin:  # type: ignore[arg-type]
            assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        killed = time.monotonic()
        await until("the old leader steps down or a new term starts",
                    lambda: _async(not first.leading or first.term > term), within_s=5, every_s=0.02)
        second = await one_leader(els)
        took = time.monotonic() - killed
        assert second.term > term
        assert took < 2.5, f"takeover took {took:.2f} s"


async def _async(v: object) -> object:
    return v


async def test_a_stale_term_write_is_refused(pg_url: str) -> None:
    store = open_store(pg_url)
    try:
        async with running(pg_url, "a") as els:
            leader = await one_leader(els)
            fenced = store.fenced(leader.term)
            fenced.delete_explanation("nothing")  # the current term writes
            stale = store.fenced(leader.term - 1)
            refused = rf"term {leader.term - 1}\) has ended: the database's term is {leader.term}"
            with pytest.raises(Fenced, match=refused):
                stale.delete_explanation("nothing")
    finally:
        store.close()


@pytest.mark.parametrize("op_s", [OP_S, LEASE_S - 0.1], ids=["op-timeout", "watchdog"])
async def test_a_leader_whose_renewals_hang_steps_down_within_its_lease(pg_url: str, op_s: float) -> None:
    """With a statement timeout well below the lease the timeout ends the hung renewal; with one
    just below it, the watchdog stops the leader first (the lease counts from the last success)."""
    async with running(pg_url, "a", "b", op_s=op_s) as els:
        leader = await one_leader(els)
        term = leader.term
        with psycopg.connect(**_libpq(pg_url)) as blocker:  # type: ignore[arg-type]
            blocker.autocommit = False
            blocker.execute("SELECT term FROM cp_leader WHERE id = 1 FOR UPDATE")  # renewals now hang
            hung = time.monotonic()
            await until("the leader steps down", lambda: _async(not leader.leading), within_s=LEASE_S + 1,
                        every_s=0.02)
            assert time.monotonic() - hung <= LEASE_S + 0.3
            await asyncio.sleep(1.0)
            assert leaders(els) == []  # taking a term is a write: nobody leads while the row hangs
            blocker.rollback()
        again = await one_leader(els)
        assert again.term > term


def lock_holder(url: str) -> tuple[int, str] | None:
    """The backend holding the election's advisory lock in ``url``'s database, as ``pg_locks`` and
    ``pg_stat_activity`` show it: ``(pid, application_name)``, None when nobody holds it."""
    with psycopg.connect(**_libpq(url)) as admin:  # type: ignore[arg-type]
        row = admin.execute(
            "SELECT l.pid, s.application_name FROM pg_locks l JOIN pg_stat_activity s ON s.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.objid = %s AND l.objsubid = 1 AND l.granted"
            " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (LOCK_KEY,),
        ).fetchone()
    return (int(row[0]), str(row[1])) if row else None


async def test_a_frozen_lock_holder_is_taken_over_after_its_lease_and_stays_fenced(pg_url: str) -> None:
    """Issue 19 item 2: SIGSTOP of the backend that holds the leader's advisory lock (it looks alive to
    PostgreSQL, so the lock never frees). The leader stops acting within its lease; another control
    plane takes a new term within lease + 2 s of the freeze (the lease, not the lock, decides) and
    ends the frozen backend; after SIGCONT the old term never leads again and its writes are refused.
    Real PostgreSQL 15, real signals; the three elections share this process (only the backend freezes)."""
    async with running(pg_url, "a", "b", "c") as els:
        leader = await one_leader(els)
        term = leader.term
        await asyncio.sleep(3 * RENEW_S)  # renewing
        held = await asyncio.to_thread(lock_holder, pg_url)
        assert held is not None
        assert held[0] == leader.backend_pid, held
        pid = held[0]
        os.kill(pid, signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            stepped: list[float] = []

            async def taken() -> PgElection | None:
                now = leaders(els)
                assert len(now) <= 1, f"two leaders: {[(e.name, e.term) for e in now]}"
                if not leader.leading and not stepped:
                    stepped.append(time.monotonic() - frozen)
                return now[0] if now and now[0].term > term else None

            new = await until("a new term while the old lock holder is frozen", taken,
                              within_s=LEASE_S + 2, every_s=0.02)
            took = time.monotonic() - frozen
            assert stepped, "the frozen leader never stepped down"
            # The hung renewal's client-side timeout ends it (not the watchdog at LEASE_S): psycopg's
            # own wait for a cancelled statement is not waited for (it made the timeout ~5 s longer).
            assert stepped[0] <= RENEW_S + OP_S + 0.3, f"the frozen leader acted for {stepped[0]:.2f} s"
            assert took <= LEASE_S + 2, f"takeover took {took:.2f} s"
            assert leaders(els) == [new]
            assert held[1] == f"llmgw leader term {term} {leader.name}"  # the term's session, by name
            ended = [e.terminated for e in els if e.terminated]
            assert any(pid in t for t in ended), f"the frozen backend {pid} was not ended: {ended}"
            store = open_store(pg_url)
            try:
                with pytest.raises(Fenced):
                    store.fenced(term).delete_explanation("nothing")
            finally:
                store.close()
        finally:
            os.kill(pid, signal.SIGCONT)
        # Running again, the frozen backend dies (it was terminated) and the old term never comes back.
        for _ in range(40):
            now = leaders(els)
            assert len(now) == 1, [(e.name, e.term) for e in now]
            assert now[0].term >= new.term, (now[0].name, now[0].term)
            await asyncio.sleep(0.05)
        gone = await until("the frozen backend exits", lambda: _async(
            (h := lock_holder(pg_url)) is None or h[0] != pid), within_s=5, every_s=0.1)
        assert gone


async def test_while_leading_runs_work_only_while_leading(pg_url: str) -> None:
    started: list[int] = []
    ended: list[int] = []

    async def work(term: int, over: asyncio.Event) -> None:
        started.append(term)
        try:
            await over.wait()
        finally:
            ended.append(term)

    stop = asyncio.Event()
    async with running(pg_url, "a") as (el,):
        runner = asyncio.create_task(while_leading(el, work, stop))
        await one_leader([el])
        await until("work started", lambda: _async(started), every_s=0.02)
        pid = el.backend_pid
        with psycopg.connect(**_libpq(pg_url)) as admin:  # type: ignore[arg-type]
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        await until("work restarted in a new term", lambda: _async(len(started) >= 2), every_s=0.02)
        assert ended[:1] == started[:1]
        assert started[1] > started[0]
        stop.set()
        await asyncio.wait_for(runner, 5)


async def test_sqlite_leads_alone_with_a_new_term_per_start(tmp_path: Path) -> None:
    url = default_url("", tmp_path / "llmgw.db")
    terms = []
    for _ in range(2):
        store: Store = open_store(url)
        stop = asyncio.Event()
        el = SoloElection(store, "solo", asyncio.to_thread)
        task = asyncio.create_task(el.run(stop))
        await until("SQLite leads", lambda e=el: _async(e.leading), every_s=0.01)  # type: ignore[misc]
        terms.append(el.term)
        stop.set()
        await task
        assert not el.leading
        store.close()
    assert terms == [1, 2]
