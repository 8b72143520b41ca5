"""What an operator sees of routing (issue 21, item 4), on a real control plane (``serve`` in a
thread, SQLite, its real listeners) in front of two real llama-server replicas (gemma-3-270m,
``-np 2``): ``GET /api/v1/replicas``' ``routing``, ``llmgw ctl replicas`` (the real CLI) and the
dashboard's model page (real HTTP, logged in).

The agent is played by this test over the real agent API (mTLS), as in test_gateway_engine.py:
two nodes register, the control plane places the model's two replicas, the test starts one
llama-server per replica with that replica's key and reports it ready.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from llmgw.agent.engines.llamacpp import FIT_OFF
from llmgw.cli.main import app
from llmgw.protocol import HeartbeatReply, ReplicaState, ReplicaStatus
from llmgw.views import ROUTING_SCOPE
from tests.conftest import Assets
from tests.helpers.control import TOKEN, Install, heartbeat, make_install
from tests.helpers.net import free_port
from tests.helpers.processes import stop_process
from tests.unit.test_ctl_model_rm import ThreadedControlPlane

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {TOKEN}"}
SLOTS = 2
CHATS = 5
NODES = ("node-1", "node-2")


@dataclass
class World:
    inst: Install
    replicas: list[str]

    def replicas_json(self) -> list[dict[str, Any]]:
        r = httpx.get(self.inst.admin + "/api/v1/replicas", params={"model": "chat"}, headers=AUTH)
        assert r.status_code == 200, r.text
        got: list[dict[str, Any]] = r.json()
        return got

    def chat(self, turn: int) -> httpx.Response:
        """One turn of one conversation (the same system prompt and first user message: one prefix key)."""
        messages = [
            {"role": "system", "content": "You are a terse assistant. " * 8},
            {"role": "user", "content": "Name a colour."},
        ]
        for i in range(turn):
            messages += [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": f"And {i}?"}]
        body = {"model": "chat", "messages": messages, "max_tokens": 4, "temperature": 0}
        return httpx.post(f"http://127.0.0.1:{self.inst.ports['gateway']}/v1/chat/completions", json=body, timeout=120)


def _wait(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {timeout:g} s"
        time.sleep(0.2)


def _engine(assets: Assets, key_file: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            *(str(assets.llama_server), "-m", str(assets.model), "--host", "127.0.0.1", "--port", str(port), *FIT_OFF),
            *("--api-key-file", str(key_file), "-c", str(512 * SLOTS), "--threads", "1", "-np", str(SLOTS)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def world(assets: Assets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("cp")
    inst = make_install(root)
    inst.write(node_lost_after_s=3600)
    engines: list[subprocess.Popen[bytes]] = []
    with ThreadedControlPlane(inst):
        try:
            ctxs = {n: inst.agent_ctx(n) for n in NODES}
            for n in NODES:
                r = httpx.post(inst.agent_url + "/agent/v1/register", content=heartbeat(), verify=ctxs[n])
                assert r.status_code == 200, r.text
            model = {"name": "chat", "source": "http://m/chat.gguf", "profiles": [{"name": "cpu"}],
                     "scaling": {"min": 2, "max": 2}}
            r = httpx.post(inst.admin + "/api/v1/models", json=model, headers=AUTH)
            assert r.status_code == 201, r.text
            specs: dict[str, tuple[str, str]] = {}  # replica id -> (node, key)

            def placed() -> bool:
                for n in NODES:
                    r = httpx.post(inst.agent_url + "/agent/v1/heartbeat", content=heartbeat(), verify=ctxs[n])
                    specs.update({s.id: (n, s.key) for s in HeartbeatReply.model_validate_json(r.content).desired})
                return len(specs) == 2

            _wait("placement of both replicas", placed, 30)
            endpoints: dict[str, str] = {}
            for rid, (_, key) in specs.items():
                key_file = root / f"{rid}.key"
                key_file.write_text(key + "\n")
                proc, endpoints[rid] = _engine(assets, key_file)
                engines.append(proc)
            for rid, ep in endpoints.items():
                _wait(f"llama-server of {rid}", lambda ep=ep: _healthy(ep))
            for rid, (n, _) in specs.items():
                ready = ReplicaStatus(id=rid, state=ReplicaState.READY, endpoint=endpoints[rid])
                r = httpx.post(inst.agent_url + "/agent/v1/heartbeat", content=heartbeat(ready), verify=ctxs[n])
                assert r.status_code == 200, r.text
            yield World(inst, sorted(specs))
        finally:
            for proc in engines:
                stop_process(proc)


def _healthy(endpoint: str) -> bool:
    try:
        return httpx.get(f"http://{endpoint}/health").status_code == 200
    except httpx.HTTPError:
        return False


def test_routing_figures_through_the_api_the_cli_and_the_dashboard(world: World) -> None:
    # Before the gateway has sent anything: zeros, slots unknown.
    before = world.replicas_json()
    assert sorted(r["id"] for r in before) == world.replicas
    for r in before:
        assert r["routing"] == {"scope": ROUTING_SCOPE, "slots": None, "in_flight": 0, "queued": 0,
                                "affinity_hits": 0, "picks": {}, "service_s": 0.0, "tokens_per_s": 0.0}

    # The gateway learns of the ready replicas on its next routing refresh.
    first: list[httpx.Response] = []
    _wait("the gateway routing to the replicas", lambda: first.append(world.chat(0)) or first[-1].status_code == 200)
    for turn in range(1, CHATS):
        r = world.chat(turn)
        assert r.status_code == 200, r.text

    def slots_read() -> bool:  # /props is read in the background after a replica's first request
        return all(r["routing"]["slots"] == SLOTS for r in world.replicas_json() if r["routing"]["picks"])

    _wait("slots from /props", slots_read, 10)
    after = {r["id"]: r["routing"] for r in world.replicas_json()}
    # One conversation, two replicas: every turn on its key's first choice.
    (hit,) = [rid for rid, g in after.items() if g["affinity_hits"]]
    (other,) = [rid for rid in after if rid != hit]
    assert after[hit]["affinity_hits"] == CHATS
    assert after[hit]["picks"] == {"affinity": CHATS, "overflow": 0, "least_load": 0, "round_robin": 0}
    assert (after[hit]["in_flight"], after[hit]["queued"], after[hit]["slots"]) == (0, 0, SLOTS)
    assert after[hit]["service_s"] > 0
    assert after[hit]["tokens_per_s"] > 0  # llama-server's own timings: the decode rate replicas are compared by
    assert after[other]["affinity_hits"] == 0
    assert after[other]["in_flight"] == 0

    # ctl replicas: the four columns, and --json carries the object.
    inst = world.inst
    out = CliRunner().invoke(app, ["--root", str(inst.root), "ctl", "replicas", "chat"])
    assert out.exit_code == 0, out.output
    header = out.output.splitlines()[1]
    for col in ("SLOTS", "IN FLIGHT", "QUEUED", "AFFINITY"):
        assert col in header, out.output
    row = next(ln for ln in out.output.splitlines() if hit in ln)
    assert re.search(rf"\b{SLOTS}\s+│?\s*0\s+│?\s*0\s+│?\s*{CHATS}\b", row), out.output
    out = CliRunner().invoke(app, ["--root", str(inst.root), "ctl", "replicas", "chat", "--json"])
    assert out.exit_code == 0, out.output
    assert {r["id"]: r["routing"]["affinity_hits"] for r in json.loads(out.output)} == {hit: CHATS, other: 0}

    # The dashboard's model page.
    with httpx.Client(base_url=inst.admin) as c:
        page = c.get("/ui/login").text
        csrf = re.search(r'name="csrf" value="([^"]+)"', page)
        assert csrf
        r = c.post("/ui/login", data={"csrf": csrf.group(1), "token": TOKEN, "next": ""}, follow_redirects=True)
        assert r.status_code == 200, r.text
        html = c.get("/ui/models/chat").text
    for col in ("Slots", "In flight", "Queued", "Affinity hits"):
        assert f">{col}</th>" in html, html
    cells = re.search(rf"<td>{hit}</td>.*?</tr>", html, re.S)
    assert cells, html
    assert f'<td class="slots">{SLOTS}</td><td class="in-flight">0</td><td class="queued">0</td>' in cells.group(0)
    assert f'<td class="affinity">{CHATS}</td>' in cells.group(0)


def test_in_flight_and_queued_while_every_slot_is_busy(world: World) -> None:
    """More requests at once than the two replicas have slots: while they run, ``routing`` shows
    every slot in flight and the rest queued at the gateway; once done, zeros again."""
    url = f"http://127.0.0.1:{world.inst.ports['gateway']}/v1/chat/completions"
    n = 2 * SLOTS + 3

    def one(i: int) -> int:
        # 32 tokens: a wave of 4 lasts seconds, against a 50 ms poll (96 took 38 s for the two waves in CI).
        body = {"model": "chat", "messages": [{"role": "user", "content": f"Count to 100, conversation {i}."}],
                "max_tokens": 32, "temperature": 0}
        return httpx.post(url, json=body, timeout=120).status_code

    seen_in_flight, seen_queued = 0, 0
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        while not all(f.done() for f in futures):
            routing = [r["routing"] for r in world.replicas_json()]
            assert all(g["in_flight"] <= g["slots"] for g in routing if g["slots"] is not None)
            seen_in_flight = max(seen_in_flight, sum(g["in_flight"] for g in routing))
            seen_queued = max(seen_queued, routing[0]["queued"])
            assert routing[0]["queued"] == routing[1]["queued"]  # the model's queue, on each of its replicas
            time.sleep(0.05)
        assert [f.result() for f in futures] == [200] * n
    assert seen_in_flight == 2 * SLOTS
    assert seen_queued >= 1
    done = [r["routing"] for r in world.replicas_json()]
    assert [(g["in_flight"], g["queued"]) for g in done] == [(0, 0), (0, 0)]
