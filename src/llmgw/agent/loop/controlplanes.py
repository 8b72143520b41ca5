"""Which control plane the agent talks to: a list it rotates through, and the highest term seen.

An HA cluster has several control planes on one database; each serves the agent API (register,
heartbeat, logs), so the agent need not reach the leader, only one that answers. The rules
(``docs/ha.md`` §5, after Nomad's client RPC proxy):

- the list starts as agent.yaml's ``server`` then ``servers`` (:attr:`AgentConfig.control_planes`),
  ranked for this node by rendezvous hashing (:func:`rendezvous`: highest sha256 of node and URL
  first): each agent has a *home* control plane, and the agents of a cluster spread evenly over
  its control planes instead of all beating to the first one listed (300 nodes over 3: each gets
  100 ± 20 %, tests/unit/test_beat_spread.py); when one fails, its agents' next choices are
  rendezvous-ranked too, so they spread over the survivors;
- the agent keeps using the last control plane that worked (:meth:`ControlPlanes.order` puts it
  first), but while that is not its home it tries its home first again every :data:`RETURN_S`:
  it goes back when its home answers. Staying would leave the load uneven for good after a
  restart (every agent of the restarted one stays on the others); the cost is one failed attempt
  per :data:`RETURN_S` while the home is down;
- on a connect error, a TLS failure, a timeout, a 5xx or a reply with a stale term, that one moves
  to the end (:meth:`ControlPlanes.failed`) and the next is tried at once, in the same beat;
- a full cycle with no answer backs off a random time up to :data:`BACKOFF_S` (1 → 2 → 5 → 10 s,
  then 10 s), drawn anew each cycle (:func:`backoff_s`: "full jitter");
- members named in replies' ``control_planes`` are added after agent.yaml's own (and the home
  ranked again over every member known); a learned member that replies stop naming is dropped
  once it has gone unnamed for :data:`FORGET_S` (agent.yaml's own are never dropped).

Terms (:class:`Terms`): the agent keeps the highest ``term`` a reply carried. A reply with a lower
term comes from a control plane left on a stale or orphaned database: its ``desired`` list is not
applied (no engine is started or stopped from it) and the agent rotates to the next control plane.

Not guaranteed: the order of learned members is the order replies named them; a control plane that
answers with a stale term stays in the list (it may catch up) and is tried again in its turn.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterable

log = logging.getLogger("llmgw.agent")

BACKOFF_S = (1.0, 2.0, 5.0, 10.0)
"""The longest wait (s) after the 1st, 2nd, 3rd, 4th and later consecutive cycle in which no control
plane answered (docs/ha.md §5 "Agent client rules"); the wait itself is drawn below it (:func:`backoff_s`)."""

FORGET_S = 60.0
"""A member learned from replies is dropped once replies have not named it for this long (seconds);
30 heartbeats at the default 2 s interval, long enough to ride out a restarting control plane."""


RETURN_S = 30.0
"""While away from its home control plane, an agent tries its home first again this often (s)."""

JITTER = (0.8, 1.0)
"""An agent waits this fraction of the interval between beats, drawn anew each time (uniform):
agents started together (a cluster restarted) drift apart instead of beating in lockstep."""


def rendezvous(node: str, urls: Iterable[str]) -> list[str]:
    """``urls`` ranked for ``node`` by rendezvous (highest random weight) hashing: by the sha256 of
    ``node``, a newline and the URL, highest first. Deterministic, even over nodes, and removing
    one URL moves only the nodes that ranked it first."""
    def weight(url: str) -> bytes:
        return hashlib.sha256(f"{node}\n{url}".encode()).digest()

    return sorted(dict.fromkeys(urls), key=weight, reverse=True)


def beat_wait_s(configured_s: float, asked_s: float, draw: float) -> float:
    """Seconds until the next beat: agent.yaml's ``heartbeat_interval_s`` (``configured_s``), or the
    control plane's ``interval_s`` (``asked_s``) when that is longer than its 2 s floor (a large
    cluster: the control plane keeps the cluster-wide rate under ``cluster.max_heartbeats_per_s``),
    times ``draw`` (in :data:`JITTER`). ``asked_s`` 0: no reply yet."""
    interval = max(configured_s, asked_s) if asked_s > 2.0 else configured_s
    return interval * draw


def backoff_s(failed_cycles: int, draw: float = 1.0) -> float:
    """Seconds to wait after ``failed_cycles`` consecutive cycles without an answer (≥ 1): ``draw``
    (uniform in [0, 1], drawn anew each cycle by the agent) times the cap for that cycle, 1, 2, 5,
    then 10 s for every later one (:data:`BACKOFF_S`). 0 for ``failed_cycles`` ≤ 0.

    This is "full jitter" (AWS Architecture Blog, "Exponential Backoff and Jitter", 2015): with a
    fixed schedule, agents that failed together (every connection of a restarted control plane
    dropped in the same second) would retry together at every step and meet it, when it comes
    back, as one burst of TLS handshakes and full registers; drawn waits spread them over the
    whole cap (``bench/scale.py``'s restart shows the accept rate and the reconnect p99).

    Raises:
        ValueError: ``draw`` is outside [0, 1].
    """
    if not 0.0 <= draw <= 1.0:
        raise ValueError(f"backoff draw must be in [0, 1], not {draw!r}")
    if failed_cycles <= 0:
        return 0.0
    return draw * BACKOFF_S[min(failed_cycles, len(BACKOFF_S)) - 1]


def _norm(url: str) -> str:
    return url.strip().rstrip("/")


class ControlPlanes:
    """The agent-API URLs of the control planes, in the order the agent tries them.

    Args:
        configured: agent.yaml's list (``https://HOST:7443`` each, at least one); never dropped.
        node: this agent's node id: the list is ranked for it by :func:`rendezvous`; "" keeps
            agent.yaml's order and the last control plane that worked (no home to go back to).
        forget_s: seconds a learned member may go unnamed by replies before it is dropped.
        return_s: seconds between tries of the home while away from it (:data:`RETURN_S`).
        clock: monotonic seconds (tests pass their own).

    Raises:
        ValueError: ``configured`` is empty.
    """

    def __init__(
        self,
        configured: Iterable[str],
        *,
        node: str = "",
        forget_s: float = FORGET_S,
        return_s: float = RETURN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.configured = list(dict.fromkeys(_norm(u) for u in configured if u.strip()))
        if not self.configured:
            raise ValueError("no control plane to talk to: give agent.yaml 'server' or 'servers'")
        self._node = node
        self._order = rendezvous(node, self.configured) if node else list(self.configured)
        self.home = self._order[0]
        """The control plane this agent belongs to while it answers (the first of its ranking)."""
        self._return_s = return_s
        self._home_tried = -math.inf
        self._learned: set[str] = set()
        self._unnamed_since: dict[str, float] = {}
        self._forget_s = forget_s
        self._clock = clock

    @property
    def current(self) -> str:
        """The control plane the agent uses now: the last one that worked (agent.yaml's first at start)."""
        return self._order[0]

    def order(self) -> list[str]:
        """One cycle's attempts: :attr:`current` first, then the others in rotation order; the
        home first instead when the agent is away from it and :data:`RETURN_S` passed since it
        was last tried."""
        now = self._clock()
        away = self._node and self.current != self.home and self.home in self._order
        if away and now - self._home_tried >= self._return_s:
            self._home_tried = now
            return [self.home, *(u for u in self._order if u != self.home)]
        return list(self._order)

    def failed(self, url: str) -> None:
        """``url`` did not answer usefully: move it to the end (the next one becomes current)."""
        url = _norm(url)
        if url == self.home:
            self._home_tried = self._clock()
        if url in self._order:
            self._order.remove(url)
            self._order.append(url)

    def succeeded(self, url: str) -> None:
        """``url`` answered: it becomes :attr:`current` (the others keep their order)."""
        url = _norm(url)
        if url in self._order:
            self._order.remove(url)
        self._order.insert(0, url)

    def learn(self, members: Iterable[str]) -> list[str]:
        """Take a reply's ``control_planes``: add the members not known yet (at the end) and drop
        learned members unnamed for ``forget_s``. An empty list (a control plane that does not
        know its peers) changes nothing. URLs that are not ``https://`` are ignored.

        Returns:
            The members added by this call (for the log).
        """
        named = [u for u in dict.fromkeys(_norm(m) for m in members) if u.startswith("https://")]
        if not named:
            return []
        now = self._clock()
        added = []
        for url in named:
            self._unnamed_since.pop(url, None)
            if url not in self._order:
                self._order.append(url)
                self._learned.add(url)
                added.append(url)
        if added and self._node:  # ranked again: the home may be a learned one
            self.home = rendezvous(self._node, self._order)[0]
            self._order = [self.current, *rendezvous(self._node, self._order[1:])]
        for url in list(self._learned):
            if url in named:
                continue
            since = self._unnamed_since.setdefault(url, now)
            if now - since >= self._forget_s and url != self.current:
                self._order.remove(url)
                self._learned.discard(url)
                del self._unnamed_since[url]
                if url == self.home:
                    self.home = rendezvous(self._node, self._order)[0] if self._node else self._order[0]
                log.info("control plane %s is no longer a member: dropped from the list", url)
        return added


class Terms:
    """The highest leadership term seen in replies (the fencing token; 0 = none yet)."""

    def __init__(self) -> None:
        self.highest = 0

    def accept(self, term: int) -> bool:
        """Whether a reply carrying ``term`` may be applied: True when ``term`` ≥ the highest seen
        (which it then becomes); False for a lower term (a stale control plane), which changes nothing."""
        if term < self.highest:
            return False
        self.highest = term
        return True
