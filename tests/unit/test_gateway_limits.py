"""The gateway holds each request to the model's max_output tokens."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmgw.control.gateway import _limit_output


@pytest.mark.parametrize(
    ("body", "limit", "want"),
    [
        ({"model": "m"}, 1024, {"max_tokens": 1024}),
        ({"model": "m", "max_tokens": 16}, 1024, {"max_tokens": 16}),
        ({"model": "m", "max_tokens": 5000}, 1024, {"max_tokens": 1024}),
        ({"model": "m", "max_completion_tokens": 5000}, 1024, {"max_completion_tokens": 1024}),
        ({"model": "m"}, 0, {}),
    ],
)
def test_limit(body: dict[str, Any], limit: int, want: dict[str, int]) -> None:
    raw = json.dumps(body).encode()
    out = json.loads(_limit_output(dict(body), raw, limit))
    assert {k: v for k, v in out.items() if k != "model"} == want


def test_an_unchanged_body_is_sent_as_it_came() -> None:
    raw = b'{"model":  "m", "max_tokens": 3}'
    assert _limit_output(json.loads(raw), raw, 100) is raw
