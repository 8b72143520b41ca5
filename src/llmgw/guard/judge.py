"""Asking a judge: choose a ready replica of the first available judge, check its template once,
wait for a slot (or be refused at once), send one judgment, read the verdict as it is generated,
all within the policy's budget.

Mechanism, per judgment (:meth:`JudgeClient.judge`):

1. The policy's judges are looked up in order (``lookup``: the routing table, guard models
   included); the first with a ready replica whose rendering has not failed serves. None: a
   ``missing`` :class:`~llmgw.errors.JudgeError` naming each judge and why.
2. Admission (:mod:`llmgw.guard.admission`): at most as many judgments at once as the judge's
   replicas have slots; the rest wait in order of arrival; one whose estimated wait would not fit
   in its budget is refused at once (``busy``, with ``retry_after_s``).
3. A replica seen for the first time (replica ids change when an engine restarts, so this is "at
   replica start") has its rendering checked with ``POST /apply-template`` for both directions and
   its slots read from ``GET /props`` (``total_slots``); a replica whose template fell back to
   another format is remembered as failed, logged with what it rendered, and never asked to judge
   (:attr:`JudgeClient.template_failed`).
4. ``POST /v1/chat/completions`` with the format's body (temperature 0, fixed seed, the format's
   ``max_tokens``, ``cache_prompt``, ``stream`` with ``timings_per_token``) to the replica with the
   fewest judgments in flight, trying the next one once when the connection is refused (nothing
   was sent). The answer is read event by event and the connection closed as soon as the format
   says the verdict is known (:meth:`~llmgw.guard.formats.JudgeFormat.decided`); llama-server
   notices the closed connection and stops generating, so the slot is free for the next one.
   A judge that answers with one JSON body instead (no stream) is read whole.
5. The answer is parsed by the format; a 200 that cannot be read is ``unparseable``, a non-2xx
   ``down``, a broken connection ``down``, the budget running out ``timeout``. Every one of these
   is an error, never a Safe verdict.

The whole of it, template check and queue wait included, runs under ``asyncio.timeout(budget_s)``.
Not guaranteed: that a judge answering Safe is right (that is the model's accuracy). A text is sent
whole, never cut: one past the judge's context is a ``too_long`` error (llama-server's
``exceed_context_size_error``), which the guard refuses whatever the policy's ``fail``
(:mod:`llmgw.control.gateway.guard`), so padding a prompt past the judge's context does not get it
served unjudged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from llmgw.errors import JudgeError
from llmgw.guard.admission import JudgeQueue
from llmgw.guard.config import Direction
from llmgw.guard.formats import JudgeFormat, Verdict, format_named
from llmgw.routing import Upstream

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class JudgeRoute:
    """A judge model as the guard sees it: its catalog name, format, and ready replicas.

    ``unavailable`` says why there is none ready (phrased for logs and ``guard judge status``).
    """

    name: str
    format: str
    upstreams: tuple[Upstream, ...] = ()
    unavailable: str = ""


#: Finds a judge by catalog name; None when the catalog has no guard model of that name.
JudgeLookup = Callable[[str], JudgeRoute | None]


@dataclass(frozen=True)
class Judgment:
    """One verdict and what it cost.

    Attributes:
        judge: the judge model that answered; ``replica`` its replica id.
        ms: wall time of the judgment in the gateway (queue wait and template check included).
        engine_ms: the engine's own time (llama-server's ``timings``: prompt + generation, up to the
            last event read), or None.
        cached_tokens: prompt tokens the engine reused from its slot's cache (``timings.cache_n``).
        raw: the judge's text as it answered (up to where the verdict was known).
        wait_ms: of ``ms``, the time spent waiting for a slot.
    """

    verdict: Verdict
    judge: str
    replica: str
    ms: float
    engine_ms: float | None
    cached_tokens: int
    raw: str
    wait_ms: float = 0.0


class JudgeClient:
    """Sends judgments to judge replicas over one pooled aiohttp session, one :class:`JudgeQueue` per judge.

    Args:
        lookup: the judge's route by name (see :data:`JudgeLookup`).

    Call :meth:`close` when done; the session is opened on first use inside the running loop.
    """

    def __init__(self, lookup: JudgeLookup) -> None:
        self.lookup = lookup
        self._session: aiohttp.ClientSession | None = None
        #: Replica id → True when its rendering was checked and is right, False when it fell back.
        self.template_checked: dict[str, bool] = {}
        #: Replica ids whose rendering is not their format's, with what they rendered.
        self.template_failed: dict[str, str] = {}
        #: Judge name → its queue (admission, the running judgment time).
        self.queues: dict[str, JudgeQueue] = {}
        #: Replica id → judgments it runs at once (``GET /props`` ``total_slots``; 1 until read).
        self.slots: dict[str, int] = {}
        #: Told the name of a judge in the catalog with no ready replica when a judgment wanted it: the
        #: gateway's demand for models at zero (``LoadCounter.missed``), so that a judge scaled to zero
        #: (``scaling.min: 0`` under ``fail: open``) starts on the requests it could not judge. Without
        #: it such a judge never started again and every request went unjudged (a new user's finding).
        self.on_missing: Callable[[str], None] | None = None
        self._busy: dict[str, int] = {}
        self._judged: set[str] = set()

    async def close(self) -> None:
        """Close the pooled session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def http(self) -> aiohttp.ClientSession:
        """The pooled session (opened on first use, inside the running loop)."""
        # One connection per request (force_close): a streamed judgment's connection is closed to stop
        # the engine anyway, and an idle pooled one that llama-server closes as a judgment is written
        # to it failed that judgment ("Can not write request body", seen in the e2e tests); a connect
        # on the judge's network costs well under a millisecond.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256, force_close=True),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
            )
        return self._session

    def pick(self, judges: list[str]) -> tuple[JudgeRoute, JudgeFormat]:
        """The first of ``judges`` with a usable replica, and its format.

        Raises:
            JudgeError: ``missing`` naming why each judge cannot serve (``absent`` when none is in the
                catalog as a guard model); ``error`` for an unknown format.
        """
        why = []
        known = False
        for name in judges:
            route = self.lookup(name)
            if route is None:
                why.append(f"{name}: not in the catalog as a guard model")
                continue
            known = True
            usable = tuple(u for u in route.upstreams if u.replica_id not in self.template_failed)
            if usable:
                return JudgeRoute(route.name, route.format, usable), format_named(route.format)
            if route.upstreams:
                why.append(f"{name}: its replicas render the wrong chat template")
            else:
                why.append(f"{name}: {route.unavailable or 'no replica is ready'}")
                if self.on_missing is not None:
                    self.on_missing(route.name)
        raise JudgeError("no judge is available (" + "; ".join(why) + ")", kind="missing" if known else "absent")

    def queue(self, name: str) -> JudgeQueue:
        """The admission queue of judge ``name`` (made on first use)."""
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = JudgeQueue(name)
        return q

    async def judge(
        self, judges: list[str], direction: Direction, prompt: str, answer: str = "", *, budget_s: float,
        whole: bool = False,
    ) -> Judgment:
        """Judge ``prompt`` (in) or ``answer`` to ``prompt`` (out) with the first available judge.

        ``whole``: read the judge's whole answer instead of stopping once the verdict is known (for
        ``guard test``, which shows all of it, Qwen3Guard's ``Refusal:`` line included).

        Raises:
            JudgeError: ``missing``, ``busy`` (at once, with ``retry_after_s``), ``down``, ``timeout``,
                ``unparseable`` or ``template``; its ``raw`` holds the judge's text when there was one.
        """
        t0 = time.perf_counter()
        route, fmt = self.pick(judges)
        q = self.queue(route.name)
        q.resize(sum(self.slots.get(u.replica_id, 1) for u in route.upstreams))
        try:
            async with asyncio.timeout(budget_s), q.admit(budget_s - (time.perf_counter() - t0)):
                return await self._judge(route, fmt, direction, prompt, answer, t0, whole)
        except TimeoutError as e:
            raise JudgeError(f"judge {route.name} did not answer within the budget of {budget_s:g} s",
                             kind="timeout") from e

    async def _judge(
        self, route: JudgeRoute, fmt: JudgeFormat, direction: Direction, prompt: str, answer: str, t0: float,
        whole: bool,
    ) -> Judgment:
        waited = time.perf_counter() - t0
        ups = sorted(route.upstreams, key=lambda u: self._busy.get(u.replica_id, 0) / self.slots.get(u.replica_id, 1))
        body = fmt.request(direction, prompt, answer)
        last: Exception | None = None
        for up in ups[:2]:
            try:
                if up.replica_id not in self.template_checked:
                    await self.check_template(up, fmt)
                if self.template_failed.get(up.replica_id) is not None:
                    raise JudgeError(f"judge {route.name}'s replica {up.replica_id} renders the wrong template",
                                     kind="template")
                self._busy[up.replica_id] = self._busy.get(up.replica_id, 0) + 1
                # A replica's first judgment prefills the whole instruction (nothing is cached yet): not
                # what the next ones will take, so it does not enter the running time.
                typical = up.replica_id in self._judged
                self._judged.add(up.replica_id)
                t1 = time.perf_counter()
                try:
                    text, finish, timings, verdict = await self._ask(up, fmt, direction, body, fmt.prefill, whole)
                    if verdict is None and fmt.category_grammar and (line := _flagged(text)):
                        # Two steps (prompted): Unsafe/Controversial, now its categories.
                        more = fmt.category_request(direction, prompt, answer, line)
                        text, finish, timings2, verdict = await self._ask(
                            up, fmt, direction, more, fmt.category_prefill(line), whole
                        )
                        timings = _add(timings, timings2)
                except asyncio.CancelledError:  # the budget ran out: what it took so far is a lower bound
                    if typical:
                        self.queue(route.name).record(time.perf_counter() - t1)
                    raise
                finally:
                    self._busy[up.replica_id] -= 1
                if typical:
                    self.queue(route.name).record(time.perf_counter() - t1)
            except aiohttp.ClientConnectorError as e:
                last = e
                log.warning("judge %s replica %s: cannot connect: %s", route.name, up.replica_id, e)
                continue
            except aiohttp.ClientError as e:
                raise JudgeError(f"judge {route.name}'s replica {up.replica_id} failed: {e}", kind="down") from e
            return _judgment(route.name, up.replica_id, fmt, direction, text, finish, timings, verdict, t0, waited)
        raise JudgeError(f"no replica of judge {route.name} accepts connections ({last})", kind="down")

    async def _ask(
        self, up: Upstream, fmt: JudgeFormat, direction: Direction, body: dict[str, Any], prefill: str,
        whole: bool,
    ) -> tuple[str, str | None, dict[str, Any] | None, Verdict | None]:
        """Send one judgment; ``(text, finish_reason, timings, verdict known early or None)``.

        ``text`` is the answer with ``prefill`` (what the request's last assistant turn began it
        with) in front, once (:meth:`JudgeFormat.answer`).

        A streamed answer is read event by event and the connection closed (so the engine stops)
        once ``fmt.decided`` gives a verdict (unless ``whole``); a JSON answer is read whole.
        """
        async with self.http().post(
            f"http://{up.endpoint}/v1/chat/completions", json=body, headers={"Authorization": "Bearer " + up.key}
        ) as resp:
            if resp.status >= 400:
                raw = (await resp.text())[:2000]
                raise JudgeError(f"the judge answered {resp.status}", kind=_error_kind(raw), raw=raw)
            if not resp.content_type.startswith("text/event-stream"):
                data = _json(await resp.text())
                try:
                    choice = data["choices"][0]
                    text = fmt.answer(str(choice["message"]["content"] or ""), prefill)
                    return text, choice.get("finish_reason"), _timings(data), None
                except (KeyError, IndexError, TypeError) as e:
                    raise JudgeError("the judge's answer has no message", kind="unparseable",
                                     raw=str(data)[:2000]) from e
            generated, finish, timings = "", None, None
            try:
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    event = _json(payload.decode(errors="replace"))
                    if isinstance(event, dict) and "error" in event:
                        raw = str(event)[:2000]
                        raise JudgeError("the judge failed mid-answer", kind=_error_kind(raw), raw=raw)
                    timings = _timings(event) or timings
                    for ch in (event.get("choices") or []) if isinstance(event, dict) else []:
                        delta = ch.get("delta") if isinstance(ch, dict) else None
                        if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                            generated += delta["content"]
                        if isinstance(ch, dict) and ch.get("finish_reason"):
                            finish = ch["finish_reason"]
                    text = fmt.answer(generated, prefill)
                    if not whole and finish is None and (verdict := fmt.decided(text, direction)) is not None:
                        return text, finish, timings, verdict  # known: closing stops the engine generating
                return fmt.answer(generated, prefill), finish, timings, None
            finally:
                resp.close()  # early: this is what stops the engine generating the rest

    async def _post(self, up: Upstream, path: str, body: dict[str, Any] | None) -> Any:
        """POST ``body`` (GET when None) to ``path`` on ``up``; the JSON answer."""
        async with self.http().request(
            "GET" if body is None else "POST", f"http://{up.endpoint}{path}", json=body,
            headers={"Authorization": "Bearer " + up.key},
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise JudgeError(f"the judge answered {resp.status}", kind="down", raw=text[:2000])
            return _json(text)

    async def check_template(self, up: Upstream, fmt: JudgeFormat) -> bool:
        """Render both directions with ``POST /apply-template`` and check the format's marker; remember it.

        Also reads the replica's slots (``GET /props`` ``total_slots``; 1 when it does not say).
        Returns whether the rendering is right. A replica that does not answer is not remembered
        (it is checked again next time); one that renders the wrong thing is failed for good.
        """
        for d in Direction:
            data = await self._post(up, "/apply-template", {"messages": fmt.messages(d, "canary", "canary")})
            rendered = str(data.get("prompt", "")) if isinstance(data, dict) else ""
            if not fmt.template_ok(rendered):
                self.template_checked[up.replica_id] = False
                self.template_failed[up.replica_id] = rendered[:500]
                log.error(
                    "judge replica %s does not render the %s template (its chat template fell back to "
                    "another format?); it will not judge. It rendered: %r",
                    up.replica_id, fmt.name, rendered[:300],
                )
                return False
        try:
            props = await self._post(up, "/props", None)
            slots = props.get("total_slots") if isinstance(props, dict) else None
            self.slots[up.replica_id] = slots if isinstance(slots, int) and slots > 0 else 1
        except JudgeError as e:
            log.info("judge replica %s: no slot count from /props (%s); assuming 1", up.replica_id, e)
        self.template_checked[up.replica_id] = True
        return True


#: What llama-server says when a request does not fit in a slot's context (its error ``type``; older
#: builds only the message).
_TOO_LONG = ("exceed_context_size", "exceeds the available context size", "larger than the max context size")


def _error_kind(raw: str) -> str:
    """The :class:`JudgeError` kind of a judge's error answer: ``too_long`` when it says the text does
    not fit in its context, else ``down``."""
    return "too_long" if any(m in raw for m in _TOO_LONG) else "down"


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise JudgeError("the judge's answer is not JSON", kind="unparseable", raw=text[:2000]) from e


_FLAGGED = re.compile(r"^\s*Safety\s*:\s*(Unsafe|Controversial)\s*$", re.IGNORECASE)


def _flagged(text: str) -> str:
    """``text`` when it is a lone ``Safety: Unsafe|Controversial`` line (a two-step first answer), else ""."""
    return text if _FLAGGED.match(text) else ""


def _add(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two steps' timings as one: times added, the cached tokens of the first (the judgment's prompt)."""
    if a is None or b is None:
        return a or b
    ms = ("prompt_ms", "predicted_ms")
    return {**a, **{k: float(a.get(k, 0.0)) + float(b.get(k, 0.0)) for k in ms}}


def _timings(data: Any) -> dict[str, Any] | None:
    t = data.get("timings") if isinstance(data, dict) else None
    return t if isinstance(t, dict) else None


def _judgment(
    judge: str, replica: str, fmt: JudgeFormat, direction: Direction, text: str, finish: str | None,
    timings: dict[str, Any] | None, verdict: Verdict | None, t0: float, waited_s: float,
) -> Judgment:
    if verdict is None:
        if finish == "length" and not text.strip():
            raise JudgeError("the judge ran out of max_tokens before saying anything", kind="unparseable", raw=text)
        verdict = fmt.parse(text, direction)
    engine_ms = None
    cached = 0
    if timings is not None:
        engine_ms = float(timings.get("prompt_ms", 0.0)) + float(timings.get("predicted_ms", 0.0))
        cached = int(timings.get("cache_n", 0) or 0)
    return Judgment(verdict, judge, replica, (time.perf_counter() - t0) * 1000, engine_ms, cached, text,
                    waited_s * 1000)
