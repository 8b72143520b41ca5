"""The gateway in front of a real llama-server (gemma-3-270m), asked with the official openai client."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from llmgw.control.gateway.app import build_gateway_app
from llmgw.routing import Route, StaticRouter, Upstream
from tests.conftest import Assets
from tests.helpers.gateway import ServerThread
from tests.helpers.net import free_port

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gateway_url(assets: Assets) -> Iterator[str]:
    port = free_port()
    engine = subprocess.Popen(
        [
            *(str(assets.llama_server), "-m", str(assets.model), "--host", "127.0.0.1", "--port", str(port)),
            *("--api-key", "replica-key", "-c", "1024", "--threads", "2", "-np", "1"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    servers = ServerThread()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert engine.poll() is None, "llama-server exited"
            assert time.monotonic() < deadline, "llama-server not ready in 60 s"
            time.sleep(0.2)
        endpoint = f"127.0.0.1:{port}"
        router = StaticRouter(
            routes={
                "gemma": Route("gemma", (Upstream("r1", endpoint, "replica-key"),)),
                "stale": Route("stale", (Upstream("r2", endpoint, "old-key"),)),
            },
            aliases={"small": "gemma"},
        )
        gw = servers.serve(build_gateway_app(router, keys={"sk-e2e"}, allow_loopback_without_key=False))
        yield f"http://127.0.0.1:{gw}/v1"
    finally:
        servers.close()
        engine.terminate()
        engine.wait(10)


def test_openai_client_against_llama_server(gateway_url: str) -> None:
    client = openai.OpenAI(base_url=gateway_url, api_key="sk-e2e", max_retries=0)
    msgs: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
    answer = client.chat.completions.create(model="small", messages=msgs, max_tokens=8)
    assert answer.model == "small"
    assert answer.choices[0].message.content
    assert answer.usage is not None
    assert answer.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model="gemma", messages=msgs, max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert {c.model for c in chunks} == {"gemma"}
    client.close()


def test_stale_replica_key_is_a_502(gateway_url: str) -> None:
    r = httpx.post(
        f"{gateway_url}/chat/completions",
        json={"model": "stale", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": "Bearer sk-e2e"},
    )
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_auth"
    assert "127.0.0.1" not in r.text


def test_completions_serve_one_prompt_per_request(gateway_url: str) -> None:
    """Issue 19 item 8: a ``prompt`` list bought one generation per prompt (llama-server answered
    every one) while being admitted, limited and charged as one request. Now one prompt per request:
    a string, token ids, or a list of one of those is served; a list of several is a 400 saying to
    send one request per prompt, and the engine is not asked."""
    auth = {"Authorization": "Bearer sk-e2e"}

    def ask(prompt: object) -> httpx.Response:
        body = {"model": "gemma", "prompt": prompt, "max_tokens": 2}
        return httpx.post(f"{gateway_url}/completions", json=body, headers=auth, timeout=120)

    many = ask(["Once upon a time", "The sky is", "One, two,"])
    assert many.status_code == 400, many.text
    err = many.json()["error"]
    assert err["code"] == "invalid_prompt"
    assert "3 prompts" in err["message"]
    assert "one request per prompt" in err["message"]
    assert "x-llmgw-replica" not in many.headers  # refused before any engine was asked
    assert ask([[1, 2], [3, 4]]).status_code == 400
    for one in ("The sky is", ["The sky is"], [818, 7217, 563], [[818, 7217, 563]]):
        r = ask(one)
        assert r.status_code == 200, (one, r.text)
        answer = r.json()
        assert len(answer["choices"]) == 1
        assert answer["usage"]["completion_tokens"] >= 1

