"""The gateway protects a real engine: a real ``llmgw server run`` process
in front of a real llama-server (gemma-3-270m, one slot: ``-np 1``).

The agent is played by this test over the real agent API (mTLS): it registers a node, the control
plane places two models there, and the test starts one llama-server that accepts both replicas'
keys (``--api-key-file``) and reports both replicas ready at its address. ``capped`` has
``max_output: 16`` (:data:`CAP`); ``long`` has no limit, for long generations.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw import tlsconf
from llmgw.agent.engines.llamacpp import FIT_OFF
from llmgw.protocol import HeartbeatReply, ReplicaState, ReplicaStatus
from tests.conftest import Assets
from tests.helpers.control import TOKEN, heartbeat, make_install, start_server_run, wait_admin_health
from tests.helpers.net import free_port
from tests.helpers.processes import stop_process

pytestmark = pytest.mark.e2e

KEY = "sk-e2e-gateway"
CAP = 16
"""``capped``'s ``max_output`` (tokens). What the tests prove does not depend on it (the control
generates 2 x CAP unbounded, each capped request asks for far more); 32 cost 4.2 CPU-s more a run
of this file (14.3 -> 10.1 CPU-s, LLMGW_TEST_CPU, 2026-12-06, 2 cores): 96 tokens fewer, ~44 ms of
CPU a token (one engine thread; the gateway's and the engine's work together)."""


@dataclass
class Cluster:
    gateway: str
    log: Path

    def chat(self, model: str, timeout: float = 300, **extra: Any) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, **extra}
        return httpx.post(
            f"{self.gateway}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=timeout,
        )


PROMPT = "Count from 1 to 1000, one number per line, and nothing else."


def _wait(what: str, check: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{what} not ready in {timeout:g} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(assets: Assets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    inst = make_install(root)
    paths, ca = inst.paths, inst.ca
    (paths.etc / "gateway-keys").write_text(KEY + "\n")
    inst.write(
        gateway={
            "listen": f"127.0.0.1:{inst.ports['gateway']}",
            "keys_file": str(paths.etc / "gateway-keys"),
            "allow_loopback_without_key": False,
        },
        node_lost_after_s=3600,
    )
    log = (root / "server.log").open("wb")
    server = start_server_run(inst, log)
    engine: subprocess.Popen[bytes] | None = None
    try:
        admin = f"http://127.0.0.1:{inst.ports['admin']}"
        agent = f"https://127.0.0.1:{inst.ports['agent']}"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        wait_admin_health(inst, server)
        cert, key = ca.issue_client("node-1").write(root / "agent", "node-1")
        ctx = tlsconf.client_context(paths.pki / "ca.pem", cert, key)
        assert httpx.post(agent + "/agent/v1/register", content=heartbeat(), verify=ctx).status_code == 200
        for name, limit in (("capped", CAP), ("long", 0)):
            model = {"name": name, "source": f"http://m/{name}.gguf", "profiles": [{"name": "cpu"}]}
            r = httpx.post(admin + "/api/v1/models", json={**model, "max_output": limit}, headers=auth)
            assert r.status_code == 201, r.text
        specs: dict[str, Any] = {}

        def placed() -> bool:
            r = httpx.post(agent + "/agent/v1/heartbeat", content=heartbeat(), verify=ctx)
            specs.update({s.model: s for s in HeartbeatReply.model_validate_json(r.content).desired})
            return len(specs) == 2

        _wait("placement of both models", placed, 30)
        keys = root / "replica-keys"
        keys.write_text("".join(s.key + "\n" for s in specs.values()))
        port = free_port()
        engine = subprocess.Popen(
            [
                *(str(assets.llama_server), "-m", str(assets.model), "--host", "127.0.0.1", "--port", str(port)),
                *FIT_OFF, *("--api-key-file", str(keys), "-c", "1024", "--threads", "1", "-np", "1"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait("llama-server", lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200)
        ready = [ReplicaStatus(id=s.id, state=ReplicaState.READY, endpoint=f"127.0.0.1:{port}") for s in specs.values()]
        assert httpx.post(agent + "/agent/v1/heartbeat", content=heartbeat(*ready), verify=ctx).status_code == 200
        yield Cluster(f"http://127.0.0.1:{inst.ports['gateway']}", root / "server.log")
    finally:
        for proc, grace in ((engine, 10), (server, 15)):
            if proc is not None:
                stop_process(proc, grace)
        log.close()


def _completion_tokens(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    tokens: int = r.json()["usage"]["completion_tokens"]
    return tokens


def test_the_prompt_makes_a_long_answer(cluster: Cluster) -> None:
    """The control for the next test: unbounded, this prompt goes on well past the cap."""
    assert _completion_tokens(cluster.chat("long", max_tokens=2 * CAP)) == 2 * CAP


@pytest.mark.parametrize(
    "extra",
    [
        {"max_tokens": -1},
        {"n_predict": 100000},
        {"max_tokens": 100000, "n_predict": -1},
        {"max_completion_tokens": 100000, "id_slot": 0, "cache_prompt": False},
    ],
)
def test_no_field_lets_a_request_past_max_output(cluster: Cluster, extra: dict[str, Any]) -> None:
    r = cluster.chat("capped", **extra)
    assert _completion_tokens(r) <= CAP
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_a_prompt_past_the_context_is_openais_context_length_exceeded(cluster: Cluster) -> None:
    """A prompt longer than the engine's context (1024 tokens here): llama-server answers 400 with its
    own ``code: 400`` (a number) and "try increasing it" (a second new user's finding, 2026-12-04);
    the client gets OpenAI's ``context_length_exceeded`` with llama-server's counts and what to do."""
    r = httpx.post(
        f"{cluster.gateway}/v1/chat/completions",
        json={"model": "long", "messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 1},
        headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded", err
    assert "exceeds the available context size (1024 tokens)" in err["message"], err
    assert err["message"].endswith("; shorten the messages or ask for fewer max_tokens"), err
    assert "try increasing it" not in err["message"]


def _abandon(gateway: str, body: bytes) -> None:
    """Send a non-streamed request on a raw socket, then close the socket without reading."""
    host, port = gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.5)


def test_abandoned_requests_free_the_engine_slot(cluster: Cluster) -> None:
    """Four abandoned 900-token requests on the one slot; a fresh request is answered at once.

    Before the fix the engine generated all four answers for nobody first (4 x 900 tokens: the
    fresh request had no answer after 120 s on a loaded 2-core machine); now each is stopped when its
    client goes (llama-server looks once a second). The 30 s bound is generous for a loaded machine
    and far below what the four would take.
    """
    body = json.dumps(
        {"model": "long", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 900, "temperature": 0}
    ).encode()
    for _ in range(4):
        _abandon(cluster.gateway, body)
    t0 = time.monotonic()
    r = cluster.chat("long", max_tokens=4, timeout=120)
    took = time.monotonic() - t0
    assert _completion_tokens(r) == 4
    assert took < 30, f"a fresh request waited {took:.1f} s behind abandoned ones"


def _access_line(cluster: Cluster, request_id: str) -> str:
    lines: list[str] = []

    def logged() -> bool:
        lines[:] = [ln for ln in cluster.log.read_text().splitlines() if f"request_id={request_id} " in ln]
        return bool(lines)

    _wait(f"the access log line of {request_id}", logged, 10)
    return lines[0]


def test_stream_tokens_are_counted_from_the_engine_and_its_usage_event_hidden(cluster: Cluster) -> None:
    """The gateway asks llama-server for a stream's usage (include_usage) and hides the event from a
    client that did not ask; the access log has the engine's counts."""
    body = {"model": "long", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}", "x-request-id": "e2e-stream-1"}
    r = httpx.post(f"{cluster.gateway}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "e2e-stream-1"
    assert '"usage"' not in r.text
    assert r.text.rstrip().endswith("data: [DONE]")
    line = _access_line(cluster, "e2e-stream-1")
    assert "key=keys-file kind=chat model=long" in line
    assert "status=200 stream=true" in line
    assert "completion_tokens=8 " in line
    assert "estimated" not in line
    assert PROMPT not in line
    assert KEY not in line
    asked = httpx.post(
        f"{cluster.gateway}/v1/chat/completions",
        json={**body, "stream_options": {"include_usage": True}},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    usage = [json.loads(ln[6:])["usage"] for ln in asked.text.splitlines() if '"usage"' in ln]
    assert usage[-1]["completion_tokens"] == 8


def test_a_client_that_leaves_a_stream_is_charged_what_was_generated(cluster: Cluster) -> None:
    body = {"model": "long", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 600, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}", "x-request-id": "e2e-left-1"}
    events = 0
    with httpx.stream(
        "POST", f"{cluster.gateway}/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        for ln in r.iter_lines():
            events += ln.startswith("data: {")
            if events >= 12:
                break
    line = _access_line(cluster, "e2e-left-1")
    assert "status=499" in line
    assert "estimated=true" in line
    completion = int(line.split("completion_tokens=")[1].split()[0])
    assert 11 <= completion < 600
