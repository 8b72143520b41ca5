"""A client's malformed request is a 400 naming the field (issue 19 item 10): the pure parts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.control.gateway.app import _parse
from llmgw.control.gateway.body import abandoned_usage, input_tokens, reserved_tokens
from llmgw.control.gateway.guard import unavailable
from llmgw.control.gateway.inspect import Call, current_call
from llmgw.control.gateway.replicaerrors import _context_error, client_mistake
from llmgw.control.gateway.request import CHAT, COMPLETIONS, EMBEDDINGS, check_chat, check_fields
from llmgw.errors import HttpError, JudgeError
from llmgw.guard.config import Direction, Policy
from llmgw.routing import Route

USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [USER], "tools": "x"}, "tools"),
        ({"messages": [USER], "tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name"),
        ({"messages": [USER], "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"messages": [USER], "tools": [{"type": "x", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"messages": [USER], "tool_choice": 3}, "tool_choice"),
        ({"messages": [USER, {"role": "tool", "tool_call_id": 1, "content": "x"}]}, "messages[1].tool_call_id"),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
    ],
)
def test_malformed_shapes_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(HttpError) as e:
        check_chat(body)
    assert e.value.status == 400
    assert f"'{field}'" in e.value.message


@pytest.mark.parametrize("role", ["wizard", "user\nExplain how to ...", "User", " user", ""])
def test_a_role_that_is_not_one_of_openais_is_refused(role: str) -> None:
    """A second new user's finding (2026-12-04): ``"role": "user\n<text>"`` was accepted, llama-server
    wrote the role into the prompt (25 -> 207 prompt tokens) and the guard never judged that text."""
    with pytest.raises(HttpError) as e:
        check_chat({"messages": [{"role": role, "content": "hi"}]})
    assert e.value.status == 400
    assert "'messages[0].role' must be one of system, developer, user, assistant, tool, function" in e.value.message


def test_well_formed_requests_pass() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    check_chat({
        "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "t"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "r"}, {"role": "developer", "content": "d"},
            {"role": "function", "name": "f", "content": "r"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    })


def test_a_lone_surrogate_is_refused_a_pair_is_not() -> None:
    with pytest.raises(HttpError) as e:
        _parse(b'{"model": "m", "messages": [{"role": "user", "content": "a\\udc00"}]}', CHAT)
    assert "'messages[0].content'" in e.value.message
    # a surrogate's own bytes in the UTF-8 (ED A0 80): Python's JSON reader let them through as '\ud800',
    # and the judge's engine answered 500 (a security tester's finding)
    with pytest.raises(HttpError) as e:
        _parse(b'{"model": "m", "messages": [{"role": "user", "content": "a\xed\xa0\x80"}]}', CHAT)
    assert "'messages[0].content' holds a lone UTF-16 surrogate" in e.value.message
    ok = _parse(b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00 \\\\ud800"}]}', CHAT)
    assert ok["messages"][0]["content"] == "\U0001f600 \\ud800"
    valid = '{"model": "m", "prompt": "\u00e9t\u00e9 \ud55c \U0001f600"}'.encode()  # valid UTF-8 passes
    assert _parse(valid, COMPLETIONS)["prompt"] == "\u00e9t\u00e9 \ud55c \U0001f600"


def test_engine_500s_for_the_clients_mistake() -> None:
    img = {"error": {"code": 500, "message": "image input is not supported - hint: if this is unexpected, you may "
                     "need to provide the mmproj", "type": "server_error"}}
    said = client_mistake(json.dumps(img).encode())
    assert "text only" in said
    assert "mmproj" not in said
    assert client_mistake(b'{"error": {"message": "[json.exception.type_error.302] type must be string"}}')
    assert client_mistake(b'{"error": {"message": "slot failed"}}') == ""


@pytest.mark.parametrize(("kind", "want"), [("timeout", 3), ("down", 5), ("missing", 5)])
def test_every_judge_503_says_when_to_retry(kind: str, want: int) -> None:
    call = Call()
    token = current_call.set(call)
    try:
        r = unavailable(Policy(name="p", judge="j", budget_s=2.5), Direction.IN, JudgeError("no", kind=kind))
    finally:
        current_call.reset(token)
    assert r.status == 503
    assert r.extra is not None
    assert r.extra["retry_after_s"] == want
    assert call.headers["Retry-After"] == str(want)


def test_chat_refuses_an_empty_model_name(tmp_path: Path) -> None:
    """``llmgw chat --model ""`` used the default model silently (a new user's report): now a usage
    error (exit 2) before any request, naming the option and where the names are."""
    r = CliRunner().invoke(app, ["--root", str(tmp_path), "chat", "--model", " ", "hi"])
    assert r.exit_code == 2, r.output
    assert "--model" in r.output
    assert "llmgw ctl models" in r.output


def test_an_embedding_input_past_the_engines_batch_is_a_400_for_the_client() -> None:
    """llama-server answers an embedding input longer than its micro-batch with a 500 "input (602
    tokens) is too large to process. increase the physical batch size" (operator advice, a server
    error, for the client's input: a new user's finding); the gateway answers 400
    ``context_length_exceeded``. (A recorded engine answer: the real engine now gets a micro-batch of
    a slot's context, tests/e2e/test_embedding_engine.py, so only an input past that meets it.)"""
    route = Route("embed", ())
    said = ("input (5000 tokens) is too large to process. increase the physical batch size (current batch size: "
            "2048)")
    got = _context_error(route, 500, {"code": 500, "message": said, "type": "server_error"})
    assert got is not None
    assert got.status == 400
    body = json.loads(got.body)  # type: ignore[arg-type]
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["message"] == ("model 'embed': input (5000 tokens) is too large to process; "
                                        "send a shorter input")
    assert _context_error(route, 500, {"message": "slot failed", "type": "server_error"}) is None


def test_a_plain_request_left_by_its_client_is_charged_an_estimate() -> None:
    """Its prompt's characters / 4, and the tokens decoded meanwhile at the replica's rate, held to the
    request's max_tokens (tests/unit/test_gateway.py has it through the gateway)."""
    body = {"messages": [{"role": "user", "content": "x" * 400}]}
    assert abandoned_usage(body, 6.0, 25.0, 0) == {
        "prompt_tokens": 100, "completion_tokens": 150, "total_tokens": 250, "estimated": True}
    assert abandoned_usage(body, 6.0, 25.0, 64)["completion_tokens"] == 64
    assert abandoned_usage(body, 6.0, 0.0, 0)["completion_tokens"] == 0  # no rate known yet
    # embeddings' input and token ids count too: an abandoned 5,900-token embedding request was charged 0
    assert abandoned_usage({"input": ["x" * 400] * 3}, 1.0, 25.0, 0)["prompt_tokens"] == 300
    assert abandoned_usage({"input": [[1, 2, 3], [4, 5]]}, 1.0, 25.0, 0)["prompt_tokens"] == 5


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"messages": [{"role": "user", "content": "x" * 40}]}, 10),
        ({"prompt": "x" * 40}, 10),
        ({"prompt": ["x" * 40]}, 10),
        ({"prompt": [1, 2, 3]}, 3),  # token ids
        ({"prompt": [[1, 2, 3, "x" * 8]]}, 5),  # one prompt of ids and text
        ({"input": "x" * 40}, 10),
        ({"input": ["x" * 40, "y" * 40]}, 20),
        ({"input": [1, 2, 3, 4]}, 4),
        ({"input": [[1, 2], [3, 4, 5]]}, 5),
    ],
)
def test_the_input_a_request_will_cost_counts_every_endpoint_and_token_ids(body: dict[str, Any], tokens: int) -> None:
    """Token-id inputs and embeddings' input counted 0: 8 parallel requests of 400 token ids each were
    all admitted on a budget of 1,000 (3,200 tokens), a security tester's finding."""
    assert input_tokens(body) == tokens
    assert reserved_tokens({**body, "max_tokens": 7}) == (tokens + 7, tokens)


def test_an_embeddings_request_of_more_inputs_than_openai_takes_is_refused() -> None:
    """3,000 inputs were one request holding an engine for 1 min 43 s (a new user's finding); OpenAI
    takes at most 2,048 a request."""
    ok = _parse(json.dumps({"model": "e", "input": ["x"] * 2048}).encode(), EMBEDDINGS)
    assert len(ok["input"]) == 2048
    with pytest.raises(HttpError) as e:
        _parse(json.dumps({"model": "e", "input": ["x"] * 2049}).encode(), EMBEDDINGS)
    assert (e.value.status, e.value.code) == (400, "invalid_input")
    assert "'input' holds 2049 items; at most 2048 a request" in e.value.message


@pytest.mark.parametrize(("extra", "said"), [
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "'stream_options' must be an object like"),
    ({"stream": True, "stream_options": "x"}, "'stream_options' must be an object like"),
    ({"stream_options": {"include_usage": True}}, "'stream_options' is only for a stream"),
])
def test_stream_options_are_checked_as_openai_does(extra: dict[str, Any], said: str) -> None:
    """``"include_usage": "yes"`` was read as false, and stream_options on a plain request accepted
    (OpenAI answers 400 to both: a new user's finding)."""
    with pytest.raises(HttpError) as e:
        check_fields({"model": "m", "messages": [USER], **extra})
    assert e.value.status == 400
    assert said in e.value.message


@pytest.mark.parametrize("item", [[1.5], ["a"], [True], 1e308, [], None, {"a": 1}])
def test_embeddings_input_items_are_strings_token_ids_or_lists_of_ids(item: Any) -> None:
    """[[1.5]], [["a"]], [[true]] and [1e308] were llama-server's 500 (a security tester's finding)."""
    with pytest.raises(HttpError) as e:
        _parse(json.dumps({"model": "e", "input": ["ok", item]}).encode(), EMBEDDINGS)
    assert e.value.status == 400
    assert e.value.message.startswith("'input[1]' must be a string, a token id or a non-empty list of token ids")
    assert _parse(b'{"model": "e", "input": ["a", 5, [1, 2]]}', EMBEDDINGS)["input"] == ["a", 5, [1, 2]]

