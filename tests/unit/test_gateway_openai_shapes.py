"""Answers shaped as OpenAI's API gives them, read with the official ``openai`` client through the
gateway, where llama-server answers in another shape (a compatibility tester's findings).

The fake engine answers ``/v1/completions`` with what llama-server (b0.3.36) sent for the same
requests, captured from a real one: ``logprobs`` in the chat shape. Its ``/v1/embeddings`` answers
vectors of 640 numbers whatever ``dimensions`` says, as llama-server does, and it ignores ``echo``
as llama-server does.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from aiohttp import web

from llmgw.control.gateway.app import build_gateway_app
from llmgw.control.gateway.legacylogprobs import CompletionsRewriter, legacy_logprobs, reshape_completion
from llmgw.routing import Route, StaticRouter, Upstream
from tests.helpers.gateway import ServerThread

KEY = "sk-good"
MODEL = "gemma"
EMBED = "embed"
#: The fake engine's embedding width (gemma-3-270m's).
WIDTH = 640
#: The completions bodies the fake engine got.
SEEN: list[dict[str, Any]] = []

#: llama-server's per-token entries for " a" then " time" (``logprobs: 2``), as it sent them.
_A = {"id": 496, "token": " a", "bytes": [32, 97], "logprob": -0.0207,
      "top_logprobs": [{"id": 496, "token": " a", "bytes": [32, 97], "logprob": -0.0207},
                       {"id": 990, "token": " time", "bytes": [32, 116, 105, 109, 101], "logprob": -4.82}]}
_TIME = {"id": 990, "token": " time", "bytes": [32, 116, 105, 109, 101], "logprob": -0.0259,
         "top_logprobs": [{"id": 990, "token": " time", "bytes": [32, 116, 105, 109, 101], "logprob": -0.0259},
                          {"id": 38735, "token": " midnight", "bytes": [32], "logprob": -5.81}]}
_LEGACY = {
    "tokens": [" a", " time"],
    "token_logprobs": [-0.0207, -0.0259],
    "top_logprobs": [{" a": -0.0207, " time": -4.82}, {" time": -0.0259, " midnight": -5.81}],
    "text_offset": [0, 2],
}


def _completion(body: dict[str, Any]) -> dict[str, Any]:
    logprobs = {"content": [_A, _TIME]} if body.get("logprobs") else None
    return {
        "choices": [{"text": " a time", "index": 0, "logprobs": logprobs, "finish_reason": "length"}],
        "created": 1796495375, "model": "/models/gemma.gguf", "object": "text_completion", "id": "cmpl-1",
        "usage": {"completion_tokens": 2, "prompt_tokens": 3, "total_tokens": 5},
    }


def _events(body: dict[str, Any]) -> list[dict[str, Any]]:
    base = {"created": 1796495375, "model": "/models/gemma.gguf", "object": "text_completion", "id": "cmpl-1"}
    asked = bool(body.get("logprobs"))
    return [
        {**base, "choices": [{"text": " a", "index": 0, "logprobs": {"content": [_A]} if asked else None,
                              "finish_reason": None}]},
        {**base, "choices": [{"text": " time", "index": 0, "logprobs": {"content": [_TIME]} if asked else None,
                              "finish_reason": None}]},
        {**base, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
         "usage": {"completion_tokens": 2, "prompt_tokens": 3, "total_tokens": 5}},
    ]


def _engine() -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        SEEN.append(body)
        if not body.get("stream"):
            return web.json_response(_completion(body))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in _events(body):
            await resp.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        vector = [0.01 * i for i in range(WIDTH)]
        encoded: Any = vector
        if body.get("encoding_format") == "base64":
            encoded = base64.b64encode(struct.pack(f"<{WIDTH}f", *vector)).decode()
        data = [{"embedding": encoded, "index": i, "object": "embedding"} for i in range(len(inputs))]
        return web.json_response({"model": "/models/e.gguf", "object": "list", "data": data,
                                  "usage": {"prompt_tokens": 2, "total_tokens": 2}})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    return app


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    servers = ServerThread()
    engine = servers.serve(_engine())
    up = Upstream("r-a", f"127.0.0.1:{engine}", "key-a")
    router = StaticRouter(routes={MODEL: Route(MODEL, (up,)), EMBED: Route(EMBED, (up,), role="embedding")})
    port = servers.serve(build_gateway_app(router, keys={KEY}, allow_loopback_without_key=False),
                         handler_cancellation=True)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    servers.close()


# -- /v1/completions' logprobs -----------------------------------------------------------------------


def test_completion_logprobs_come_in_the_legacy_shape(client: openai.OpenAI) -> None:
    """``choice.logprobs.tokens`` was None: llama-server's chat-shaped ``{"content": [...]}`` went through."""
    answer = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.model_dump() == _LEGACY
    assert answer.model == MODEL


def test_streamed_completion_logprobs_come_in_the_legacy_shape(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2, logprobs=2, stream=True))
    got = [c.choices[0].logprobs.model_dump() for c in chunks if c.choices and c.choices[0].logprobs]
    assert got == [
        {"tokens": [" a"], "token_logprobs": [-0.0207], "top_logprobs": [{" a": -0.0207, " time": -4.82}],
         "text_offset": [0]},
        {"tokens": [" time"], "token_logprobs": [-0.0259], "top_logprobs": [{" time": -0.0259, " midnight": -5.81}],
         "text_offset": [2]},  # after " a": offsets run across the stream's events
    ]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " a time"


def test_a_completion_without_logprobs_is_untouched(client: openai.OpenAI) -> None:
    answer = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2)
    assert answer.choices[0].logprobs is None
    assert answer.choices[0].text == " a time"


def test_legacy_logprobs_leave_other_shapes_alone() -> None:
    assert legacy_logprobs(None) is None
    assert legacy_logprobs(_LEGACY) is None  # vLLM's answer is already legacy
    answer = {"choices": [{"index": 0, "text": "x", "logprobs": dict(_LEGACY)}]}
    assert not reshape_completion(answer)
    assert answer["choices"][0]["logprobs"] == _LEGACY


def test_the_stream_rewriter_reshapes_an_event_split_across_chunks() -> None:
    event = {"choices": [{"text": " a", "index": 0, "logprobs": {"content": [_A]}}], "model": "/m.gguf"}
    line = b"data: " + json.dumps(event).encode() + b"\n\n"
    rewriter = CompletionsRewriter(MODEL)
    out = rewriter.feed(line[:40]) + rewriter.feed(line[40:]) + rewriter.tail()
    sent = json.loads(out.split(b"\n")[0][6:])
    assert sent["model"] == MODEL
    assert sent["choices"][0]["logprobs"]["tokens"] == [" a"]


# -- /v1/completions' echo ---------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["Once upon", ["Once upon"]])
def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI, prompt: Any) -> None:
    """llama-server ignores ``echo``: the text was " a time" alone."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True)
    assert raw.parse().choices[0].text == "Once upon a time"
    assert "echo" not in SEEN[-1]  # the gateway echoes, for every engine (vLLM would echo a second time)
    assert raw.headers.get("x-llmgw-dropped") is None  # served, not dropped


def test_a_streamed_echo_sends_the_prompt_first(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2, echo=True, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == "Once upon a"
    assert "".join(texts) == "Once upon a time"


@pytest.mark.parametrize(("extra", "says"), [
    ({"prompt": [1, 2, 3]}, "cannot echo token ids"),
    ({"logprobs": 2}, "'echo' with 'logprobs' is not supported"),
    ({"echo": "yes"}, "'echo' must be true or false"),
])
def test_echo_it_cannot_serve_is_a_400(client: openai.OpenAI, extra: dict[str, Any], says: str) -> None:
    body: dict[str, Any] = {"prompt": "Once upon", "echo": True, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, max_tokens=2, **{k: v for k, v in body.items() if k != "echo"},
                                  extra_body={"echo": body["echo"]})
    assert says in e.value.message


def test_echo_false_changes_nothing(client: openai.OpenAI) -> None:
    assert client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2, echo=False).choices[0].text == (
        " a time")


# -- /v1/embeddings' dimensions ----------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_dimensions_the_engine_cannot_give_are_a_400(client: openai.OpenAI, encoding: Any) -> None:
    """llama-server ignores ``dimensions``: a request for 8 got 640 numbers back, silently."""
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=EMBED, input=["hi", "there"], dimensions=8, encoding_format=encoding)
    assert "640-dimensional" in e.value.message
    assert "'dimensions'" in e.value.message


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_dimensions_equal_to_the_models_width_pass(client: openai.OpenAI, encoding: Any) -> None:
    vector: Any = client.embeddings.create(model=EMBED, input="hi", dimensions=WIDTH,
                                           encoding_format=encoding).data[0].embedding
    assert (len(base64.b64decode(vector)) // 4 if encoding == "base64" else len(vector)) == WIDTH
    assert len(client.embeddings.create(model=EMBED, input="hi").data[0].embedding) == WIDTH


@pytest.mark.parametrize("dimensions", [0, -1, 1.5, "8", True])
def test_dimensions_that_are_no_positive_integer_are_a_400(client: openai.OpenAI, dimensions: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=EMBED, input="hi", extra_body={"dimensions": dimensions})
    assert "'dimensions' must be a positive integer" in e.value.message
