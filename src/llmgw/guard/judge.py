"""Asking a judge: choose a ready replica of the first available judge, check its template once,
send one judgment, read the verdict, all within the policy's budget.

Mechanism, per judgment (:meth:`JudgeClient.judge`):

1. The policy's judges are looked up in order (``lookup``: the routing table, guard models
   included); the first with a ready replica whose rendering has not failed serves. None: a
   ``missing`` :class:`~llmgw.guard.formats.JudgeError` naming each judge and why.
2. A replica seen for the first time (replica ids change when an engine restarts, so this is "at
   replica start") has its rendering checked with ``POST /apply-template`` for both directions; a
   replica whose template fell back to another format is remembered as failed, logged with what it
   rendered, and never asked to judge (:attr:`JudgeClient.template_failed`).
3. ``POST /v1/chat/completions`` with the format's body (temperature 0, fixed seed, small
   ``max_tokens``, ``cache_prompt``), round-robin over the ready replicas, trying the next one once
   when the connection is refused (nothing was sent).
4. The answer is parsed by the format; a 200 that cannot be read is ``unparseable``, a non-2xx
   ``down``, a broken connection ``down``, the budget running out ``timeout``. Every one of these
   is an error, never a Safe verdict.

The whole of it, template check included, runs under ``asyncio.timeout(budget_s)``.
Not guaranteed: that a judge answering Safe is right (that is the model's accuracy), nor that a
long text is judged whole: it is sent as is, and one past the judge's context is a ``down`` error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from llmgw.control.routing import Upstream
from llmgw.guard.config import Direction
from llmgw.guard.formats import JudgeError, JudgeFormat, Verdict, format_named

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
        ms: wall time of the judgment in the gateway (template check included, when it ran).
        engine_ms: the engine's own time (llama-server's ``timings``: prompt + generation), or None.
        cached_tokens: prompt tokens the engine reused from its slot's cache (``timings.cache_n``).
        raw: the judge's text as it answered.
    """

    verdict: Verdict
    judge: str
    replica: str
    ms: float
    engine_ms: float | None
    cached_tokens: int
    raw: str


class JudgeClient:
    """Sends judgments to judge replicas over one pooled aiohttp session.

    Args:
        lookup: the judge's route by name (see :data:`JudgeLookup`).

    Call :meth:`close` when done; the session is opened on first use inside the running loop.
    """

    def __init__(self, lookup: JudgeLookup) -> None:
        self.lookup = lookup
        self._session: aiohttp.ClientSession | None = None
        self._next: dict[str, int] = {}
        #: Replica id → True when its rendering was checked and is right, False when it fell back.
        self.template_checked: dict[str, bool] = {}
        #: Replica ids whose rendering is not their format's, with what they rendered.
        self.template_failed: dict[str, str] = {}

    async def close(self) -> None:
        """Close the pooled session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=4.0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
            )
        return self._session

    def pick(self, judges: list[str]) -> tuple[JudgeRoute, JudgeFormat]:
        """The first of ``judges`` with a usable replica, and its format.

        Raises:
            JudgeError: ``missing`` naming why each judge cannot serve; ``error`` for an unknown format.
        """
        why = []
        for name in judges:
            route = self.lookup(name)
            if route is None:
                why.append(f"{name}: not in the catalog as a guard model")
                continue
            usable = tuple(u for u in route.upstreams if u.replica_id not in self.template_failed)
            if usable:
                return JudgeRoute(route.name, route.format, usable), format_named(route.format)
            if route.upstreams:
                why.append(f"{name}: its replicas render the wrong chat template")
            else:
                why.append(f"{name}: {route.unavailable or 'no replica is ready'}")
        raise JudgeError("no judge is available (" + "; ".join(why) + ")", kind="missing")

    async def judge(
        self, judges: list[str], direction: Direction, prompt: str, answer: str = "", *, budget_s: float
    ) -> Judgment:
        """Judge ``prompt`` (in) or ``answer`` to ``prompt`` (out) with the first available judge.

        Raises:
            JudgeError: ``missing``, ``down``, ``timeout``, ``unparseable`` or ``template``; its
                ``raw`` holds the judge's text when there was one.
        """
        t0 = time.perf_counter()
        route, fmt = self.pick(judges)
        try:
            async with asyncio.timeout(budget_s):
                return await self._judge(route, fmt, direction, prompt, answer, t0)
        except TimeoutError as e:
            raise JudgeError(f"judge {route.name} did not answer within the budget of {budget_s:g} s",
                             kind="timeout") from e

    async def _judge(
        self, route: JudgeRoute, fmt: JudgeFormat, direction: Direction, prompt: str, answer: str, t0: float
    ) -> Judgment:
        ups = route.upstreams
        first = self._next.get(route.name, 0)
        self._next[route.name] = first + 1
        body = fmt.request(direction, prompt, answer)
        last: Exception | None = None
        for attempt in range(min(2, len(ups))):
            up = ups[(first + attempt) % len(ups)]
            try:
                if up.replica_id not in self.template_checked:
                    await self.check_template(up, fmt)
                if self.template_failed.get(up.replica_id) is not None:
                    raise JudgeError(f"judge {route.name}'s replica {up.replica_id} renders the wrong template",
                                     kind="template")
                data = await self._post(up, "/v1/chat/completions", body)
            except aiohttp.ClientConnectorError as e:
                last = e
                log.warning("judge %s replica %s: cannot connect: %s", route.name, up.replica_id, e)
                continue
            except aiohttp.ClientError as e:
                raise JudgeError(f"judge {route.name}'s replica {up.replica_id} failed: {e}", kind="down") from e
            return _judgment(route.name, up.replica_id, fmt, direction, data, t0)
        raise JudgeError(f"no replica of judge {route.name} accepts connections ({last})", kind="down")

    async def _post(self, up: Upstream, path: str, body: dict[str, Any]) -> Any:
        async with self._http().post(
            f"http://{up.endpoint}{path}", json=body, headers={"Authorization": "Bearer " + up.key}
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise JudgeError(f"the judge answered {resp.status}", kind="down", raw=text[:2000])
            try:
                return json.loads(text)
            except ValueError as e:
                raise JudgeError("the judge's answer is not JSON", kind="unparseable", raw=text[:2000]) from e

    async def check_template(self, up: Upstream, fmt: JudgeFormat) -> bool:
        """Render both directions with ``POST /apply-template`` and check the format's marker; remember it.

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
        self.template_checked[up.replica_id] = True
        return True


def _judgment(judge: str, replica: str, fmt: JudgeFormat, direction: Direction, data: Any, t0: float) -> Judgment:
    try:
        choice = data["choices"][0]
        text = choice["message"]["content"] or ""
    except (KeyError, IndexError, TypeError) as e:
        raise JudgeError("the judge's answer has no message", kind="unparseable", raw=str(data)[:2000]) from e
    if choice.get("finish_reason") == "length" and not text.strip():
        raise JudgeError("the judge ran out of max_tokens before saying anything", kind="unparseable", raw=text)
    verdict = fmt.parse(text, direction)
    timings = data.get("timings") if isinstance(data, dict) else None
    engine_ms = None
    cached = 0
    if isinstance(timings, dict):
        engine_ms = float(timings.get("prompt_ms", 0.0)) + float(timings.get("predicted_ms", 0.0))
        cached = int(timings.get("cache_n", 0) or 0)
    return Judgment(verdict, judge, replica, (time.perf_counter() - t0) * 1000, engine_ms, cached, text)
