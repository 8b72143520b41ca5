"""The gateway's two seams: :class:`Inspector` (where the guard will plug in) and ``observe``.

Flow 4 is: key → model → guard on the prompt (in) → a ready replica → proxy → guard on the answer
(out) → response; usage and metrics. The gateway does not implement guardrails; it calls an
optional :class:`Inspector` at the three points where the guard must decide, and an optional
``observe`` callable with one :class:`Exchange` per chat request (usage, metrics, the overhead).

Without an inspector the hot path pays one ``is None`` check per request: streams are relayed per
network chunk, never re-parsed. With one, the stream inspector sees each chunk as it
arrives and may change it, hold it back (return ``b""``) or stop the stream with a :class:`Refusal`;
parsing the SSE events is the inspector's business, since only it needs the text.

Refusals become OpenAI error envelopes: before the first byte as an HTTP status, mid-stream as a
final ``data: {"error": {...}}`` event (the official ``openai`` client raises ``APIError`` on it).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmgw.routing import Route


@dataclass(frozen=True)
class Refusal:
    """The inspector stops this exchange; the client gets ``status`` and an OpenAI error envelope.

    Attributes:
        message: shown to the client; name the policy, never the judge's address.
        status: HTTP status when nothing was sent yet (400 for a refused prompt).
        code: the envelope's ``code``.
        extra: more fields for the envelope's ``error`` object (the guard's ``direction``,
            ``categories``, ``policy``); never an internal address.
    """

    message: str
    status: int = 400
    code: str = "content_policy_violation"
    extra: dict[str, Any] | None = None


@dataclass
class Call:
    """One chat request's notes between the gateway and its inspector (set only with an inspector).

    Attributes:
        caller: the API key's id (:func:`llmgw.guard.config.key_id`), "" for a client without a key.
        key_name: the caller's name (the policies' ``key_names``): a stored key's, ``keys-file`` for a key of
            the keys file, ``loopback`` for a client on this machine without a key; "" when unknown.
        headers: response headers the inspector adds (verdicts, judge time); the gateway copies them
            onto the response before it is sent (for a stream, those set before its first byte).
        blocked: the refusal's code when the inspector ended a stream it had let start (its 200 sent)
            with a ``content_filter`` chunk, "" otherwise: the gateway counts the request as blocked
            (the access log's ``code``, guard blocks in metrics and usage), as a refused answer.
    """

    caller: str = ""
    key_name: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    blocked: str = ""


#: The current chat request's :class:`Call` (each aiohttp handler runs in its own task and context).
current_call: ContextVar[Call | None] = ContextVar("llmgw_current_call", default=None)


class StreamInspector(Protocol):
    """Sees one streamed answer, chunk by chunk, in the order the replica sent them."""

    async def chunk(self, data: bytes) -> bytes | Refusal:
        """The bytes to relay for ``data`` (``data`` itself when unchanged, ``b""`` to hold back).

        ``data`` is one or more complete lines (a network chunk cut at its last newline).
        """
        ...

    async def end(self) -> bytes | Refusal:
        """Called after the replica's last chunk: bytes still to send (what was held back), or stop."""
        ...


class Inspector(Protocol):
    """The guard's hooks. ``request`` is the client's parsed body, ``route`` the resolved model."""

    async def prompt(self, route: Route, request: dict[str, Any]) -> Refusal | None:
        """Before any replica is asked: None lets the prompt through."""
        ...

    async def answer(self, route: Route, request: dict[str, Any], response: dict[str, Any]) -> Refusal | None:
        """A complete (non-streamed) answer, parsed, before it is sent; None lets it through."""
        ...

    def stream(self, route: Route, request: dict[str, Any]) -> StreamInspector | None:
        """A streamed answer is about to start: an inspector for it, or None to relay it untouched."""
        ...


@dataclass(frozen=True)
class Exchange:
    """One gateway request (chat, completions or embeddings) as the gateway saw it, for usage
    accounting, rate limits, metrics and the access log. Never holds a prompt, an answer or a secret.

    Attributes:
        requested: the model name the client used (an alias, or "" when the body had none).
        model: the catalog name it resolved to ("" when it did not resolve).
        replica: the replica that answered ("" when none was asked).
        status: the HTTP status sent to the client (200 for a stream that started, even if it broke;
            499 when the client went away first).
        stream: whether the client asked for a stream.
        overhead_ms: time in the gateway, not counting the wait on the replica (to the stream's first
            byte, for streams).
        upstream_ms: time waiting on the replica (whole stream included), the wait for a slot in the
            model's queue included (``queued_ms`` says how much of it that was).
        usage: the answer's ``usage`` object (``prompt_tokens``, ``completion_tokens``,
            ``total_tokens``) when known, for streams too (asked of the engine with
            ``stream_options.include_usage``, or counted from the events relayed when the client left
            early); None when no replica answered.
        key: the caller's name: an API key's name from the store, ``keys-file`` for a key from
            ``gateway.keys_file``, ``loopback`` for a loopback client without a key, "" when the key
            was refused. A label value for metrics: it comes from the store, never from request text.
        kind: ``chat``, ``completions`` or ``embeddings`` (the endpoint), or ``models`` (``GET
            /v1/models`` and ``/v1/models/{id}``: logged and metered, not usage).
        request_id: the ``x-request-id`` sent back (the client's, or one the gateway made).
        code: the OpenAI error ``code`` sent when ``status`` >= 400 (e.g. ``rate_limit_exceeded``,
            ``content_blocked``, ``model_not_found``), or the code of an error event that ended a stream;
            "" otherwise.
        blocked: the guard refused the prompt or the answer (before or during a stream).
        ttft_ms: time from the handler's start to the first byte of the answer sent to the client (ms);
            for a non-streamed answer, until the response was ready.
        refused: "" for a request whose key was accepted; for a 401, why: ``invalid`` (a key was
            presented and is unknown, revoked or expired: never the key itself) or ``missing`` (no
            key). A refused exchange has ``key`` "", no model and no usage; ``kind`` may be ``models``.
        queued_ms: time waiting in the model's queue for a free slot (ms), part of ``upstream_ms``.
    """

    requested: str
    model: str
    replica: str
    status: int
    stream: bool
    overhead_ms: float
    upstream_ms: float
    usage: dict[str, Any] | None = None
    key: str = ""
    kind: str = "chat"
    request_id: str = ""
    code: str = ""
    blocked: bool = False
    ttft_ms: float = 0.0
    refused: str = ""
    queued_ms: float = 0.0
