"""Callers.put: the admin API's write reaches this control plane's gateway at once, and a read of
the stored keys that began before it (possibly from before the write) does not undo it."""

from __future__ import annotations

from dataclasses import replace

from llmgw.control.gateway.callers import Callers
from llmgw.control.gateway.keys import GatewayKeys, digest
from llmgw.control.store.rows import ApiKeyRow

ROW = ApiKeyRow(name="team", digest=digest("sk-team").hex(), prefix="sk-te", created_at=0.0, revision=1)


def _callers() -> Callers:
    return Callers(GatewayKeys(None, initial=set()))


def test_a_put_row_is_used_at_once_and_a_read_begun_before_it_is_not() -> None:
    callers = _callers()
    since = callers.writes  # a sync's read begins: the key is not stored yet
    assert callers.put(ROW)
    assert callers.lookup("sk-team") is not None
    assert not callers.set_rows([], since=since)  # that read ends: it predates the write
    assert callers.lookup("sk-team") is not None
    assert callers.set_rows([ROW], since=callers.writes) is False  # a later read: the same table
    assert callers.lookup("sk-team") is not None


def test_a_revoked_or_rotated_put_is_refused_at_once() -> None:
    callers = _callers()
    callers.set_rows([ROW])
    rotated = replace(ROW, digest=digest("sk-new").hex(), revision=2)
    assert callers.put(rotated)
    assert callers.lookup("sk-team") is None
    assert callers.lookup("sk-new") is not None
    assert callers.put(replace(rotated, revoked_at=5.0, revision=3))
    assert callers.lookup("sk-new") is None
    assert "team" not in callers.by_name


def test_a_put_older_than_what_was_read_is_not_used() -> None:
    """Another control plane changed the key after this one wrote it, and that was read already."""
    callers = _callers()
    callers.set_rows([replace(ROW, revoked_at=5.0, revision=3)])
    assert not callers.put(replace(ROW, revision=2))
    assert callers.lookup("sk-team") is None


def test_other_keys_stay_when_one_is_put() -> None:
    callers = _callers()
    other = ApiKeyRow(name="other", digest=digest("sk-other").hex(), prefix="sk-ot", created_at=0.0, revision=4)
    callers.set_rows([other])
    callers.put(ROW)
    assert set(callers.by_name) == {"other", "team"}
    assert callers.set_rows([other, ROW]) is False  # the next read finds what the put made: nothing to rebuild


def test_a_revoked_key_whose_secret_is_also_in_the_keys_file_stays_refused() -> None:
    """A new user's finding: a stored key revoked, its secret also in ``gateway.keys_file``, went on
    working as a keys-file key, without its limits. The revocation holds; another file key still works."""
    callers = Callers(GatewayKeys(None, initial={"sk-team", "sk-file"}))
    callers.set_rows([ROW])
    assert callers.lookup("sk-team") is not None
    assert callers.lookup("sk-team").name == "team"  # type: ignore[union-attr]
    assert callers.put(replace(ROW, revoked_at=5.0, revision=2))
    assert callers.lookup("sk-team") is None
    assert callers.lookup("sk-file") is not None
