"""``/v1/completions`` carries one prompt (issue 19 item 8): :func:`check_prompts` on each shape."""

from __future__ import annotations

import json

import pytest

from llmgw.control.gateway.body import parse_body
from llmgw.control.gateway.request import COMPLETIONS, check_prompts
from llmgw.errors import HttpError


@pytest.mark.parametrize("prompt", ["hi", [1, 2, 3], [1, "a", 2], ["hi"], [[1, 2]], [["a", 3]]])
def test_one_prompt_passes(prompt: object) -> None:
    assert check_prompts(prompt) == 1


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], [{"x": 1}], [1.5], [True], {"a": 1}, [[]]])
def test_several_or_odd_prompts_are_refused(prompt: object) -> None:
    with pytest.raises(HttpError) as e:
        check_prompts(prompt)
    assert e.value.status == 400
    assert e.value.code == "invalid_prompt"


def test_the_message_says_what_to_do() -> None:
    with pytest.raises(HttpError) as e:
        check_prompts(["a"] * 50_000)
    assert "50000 prompts" in e.value.message
    assert "one request per prompt" in e.value.message


@pytest.mark.parametrize(("body", "says"), [
    ({"model": "m"}, "'prompt' is required: a string, or a non-empty list"),
    ({"model": "m", "prompt": {"a": 1}}, "'prompt' must be a string, or a non-empty list of strings (or of token "
                                        "ids), not an object"),
    ({"model": "m", "prompt": []}, "not an empty list"),
    ({"model": "m", "prompt": 5}, "not a number"),
])
def test_a_missing_prompt_and_a_wrong_one_are_told_apart(body: dict[str, object], says: str) -> None:
    """A new user's finding: ``"prompt": {"a": 1}`` got "'prompt' is required", though it was there."""
    with pytest.raises(HttpError) as e:
        parse_body(json.dumps(body).encode(), COMPLETIONS)
    assert (e.value.status, e.value.code) == (400, "invalid_prompt")
    assert says in e.value.message
