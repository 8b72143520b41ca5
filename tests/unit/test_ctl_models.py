"""``llmgw ctl models`` through the real CLI against a real control plane (``serve`` in a thread,
SQLite): READY counts the replicas ready against the replicas wanted, so a model short of its
count never reads as whole."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from llmgw.cli.ctl import ready_cell
from llmgw.cli.main import app
from llmgw.views import ModelView
from tests.helpers.control import TOKEN, Install, make_install
from tests.unit.test_ctl_model_rm import ThreadedControlPlane


@pytest.fixture
def cp(tmp_path: pathlib.Path) -> Iterator[Install]:
    inst = make_install(tmp_path)
    with ThreadedControlPlane(inst):
        yield inst


def test_a_model_with_no_node_reads_0_of_1(cp: Install) -> None:
    """No node has registered: the model wants 1 and has none placed; READY was '0/0' (ready of
    placed), which looked whole."""
    spec = {"name": "chat", "source": "http://127.0.0.1:9/chat.gguf", "profiles": [{"name": "cpu"}]}
    r = httpx.post(f"{cp.admin}/api/v1/models", json=spec, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code in (200, 201), r.text
    out = CliRunner().invoke(app, ["--root", str(cp.root), "ctl", "models"])
    assert out.exit_code == 0, out.output
    (row,) = [ln for ln in out.output.splitlines() if "│ chat " in ln]
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells[4:6] == ["1", "0/1"], row  # WANTED, READY


@pytest.mark.parametrize(
    ("ready", "placed", "wanted", "cell", "failed"),
    [
        (0, 0, 1, "0/1", 0),  # its node was removed
        (2, 2, 3, "2/3", 0),  # scaled to 3, one does not fit
        (1, 2, 2, "1/2 (2 placed)", 0),  # one still starting
        (2, 2, 2, "2/2", 0),
        (0, 0, 0, "0/0", 0),  # scaled to zero
        (0, 1, 1, "0/1 (1 failed)", 1),  # its weights cannot be fetched: it read "(1 placed)", as if starting
        (1, 3, 3, "1/3 (3 placed, 1 failed)", 1),  # one ready, one starting, one failed
    ],
)
def test_ready_counts_against_the_wanted(ready: int, placed: int, wanted: int, cell: str, failed: int) -> None:
    m = ModelView(name="chat", replicas_ready=ready, replicas=placed, replicas_wanted=wanted, replicas_failed=failed)
    assert ready_cell(m) == cell
