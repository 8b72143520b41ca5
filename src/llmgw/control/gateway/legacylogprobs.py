"""``/v1/completions``' ``logprobs`` in the shape OpenAI's legacy completions API gives them.

OpenAI (and vLLM) answer a completions request that sets ``logprobs`` with, per choice,
``{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
"text_offset": [...]}``, which the official clients type as ``CompletionChoice.logprobs``.
llama-server answers it in the chat shape instead (``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob"}]}]}``), so an ``openai`` client read ``None`` for every field
(``choice.logprobs.tokens`` and ``token_logprobs`` were empty though the engine had computed them: a
compatibility tester's finding). The gateway turns the chat shape into the legacy one, in a plain
answer (:func:`reshape_completion`) and, per event, in a stream (:class:`CompletionsRewriter`, made
only for a completions stream that asked for ``logprobs`` or ``echo``); an answer already in the legacy shape
(vLLM's) is left as it is. ``text_offset`` counts characters from the start of the generated text,
as OpenAI documents it, carried across a stream's events. The same place puts an ``echo``ed prompt
before the text (the first event's, in a stream), which llama-server ignores.
"""

from __future__ import annotations

import json
from typing import Any

from llmgw.control.gateway.request import COMPLETIONS
from llmgw.control.gateway.sse import ModelRewriter

#: The path of the endpoint whose answers are reshaped.
COMPLETIONS_PATH = COMPLETIONS.path


def reshaped(path: str, echo: str, request: dict[str, Any]) -> bool:
    """Whether the answer to ``request`` on the engine's ``path`` is reshaped here: a completions one
    that asked for ``logprobs`` or for its prompt ``echo``ed."""
    return path == COMPLETIONS_PATH and (bool(echo) or request.get("logprobs") is not None)


def legacy_logprobs(logprobs: Any, offset: int = 0) -> dict[str, Any] | None:
    """The legacy shape of a chat-shaped ``logprobs`` object, its ``text_offset`` starting at
    ``offset``; None when ``logprobs`` is not in the chat shape (null, or already legacy)."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or "tokens" in logprobs:
        return None
    tokens: list[str] = []
    token_logprobs: list[Any] = []
    top: list[dict[str, Any]] = []
    text_offset: list[int] = []
    for entry in content:
        if not isinstance(entry, dict):
            continue
        token = entry.get("token")
        token = token if isinstance(token, str) else ""
        tokens.append(token)
        token_logprobs.append(entry.get("logprob"))
        alternatives = entry.get("top_logprobs")
        top.append({
            alt["token"]: alt.get("logprob")
            for alt in (alternatives if isinstance(alternatives, list) else ())
            if isinstance(alt, dict) and isinstance(alt.get("token"), str)
        })
        text_offset.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}


def reshape_completion(
    answer: dict[str, Any], offsets: dict[int, int] | None = None, *, echo: str = "", echoed: set[int] | None = None
) -> bool:
    """Put every choice's ``logprobs`` of a completions answer (or stream event) in the legacy shape,
    and ``echo`` (the prompt, :func:`~llmgw.control.gateway.request.echo_text`) before its ``text``,
    in place; True when something changed. ``offsets``: per choice index, the characters generated
    before this event (a stream's), advanced by this event's tokens. ``echoed``: a stream's choice
    indexes whose prompt went out already (each gets it once, in its first event)."""
    changed = False
    choices = answer.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        index = choice.get("index", 0)
        index = index if isinstance(index, int) else 0
        if echo and isinstance(choice.get("text"), str) and (echoed is None or index not in echoed):
            choice["text"] = echo + choice["text"]
            changed = True
            if echoed is not None:
                echoed.add(index)
        start = offsets.get(index, 0) if offsets is not None else 0
        legacy = legacy_logprobs(choice.get("logprobs"), start)
        if legacy is None:
            continue
        choice["logprobs"] = legacy
        changed = True
        if offsets is not None:
            offsets[index] = start + sum(len(t) for t in legacy["tokens"])
    return changed


class CompletionsRewriter(ModelRewriter):
    """:class:`ModelRewriter` that also puts each event's ``logprobs`` in the legacy shape (see the
    module docstring), for a ``/v1/completions`` stream that asked for them. Only a line that holds a
    chat-shaped ``logprobs`` is parsed and re-encoded."""

    __slots__ = ("_echo", "_echoed", "_offsets")

    def __init__(self, requested: str, *, echo: str = "") -> None:
        super().__init__(requested)
        self._offsets: dict[int, int] = {}
        self._echo = echo
        self._echoed: set[int] = set()

    def feed(self, chunk: bytes) -> bytes:
        return self._reshape(super().feed(chunk))

    def tail(self) -> bytes:
        return self._reshape(super().tail())

    def _reshape(self, data: bytes) -> bytes:
        echoing = self._echo and not self._echoed
        if not echoing and b'"content"' not in data:
            return data
        lines = data.split(b"\n")
        for i, line in enumerate(lines):
            if not (line.startswith(b"data: {") and (echoing or b'"logprobs"' in line)):
                continue
            try:
                event = json.loads(line[6:])
            except ValueError:
                continue
            if isinstance(event, dict) and reshape_completion(event, self._offsets, echo=self._echo,
                                                              echoed=self._echoed):
                lines[i] = b"data: " + json.dumps(event, separators=(",", ":")).encode()
        return b"\n".join(lines)
