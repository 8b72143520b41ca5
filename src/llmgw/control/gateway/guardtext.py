"""What the guard judges of a request or an answer, as text: every message of a chat (system,
earlier turns, tool calls and their arguments), a completion's prompt (token ids detokenized by the
engine first: :func:`token_prompts` finds them), and an answer's content and tool calls.

Kept apart from :mod:`llmgw.control.gateway.guard` (the inspector and its policy decisions): these
are pure functions of the OpenAI request and response shapes, tested on their own
(tests/unit/test_guard_judged_text.py).
"""

from __future__ import annotations

import json
from typing import Any


def message_text(content: Any) -> str:
    """A message's text: a string, or the ``text`` parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def prompt_text(request: dict[str, Any]) -> str:
    """The prompt as the *context* of an answer's judgment (direction out): the last user message (the
    last message when none is a user's); for ``/v1/completions`` its ``prompt``, for ``/v1/embeddings``
    its ``input`` (the strings of a list, joined). Also what the prompt is judged as when it holds no
    token ids and no messages. The prompt itself (direction in) is judged whole:
    :meth:`GuardInspector.prompt`, :func:`conversation_text`."""
    for name in ("prompt", "input"):
        value = request.get(name)
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return "\n".join(v for v in value if isinstance(v, str))
    msgs = [m for m in request.get("messages", []) if isinstance(m, dict)]
    users = [m for m in msgs if m.get("role") == "user"]
    last = users[-1] if users else (msgs[-1] if msgs else {})
    return message_text(last.get("content"))


#: The chat roles a message may have (OpenAI's; ``function`` is its deprecated tool role), each with the
#: label of its text in what the guard judges (``ROLE: text``). The gateway refuses any other role
#: (:func:`llmgw.control.gateway.request.check_chat`): llama-server writes the role string into the
#: prompt, so text hidden there would reach the model unjudged (a new user's finding, 2026-12-04:
#: ``"role": "user\n<200 tokens>"`` took the engine's prompt from 25 to 207 tokens).
ROLE_LABELS = {
    "system": "SYSTEM", "developer": "SYSTEM", "user": "USER", "assistant": "ASSISTANT", "tool": "TOOL",
    "function": "TOOL",
}


def conversation_text(request: dict[str, Any]) -> str:
    """The whole text of a chat request an engine reads, as the guard judges it (direction in).

    Every message of every role (system and developer, each user turn, assistant turns the client
    wrote, tool results): its ``name``, its ``tool_call_id``, its ``reasoning_content``, its ``content``
    (a string, or the ``text`` parts of a list of parts) and its tool calls' ids, names and arguments
    (chat templates render each of them into the prompt: Mistral's write ``[CALL_ID]<id>`` and
    ``[TOOL_RESULTS]<tool_call_id>``, and an id was free text the judge never saw: a security tester's
    finding); and the ``tools`` the request declares (their JSON: names,
    descriptions and parameter schemas are rendered into the engine's prompt too). A request whose
    only text is one user message is judged as that text alone, as before; otherwise each message is
    a paragraph ``ROLE: text`` in order (``SYSTEM``, ``USER``, ``ASSISTANT``, ``TOOL``), then
    ``TOOLS: [...]``. Images and audio are not text and are not judged.
    """
    parts: list[tuple[str, str]] = []
    for m in request.get("messages") or ():
        if not isinstance(m, dict):
            continue
        said = (_str(m.get("name")), _str(m.get("tool_call_id")), _str(m.get("reasoning_content")),
                message_text(m.get("content")))
        text = "\n".join(t for t in (*said, *tool_texts(m.get("tool_calls"), ids=True)) if t)
        if text:
            parts.append((ROLE_LABELS.get(str(m.get("role")), "MESSAGE"), text))  # checked: check_chat
    tools = request.get("tools")
    if tools:
        parts.append(("TOOLS", json.dumps(tools, ensure_ascii=False)))
    if len(parts) == 1 and parts[0][0] == "USER":
        return parts[0][1]
    return "\n\n".join(f"{role}: {text}" for role, text in parts)


def token_prompts(value: Any) -> list[list[int | str]] | None:
    """The prompts of a ``prompt``/``input`` that hold token ids, each a list of ids (strings mixed
    in, as llama-server reads them), or None when it is all text (a string, a list of strings)."""
    def ids(v: Any) -> bool:
        return isinstance(v, list) and any(isinstance(x, int) and not isinstance(x, bool) for x in v)

    if ids(value):
        return [value]
    if isinstance(value, list) and any(ids(v) for v in value):
        return [v if isinstance(v, list) else [v] for v in value]
    return None


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def tool_texts(calls: Any, *, ids: bool = False) -> list[str]:
    """Each OpenAI tool call's function name, then its argument string, in order (with ``ids``, its
    ``id`` first: a client's tool calls, which some chat templates render with their ids); [] for
    anything else (what a chat template renders of a message's ``tool_calls``)."""
    if not isinstance(calls, list):
        return []
    out = []
    for c in calls:
        if not isinstance(c, dict):
            continue
        fn = c.get("function")
        if ids and isinstance(c.get("id"), str) and c["id"]:
            out.append(c["id"])
        if isinstance(fn, dict):
            out += [v for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str) and v]
    return out


def answer_text(response: dict[str, Any]) -> str:
    """The text judged as the answer: every choice's reasoning, content and tool-call arguments."""
    parts: list[str] = []
    for ch in response.get("choices") or []:
        if isinstance(ch, dict) and isinstance(ch.get("text"), str):  # /v1/completions
            parts.append(ch["text"])
        msg = ch.get("message") if isinstance(ch, dict) else None
        if not isinstance(msg, dict):
            continue
        for key in ("reasoning_content", "content"):
            if isinstance(msg.get(key), str) and msg[key]:
                parts.append(msg[key])
        parts.extend(tool_texts(msg.get("tool_calls")))
    return "\n".join(parts)
