"""init's wait for a model to serve, against a scripted admin API (httpx.MockTransport: the
control plane's answers are what is under test here, not its placement)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.errors import EngineError
from llmgw.paths import Paths
from llmgw.serverinit import files
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.steps import ServerInit, serve
from llmgw.serverinit.wait import Clock
from llmgw.service.manager import SupervisorManager


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def make_init(tmp_path: Path, answers: dict[str, Any]) -> tuple[ServerInit, io.StringIO]:
    paths = Paths(tmp_path)
    files.write_atomic(paths.server_config, files.server_yaml(
        admin_listen="127.0.0.1:9", agent_listen=":7443", gateway_listen=":8080", pki=paths.pki,
        keys_file=paths.client_keys))
    files.write_atomic(paths.admin_token, "t\n", 0o600)

    def handler(request: httpx.Request) -> httpx.Response:
        key = request.url.path + ("?" + request.url.query.decode() if request.url.query else "")
        return httpx.Response(200, json=answers[key])

    out = io.StringIO()
    c = FakeClock()
    init = ServerInit(
        paths, InitOptions(unplaced_grace_s=90, serve_wait_s=600, poll_s=2), SupervisorManager(paths),
        out=out, clock=Clock(c.now, c.sleep), admin_transport=httpx.MockTransport(handler),
    )
    return init, out


def test_a_replica_pending_on_no_node_is_believed_after_the_grace(tmp_path: Path) -> None:
    """The replicas view lists a wanted-but-unplaced replica as pending with no node; init must
    treat that as 'nowhere to run', not as a replica starting, or it waits out ten minutes."""
    init, out = make_init(tmp_path, {
        "/api/v1/replicas?model=judge": [{"id": "judge#pending-1", "model": "judge", "node": "", "state": "pending"}],
        "/api/v1/explain-placement?model=judge": {
            "model": "judge", "placed": False, "summary": "0/1 nodes can run it: 1 not enough cores",
            "rejections": [{"node": "vm", "profile": "cpu", "kind": "exhausted", "code": "cores_exhausted",
                            "reason": "needs 2 cores, 0 of 2 free"}],
        },
    })
    with pytest.raises(EngineError, match=r"judge has nowhere to run \(vm: needs 2 cores, 0 of 2 free\)"):
        serve.wait_serving(init.ctx, "judge")
    assert "0/1 nodes can run it: 1 not enough cores" in out.getvalue()


def test_a_ready_replica_ends_the_wait(tmp_path: Path) -> None:
    init, out = make_init(tmp_path, {
        "/api/v1/replicas?model=m": [{"id": "m-1", "model": "m", "node": "vm", "state": "ready", "profile": "cpu"}],
    })
    serve.wait_serving(init.ctx, "m")
    assert "kept m is serving (profile cpu)" in out.getvalue()
