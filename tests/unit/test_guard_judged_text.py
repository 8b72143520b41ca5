"""What the guard judges of a prompt (issue 19 item 9): the pure parts."""

from __future__ import annotations

import pytest

from llmgw.control.gateway.guardtext import answer_text, conversation_text, token_prompts
from llmgw.guard.judge import _error_kind


def test_one_user_message_is_judged_alone() -> None:
    assert conversation_text({"messages": [{"role": "user", "content": "hi"}]}) == "hi"


def test_every_message_and_the_tools_are_judged() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"q": "x"}'}}
    req = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "sys"}, {"type": "image_url", "image_url": {}}]},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "result"},
            {"role": "user", "content": "last"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "description": "desc"}}],
    }
    text = conversation_text(req)
    assert text.split("\n\n") == [
        "SYSTEM: sys", "USER: first", 'ASSISTANT: c\nf\n{"q": "x"}', "TOOL: c\nresult", "USER: last",
        'TOOLS: [{"type": "function", "function": {"name": "f", "description": "desc"}}]',
    ]


def test_names_reasoning_and_tool_names_are_judged_too() -> None:
    """A second new user's finding (2026-12-04): a message's ``name``, an assistant turn's
    ``reasoning_content`` and a tool call's function name were left out of what the guard judges,
    while chat templates render them into the engine's prompt."""
    call = {"id": "c", "type": "function", "function": {"name": "HIDDEN_IN_NAME", "arguments": "{}"}}
    req = {
        "messages": [
            {"role": "user", "name": "HIDDEN_IN_USER_NAME", "content": "hi"},
            {"role": "assistant", "reasoning_content": "HIDDEN_IN_REASONING", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "name": "HIDDEN_IN_TOOL_NAME", "content": "r"},
        ],
    }
    text = conversation_text(req)
    for hidden in ("HIDDEN_IN_USER_NAME", "HIDDEN_IN_REASONING", "HIDDEN_IN_NAME", "HIDDEN_IN_TOOL_NAME"):
        assert hidden in text, text
    assert answer_text({"choices": [{"message": {"tool_calls": [call]}}]}) == "HIDDEN_IN_NAME\n{}"


def test_tool_call_ids_are_judged() -> None:
    """A security tester's finding: ``tool_call_id`` and a client's ``tool_calls[].id`` are free text
    that Mistral-style chat templates render into the engine's prompt (``[CALL_ID]<id>``,
    ``[TOOL_RESULTS]<tool_call_id>``), checked only to be strings, and the judge never saw them:
    through the gateway, text hidden there reached llama-server while the judge was sent
    ``USER: weather?\n\nASSISTANT: get\n{}\n\nTOOL: sunny``."""
    call = {"id": "HIDDEN_IN_CALL_ID", "type": "function", "function": {"name": "get", "arguments": "{}"}}
    req = {
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "HIDDEN_IN_TOOL_CALL_ID", "content": "sunny"},
        ],
    }
    text = conversation_text(req)
    assert "HIDDEN_IN_CALL_ID" in text, text
    assert "HIDDEN_IN_TOOL_CALL_ID" in text, text
    # an answer's ids are the engine's own (random), not the model's text: not judged
    assert answer_text({"choices": [{"message": {"tool_calls": [call]}}]}) == "get\n{}"


@pytest.mark.parametrize(
    ("value", "want"),
    [("text", None), (["a", "b"], None), ([1, 2], [[1, 2]]), ([[1], "a"], [[1], ["a"]]), ([1, "a"], [[1, "a"]])],
)
def test_token_prompts(value: object, want: object) -> None:
    assert token_prompts(value) == want


def test_a_judge_past_its_context_is_too_long() -> None:
    raw = '{"error":{"code":400,"message":"request (5000 tokens) exceeds the available context size (1024 tokens)",'
    assert _error_kind(raw + '"type":"exceed_context_size_error"}}') == "too_long"
    assert _error_kind('{"error":{"code":500,"message":"slot crashed"}}') == "down"
