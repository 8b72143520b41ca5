"""A key's priority (0-9, the gateway queue's band): ``ctl key create/set --priority`` and the keys
API on a real control plane (``serve`` in a thread, SQLite, the real CLI through Typer's runner);
strict integers with a 400 naming the field; the gateway's :class:`Caller` carries it; migration 9
adds the column to databases made before it (the committed f6e5588 SQLite file, and a column
dropped from a current database on SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.control.gateway.callers import Callers, caller_of
from llmgw.control.gateway.keys import GatewayKeys
from llmgw.control.store import default_url, open_store
from llmgw.control.store.rows import ApiKeyRow
from llmgw.control.store.schema import MIGRATIONS
from tests.helpers.control import TOKEN, Install, make_install
from tests.unit.test_ctl_model_rm import ThreadedControlPlane

AUTH = {"Authorization": f"Bearer {TOKEN}"}
DATA = pathlib.Path(__file__).parents[1] / "data"


@pytest.fixture
def cp(tmp_path: pathlib.Path) -> Iterator[Install]:
    inst = make_install(tmp_path)
    inst.write(gateway={"listen": f"127.0.0.1:{inst.ports['gateway']}", "allow_loopback_without_key": False})
    with ThreadedControlPlane(inst):
        yield inst


def _ctl(inst: Install, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["--root", str(inst.root), "ctl", *args])
    return r.exit_code, r.output


def _keys(inst: Install) -> dict[str, dict[str, Any]]:
    r = httpx.get(inst.admin + "/api/v1/keys", headers=AUTH)
    assert r.status_code == 200, r.text
    return {k["name"]: k for k in r.json()}


def test_priority_round_trip_through_the_cli_and_the_api(cp: Install) -> None:
    code, out = _ctl(cp, "key", "create", "batch")
    assert code == 0, out
    assert "priority: 0" in out
    code, out = _ctl(cp, "key", "create", "interactive", "--priority", "7", "--rpm", "60")
    assert code == 0, out
    assert "priority: 7" in out
    assert {n: k["priority"] for n, k in _keys(cp).items()} == {"batch": 0, "interactive": 7}

    code, out = _ctl(cp, "key", "ls")
    assert code == 0, out
    assert "PRIORITY" in out
    code, out = _ctl(cp, "key", "ls", "--json")
    assert {k["name"]: k["priority"] for k in json.loads(out)} == {"batch": 0, "interactive": 7}

    code, out = _ctl(cp, "key", "set", "interactive", "--priority", "9")
    assert code == 0, out
    assert "priority: 9" in out
    assert _keys(cp)["interactive"]["rpm"] == 60  # the rest stays

    r = httpx.patch(cp.admin + "/api/v1/keys/interactive", json={"priority": None}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["priority"] == 0  # null: back to the default
    r = httpx.post(cp.admin + "/api/v1/keys", json={"name": "api-made", "priority": 3}, headers=AUTH)
    assert r.status_code == 201, r.text
    assert r.json()["key"]["priority"] == 3

    code, out = _ctl(cp, "key", "set", "batch", "--priority", "10")
    assert code == 1
    assert "priority: Input should be less than or equal to 9" in out


@pytest.mark.parametrize(
    ("priority", "says"),
    [
        (10, "priority: Input should be less than or equal to 9"),
        (-1, "priority: Input should be greater than or equal to 0"),
        ("5", "priority: Input should be a valid integer"),
        (5.0, "priority: Input should be a valid integer"),
        (True, "priority: Input should be a valid integer"),
    ],
)
def test_a_bad_priority_is_a_400_naming_the_field(cp: Install, priority: Any, says: str) -> None:
    r = httpx.post(cp.admin + "/api/v1/keys", json={"name": "k", "priority": priority}, headers=AUTH)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    r = httpx.post(cp.admin + "/api/v1/keys", json={"name": "k", "priority": 4}, headers=AUTH)
    assert r.status_code == 201, r.text
    r = httpx.patch(cp.admin + "/api/v1/keys/k", json={"priority": priority}, headers=AUTH)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    assert _keys(cp)["k"]["priority"] == 4  # unchanged


def test_the_gateway_caller_carries_the_stored_priority() -> None:
    row = ApiKeyRow("team", "sk-llmgw-team000", "ab" * 32, priority=6)
    assert caller_of(row).priority == 6
    callers = Callers(GatewayKeys(None, initial=set()))
    callers.set_rows([row])
    assert callers.by_name["team"].priority == 6
    assert callers.set_rows([replace(row, priority=2, revision=2)])  # a change is a new revision
    assert callers.by_name["team"].priority == 2


def test_the_f6e5588_database_gains_priority_0_and_keeps_a_new_one(tmp_path: pathlib.Path) -> None:
    db = tmp_path / "llmgw.db"
    shutil.copy(DATA / "store-made-by-f6e5588.db", db)
    store = open_store(default_url("", db))
    key = store.get_key("alice")
    assert key is not None
    assert (key.rpm, key.priority) == (60, 0)
    store.update_key(replace(key, priority=5), revision=key.revision)
    store.close()
    store = open_store(default_url("", db))
    again = store.get_key("alice")
    store.close()
    assert again is not None
    assert (again.rpm, again.priority) == (60, 5)


def test_migration_9_adds_the_column_to_a_database_without_it(store_url: str) -> None:
    """SQLite and PostgreSQL: a current database has the column dropped and migration 9 forgotten
    (what a database made before migration 9 looks like), then opens again."""
    store = open_store(store_url)
    store.add_key(ApiKeyRow("old", "sk-llmgw-old0000", "cd" * 32, rpm=5))
    with store.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE api_keys DROP COLUMN priority")
        conn.exec_driver_sql("DELETE FROM schema_migrations WHERE version = 9")
    store.close()
    store = open_store(store_url)
    try:
        assert store.schema_versions() == [v for v, _ in MIGRATIONS]
        old = store.get_key("old")
        assert old is not None
        assert (old.rpm, old.priority) == (5, 0)
        store.add_key(ApiKeyRow("new", "sk-llmgw-new0000", "ef" * 32, priority=9))
        assert [(k.name, k.priority) for k in store.list_keys()] == [("new", 9), ("old", 0)]
    finally:
        store.close()
