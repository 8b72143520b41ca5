"""Stored keys refused while they are stale (issue 19 item 4; the process-level test is
tests/ha/test_keys_cutoff.py): only stored keys, never a keys-file key or loopback without a key."""

from __future__ import annotations

from llmgw.control.gateway.callers import FILE_CALLER, LOOPBACK_CALLER, Callers
from llmgw.control.gateway.keys import GatewayKeys, digest
from llmgw.control.store.rows import ApiKeyRow


def test_stored_keys_are_stale_after_the_bound_and_fresh_after_a_read() -> None:
    now = [100.0]
    callers = Callers(GatewayKeys(None, initial={"file-key"}), stale_after_s=5.0, monotonic=lambda: now[0])
    row = ApiKeyRow(name="team", digest=digest("sk-team").hex(), prefix="sk-te", created_at=0.0, revision=1)
    callers.set_rows([row])
    team = callers.lookup("sk-team")
    assert team is not None
    assert team.name == "team"
    now[0] += 5.0
    assert callers.stale(team) is None  # at the bound: still fresh
    now[0] += 0.5
    assert callers.stale(team) == 5.5
    assert callers.lookup("file-key") is FILE_CALLER
    assert callers.stale(FILE_CALLER) is None
    assert callers.stale(LOOPBACK_CALLER) is None
    callers.set_rows([row])  # a read, nothing changed: fresh again
    assert callers.stale(team) is None


def test_no_bound_never_stale() -> None:
    now = [0.0]
    callers = Callers(GatewayKeys(None, initial=set()), monotonic=lambda: now[0])
    now[0] += 1e6
    assert callers.stale(LOOPBACK_CALLER) is None
