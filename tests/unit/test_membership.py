"""Control-plane membership (:mod:`llmgw.control.reconcile.membership`) on a real store: two
control planes given one ``cluster.name`` by mistake are named in the log (a new operator's
second "cp2" went unnoticed while agents learned whichever agent URL wrote last)."""

from __future__ import annotations

import logging

import pytest

from llmgw.control.reconcile.election import SoloElection
from llmgw.control.reconcile.membership import Membership
from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop


async def test_two_control_planes_with_one_name_are_logged_once(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    db = OffLoop()
    now = [1000.0]
    try:
        def member(url: str) -> Membership:
            return Membership(store, db, SoloElection(store, "cp2", db.run), name="cp2", agent_url=url,
                              version="t", clock=lambda: now[0])

        first, second = member("https://10.0.0.2:7443"), member("https://10.0.0.9:7443")
        second.started_at += 1  # another process, started a second later
        with caplog.at_level(logging.ERROR, logger="llmgw.control.reconcile.membership"):
            await first.tick()
            assert caplog.records == []  # alone: its own row
            await second.tick()  # writes over first's row
            now[0] += 1
            await first.tick()  # reads it before its next write (every 2 s)
            await first.tick()
        errors = [r.getMessage() for r in caplog.records]
        assert len(errors) == 1, errors
        assert "another control plane uses the same cluster.name (its agent URL https://10.0.0.9:7443" in errors[0]
    finally:
        db.close()
