"""What of a chat request reaches an engine (gateway_request): the allow-list and the max_output limit."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmgw.control.gateway.request import FORWARDED, check_fields, dropped_header, upstream_body
from llmgw.errors import HttpError


@pytest.mark.parametrize(
    ("body", "limit", "want"),
    [
        ({}, 1024, {"max_tokens": 1024}),
        ({"max_tokens": 16}, 1024, {"max_tokens": 16}),
        ({"max_tokens": 5000}, 1024, {"max_tokens": 1024}),
        ({"max_tokens": -1}, 1024, {"max_tokens": 1024}),
        ({"max_tokens": 0}, 1024, {"max_tokens": 1024}),
        ({"max_tokens": None}, 1024, {"max_tokens": 1024}),
        ({"max_completion_tokens": 5000}, 1024, {"max_tokens": 1024, "max_completion_tokens": 1024}),
        ({"max_completion_tokens": 8}, 1024, {"max_tokens": 8, "max_completion_tokens": 8}),
        ({"max_tokens": -1, "max_completion_tokens": 8}, 1024, {"max_tokens": 8, "max_completion_tokens": 8}),
        ({"max_tokens": 8, "max_completion_tokens": 100}, 1024, {"max_tokens": 8, "max_completion_tokens": 8}),
        ({"n_predict": 100000}, 1024, {"max_tokens": 1024}),
        ({}, 0, {}),
        ({"max_tokens": 5000}, 0, {"max_tokens": 5000}),
        ({"max_tokens": -1, "n_predict": -1}, 0, {}),
    ],
)
def test_limit(body: dict[str, Any], limit: int, want: dict[str, int]) -> None:
    body = {"model": "m", "messages": [], **body}
    raw, _ = upstream_body(dict(body), json.dumps(body).encode(), limit)
    assert {k: v for k, v in json.loads(raw).items() if k not in ("model", "messages")} == want


def test_an_unchanged_body_is_sent_as_it_came() -> None:
    raw = b'{"model":  "m", "messages": [], "max_tokens": 3, "temperature": 0}'
    out, dropped = upstream_body(json.loads(raw), raw, 100)
    assert out is raw
    assert dropped == []


def test_only_openai_fields_are_forwarded() -> None:
    body = dict.fromkeys(FORWARDED) | {"n_predict": 9, "id_slot": 0, "cache_prompt": True, "top_k": 1}
    body.update(model="m", messages=[], n=1, stream=False, max_tokens=4)
    raw, dropped = upstream_body(body, b"", 64)
    assert set(json.loads(raw)) == FORWARDED
    assert dropped == ["n_predict", "id_slot", "cache_prompt", "top_k"]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"n": 2}, "'n' must be 1"),
        ({"n": True}, "'n' must be 1"),
        ({"max_tokens": "9"}, "'max_tokens' must be an integer"),
        ({"max_tokens": 2.5}, "'max_tokens' must be an integer"),
        ({"max_completion_tokens": False}, "'max_completion_tokens' must be an integer"),
        ({"top_logprobs": 21}, "'top_logprobs' must be between 0 and 20"),
        ({"top_logprobs": -1}, "'top_logprobs' must be between 0 and 20"),
        ({"stream": 1}, "'stream' must be true or false"),
        ({"temperature": "hot"}, "'temperature' must be a number, got \"hot\""),
        ({"top_p": True}, "'top_p' must be a number"),
        ({"seed": [1]}, "'seed' must be a number"),
        ({"stop": 3}, "'stop' must be a string or a list of strings"),
        ({"stop": ["a", None]}, "'stop' must be a string or a list of strings"),
    ],
)
def test_fields_an_engine_would_misread_are_a_400(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(HttpError, match=named) as e:
        check_fields({"model": "m", "messages": [], **extra})
    assert e.value.status == 400


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"prompt": "Hi", "logprobs": 262144}, "between 0 and 20 .alternatives per token., got 262144"),
        ({"prompt": "Hi", "logprobs": 21}, "'logprobs' must be between 0 and 20"),
        ({"prompt": "Hi", "logprobs": -1}, "'logprobs' must be between 0 and 20"),
        ({"prompt": "Hi", "logprobs": "5"}, "'logprobs' must be an integer"),
        ({"prompt": "Hi", "logprobs": True}, "'logprobs' must be an integer"),
        ({"messages": [], "logprobs": 1000}, "'logprobs' must be true or false on a chat request"),
    ],
)
def test_logprobs_is_bounded_as_openai_types_it(body: dict[str, Any], named: str) -> None:
    """On /v1/completions llama-server reads 'logprobs' as the alternatives per token with no bound:
    262144 listed the whole vocabulary for each token (31 MB a token, 2 GB in the control plane)."""
    with pytest.raises(HttpError, match=named) as e:
        check_fields({"model": "m", **body})
    assert e.value.status == 400


def test_logprobs_within_openai_range_pass() -> None:
    for body in ({"prompt": "Hi", "logprobs": 5}, {"prompt": "Hi", "logprobs": 0}, {"prompt": "Hi", "logprobs": None},
                 {"messages": [], "logprobs": True, "top_logprobs": 20}, {"messages": [], "logprobs": False},
                 {"input": "x", "logprobs": 99}):  # embeddings: not forwarded, dropped
        check_fields({"model": "m", **body})


def test_well_typed_sampling_fields_pass() -> None:
    body = {"model": "m", "messages": [], "temperature": 0, "top_p": 0.9, "seed": None, "stop": ["\n"],
            "frequency_penalty": -0.5, "presence_penalty": 1}
    raw = json.dumps(body).encode()
    assert upstream_body(dict(body), raw, 0) == (raw, [])
    assert upstream_body({"model": "m", "messages": [], "stop": "x"}, b"{}", 0)[1] == []


def test_the_header_names_only_plain_identifiers() -> None:
    assert dropped_header(["n_predict", "bad\r\nname", *[f"f{i}" for i in range(12)]]) == (
        "n_predict, f0, f1, f2, f3, f4, f5, f6, f7, f8 (+4 more)"
    )
