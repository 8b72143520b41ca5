"""Probing the engines of silent nodes, so an agent's silence alone does not kill a serving engine.

Before each pass the leader (:mod:`llmgw.control.reconcile.leader`, step 2) probes every ``ready``
replica whose node is silent (:func:`silent`: ``lost`` already, or no heartbeat for
``node_lost_after_s``) or gone, as the gateway would reach it: ``GET http://<endpoint>/health`` with
the replica's key (:func:`probe_engine`), all at once (:func:`answering`). A replica whose engine
answers is kept and stays routable; killing and replacing a serving engine turned a 30 s agent
pause into ~20 s of 503s. The probes are I/O only and run on the event loop; the store
reads (:func:`suspects`) run off it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp

from llmgw.control.store import NodeRow, ReplicaRow, Store
from llmgw.protocol import ReplicaState

#: The probe of an engine on a silent node: a healthy llama-server answers ``/health`` in
#: milliseconds, so 2 s only ever runs out on an engine (or a network path) that is gone.
PROBE_TIMEOUT_S = 2.0

#: ``(endpoint, key) -> answers``: whether a replica's engine answers its health probe.
EngineProbe = Callable[[str, str], Awaitable[bool]]


async def probe_engine(
    session: aiohttp.ClientSession, endpoint: str, key: str, *, timeout_s: float = PROBE_TIMEOUT_S
) -> bool:
    """Whether ``GET http://<endpoint>/health`` with ``Authorization: Bearer <key>`` answers 200
    within ``timeout_s`` (``endpoint`` is ``host:port`` as the agent reported it, the address the
    gateway dials). Any connection error, timeout or other status is False."""
    try:
        async with session.get(
            f"http://{endpoint}/health",
            headers={"Authorization": f"Bearer {key}"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return False


def silent(node: NodeRow, now: float, *, lost_after_s: float, since: float | None) -> bool:
    """Whether ``node`` counts as silent at ``now``: ``lost`` already, or ``ready`` with no
    heartbeat for ``lost_after_s`` seconds, counted from ``since`` at the earliest (the leader's
    first pass: a control plane that was down heard no heartbeats; None: from ``now``)."""
    if node.state != "ready":
        return True
    return now - max(node.last_seen, since or now) > lost_after_s


def suspects(store: Store, is_silent: Callable[[NodeRow], bool]) -> list[ReplicaRow]:
    """The ``ready`` replicas (with an endpoint) whose node ``is_silent`` or is gone (store reads)."""
    nodes = {n.id: n for n in store.list_nodes()}
    return [
        r
        for r in store.list_replicas()
        if r.state == ReplicaState.READY and r.endpoint and (r.node not in nodes or is_silent(nodes[r.node]))
    ]


async def answering(probe: EngineProbe, replicas: list[ReplicaRow]) -> set[str]:
    """Probe every replica's engine at once; the ids of those that answered (a probe that raised
    counts as not answering)."""
    if not replicas:
        return set()
    answers = await asyncio.gather(*(probe(r.endpoint, r.key) for r in replicas), return_exceptions=True)
    return {r.id for r, ok in zip(replicas, answers, strict=True) if ok is True}
