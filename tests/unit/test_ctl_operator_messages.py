"""What ``llmgw ctl`` says back to a new operator's mistakes and surprises (a report of 2026-12-05):

- ``ctl restart nosuch`` advised ``GET /api/v1/replicas`` where every other command names
  ``llmgw ctl replicas``;
- ``ctl model scale NAME -1`` was Typer's ``No such option: -1``;
- ``ctl model add`` of a model that fits on no node printed ``added … (replicas 1..1)`` and nothing else.

A real control plane (``serve`` in a thread, SQLite) driven through the real CLI.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from llmgw.adminclient import AdminClient
from llmgw.cli.main import app
from tests.helpers.control import TOKEN, Install, make_install
from tests.unit.test_ctl_model_rm import ThreadedControlPlane


@pytest.fixture
def cp(tmp_path: pathlib.Path) -> Iterator[Install]:
    inst = make_install(tmp_path / "root")
    with ThreadedControlPlane(inst):
        yield inst


def ctl(inst: Install, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["--root", str(inst.root), "ctl", *args])
    return r.exit_code, r.output


def test_an_unknown_replica_is_listed_with_ctl_replicas(cp: Install) -> None:
    code, out = ctl(cp, "restart", "nosuch")
    assert code != 0
    assert out.strip().endswith(
        "404 no replica 'nosuch'; list them with 'llmgw ctl replicas' (GET /api/v1/replicas)")
    code, out = ctl(cp, "logs", "nosuch")
    assert code != 0
    assert out.strip().endswith(
        "404 no replica 'nosuch'; list them with 'llmgw ctl replicas' (GET /api/v1/replicas)")


def test_scale_to_a_negative_count_says_what_is_allowed(cp: Install) -> None:
    admin = AdminClient(cp.admin, TOKEN)
    admin.add_model({"name": "m", "source": "http://m.test:8081/m/1/m.gguf",
                     "profiles": [{"name": "cpu", "min_memory_gb": 1}]})
    code, out = ctl(cp, "model", "scale", "m", "-1")
    assert code == 2, out
    assert "replicas must be 0 or more, not -1" in out
    assert "No such option" not in out
    assert admin.model("m").scaling_min == 1  # nothing changed
    code, out = ctl(cp, "model", "scale", "m", "3", "--json")  # known options still parse
    assert code == 0, out
    assert (admin.model("m").scaling_min, admin.model("m").scaling_max) == (3, 3)
    code, out = ctl(cp, "model", "scale", "m", "0")
    assert (code, out) == (0, "m: scaling 0..0\n")
