"""Store calls stuck past every driver bound are ended from outside (issue 19 item 3; the Patroni run
is tests/ha/test_orphan.py): a real PostgreSQL 15 reached through :class:`~tests.helpers.tcpcut.CutProxy`
first and directly second, in one multi-host URL (both hosts take writes, as an orphan and the new
primary would). Cutting the proxy leaves a call hanging with no error, as a commit waiting on an
orphan's standby or a frozen server does (the proxy's kernel acknowledges every byte, so neither
keepalives nor ``tcp_user_timeout`` fire).

Before the fix the call held its thread for as long as the cut lasted; now the deadline (or the
reaper, for calls without one) shuts its socket down, the thread is free within a second, and the
next connection goes to the other host first.

Not marked ``ha``: only the session's PostgreSQL (tests/helpers/postgres.py) and about 10 s.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from llmgw.control.store.offloop import OffLoop
from llmgw.control.store.sql import SqlStore
from llmgw.errors import StoreUnavailable
from tests.helpers.postgres import Cluster
from tests.helpers.tcpcut import CutProxy


@pytest.fixture
def cut_store(pg_cluster: Cluster) -> Iterator[tuple[SqlStore, CutProxy]]:
    """A store whose URL lists the proxy first and the server itself second."""
    url = pg_cluster.new_database()
    with CutProxy(("127.0.0.1", pg_cluster.port)) as proxy:
        base, _, db = url.rpartition("/")
        user = base.split("//", 1)[1].split("@", 1)[0]
        multi = (f"postgresql+psycopg://{user}@/{db}?host=127.0.0.1:{proxy.port}&host=127.0.0.1:{pg_cluster.port}"
                 "&target_session_attrs=read-write")
        store = SqlStore.open(multi)
        try:
            yield store, proxy
        finally:
            proxy.heal()
            store.close()


def _server_port(store: SqlStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT inet_server_port()").scalar_one())


async def test_a_call_past_its_deadline_is_ended_and_the_next_one_goes_elsewhere(
    cut_store: tuple[SqlStore, CutProxy], pg_cluster: Cluster
) -> None:
    store, proxy = cut_store
    store.list_models()  # a pooled connection through the proxy
    db = OffLoop(deadline_s=1.0, abort=store.abort_thread)
    try:
        proxy.cut()
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="did not answer within 1 s"):
            await db.run(store.list_models)
        for _ in range(200):  # the stuck call gives its thread back (polled: nothing to wait on)
            if not db._overdue:
                break
            await asyncio.sleep(0.05)
        freed = time.monotonic() - t0
        assert freed < 2.0, f"the stuck call held its thread for {freed:.1f} s"
        assert await db.run(store.list_models) == []  # the proxy is still cut: the other host answers
        assert await db.run(_server_port, store) == pg_cluster.port
    finally:
        proxy.heal()
        db.close()


def test_the_reaper_ends_a_call_without_a_deadline(cut_store: tuple[SqlStore, CutProxy]) -> None:
    store, proxy = cut_store
    store.list_models()
    store.bound_holds(1.0)
    proxy.cut()
    result: list[object] = []

    def call() -> None:
        try:
            result.append(store.list_models())
        except Exception as e:
            result.append(e)

    t0 = time.monotonic()
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10)
    took = time.monotonic() - t0
    proxy.heal()
    assert not thread.is_alive(), "the reaper did not end the stuck call in 10 s"
    assert took < 3.0, took
    # ended: an error, or (when the reaper caught the pooled connection's ping) the answer from
    # a new connection, which lists the cut host last
    assert result, result
    assert isinstance(result[0], Exception) or result[0] == [], result
