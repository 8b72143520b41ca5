"""What of a chat request reaches an engine: an allow-list of OpenAI fields and the output limit.

llama-server reads its own fields from an OpenAI request body (``n_predict``, ``id_slot``,
``cache_prompt``, ``grammar``, ``n_probs``, ...), and ``max_tokens: -1`` means "until the context is
full" there. Passed through, any caller could ignore the model's ``max_output`` and hold a slot
for its whole context, so :func:`upstream_body` decides, per field, before an engine is asked:

**Forwarded** (:data:`FORWARDED`, OpenAI's chat-completions fields the engines understand):
``model``, ``messages``, ``stream``, ``stream_options``, ``max_tokens``, ``max_completion_tokens``,
``temperature``, ``top_p``, ``n``, ``stop``, ``presence_penalty``, ``frequency_penalty``, ``seed``,
``logit_bias``, ``logprobs``, ``top_logprobs``, ``response_format``, ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``user``.

**Dropped**, silently for the answer but named in the ``x-llmgw-dropped`` response header: every
other field (engine-specific ones such as ``n_predict``, ``id_slot``/``slot_id``, ``cache_prompt``,
``grammar``, ``top_k``, ``min_p``; OpenAI-only ones such as ``metadata``, ``store``,
``service_tier``). Dropping rather than refusing keeps clients written for other servers working
(many send ``top_k`` or ``cache_prompt`` by default); none of these fields can widen what the
request may cost once it is gone.

**Limited**: ``max_tokens``/``max_completion_tokens`` absent, ``null`` or ≤ 0 become the model's
``max_output``; a larger ask is lowered to it (the answer then ends with ``finish_reason:
"length"``, as OpenAI's own answers do when a limit is reached; a 400 would break clients that send
a fixed large ``max_tokens`` to every model). Both fields, when present, carry the same value, so
the limit holds whichever one an engine reads. A model without ``max_output`` (0) has no limit:
positive asks pass, others are removed (the engine's default applies).

**Refused** (400 ``invalid_request_error``), because an engine would misread them: ``n`` other than
1 (each choice is a whole generation; llama-server serves one), ``max_tokens`` /
``max_completion_tokens`` / ``top_logprobs`` that are not integers, ``top_logprobs`` outside 0-20
(OpenAI's range), ``logprobs`` that is not a boolean on chat or not an integer of 0-20 on
``/v1/completions`` (:func:`_check_logprobs`), ``stream`` that is not a boolean, ``temperature`` / ``top_p`` /
``frequency_penalty`` / ``presence_penalty`` / ``seed`` that are not numbers, ``stop`` that is not a
string or a list of strings; on ``/v1/completions``, a ``prompt`` listing
more than one prompt (:func:`check_prompts`: one request, one generation).

Cost: one pass over the body's top-level keys; the body is re-encoded (once) only when something
changed, so a request that asks within ``max_output`` with OpenAI fields only is sent byte for byte
as it came.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llmgw.control.gateway.guardtext import ROLE_LABELS
from llmgw.errors import HttpError

#: The top-level fields that reach an engine (see the module docstring).
FORWARDED = frozenset(
    {
        "model",
        "messages",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "user",
    }
)
#: ``/v1/completions``' fields that reach an engine (OpenAI's legacy completions API).
COMPLETIONS_FORWARDED = frozenset(
    {
        "model", "prompt", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop",
        "presence_penalty", "frequency_penalty", "seed", "logit_bias", "logprobs", "suffix", "user",
    }
)
#: ``/v1/embeddings``' fields that reach an engine.
EMBEDDINGS_FORWARDED = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True)
class Endpoint:
    """One OpenAI endpoint the gateway serves: every one goes through the same pipeline
    (:meth:`llmgw.control.gateway.app._Gateway.serve`), differing only in these.

    Attributes:
        kind: ``chat``, ``completions`` or ``embeddings`` (``Exchange.kind``, metrics, the access log).
        path: the path on the gateway and on the engine.
        role: the catalog role of the models it serves (``chat`` or ``embedding``).
        text_field: the body field that carries the input: ``messages``, ``prompt`` or ``input``.
        forwarded: the top-level fields that reach an engine; others are dropped (``x-llmgw-dropped``).
        limits_output: whether ``max_tokens`` is held to the model's ``max_output`` (not for embeddings).
        engine_finishes: whether an engine computes a request it accepted to the end, whatever its
            connection (llama-server's embeddings): then a client that leaves does not free the slot
            before the engine answers (:func:`~llmgw.control.gateway.upstream.relay_to_the_answer`).
    """

    kind: str
    path: str
    role: str
    text_field: str
    forwarded: frozenset[str]
    limits_output: bool = True
    engine_finishes: bool = False


CHAT = Endpoint("chat", "/v1/chat/completions", "chat", "messages", FORWARDED)
COMPLETIONS = Endpoint("completions", "/v1/completions", "chat", "prompt", COMPLETIONS_FORWARDED)
EMBEDDINGS = Endpoint("embeddings", "/v1/embeddings", "embedding", "input", EMBEDDINGS_FORWARDED, limits_output=False,
                      engine_finishes=True)
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)

_LIMITS = ("max_tokens", "max_completion_tokens")
#: OpenAI's range for ``top_logprobs``.
MAX_TOP_LOGPROBS = 20
# A dropped field is named in the header only when it is a plain identifier; at most this many.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MAX_NAMED = 10


def _bad(message: str) -> HttpError:
    return HttpError(400, "invalid_request", message)


def _int_field(body: dict[str, Any], key: str, unit: str = "tokens") -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{key}' must be an integer ({unit}), got {json.dumps(value)[:40]}")
    return value


def _check(body: dict[str, Any]) -> None:
    """Refuse what an engine would misread (see the module docstring); HttpError 400."""
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or n != 1):
        raise _bad(f"'n' must be 1 (one choice per request), got {json.dumps(n)[:40]}; send n requests instead")
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        raise _bad(f"'stream' must be true or false, got {json.dumps(body['stream'])[:40]}")
    opts = body.get("stream_options")
    if opts is not None:  # as OpenAI: an object, for a stream ('include_usage': "yes" was read as false)
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            raise _bad("'stream_options' must be an object like {\"include_usage\": true}, got "
                       f"{json.dumps(opts)[:60]}")
        if body.get("stream") is not True:
            raise _bad("'stream_options' is only for a stream: set 'stream': true, or leave it out")
    top = _int_field(body, "top_logprobs", "alternatives per token")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise _bad(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
    for k in _NUMBERS:
        v = body.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise _bad(f"'{k}' must be a number, got {json.dumps(v)[:40]}")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
        isinstance(stop, list) and all(isinstance(x, str) for x in stop)
    ):
        raise _bad(f"'stop' must be a string or a list of strings, got {json.dumps(stop)[:40]}")


#: Sampling fields that are numbers in OpenAI's API: a string there (``"temperature": "hot"``) made
#: llama-server answer with its JSON library's exception text and a numeric ``code`` (a new user's
#: finding, 2026-12-04), not an OpenAI-shaped error naming the field.
_NUMBERS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "seed")


#: Prompts one ``/v1/completions`` request may carry (see :func:`check_prompts`).
MAX_PROMPTS = 1


def _is_token_ids(value: Any) -> bool:
    """True for a non-empty list of integers (token ids) and strings: one prompt to llama-server, which
    reads a list of only ids, or of ids and strings mixed, as a single prompt."""
    return (
        isinstance(value, list) and bool(value)
        and all(isinstance(v, int | str) and not isinstance(v, bool) for v in value)
        and any(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def check_prompts(prompt: Any) -> int:
    """How many prompts ``/v1/completions``' ``prompt`` holds (always :data:`MAX_PROMPTS`, 1), or
    HttpError 400 ``invalid_prompt``.

    One prompt is a string, a list of token ids (integers, strings mixed in allowed), or a list
    holding one of those. A list of several prompts is refused: each is a whole generation, and
    engines answer it with one completion per prompt (llama-server's ``usage`` counted one of them,
    so ``tpm`` and budgets were never reached, and 2,000 prompts held the engine for a minute,
    starving every other client), so a request would buy as many generations as it lists while
    being admitted, limited and guarded as one. The message says to send one request per prompt.
    """
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return 1
    if not isinstance(prompt, list) or not prompt:
        raise HttpError(400, "invalid_prompt", "'prompt' must be a string or a list of token ids")
    if len(prompt) > MAX_PROMPTS:
        raise HttpError(
            400, "invalid_prompt",
            f"'prompt' lists {len(prompt)} prompts; this gateway serves {MAX_PROMPTS} prompt per request "
            "(each prompt is a whole generation, admitted, limited and guarded as one request): send one "
            "request per prompt",
        )
    one = prompt[0]
    if not (isinstance(one, str) or _is_token_ids(one)):
        raise HttpError(
            400, "invalid_prompt",
            f"'prompt[0]' must be a string or a list of token ids, got {json.dumps(one)[:40]}",
        )
    return 1


_TOOL_CHOICES = ("none", "auto", "required")


def json_kind(value: Any) -> str:
    """A JSON value's type as a message names it (``a number``, ``null``...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def _want(cond: bool, where: str, what: str, value: Any) -> None:
    """Raise the 400 naming the field ``where`` (``messages[2].tool_call_id``) when ``cond`` is false."""
    if not cond:
        raise _bad(f"'{where}' must be {what}, got {json_kind(value)}")


def _check_parts(parts: list[Any], where: str) -> None:
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        _want(isinstance(part, dict), at, "an object with a 'type'", part)
        kind = part.get("type")
        _want(isinstance(kind, str), f"{at}.type", "a string ('text', 'image_url' or 'input_audio')", kind)
        if kind == "text":
            _want(isinstance(part.get("text"), str), f"{at}.text", "a string", part.get("text"))
        elif kind == "image_url":
            img = part.get("image_url")
            url = img.get("url") if isinstance(img, dict) else img
            _want(isinstance(url, str), f"{at}.image_url.url", "a string (an https: or data: URL)", url)
        elif kind == "input_audio":
            audio = part.get("input_audio")
            _want(isinstance(audio, dict) and isinstance(audio.get("data"), str), f"{at}.input_audio",
                  "an object with 'data' (base64) and 'format'", audio)
        else:
            raise _bad(f"'{at}.type' must be 'text', 'image_url' or 'input_audio', got {json.dumps(kind)[:40]}")


def _check_function(fn: Any, where: str, *, call: bool) -> None:
    _want(isinstance(fn, dict), where, "an object with 'name'" + (" and 'arguments'" if call else ""), fn)
    name = fn.get("name")
    _want(isinstance(name, str) and bool(name), f"{where}.name", "a non-empty string", name)
    if call:
        args = fn.get("arguments")
        _want(isinstance(args, str), f"{where}.arguments", "a string (the arguments as JSON text)", args)
        return
    if "description" in fn and fn["description"] is not None:
        _want(isinstance(fn["description"], str), f"{where}.description", "a string", fn["description"])
    if "parameters" in fn and fn["parameters"] is not None:
        _want(isinstance(fn["parameters"], dict), f"{where}.parameters", "an object (a JSON schema)",
              fn["parameters"])


def check_chat(body: dict[str, Any]) -> None:
    """Refuse (HttpError 400 ``invalid_request``, naming the field) a chat request an engine would fail
    on with a 500, as if the fault were the server's: the shapes of ``messages`` (``role`` a string;
    ``content`` a string, null or a list of ``text``/``image_url``/``input_audio`` parts;
    ``tool_call_id`` and ``name`` strings; ``tool_calls`` with string ``arguments``), ``tools`` (a
    list of ``{"type": "function", "function": {"name", "description", "parameters"}}``) and
    ``tool_choice`` (``none``/``auto``/``required`` or ``{"type": "function", "function": {"name"}}``).
    Only types and shapes: what an engine then makes of a well-formed request is its business.
    """
    for i, m in enumerate(body.get("messages") or ()):
        at = f"messages[{i}]"
        _want(isinstance(m, dict), at, "an object with 'role' and 'content'", m)
        role = m.get("role")
        if not (isinstance(role, str) and role in ROLE_LABELS):
            shown = json.dumps(role)[:40] if isinstance(role, str) else json_kind(role)
            raise _bad(f"'{at}.role' must be one of {', '.join(ROLE_LABELS)}, got {shown}")
        content = m.get("content")
        if isinstance(content, list):
            _check_parts(content, f"{at}.content")
        else:
            _want(content is None or isinstance(content, str), f"{at}.content", "a string or a list of parts",
                  content)
        for key in ("tool_call_id", "name"):
            if key in m:
                _want(isinstance(m[key], str), f"{at}.{key}", "a string", m[key])
        calls = m.get("tool_calls")
        if calls is not None:
            _want(isinstance(calls, list), f"{at}.tool_calls", "a list", calls)
            for j, c in enumerate(calls):
                _want(isinstance(c, dict), f"{at}.tool_calls[{j}]", "an object with 'id' and 'function'", c)
                if "id" in c:
                    _want(isinstance(c["id"], str), f"{at}.tool_calls[{j}].id", "a string", c["id"])
                _check_function(c.get("function"), f"{at}.tool_calls[{j}].function", call=True)
    tools = body.get("tools")
    if tools is not None:
        _want(isinstance(tools, list), "tools", "a list of {\"type\": \"function\", \"function\": {...}}", tools)
        for i, t in enumerate(tools):
            _want(isinstance(t, dict), f"tools[{i}]", "an object {\"type\": \"function\", \"function\": {...}}", t)
            if t.get("type", "function") != "function":
                raise _bad(f"'tools[{i}].type' must be \"function\", got {json.dumps(t.get('type'))[:40]}")
            _check_function(t.get("function"), f"tools[{i}].function", call=False)
    choice = body.get("tool_choice")
    if choice is not None and choice not in _TOOL_CHOICES:
        fn = choice.get("function") if isinstance(choice, dict) else None
        _want(isinstance(fn, dict) and isinstance(fn.get("name"), str), "tool_choice",
              "'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}", choice)


def _check_logprobs(body: dict[str, Any]) -> None:
    """``logprobs`` as OpenAI types it: a boolean on chat (how many alternatives is ``top_logprobs``),
    on ``/v1/completions`` the number of alternatives per token, 0 to :data:`MAX_TOP_LOGPROBS`.
    llama-server reads the completions one as ``n_probs`` with no bound of its own: ``"logprobs":
    262144`` listed the whole vocabulary for every token, 31 MB and 3 s of engine time a token, and
    the control plane, which buffers a plain answer, reached 2 GB and stalled its admin API 7 s on one
    request of 8 tokens (a security tester's finding, 2026-12-05)."""
    value = body.get("logprobs")
    if value is None:
        return
    if "messages" in body:
        if not isinstance(value, bool):
            raise _bad(f"'logprobs' must be true or false on a chat request, got {json.dumps(value)[:40]} "
                       "(how many alternatives per token is 'top_logprobs')")
    elif "prompt" in body:
        n = _int_field(body, "logprobs", "alternatives per token")
        if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
            raise _bad(f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS} (alternatives per token), got {n}")


def check_dimensions(model: str, request: dict[str, Any], answer: dict[str, Any]) -> None:
    """HttpError 400 when an embeddings request asked for ``dimensions`` and the engine's vectors have
    another length. llama-server ignores the field and answers its model's full width (a request for
    8 got 640 numbers, which an 8-wide vector index then refused or, worse, truncated on its own); OpenAI
    refuses ``dimensions`` for a model that cannot shorten its embeddings, and vLLM does too, so the
    client learns it here instead of storing vectors of the wrong width. A vector is counted as floats,
    or as base64 of 4-byte floats (``encoding_format: "base64"``, the ``openai`` client's default)."""
    asked = request.get("dimensions")
    data = answer.get("data")
    if not isinstance(asked, int) or not isinstance(data, list):
        return
    for item in data:
        vector = item.get("embedding") if isinstance(item, dict) else None
        if isinstance(vector, list):
            width = len(vector)
        elif isinstance(vector, str):
            width = len(vector.rstrip("=")) * 3 // 4 // 4
        else:
            continue
        if width != asked:
            raise _bad(f"model '{model}' gives {width}-dimensional embeddings and cannot shorten them: leave "
                       f"'dimensions' out, or set it to {width}")


def dropped_header(dropped: list[str]) -> str:
    """The ``x-llmgw-dropped`` value: the dropped names that are plain identifiers, at most 10."""
    named = [k for k in dropped if _NAME.fullmatch(k)][:_MAX_NAMED]
    more = len(dropped) - len(named)
    return ", ".join(named) + (f" (+{more} more)" if more else "")


def check_fields(body: dict[str, Any]) -> None:
    """Refuse (HttpError 400 ``invalid_request``, naming the field) what an engine would misread: the
    sampling and limit fields' types, ``n``, ``stream`` and ``stream_options``, and a chat request's
    shapes (:func:`check_chat`). Run as the body is parsed, before the request is routed, held for a
    model starting from zero or counted against its key's limits: a malformed request started a
    model at zero and spent the key's rpm before its 400 (a new user's finding)."""
    _check(body)
    if "messages" in body:
        check_chat(body)
    _check_logprobs(body)
    if "prompt" in body:
        _check_echo(body)
    for k in _LIMITS:
        _int_field(body, k)


#: ``/v1/completions``' fields the gateway serves itself: taken out of what an engine sees, never
#: named in ``x-llmgw-dropped`` (:func:`echo_text`).
SERVED = frozenset({"echo"})


def echo_text(body: dict[str, Any]) -> str:
    """The prompt a ``/v1/completions`` request asked to have echoed (``"echo": true``), "" when none.

    OpenAI's ``echo`` puts the prompt before the completion in each choice's ``text``. llama-server
    ignores the field (the answer held the completion alone: a compatibility tester's finding) and vLLM
    honours it, so the gateway takes it out of what any engine sees and puts the prompt back itself,
    the same for both (:mod:`.legacylogprobs` for the answer). :func:`check_fields` has refused what
    it cannot echo: token ids, and ``logprobs`` (OpenAI's then cover the prompt's tokens too)."""
    prompt = _one_prompt(body)
    return prompt if body.get("echo") is True and isinstance(prompt, str) else ""


def _one_prompt(body: dict[str, Any]) -> Any:
    """``prompt``, or its one item when it is a list of one (what :func:`check_prompts` lets through)."""
    prompt = body.get("prompt")
    return prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt


def _check_echo(body: dict[str, Any]) -> None:
    """``echo``: a boolean; when true, a text prompt and no ``logprobs`` (see :func:`echo_text`)."""
    echo = body.get("echo")
    if echo is None or echo is False:
        return
    if echo is not True:
        raise _bad(f"'echo' must be true or false, got {json.dumps(echo)[:40]}")
    if not isinstance(_one_prompt(body), str):
        raise _bad("'echo' needs a text prompt: this gateway cannot echo token ids; send the prompt as a string")
    if body.get("logprobs") is not None:
        raise _bad("'echo' with 'logprobs' is not supported here (the prompt's tokens would have none): leave "
                   "one of them out")


def upstream_body(
    body: dict[str, Any], raw: bytes, max_output: int, forwarded: frozenset[str] = FORWARDED
) -> tuple[bytes, list[str]]:
    """The body to send to an engine, and the names of the fields dropped from it.

    Args:
        body: the parsed request (a dict with ``model`` and ``messages``); changed in place to what
            is sent, so the guard judges exactly what the engine will see.
        raw: the request's bytes, returned as they are when nothing changed.
        max_output: the model's ``max_output`` (tokens), 0 for no limit.
        forwarded: the endpoint's fields (:data:`FORWARDED` for chat; :class:`Endpoint`).

    Raises:
        HttpError: 400 ``invalid_request`` for a limit field that is not an integer (:func:`check_fields`,
            which the gateway runs when it parses the body, refuses it first, with every other field
            an engine would misread).
    """
    dropped = [k for k in body if k not in forwarded]
    for k in dropped:
        del body[k]
    changed = bool(dropped)
    if forwarded is COMPLETIONS_FORWARDED:  # served by the gateway (echo_text): gone, not "dropped"
        dropped = [k for k in dropped if k not in SERVED]
    asked = [v for k in _LIMITS if (v := _int_field(body, k)) is not None and v > 0]
    want = min(asked) if asked else 0
    if max_output > 0 and not 0 < want <= max_output:
        want = max_output
    for k in _LIMITS:
        if k == "max_tokens" or k in body:
            if want > 0 and body.get(k) != want:
                body[k] = want
                changed = True
            elif want <= 0 and k in body:
                del body[k]
                changed = True
    return (json.dumps(body).encode() if changed else raw), dropped


def with_stream_usage(body: dict[str, Any], raw: bytes) -> tuple[bytes, bool]:
    """A streamed request's body asking the engine for a final ``usage`` event, and whether the client
    asked for it itself.

    ``body`` is the request as :func:`upstream_body` left it (what the engine sees); ``raw`` its bytes.
    The gateway counts a stream's tokens for usage and limits from that event
    (``stream_options.include_usage``, which llama-server and vLLM both honour); when the client did not
    ask for it, the relay removes the event again (:class:`~llmgw.control.gateway.upstream.StreamTally`),
    so the client sees the stream it asked for. Costs one re-encode (~6 µs) when the field is added.
    """
    opts = body.get("stream_options")
    if isinstance(opts, dict) and opts.get("include_usage") is True:
        return raw, True
    body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return json.dumps(body).encode(), False
