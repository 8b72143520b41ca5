"""init after ``llmgw ctl node rm`` on a one-machine install, on real processes (as test_init.py).

A new user's report: after ``ctl node rm vm --force``, ``server init`` printed ``kept agent
certificate for vm`` (the revoked one); the agent, refused, exited and was not restarted, and init
waited twenty minutes for ``node vm`` to register. init now asks the control plane whether the
certificate is revoked, issues a new one, and (re)starts the agent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Assets
from tests.helpers.processes import llmgw, offline_init

pytestmark = pytest.mark.e2e


@pytest.fixture
def install(tmp_path: Path, assets: Assets) -> Iterator[tuple[Path, list[str]]]:
    with offline_init(tmp_path, assets) as got:
        yield got


def _agent_state(root: Path) -> str:
    r = llmgw(root, "service", "status", "agent", "--json", timeout=60)
    return str(json.loads(r.stdout)[0]["state"]) if r.returncode in (0, 3) else ""  # 3: not running


def test_init_after_node_rm_issues_a_new_certificate_and_the_node_rejoins(install: tuple[Path, list[str]]) -> None:
    root, args = install
    first = llmgw(root, *args)
    assert first.returncode == 0, first.stdout + first.stderr

    rm = llmgw(root, "ctl", "node", "rm", "e2e-node", "--force", timeout=60)
    assert rm.returncode == 0, rm.stdout + rm.stderr
    old = (root / "etc/llmgw/agent.pem").read_bytes()
    deadline = time.monotonic() + 60  # the agent hears 403 at its next heartbeat and exits
    while time.monotonic() < deadline and _agent_state(root) == "running":
        time.sleep(1)

    again = llmgw(root, *args)  # before the fix: waits 20 minutes, so the helper's timeout ends it
    out = again.stdout
    assert again.returncode == 0, out + again.stderr
    assert "updated agent certificate for e2e-node: the old one was revoked by 'ctl node rm'" in out
    assert "kept agent certificate" not in out
    assert "done node e2e-node is ready" in out
    assert (root / "etc/llmgw/agent.pem").read_bytes() != old
    nodes = llmgw(root, "ctl", "nodes", timeout=60)
    assert "e2e-node" in nodes.stdout, nodes.stdout
    assert "ready" in nodes.stdout, nodes.stdout
