"""``/v1/completions`` carries one prompt (issue 19 item 8): :func:`check_prompts` on each shape."""

from __future__ import annotations

import pytest

from llmgw.control.gateway.request import check_prompts
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
