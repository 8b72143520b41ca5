"""The store's gateway keys, usage and rate counts (migration 7), on SQLite and on a real PostgreSQL."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmgw.control.store.base import Store
from llmgw.control.store.rows import ApiKeyRow, RateDelta, UsageDelta
from llmgw.errors import Conflict

KEY = ApiKeyRow("alice", "sk-llmgw-abcdefg", "ab" * 32, models=("gemma", "chat"), rpm=60, tpm=1000, priority=7,
                budget_tokens=10_000, budget_period="day", expires_at=2e9, created_at=1e9)


def test_keys_add_get_list_update(store: Store) -> None:
    assert store.add_key(KEY).revision == 1
    with pytest.raises(Conflict, match="already exists"):
        store.add_key(replace(KEY, digest="cd" * 32))
    with pytest.raises(Conflict):
        store.add_key(replace(KEY, name="bob"))  # the same digest
    assert store.get_key("alice") == KEY
    assert store.get_key("nobody") is None
    store.add_key(replace(KEY, name="bob", digest="ef" * 32, models=(), rpm=None))
    assert [k.name for k in store.list_keys()] == ["alice", "bob"]
    revoked = store.update_key(replace(KEY, revoked_at=1.5e9), revision=1)
    assert revoked.revision == 2
    assert store.get_key("alice") == revoked
    with pytest.raises(Conflict, match="changed"):
        store.update_key(replace(KEY, rpm=1), revision=1)


def test_accounting_adds_up_across_calls_and_control_planes(store: Store) -> None:
    store.add_key(KEY)
    u = UsageDelta("alice", "gemma", "2027-01-15", requests=2, prompt_tokens=10, completion_tokens=5, errors=1)
    store.record_accounting("cp1", [u], [RateDelta("alice", 600, 2, 15)], {"alice": 100.0})
    store.record_accounting(
        "cp2", [u, replace(u, model="other", day="2027-01-16", guard_blocks=1)],
        [RateDelta("alice", 600, 3, 1), RateDelta("alice", 660, 1, 0)], {"alice": 50.0},
    )
    store.record_accounting("cp1", [u], [RateDelta("alice", 600, 1, 1)], {})
    assert store.usage(since_day="2027-01-01") == [
        UsageDelta("alice", "gemma", "2027-01-15", 6, 30, 15, 0, 3),
        UsageDelta("alice", "other", "2027-01-16", 2, 10, 5, 1, 1),
    ]
    assert store.usage(since_day="2027-01-16", model="other", key="alice") == [
        UsageDelta("alice", "other", "2027-01-16", 2, 10, 5, 1, 1)
    ]
    assert store.usage(since_day="2027-01-01", until_day="2027-01-15", key="bob") == []
    assert store.rate_totals(since_window=600, exclude_cp="cp1") == {("alice", 600): (3, 1), ("alice", 660): (1, 0)}
    assert store.rate_totals(since_window=660, exclude_cp="cp2") == {}
    assert store.key_tokens_by_day(since_day="2027-01-16") == {("alice", "2027-01-16"): 15}
    key = store.get_key("alice")
    assert key is not None
    assert key.last_used_at == 100.0  # the later of the two, never moved back
    assert key.revision == 1  # a use is not an edit
    assert store.prune_rate_windows(before_window=660) == 2
    assert store.rate_totals(since_window=0, exclude_cp="") == {("alice", 660): (1, 0)}


def test_an_admin_write_read_before_an_accounting_sync_keeps_the_newer_last_use(store: Store) -> None:
    """``ctl key set`` reads the key, accounting's sync raises ``last_used_at`` (every 0.5 s), then
    the set is written: it wrote the time it had read back over the newer one (found reading the
    store: every field was written, accounting's too)."""
    store.add_key(replace(KEY, last_used_at=10.0))
    read = store.get_key("alice")
    assert read is not None
    store.record_accounting("cp1", [], [], {"alice": 20.0})
    written = store.update_key(replace(read, rpm=5), revision=read.revision)
    assert written.last_used_at == 20.0
    assert store.get_key("alice") == written
