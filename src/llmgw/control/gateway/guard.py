"""The guard in the gateway: an :class:`~llmgw.control.gateway.inspect.Inspector` that has every
prompt and answer judged by the policy's judge (:mod:`llmgw.guard`).

Per chat request (the first policy of ``guard.policies`` whose ``models``/``keys`` match; none:
untouched):

- **in**: everything the engine will read is judged before any engine is asked: a chat request's
  system message, every user turn, the assistant turns and tool results the client sent, and its
  ``tools`` (:func:`conversation_text`); a completions ``prompt`` or embeddings ``input`` whole, token
  ids turned back into text by the model's engine (``POST /detokenize``) or refused (400
  ``unjudgeable_prompt``). Sent whole to the judge: a text past the judge's context is refused with
  400 ``too_long_to_judge`` whatever ``fail`` says (never served unjudged, never judged in part).
- **out**, not streamed: the answer (content, reasoning, tool-call arguments of every choice) is
  judged before it is sent.
- **out**, streamed: the answer is held until it is complete and judged, then sent as the engine
  sent it (buffer-all: no unjudged byte reaches the client; the cost is time to first byte). A
  blocked stream is one ``chat.completion.chunk`` with ``finish_reason: "content_filter"`` and an
  ``llmgw_guard`` object, then ``data: [DONE]``: valid SSE the official ``openai`` client parses.

Decisions: Unsafe is blocked; Controversial as the policy says (block, warn: served and logged,
allow). Blocked → HTTP 400, OpenAI envelope, code ``content_blocked``, with ``direction``,
``categories`` and ``policy`` fields. No verdict (judge missing, down, over budget, busy,
unparseable, wrong template): ``fail: closed`` → 503 ``judge_unavailable`` (mid-stream: a final
error event, then ``data: [DONE]``); a busy judge (its queue would not reach the judgment within
the budget: :mod:`llmgw.guard.admission`) is refused at once, with ``Retry-After``;
``fail: open`` → served, marked ``unjudged`` in the header and counted. A parsed block blocks under
``fail: open`` too: only the absence of a verdict is covered by it.

Headers (set before the response's first byte): ``x-llmgw-guard-in`` / ``x-llmgw-guard-out``
(``safe``, ``controversial``, ``unsafe``, ``unjudged``), ``…-categories``, ``…-ms`` (judge time in
the gateway), ``x-llmgw-guard-policy``. A stream's out verdict comes after its headers, so it is
the SSE comment ``: llmgw-guard out=<verdict> categories=<…> ms=<…>`` just before the answer's
events (SSE clients ignore comments), and its header says ``x-llmgw-guard-out: held``.
Each judgment is logged with its verdict, categories, judge, time and, for an error, the judge's raw
text. Bodies never carry the judge's address or raw text.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from llmgw.catalog import Model, Role
from llmgw.control.gateway.guardtext import answer_text, conversation_text, prompt_text, token_prompts, tool_texts
from llmgw.control.gateway.inspect import Refusal, current_call
from llmgw.errors import JudgeError
from llmgw.guard.config import Controversial, Direction, FailMode, GuardConfig, Policy
from llmgw.guard.formats import Safety
from llmgw.guard.judge import JudgeClient, JudgeRoute, Judgment
from llmgw.routing import Route, Upstream

log = logging.getLogger(__name__)

#: ``Retry-After`` (s) of a 503 ``judge_unavailable`` when the judge is missing or down.
RETRY_UNAVAILABLE_S = 5
#: Seconds one ``/detokenize`` call to an engine may take (a list of ids is turned into text in ms).
DETOKENIZE_S = 10.0
#: Judge times kept per judge for p50/p95 in ``guard judge status``.
TIMES_KEPT = 1000


RECENT_KEPT = 50  # verdicts kept for the dashboard's "recent verdicts" (control/ui)


@dataclass(frozen=True)
class RecentVerdict:
    """One verdict as the dashboard lists it: when (unix seconds), which way (``in``/``out``), the
    policy, the model asked for, the verdict, its categories, the judge, its time (ms) and whether
    the request was refused. Never any text of the prompt or the answer."""

    at: float
    direction: str
    policy: str
    model: str
    verdict: str
    categories: tuple[str, ...]
    judge: str
    ms: float
    blocked: bool


@dataclass
class GuardStats:
    """Counters for metrics and ``guard judge status``; all since the control plane started.

    Attributes:
        verdicts: ``"{direction} {verdict}"`` → count (``in safe``, ``out unsafe``…).
        blocked: ``direction`` → requests refused for content.
        unjudged: ``direction`` → requests served without a verdict under ``fail: open``.
        refused_unavailable: ``direction`` → requests refused with 503 under ``fail: closed``.
        errors: judge error kind → count.
        times_ms: judge → the last :data:`TIMES_KEPT` judgment times (ms).
        categories: ``"{direction} {category}"`` → verdicts naming that category (``in S1``…).
        recent: the last :data:`RECENT_KEPT` verdicts, newest last, as :class:`RecentVerdict` (no
            text: never the prompt or the answer).
        on_judgment: called with (judge, ms) for every verdict (the metrics' histogram), if set.
    """

    verdicts: dict[str, int] = field(default_factory=dict)
    blocked: dict[str, int] = field(default_factory=dict)
    unjudged: dict[str, int] = field(default_factory=dict)
    refused_unavailable: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    times_ms: dict[str, deque[float]] = field(default_factory=dict)
    categories: dict[str, int] = field(default_factory=dict)
    recent: deque[RecentVerdict] = field(default_factory=lambda: deque(maxlen=RECENT_KEPT))
    on_judgment: Callable[[str, float], None] | None = None

    @staticmethod
    def _inc(d: dict[str, int], k: str) -> None:
        d[k] = d.get(k, 0) + 1

    def percentiles(self, judge: str) -> tuple[float, float] | None:
        """``(p50, p95)`` of the judge's recent times (ms), None before its first judgment."""
        times = sorted(self.times_ms.get(judge, ()))
        if not times:
            return None
        return times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.95))]

    def as_dict(self) -> dict[str, Any]:
        """The counters (and p50/p95 per judge) as JSON-ready data."""
        pct = {j: self.percentiles(j) for j in self.times_ms}
        return {
            "verdicts": dict(self.verdicts),
            "blocked": dict(self.blocked),
            "unjudged": dict(self.unjudged),
            "refused_unavailable": dict(self.refused_unavailable),
            "errors": dict(self.errors),
            "judge_ms": {j: {"p50": p[0], "p95": p[1], "n": len(self.times_ms[j])} for j, p in pct.items() if p},
            "categories": dict(self.categories),
            "recent": [asdict(v) for v in self.recent],
        }


class GuardInspector:
    """The gateway's :class:`~llmgw.control.gateway.inspect.Inspector` for ``guard.policies``.

    Args:
        config: the ``guard:`` block (re-read through ``config()`` when a callable is given).
        client: sends judgments (:class:`~llmgw.guard.judge.JudgeClient`).
    """

    def __init__(self, config: GuardConfig | Callable[[], GuardConfig], client: JudgeClient) -> None:
        if isinstance(config, GuardConfig):
            fixed = config
            self._config: Callable[[], GuardConfig] = lambda: fixed
        else:
            self._config = config
        self.client = client
        self.stats = GuardStats()

    def config(self) -> GuardConfig:
        """The guard configuration in force."""
        return self._config()

    def policy(self, route: Route) -> Policy | None:
        """The policy for ``route``'s model (by its name or an alias) and the current request's caller, or None."""
        call = current_call.get()
        if call is None:
            return self.config().policy_for(route.model, "", route.aliases)
        return self.config().policy_for(route.model, call.caller, route.aliases, call.key_name)

    # -- the Inspector hooks -------------------------------------------------------------------
    async def prompt(self, route: Route, request: dict[str, Any]) -> Refusal | None:
        """Judge the prompt (in) before any engine is asked; a refusal or None.

        What is judged is all the engine will read: a chat request's whole conversation
        (:func:`conversation_text`); a completions ``prompt`` or embeddings ``input``, where token ids
        are first turned back into text by the model's own engine (:meth:`detokenize`; a prompt whose
        ids it cannot turn into text is refused with 400 ``unjudgeable_prompt``, never judged as empty).
        """
        policy = self.policy(route)
        if policy is None or not policy.checks(Direction.IN):
            return None
        if "messages" in request:
            text = conversation_text(request)
        else:
            field = "prompt" if "prompt" in request else "input"
            value = request.get(field)
            tokens = token_prompts(value)
            if tokens is None:
                text = prompt_text(request)
            else:
                try:
                    text = "\n".join([await self.detokenize(route, p) for p in tokens])
                except JudgeError as e:
                    log.warning("guard in: policy %s model %s: token ids not judged: %s", policy.name, route.model, e)
                    return Refusal(
                        f"policy '{policy.name}' judges every prompt to model '{route.model}', and the token ids "
                        f"in '{field}' could not be turned back into text to judge ({e}); send the {field} as text",
                        status=400, code="unjudgeable_prompt", extra={"direction": "in", "policy": policy.name},
                    )
        return await self.decide(policy, Direction.IN, route.model, text)

    async def detokenize(self, route: Route, prompt: list[int | str]) -> str:
        """The text of one token-id prompt as the model's engine reads it: each run of ids through the
        engine's ``POST /detokenize`` (llama-server; the model's own vocabulary), strings kept as they are.

        Raises:
            JudgeError: ``error`` when no replica turned the ids into text (no replica, a refused
                connection, an error answer such as an id outside the vocabulary, or no ``content``).
        """
        if not route.upstreams:
            raise JudgeError("the model has no ready replica", kind="error")
        up = route.upstreams[0]
        out: list[str] = []
        run: list[int] = []
        for item in [*prompt, ""]:
            if isinstance(item, int) and not isinstance(item, bool):
                run.append(item)
                continue
            if run:
                out.append(await self._detokenize_run(up, run))
                run = []
            if isinstance(item, str):
                out.append(item)
        return "".join(out)

    async def _detokenize_run(self, up: Upstream, ids: list[int]) -> str:
        try:
            async with self.client.http().post(
                f"http://{up.endpoint}/detokenize", json={"tokens": ids},
                headers={"Authorization": "Bearer " + up.key}, timeout=aiohttp.ClientTimeout(total=DETOKENIZE_S),
            ) as resp:
                data = await resp.json(content_type=None) if resp.status == 200 else None
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise JudgeError(f"the engine's /detokenize failed: {type(e).__name__}", kind="error") from e
        content = data.get("content") if isinstance(data, dict) else None
        if not isinstance(content, str):
            raise JudgeError(f"the engine's /detokenize answered {status} without text", kind="error")
        return content

    async def answer(self, route: Route, request: dict[str, Any], response: dict[str, Any]) -> Refusal | None:
        """Judge a complete answer (out) before it is sent; a refusal or None."""
        policy = self.policy(route)
        if policy is None or not policy.checks(Direction.OUT):
            return None
        return await self.decide(policy, Direction.OUT, route.model, prompt_text(request), answer_text(response))

    def stream(self, route: Route, request: dict[str, Any]) -> HeldStream | None:
        """A holder for a streamed answer when the policy checks ``out``."""
        policy = self.policy(route)
        if policy is None or not policy.checks(Direction.OUT):
            return None
        if (call := current_call.get()) is not None:
            call.headers["x-llmgw-guard-out"] = "held"
            call.headers["x-llmgw-guard-policy"] = policy.name
        return HeldStream(self, policy, route.model, prompt_text(request))

    # -- deciding ------------------------------------------------------------------------------
    async def judge(
        self, policy: Policy, direction: Direction, prompt: str, answer: str = "", *, whole: bool = False
    ) -> Judgment:
        """One judgment under ``policy``'s judges and budget (raises :class:`JudgeError`); ``whole``
        reads the judge's whole answer rather than stopping at the verdict (:meth:`JudgeClient.judge`)."""
        return await self.client.judge(
            policy.judges(), direction, prompt, answer, budget_s=policy.budget_s, whole=whole
        )

    async def decide(
        self, policy: Policy, direction: Direction, model: str, prompt: str, answer: str = ""
    ) -> Refusal | None:
        """Judge, count, log, note the headers; the refusal to send, or None to serve."""
        d = direction.value
        notes = _Notes(direction)
        notes.set("policy", policy.name)
        t0 = time.perf_counter()
        try:
            j = await self.judge(policy, direction, prompt, answer)
        except JudgeError as e:
            ms = (time.perf_counter() - t0) * 1000
            GuardStats._inc(self.stats.errors, e.kind)
            log.warning(
                "guard %s: policy %s model %s: no verdict (%s, %.0f ms): %s; judge said: %r; fail %s",
                d, policy.name, model, e.kind, ms, e, e.raw[:500], policy.fail.value,
            )
            if e.kind == "too_long":  # never served unjudged, whatever ``fail`` says: padding is no way round
                notes.verdict("unjudged", (), ms)
                return too_long(policy, direction)
            if policy.fail is FailMode.OPEN:
                GuardStats._inc(self.stats.unjudged, d)
                notes.verdict("unjudged", (), ms)
                return None
            GuardStats._inc(self.stats.refused_unavailable, d)
            notes.verdict("unjudged", (), ms)
            return unavailable(policy, direction, e)
        v = j.verdict
        GuardStats._inc(self.stats.verdicts, f"{d} {v.safety.value}")
        self.stats.times_ms.setdefault(j.judge, deque(maxlen=TIMES_KEPT)).append(j.ms)
        if self.stats.on_judgment is not None:
            self.stats.on_judgment(j.judge, j.ms)
        notes.verdict(v.safety.value, v.categories, j.ms)
        block = v.safety is Safety.UNSAFE or (
            v.safety is Safety.CONTROVERSIAL and policy.controversial is Controversial.BLOCK
        )
        for c in v.categories:
            GuardStats._inc(self.stats.categories, f"{d} {c}")
        self.stats.recent.append(RecentVerdict(
            time.time(), d, policy.name, model, v.safety.value, tuple(v.categories), j.judge, round(j.ms, 1), block
        ))
        level = logging.WARNING if block or v.safety is not Safety.SAFE else logging.INFO
        log.log(
            level,
            "guard %s: policy %s model %s: %s [%s] by %s in %.0f ms (engine %s ms)%s",
            d, policy.name, model, v.safety.value, ", ".join(v.categories), j.judge, j.ms,
            f"{j.engine_ms:.0f}" if j.engine_ms is not None else "?", " - blocked" if block else "",
        )
        if not block:
            return None
        GuardStats._inc(self.stats.blocked, d)
        return blocked(policy, direction, v.categories)


def unavailable(policy: Policy, direction: Direction, error: JudgeError) -> Refusal:
    """The 503 ``judge_unavailable`` refusal when ``policy`` got no verdict (``fail: closed``).

    Every one but ``absent`` says when to retry: ``retry_after_s`` in the error object and a ``Retry-After`` header
    (whole seconds) on a response not yet started. A ``busy`` judge (refused at once by admission,
    :mod:`llmgw.guard.admission`): when its queue should have room; a spent budget (``timeout``): the
    policy's budget (the judge was that slow just now); any other (judge missing or down):
    :data:`RETRY_UNAVAILABLE_S`; but none when no judge of the policy is in the catalog (``absent``).
    """
    what = "prompt" if direction is Direction.IN else "answer"
    extra: dict[str, Any] = {"direction": direction.value, "policy": policy.name}
    if error.kind == "busy" and error.retry_after_s is not None:
        retry = max(1, math.ceil(error.retry_after_s))
        message = (
            f"policy '{policy.name}' could not judge the {what} within its budget of {policy.budget_s:g} s: "
            f"its judge is busy (too many judgments queued); retry in {retry} s"
        )
    elif error.kind == "absent":  # no retry helps (a new user's finding: told to retry in 5 s, forever)
        return Refusal(
            f"policy '{policy.name}' could not judge the {what}: none of its judges is in the catalog as a guard "
            "model; the operator adds one ('llmgw ctl guard judge enable') or changes the policy",
            status=503, code="judge_unavailable", extra=extra,
        )
    elif error.kind == "timeout":
        retry = max(1, math.ceil(policy.budget_s))
        message = (
            f"policy '{policy.name}' could not judge the {what} within its budget of {policy.budget_s:g} s "
            f"(its judge is slow right now); retry in {retry} s"
        )
    else:
        retry = RETRY_UNAVAILABLE_S
        message = (
            f"policy '{policy.name}' could not judge the {what}: its judge is unavailable; retry in {retry} s"
        )
    extra["retry_after_s"] = retry
    if (call := current_call.get()) is not None:
        call.headers["Retry-After"] = str(retry)
    return Refusal(message, status=503, code="judge_unavailable", extra=extra)


def too_long(policy: Policy, direction: Direction) -> Refusal:
    """The 400 ``too_long_to_judge`` refusal for a text longer than the judge's context (any ``fail``)."""
    what = "prompt" if direction is Direction.IN else "answer"
    hint = "shorten the conversation" if direction is Direction.IN else "ask for a shorter answer (max_tokens)"
    return Refusal(
        f"the {what} is longer than the judge of policy '{policy.name}' can read (its context); it is not served "
        f"unjudged: {hint}",
        status=400, code="too_long_to_judge", extra={"direction": direction.value, "policy": policy.name},
    )


def blocked(policy: Policy, direction: Direction, categories: tuple[str, ...]) -> Refusal:
    """The 400 ``content_blocked`` refusal for content ``policy`` blocks."""
    what = "prompt" if direction is Direction.IN else "answer"
    cats = f" ({', '.join(categories)})" if categories else ""
    return Refusal(
        f"the {what} was blocked by policy '{policy.name}'{cats}",
        status=400,
        code="content_blocked",
        extra={"direction": direction.value, "categories": list(categories), "policy": policy.name},
    )


class _Notes:
    """Writes one direction's guard headers into the current request's :class:`Call`."""

    def __init__(self, direction: Direction) -> None:
        self.prefix = f"x-llmgw-guard-{direction.value}"
        self.call = current_call.get()
        self.last: tuple[str, tuple[str, ...], float] = ("", (), 0.0)

    def set(self, name: str, value: str) -> None:
        if self.call is not None:
            self.call.headers[f"x-llmgw-guard-{name}"] = value

    def verdict(self, verdict: str, categories: tuple[str, ...], ms: float) -> None:
        self.last = (verdict, categories, ms)
        if self.call is not None:
            self.call.headers[self.prefix] = verdict
            self.call.headers[self.prefix + "-categories"] = ", ".join(categories)
            self.call.headers[self.prefix + "-ms"] = f"{ms:.1f}"


class HeldStream:
    """Holds a streamed answer until it is complete and judged (a :class:`StreamInspector`).

    Reads each ``data:`` event's ``choices[].delta`` (content, reasoning, tool-call arguments), or
    ``choices[].text`` (a ``/v1/completions`` stream), to rebuild the answer, remembers the chunk
    ``id``/``object``/``created``/``model`` for the final chunk of a blocked stream (in the
    completions shape when the stream's ``object`` was ``text_completion``), and sends nothing
    until :meth:`end`.
    """

    def __init__(self, guard: GuardInspector, policy: Policy, model: str, prompt: str) -> None:
        self.guard = guard
        self.policy = policy
        self.model = model
        self.prompt = prompt
        self.held: list[bytes] = []
        self.parts: list[str] = []
        self.meta: dict[str, Any] = {}

    async def chunk(self, data: bytes) -> bytes | Refusal:
        """Hold ``data`` (complete lines) and collect the answer's text from its events."""
        self.held.append(data)
        for line in data.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload or payload == b"[DONE]":
                continue
            try:
                event = json.loads(payload)
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            for k in ("id", "object", "created", "model", "system_fingerprint"):
                if k in event and k not in self.meta:
                    self.meta[k] = event[k]
            for ch in event.get("choices") or []:
                if isinstance(ch, dict) and isinstance(ch.get("text"), str):  # a /v1/completions stream
                    self.parts.append(ch["text"])
                delta = ch.get("delta") if isinstance(ch, dict) else None
                if not isinstance(delta, dict):
                    continue
                for key in ("reasoning_content", "content"):
                    if isinstance(delta.get(key), str):
                        self.parts.append(delta[key])
                self.parts.extend(tool_texts(delta.get("tool_calls")))
        return b""

    async def end(self) -> bytes | Refusal:
        """Judge the whole answer: its held bytes, a ``content_filter`` ending, or a refusal."""
        notes_call = current_call.get()
        refusal = await self.guard.decide(self.policy, Direction.OUT, self.model, self.prompt, "".join(self.parts))
        verdict, cats, ms = "", "", ""
        if notes_call is not None:
            verdict = notes_call.headers.get("x-llmgw-guard-out", "")
            cats = notes_call.headers.get("x-llmgw-guard-out-categories", "")
            ms = notes_call.headers.get("x-llmgw-guard-out-ms", "")
        comment = f": llmgw-guard out={verdict} categories={cats.replace(' ', '')} ms={ms}\n\n".encode()
        if refusal is None:
            return comment + b"".join(self.held)
        if refusal.code != "content_blocked":
            return refusal
        if notes_call is not None:  # counted as a block, as a refused plain answer is (a new user's finding)
            notes_call.blocked = refusal.code
        choice: dict[str, Any] = {"index": 0, "finish_reason": "content_filter"}
        if self.meta.get("object") == "text_completion":  # a /v1/completions stream ends as one
            kind, choice["text"] = ("cmpl-llmgw", "text_completion"), ""
        else:
            kind, choice["delta"] = ("chatcmpl-llmgw", "chat.completion.chunk"), {}
        final = {
            "id": self.meta.get("id", kind[0]),
            "object": kind[1],
            "created": self.meta.get("created", int(time.time())),
            "model": self.meta.get("model", self.model),
            "choices": [choice],
            "llmgw_guard": refusal.extra,
        }
        return comment + b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n"


def route_judges(
    resolve_any: Callable[[str], Route | None], format_of: Callable[[str], str | None]
) -> Callable[[str], JudgeRoute | None]:
    """A :data:`~llmgw.guard.judge.JudgeLookup` over the routing table: a guard model's route and format.

    ``format_of(name)`` is the catalog's ``guard.format`` for a guard model, None for anything else
    (a chat model is not a judge unless the catalog says so).
    """

    def lookup(name: str) -> JudgeRoute | None:
        fmt = format_of(name)
        route = resolve_any(name)
        if fmt is None or route is None:
            return None
        return JudgeRoute(route.model, fmt, route.upstreams, route.unavailable)

    return lookup


class CatalogFormats:
    """``format_of`` for :func:`route_judges` from the catalog, cached ``max_age_s`` (1 s) in memory.

    Args:
        models: the catalog's models (``lambda: [r.model for r in store.list_models()]``).
        clock: monotonic seconds (injected for tests).
    """

    def __init__(
        self, models: Callable[[], list[Model]], *, clock: Callable[[], float] = time.monotonic,
        max_age_s: float = 1.0,
    ) -> None:
        self.models = models
        self.clock = clock
        self.max_age_s = max_age_s
        self._formats: dict[str, str] = {}
        self._at = float("-inf")

    def __call__(self, name: str) -> str | None:
        """The guard format of the guard model ``name``; None when it is not a guard model."""
        if self.clock() - self._at > self.max_age_s:
            try:
                self._formats = {
                    m.name: (m.guard.format if m.guard else "qwen3guard") for m in self.models() if m.role == Role.GUARD
                }
                self._at = self.clock()
            except Exception:
                log.exception("reading the catalog's judges failed; using the last list")
        return self._formats.get(name)
