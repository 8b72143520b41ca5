"""The gateway in front of a real llama-server (gemma-3-270m), asked with the official openai client."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from llmgw.agent.engines.llamacpp import FIT_OFF
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
            *(str(assets.llama_server), "-m", str(assets.model), "--host", "127.0.0.1", "--port", str(port), *FIT_OFF),
            *("--api-key", "replica-key", "-c", "1024", "--threads", "1", "-np", "1"),
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


@pytest.mark.parametrize(
    ("case", "field"),
    [
        ("tools", "tools[0].function.name"),
        ("tool_call_id", "messages[2].tool_call_id"),
        ("image", ""),
        ("surrogate", "messages[0].content"),
    ],
)
def test_a_clients_mistake_is_a_400_not_the_engines_500(gateway_url: str, case: str, field: str) -> None:
    """Issue 19 item 10: llama-server answers these client mistakes with a 500 ``server_error``, which
    the gateway passed on (and counted as a server error). Now the gateway refuses the malformed
    shapes itself (400 naming the field) and turns llama-server's 500 for an image sent to a text
    model (which the gateway cannot know) into a 400 saying so."""
    user = {"role": "user", "content": "What is the weather in Paris?"}
    body: dict[str, object] = {"model": "gemma", "messages": [user], "max_tokens": 2}
    raw = b""
    if case == "tools":
        body["tools"] = [{"type": "function", "function": {"name": 5, "parameters": {"type": "object"}}}]
    elif case == "tool_call_id":
        call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
        body["messages"] = [user, {"role": "assistant", "content": None, "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": 1, "content": "sunny"}]
    elif case == "image":
        img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, img]}]
    else:
        raw = b'{"model": "gemma", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    headers = {"Authorization": "Bearer sk-e2e", "Content-Type": "application/json"}
    r = httpx.post(f"{gateway_url}/chat/completions", content=raw or json.dumps(body).encode(), headers=headers,
                   timeout=120)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    if field:
        assert f"'{field}'" in err["message"]
    else:
        assert "text only" in err["message"]
        assert "mmproj" not in err["message"]
