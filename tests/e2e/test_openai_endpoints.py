"""``/v1/completions`` and ``/v1/embeddings`` with the official ``openai`` client, through a real
``llmgw server run`` to real llama-servers (gemma-3-270m): one for the chat model, one started with the
args the control plane gives the embedding model's replica (``--embeddings --pooling mean``, from its
catalog role). The agent is played by this test over the real agent API (mTLS)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from llmgw import tlsconf
from llmgw.agent.engines.llamacpp import FIT_OFF
from llmgw.protocol import HeartbeatReply, ReplicaState, ReplicaStatus
from tests.conftest import Assets
from tests.helpers.control import TOKEN, heartbeat, make_install, start_server_run, wait_admin_health
from tests.helpers.net import free_port

pytestmark = pytest.mark.e2e

KEY = "sk-e2e-endpoints"


@dataclass
class World:
    client: openai.OpenAI
    gateway: str
    embed_args: list[str]


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
def world(assets: Assets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("endpoints")
    inst = make_install(root)
    (inst.paths.etc / "gateway-keys").write_text(KEY + "\n")
    inst.write(
        gateway={"listen": f"127.0.0.1:{inst.ports['gateway']}", "keys_file": str(inst.paths.etc / "gateway-keys"),
                 "allow_loopback_without_key": False},
        node_lost_after_s=3600,
    )
    log = (root / "server.log").open("wb")
    server = start_server_run(inst, log)
    engines: list[subprocess.Popen[bytes]] = []
    try:
        admin, agent = inst.admin, inst.agent_url
        wait_admin_health(inst, server)
        cert, key = inst.ca.issue_client("node-1").write(root / "agent", "node-1")
        ctx = tlsconf.client_context(inst.paths.pki / "ca.pem", cert, key)
        assert httpx.post(agent + "/agent/v1/register", content=heartbeat(), verify=ctx).status_code == 200
        for name, role in (("gemma", "chat"), ("gemma-embed", "embedding")):
            model = {"name": name, "source": f"http://m/{name}.gguf", "role": role, "max_output": 64,
                     "profiles": [{"name": "cpu"}]}
            r = httpx.post(admin + "/api/v1/models", json=model, headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 201, r.text
        specs: dict[str, Any] = {}

        def placed() -> bool:
            r = httpx.post(agent + "/agent/v1/heartbeat", content=heartbeat(), verify=ctx)
            specs.update({s.model: s for s in HeartbeatReply.model_validate_json(r.content).desired})
            return len(specs) == 2

        _wait("placement of both models", placed, 30)
        ready = []
        for name in ("gemma", "gemma-embed"):
            port = free_port()
            engines.append(subprocess.Popen(
                [str(assets.llama_server), "-m", str(assets.model), "--host", "127.0.0.1", "--port", str(port),
                 *FIT_OFF, "--api-key", specs[name].key, "-c", "1024", "--threads", "1", "-np", "1", *specs[name].args],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
            health = f"http://127.0.0.1:{port}/health"
            _wait(f"llama-server for {name}", lambda u=health: httpx.get(u).status_code == 200)
            ready.append(ReplicaStatus(id=specs[name].id, state=ReplicaState.READY, endpoint=f"127.0.0.1:{port}"))
        assert httpx.post(agent + "/agent/v1/heartbeat", content=heartbeat(*ready), verify=ctx).status_code == 200
        gateway = f"http://127.0.0.1:{inst.ports['gateway']}"
        client = openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0, timeout=120)
        yield World(client, gateway, list(specs["gemma-embed"].args))
        client.close()
    finally:
        for proc in [*engines, server]:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


def test_the_embedding_models_engine_gets_embeddings_on(world: World) -> None:
    assert world.embed_args[-3:] == ["--embeddings", "--pooling", "mean"]


def test_models_lists_chat_and_embedding_models(world: World) -> None:
    assert sorted(m.id for m in world.client.models.list()) == ["gemma", "gemma-embed"]


def test_completions_plain_and_streamed(world: World) -> None:
    c = world.client.completions.create(model="gemma", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert c.model == "gemma"
    assert c.usage is not None
    assert c.usage.completion_tokens == 8
    assert isinstance(c.choices[0].text, str)
    stream = world.client.completions.create(
        model="gemma", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
    )
    text = "".join(ch.choices[0].text for ch in stream if ch.choices)
    assert text == c.choices[0].text  # temperature 0: the same words


def test_completions_max_tokens_held_to_max_output(world: World) -> None:
    c = world.client.completions.create(model="gemma", prompt="Count: 1, 2, 3,", max_tokens=5000, temperature=0)
    assert c.usage is not None
    assert c.usage.completion_tokens <= 64


def test_embeddings(world: World) -> None:
    e = world.client.embeddings.create(model="gemma-embed", input=["hello world", "goodbye"])
    assert len(e.data) == 2
    assert len(e.data[0].embedding) == 640  # gemma-3-270m's embedding length
    assert e.data[0].embedding != e.data[1].embedding
    assert e.model == "gemma-embed"
    assert e.usage.prompt_tokens > 0


def test_wrong_endpoint_names_the_right_one(world: World) -> None:
    with pytest.raises(openai.BadRequestError, match="use /v1/embeddings"):
        world.client.chat.completions.create(model="gemma-embed", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        world.client.completions.create(model="gemma-embed", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="is a chat model"):
        world.client.embeddings.create(model="gemma", input="hi")
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(world.gateway + "/v1/completions", json={"model": "gemma"}, headers=auth)
    assert r.status_code == 400
    assert "'prompt' is required" in r.json()["error"]["message"]
