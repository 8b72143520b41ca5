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
