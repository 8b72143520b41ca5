"""init's wait for a model to serve, against a scripted admin API (httpx.MockTransport: the
control plane's answers are what is under test here, not its placement)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.errors import EngineError
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.steps import ServerInit, serve
from tests.helpers.init import scripted_init


def make_init(tmp_path: Path, answers: dict[str, Any]) -> tuple[ServerInit, io.StringIO]:
    options = InitOptions(unplaced_grace_s=90, serve_wait_s=600, poll_s=2)
    init, out, _clock = scripted_init(tmp_path, answers, options)
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


def _restarting_init(tmp_path: Path, created_at: float) -> tuple[ServerInit, io.StringIO, list[str]]:
    """An init whose admin API lists one failed replica of ``m`` created at ``created_at``
    (seconds relative to the init's start) and answers a restart with a fresh replica that is ready."""
    init, out = make_init(tmp_path, {})
    failed = {"id": "m-old", "model": "m", "node": "vm", "state": "failed", "profile": "cpu",
              "created_at": init.ctx.started_at + created_at,
              "err": "llama-server exited 1: version: 1 (abc)"}
    fresh = {"id": "m-new", "model": "m", "node": "vm", "state": "ready", "profile": "cpu",
             "created_at": init.ctx.started_at + 1}
    restarted: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/api/v1/replicas/m-old/restart":
            restarted.append("m-old")
            return httpx.Response(202, json={**fresh, "state": "pending"})
        assert request.url.path == "/api/v1/replicas"
        return httpx.Response(200, json=[fresh] if restarted else [failed])

    init.ctx.admin_transport = httpx.MockTransport(handler)
    return init, out, restarted


def test_a_failure_from_before_this_run_is_not_final_the_replica_is_restarted(tmp_path: Path) -> None:
    """A new user's item 23: after an install whose replica failed with a bad llama-server, init
    with the real one restarted the agent and then at once stopped on the old failure ("fix the
    cause and run init again", exit 1). A failure recorded before this run is restarted once."""
    init, out, restarted = _restarting_init(tmp_path, created_at=-60)
    serve.wait_serving(init.ctx, "m")
    assert restarted == ["m-old"]
    text = out.getvalue()
    assert "m: replica m-old had failed before this run; restarted it as m-new" in text
    assert "done m is serving (profile cpu)" in text


def test_a_failure_during_this_run_is_final(tmp_path: Path) -> None:
    init, _out, restarted = _restarting_init(tmp_path, created_at=5)
    with pytest.raises(EngineError, match=r"m failed to start on node vm: llama-server exited 1"):
        serve.wait_serving(init.ctx, "m")
    assert restarted == []


def _scripted(init: ServerInit, answers: list[list[dict[str, Any]]]) -> list[int]:
    """Answer the replicas view with ``answers`` in turn (the last one from then on); returns the calls."""
    seen: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/replicas"
        seen.append(1)
        return httpx.Response(200, json=answers[min(len(seen), len(answers)) - 1])

    init.ctx.admin_transport = httpx.MockTransport(handler)
    return seen


def test_after_a_profile_change_only_the_replacement_serves(tmp_path: Path) -> None:
    """A judge carried in on a later run changes the starter's profile (its cores): the old replica,
    ready, then draining, was taken for "serving" and the first chat after init met only the new
    one starting (503 model_unavailable, tests/e2e/test_init.py under load). Serving is what the
    gateway routes to: ready and not draining; the replica on the changed profile only once it
    stayed so for REPLACED_SETTLE_S."""
    init, out = make_init(tmp_path, {})
    init.ctx.replaced["m"] = {"m-old"}
    old = {"id": "m-old", "model": "m", "node": "vm", "state": "ready", "profile": "cpu"}
    new = {"id": "m-new", "model": "m", "node": "vm", "state": "starting", "profile": "cpu"}
    seen = _scripted(init, [
        [old],  # before the leader drained it: still ready, not yet draining
        [{**old, "draining_since": 1.0}, new],
        [{**old, "draining_since": 1.0}, {**new, "state": "ready"}],
    ])
    serve.wait_serving(init.ctx, "m")
    assert len(seen) == 3  # neither the old one nor the new one starting was taken for serving
    assert "done m is serving (profile cpu)" in out.getvalue()


def test_a_replica_the_change_does_not_replace_serves_after_the_settle(tmp_path: Path) -> None:
    """The changed profile's replica that the leader does not replace (its spec unchanged, e.g. the
    replica runs another profile's spec) is not waited on for ever: it serves once it stayed ready
    and not draining for REPLACED_SETTLE_S."""
    init, out = make_init(tmp_path, {})
    init.ctx.replaced["m"] = {"m-1"}
    seen = _scripted(init, [[{"id": "m-1", "model": "m", "node": "vm", "state": "ready", "profile": "cpu"}]])
    t0 = init.ctx.clock.now()
    serve.wait_serving(init.ctx, "m")
    assert init.ctx.clock.now() - t0 >= serve.REPLACED_SETTLE_S
    assert len(seen) >= 2
    assert "m is serving (profile cpu)" in out.getvalue()
