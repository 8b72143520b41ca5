"""How often agents beat, and how long a silent node has before it is ``lost``: both grow with the
cluster so that the heartbeats arriving cluster-wide stay under ``cluster.max_heartbeats_per_s``.

The rule is Nomad's (``max_heartbeats_per_second``, 50 by default; the TTL it hands each client is
``max(min_heartbeat_ttl, nodes / max_heartbeats_per_second)``):

- :func:`interval_for`: ``max(2 s, nodes / (0.9 × max_heartbeats_per_s))``: agents beat at a random
  80-100 % of it (:mod:`llmgw.agent.loop.loop`), 90 % on average, so they do not beat in lockstep
  and the average rate is ``max_heartbeats_per_s``: 2 s up to 90 nodes at the default 50/s, 11.1 s
  at 500, 44.4 s at 2,000, 111 s at 5,000 (measured with the jitter alone: 500 agents at a 10 s
  interval sent 54.6 beats/s).
- :func:`lost_after_for`: ``max(node_lost_after_s, LOST_AFTER_BEATS × interval)`` once the interval
  is above its floor: a node is ``lost`` once it has been silent for three intervals (one beat
  missed and the next late still counts as alive), never sooner than server.yaml's
  ``node_lost_after_s`` (30 s).

:class:`Cadence` keeps the node count (read from the store at most every :data:`COUNT_EVERY_S`, on
a heartbeat, off the event loop, never awaited by it) and answers both for the current count.
A node registering through this control plane is counted at once (:meth:`Cadence.node_added`).
Several control planes (HA) each count the same ``nodes`` table, so they hand out the same interval.

Not guaranteed: the bound holds on average; a node count read up to :data:`COUNT_EVERY_S` ago,
agents that beat at once on a state change (limited to ~10 per second each) and agents of other
versions that ignore ``interval_s`` can push the rate above it for a while.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

MEAN_JITTER = 0.9
"""The mean fraction of the interval agents wait (they draw 80-100 %)."""

MIN_INTERVAL_S = 2.0
"""The shortest interval handed out (s): today's, measured to cost ~5 ms of CPU per full beat."""

LOST_AFTER_BEATS = 3
"""A node is lost after this many intervals without a beat (see the module docstring)."""

COUNT_EVERY_S = 10.0
"""The node count is read again on a heartbeat at most this often (s)."""


def interval_for(nodes: int, max_heartbeats_per_s: float) -> float:
    """The heartbeat interval (s) for ``nodes`` nodes: ``max(2, nodes / (0.9 × max_heartbeats_per_s))``.

    Raises:
        ValueError: ``max_heartbeats_per_s`` is not positive and finite.
    """
    if not (max_heartbeats_per_s > 0 and math.isfinite(max_heartbeats_per_s)):
        raise ValueError(f"max_heartbeats_per_s must be a positive number, not {max_heartbeats_per_s!r}")
    return max(MIN_INTERVAL_S, max(nodes, 0) / (MEAN_JITTER * max_heartbeats_per_s))


def lost_after_for(interval_s: float, node_lost_after_s: float) -> float:
    """Seconds of silence after which a node is lost: ``max(node_lost_after_s, 3 × interval_s)``
    once the interval is above its 2 s floor; ``node_lost_after_s`` as configured at the floor
    (agents then beat at agent.yaml's own ``heartbeat_interval_s``, which may be shorter: a test's
    1.5 s threshold stays 1.5 s)."""
    if interval_s <= MIN_INTERVAL_S:
        return node_lost_after_s
    return max(node_lost_after_s, LOST_AFTER_BEATS * interval_s)


class Cadence:
    """The interval and the lost threshold for the cluster's current size.

    Args:
        max_heartbeats_per_s: ``cluster.max_heartbeats_per_s`` (server.yaml).
        node_lost_after_s: ``node_lost_after_s`` (server.yaml): the lost threshold's floor.
        count: reads the number of stored nodes (runs off the event loop; a failure keeps the old count).
        on_lost_after: called with the new lost threshold (s) whenever a new count changes it
            (the control plane passes it to its leader).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        max_heartbeats_per_s: float = 50.0,
        node_lost_after_s: float = 30.0,
        *,
        count: Callable[[], Awaitable[int]] | None = None,
        on_lost_after: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        interval_for(0, max_heartbeats_per_s)  # the ValueError, now
        self.max_heartbeats_per_s = max_heartbeats_per_s
        self.node_lost_after_s = node_lost_after_s
        self.nodes = 0
        self._count = count
        self._on_lost_after = on_lost_after
        self._clock = clock
        self._counted_at = -math.inf
        self._counting: asyncio.Task[None] | None = None

    @property
    def interval_s(self) -> float:
        """The interval (s) for the last count (:func:`interval_for`)."""
        return interval_for(self.nodes, self.max_heartbeats_per_s)

    @property
    def lost_after_s(self) -> float:
        """The lost threshold (s) for the last count (:func:`lost_after_for`)."""
        return lost_after_for(self.interval_s, self.node_lost_after_s)

    async def start(self) -> None:
        """Count the nodes now (the agent API's start): the first replies carry the right interval."""
        self._counted_at = self._clock()
        if self._count is not None:
            await self._recount(self._count)

    def tick(self) -> None:
        """On a heartbeat: start a new count in the background when the last is :data:`COUNT_EVERY_S` old."""
        now = self._clock()
        if self._count is None or now - self._counted_at < COUNT_EVERY_S:
            return
        if self._counting is not None and not self._counting.done():
            return
        self._counted_at = now
        self._counting = asyncio.get_running_loop().create_task(self._recount(self._count))

    async def _recount(self, count: Callable[[], Awaitable[int]]) -> None:
        try:
            nodes = await count()
        except Exception as e:  # a failed count keeps the last; the beat path must not fail on it
            log.debug("node count failed: %s", e)
            return
        self.set_nodes(nodes)

    def node_added(self) -> None:
        """A node registered: counted at once, not at the next count (agents joining a fresh
        control plane would otherwise all beat at 2 s until then)."""
        self.set_nodes(self.nodes + 1)

    def set_nodes(self, nodes: int) -> None:
        """Take a node count; tell ``on_lost_after`` when the lost threshold moves."""
        before = self.lost_after_s
        self.nodes = nodes
        after = self.lost_after_s
        if after != before:
            log.info(
                "%d nodes: heartbeat interval %.1f s, a node is lost after %.0f s of silence",
                nodes, self.interval_s, after,
            )
            if self._on_lost_after is not None:
                self._on_lost_after(after)
