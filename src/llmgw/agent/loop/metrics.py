"""The agent's side of the engine metrics relay: read each ready replica's ``/metrics`` and post them.

Every :data:`PUSH_EVERY_S` the agent GETs ``http://{endpoint}/metrics`` of each ready replica (with the
replica's key: llama-server asks for it when ``--api-key`` is set; 2 s timeout each, at most
:data:`MAX_PAGE_BYTES` read) and posts the pages to its current control plane's
``POST /agent/v1/metrics`` (:mod:`llmgw.control.api.enginemetrics`). An engine without a metrics
endpoint (404) or one that does not answer is left out of that push; a control plane that does not
know the route (an older version) is logged once. Nothing here delays a heartbeat: it runs as its
own task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

import aiohttp
from pydantic import TypeAdapter

from llmgw.protocol import EngineMetricsText, ReplicaState, ReplicaStatus

log = logging.getLogger(__name__)

#: Seconds between pushes (Prometheus' default scrape interval is 15 s to 1 min).
PUSH_EVERY_S = 15.0
MAX_PAGE_BYTES = 256 * 1024
READ_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
_PAGES = TypeAdapter(list[EngineMetricsText])


async def read_pages(
    session: aiohttp.ClientSession, replicas: Iterable[tuple[ReplicaStatus, str, str]]
) -> list[EngineMetricsText]:
    """The ``/metrics`` pages of the ready ``(status, model, key)`` replicas that answer one."""

    async def one(status: ReplicaStatus, model: str, key: str) -> EngineMetricsText | None:
        try:
            async with session.get(
                f"http://{status.endpoint}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=READ_TIMEOUT
            ) as resp:
                if resp.status != 200:
                    return None
                body = await resp.content.read(MAX_PAGE_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError):
            return None
        if len(body) > MAX_PAGE_BYTES:
            return None
        return EngineMetricsText(replica=status.id, model=model, text=body.decode("utf-8", "replace"))

    ready = [(s, m, k) for s, m, k in replicas if s.state == ReplicaState.READY and s.endpoint]
    got = await asyncio.gather(*(one(*r) for r in ready))
    return [p for p in got if p is not None]


async def push_loop(
    plain: aiohttp.ClientSession,
    api: aiohttp.ClientSession,
    replicas: Callable[[], list[tuple[ReplicaStatus, str, str]]],
    control_plane: Callable[[], str],
    stop: asyncio.Event,
    every_s: float = PUSH_EVERY_S,
) -> None:
    """Until ``stop``: read the pages (``replicas()``: ``(status, model, key)`` of each replica) and post
    them to ``control_plane()`` (its agent API URL) every ``every_s``."""
    told = False
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        if stop.is_set():
            return
        pages = await read_pages(plain, replicas())
        if not pages:
            continue
        try:
            async with api.post(
                control_plane() + "/agent/v1/metrics", data=_PAGES.dump_json(pages),
                headers={"Content-Type": "application/json"}, timeout=READ_TIMEOUT,
            ) as resp:
                await resp.read()
                if resp.status == 404 and not told:
                    log.info("the control plane does not take engine metrics (an older version); not relayed")
                    told = True
        except (aiohttp.ClientError, TimeoutError) as e:
            log.debug("engine metrics not posted: %s", e)
