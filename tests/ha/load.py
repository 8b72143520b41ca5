"""The load an HA test puts on :class:`~tests.helpers.hacluster.HACluster` while it injects faults,
and what it records, for ``tests/ha/test_failover.py`` and ``bench/failover.py``. Each runs in a
thread of its own until :meth:`Load.stop`:

- :class:`Writer`: adds catalog entries (``POST /api/v1/models``, a unique name each, ``scaling.min``
  0 so nothing is placed) through a random control plane in rotation, every ``every_s`` seconds, and
  records each ACKNOWLEDGED write (201) with its time; a write without an answer (timeout,
  connection error, 5xx) has an unknown outcome (docs/ha.md §2: a commit cut off may still have
  committed) and is neither acknowledged nor counted lost.
- :class:`GatewayClient`: short chats to the ready replica through the control planes in rotation,
  recording each outcome; a failure counts only when the control plane it went to was in rotation
  for the whole request (a control plane the test kills, or one restarting and not yet serving, is
  not a surviving one).
- :class:`LeaderWatch`: every ``every_s`` seconds, ``GET /api/v1/cluster`` on every live control plane
  (PREAMBLE's interface: ``me``, ``term``, ``leader``); records each control plane claiming to lead
  (``leader == me``) with its term, so a test can look for two at once.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.helpers.control import heartbeat
from tests.helpers.hacluster import AUTH, ControlPlane, HACluster, Member, chat
from tests.helpers.waits import wait_for


@dataclass
class Rotation:
    """The control planes the load may use: a test takes one out before it kills it and puts it back
    once it serves again. Thread-safe."""

    cluster: HACluster
    out: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_out(self, name: str) -> None:
        """Stop sending load to ``name``."""
        with self.lock:
            self.out.add(name)

    def put_back(self, name: str) -> None:
        """Send load to ``name`` again."""
        with self.lock:
            self.out.discard(name)

    def members(self) -> list[ControlPlane]:
        """The control planes in rotation that run."""
        with self.lock:
            out = set(self.out)
        return [cp for cp in self.cluster.control_planes if cp.name not in out and cp.alive()]

    def serving(self, name: str) -> bool:
        """Whether ``name`` is in rotation and runs."""
        return any(cp.name == name for cp in self.members())


class _Loop(threading.Thread):
    def __init__(self, every_s: float) -> None:
        super().__init__(daemon=True)
        self.every_s = every_s
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            t0 = time.monotonic()
            self.step()
            self.stopping.wait(max(0.0, self.every_s - (time.monotonic() - t0)))

    def step(self) -> None:
        raise NotImplementedError


class Writer(_Loop):
    """Catalog writes (module docstring). ``acked``: name -> monotonic times (sent, answered 201);
    ``unknown``: names whose outcome is unknown; ``refused``: (time, status) of each clear refusal
    (503 ``store_unavailable`` while there is no primary); ``hung``: (control plane, start) of each
    write with no answer in ``timeout_s`` (PREAMBLE: a write while the database is unreachable answers
    503 within a few seconds); ``slowest_s``: the longest answer or timeout."""

    def __init__(self, rotation: Rotation, every_s: float = 0.1, timeout_s: float = 10, prefix: str = "") -> None:
        super().__init__(every_s)
        self.rotation = rotation
        self.prefix = prefix  # of the names it writes (several writers at once: each its own)
        self.timeout_s = timeout_s
        self.seq = itertools.count(1)
        self.acked: dict[str, tuple[float, float]] = {}
        self.unknown: list[str] = []
        self.refused: list[tuple[float, int]] = []
        self.hung: list[tuple[str, float]] = []
        self.slowest_s = 0.0
        self.lock = threading.Lock()

    def step(self) -> None:
        cps = self.rotation.members()
        if not cps:
            return
        cp = random.choice(cps)
        name = f"w-{self.prefix}{next(self.seq)}"
        # a file the file server does not have: the reconcilers' memory estimate fails at once (404)
        files = self.rotation.cluster.files.url if self.rotation.cluster.files else "http://127.0.0.1:9"
        body = {"name": name, "source": f"{files}/absent/{name}.gguf", "profiles": [{"name": "cpu"}],
                "scaling": {"min": 0, "max": 1}}
        t0 = time.monotonic()
        try:
            r = httpx.post(f"{cp.admin}/api/v1/models", json=body, headers=AUTH, timeout=self.timeout_s)
        except httpx.TimeoutException:
            with self.lock:
                self.unknown.append(name)
                self.hung.append((cp.name, t0))
            return
        except httpx.HTTPError:
            with self.lock:
                self.unknown.append(name)
            return
        finally:
            self.slowest_s = max(self.slowest_s, time.monotonic() - t0)
        with self.lock:
            if r.status_code == 201:
                self.acked[name] = (t0, time.monotonic())
            elif r.status_code >= 500:
                self.unknown.append(name)
                self.refused.append((time.monotonic(), r.status_code))
            else:
                raise AssertionError(f"POST /api/v1/models {name} on {cp.name}: {r.status_code} {r.text[:300]}")

    def longest_gap_s(self, start: float, end: float) -> float:
        """The longest time between ``start`` and ``end`` (monotonic) with no write acknowledged:
        the write outage a fault in that window caused (0.1 s when writes never stopped)."""
        with self.lock:
            times = sorted(acked for _sent, acked in self.acked.values() if start < acked <= end)
        edges = [start, *times]
        return max((b - a for a, b in itertools.pairwise(edges)), default=end - start)

    def first_ack_after(self, t: float) -> float | None:
        """The monotonic time of the first acknowledgement of a write sent after ``t``, or None (a
        write sent before ``t`` may have committed before it: it says nothing about the outage)."""
        with self.lock:
            after = [acked for sent, acked in self.acked.values() if sent > t]
        return min(after) if after else None


class GatewayClient(_Loop):
    """Chats through the gateway (module docstring). ``ok`` and ``failed`` count the outcomes that
    count; ``failures`` keeps (control plane, status or error) of each failed one."""

    def __init__(self, rotation: Rotation, model: str, every_s: float = 0.25) -> None:
        super().__init__(every_s)
        self.rotation = rotation
        self.model = model
        self.turn = itertools.count()
        self.ok = 0
        self.failed = 0
        self.failures: list[tuple[str, str]] = []

    def step(self) -> None:
        cps = self.rotation.members()
        if not cps:
            return
        cp = cps[next(self.turn) % len(cps)]
        try:
            r = chat(cp, self.model, timeout=30)
            good, why = r.status_code == 200, f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            good, why = False, repr(e)
        if good:
            self.ok += 1
        elif self.rotation.serving(cp.name):  # still a surviving control plane: a real failure
            self.failed += 1
            self.failures.append((cp.name, why))

    @property
    def success_pct(self) -> float:
        """Successful requests in percent of those that count (100 when none counted)."""
        total = self.ok + self.failed
        return 100.0 * self.ok / total if total else 100.0


@dataclass
class Claim:
    """One control plane's view at one moment: ``me`` claims to lead in ``term`` (or follows)."""

    t: float
    me: str
    term: int
    leader: str


class LeaderWatch(_Loop):
    """Samples every live control plane's ``GET /api/v1/cluster`` (module docstring). ``samples``:
    one list of :class:`Claim` per round; ``errors``: what did not answer as the interface says."""

    def __init__(self, cluster: HACluster, every_s: float = 0.25) -> None:
        super().__init__(every_s)
        self.cluster = cluster
        self.samples: list[list[Claim]] = []
        self.errors: list[str] = []

    def step(self) -> None:
        now = time.monotonic()
        round_: list[Claim] = []
        for cp in self.cluster.live():
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{cp.admin}/api/v1/cluster", headers=AUTH, timeout=1)
                if r.status_code != 200:
                    if len(self.errors) < 20:
                        self.errors.append(f"{cp.name}: GET /api/v1/cluster answered {r.status_code}")
                    continue
                v = r.json()
                round_.append(Claim(now, str(v["me"]), int(v["term"]), str(v["leader"])))
        self.samples.append(round_)

    def double_claims(self) -> list[list[Claim]]:
        """Rounds where two control planes each claimed to lead in the same term (split brain)."""
        out = []
        for round_ in self.samples:
            leading = [c for c in round_ if c.leader == c.me and c.leader]
            if len({c.term for c in leading}) < len(leading):
                out.append(leading)
        return out

    def overlap_s(self) -> float:
        """The longest stretch in which two control planes claimed to lead at once (in different
        terms: a stale leader not yet stepped down; its lease bounds it: docs/ha.md §3.3)."""
        longest, start = 0.0, None
        for round_ in self.samples:
            leading = [c for c in round_ if c.leader == c.me and c.leader]
            if len(leading) > 1:
                start = round_[0].t if start is None else start
                longest = max(longest, round_[0].t - start)
            else:
                start = None
        return longest


@dataclass
class Load:
    """A writer, a gateway client and a leader watch over one cluster; :meth:`stop` joins them."""

    rotation: Rotation
    writer: Writer
    gateway: GatewayClient
    watch: LeaderWatch

    @classmethod
    def start(cls, cluster: HACluster, model: str, *, write_every_s: float = 0.1, chat_every_s: float = 0.25) -> Load:
        """Start all three threads: a write every ``write_every_s`` and a chat every ``chat_every_s``
        seconds (bench/failover.py's defaults; tests/ha/test_failover.py passes lighter ones)."""
        rotation = Rotation(cluster)
        load = cls(rotation, Writer(rotation, every_s=write_every_s),
                   GatewayClient(rotation, model, every_s=chat_every_s), LeaderWatch(cluster))
        for t in (load.writer, load.gateway, load.watch):
            t.start()
        return load

    def running(self) -> bool:
        """Whether the load is under way end to end: a write acknowledged, a chat answered and a
        round of leader views taken."""
        with self.writer.lock:
            acked = bool(self.writer.acked)
        return acked and self.gateway.ok > 0 and bool(self.watch.samples)

    def stop(self) -> None:
        """Stop the threads and wait for them (a request in flight finishes: at most its timeout)."""
        for t in (self.writer, self.gateway, self.watch):
            t.stopping.set()
        for t in (self.writer, self.gateway, self.watch):
            t.join(40)


def cluster_views(cluster: HACluster) -> dict[str, Any]:
    """Each live control plane's ``GET /api/v1/cluster`` JSON, or the status/error it gave instead."""
    out: dict[str, Any] = {}
    for cp in cluster.live():
        try:
            r = httpx.get(f"{cp.admin}/api/v1/cluster", headers=AUTH, timeout=2)
            out[cp.name] = r.json() if r.status_code == 200 else f"HTTP {r.status_code}"
        except (httpx.HTTPError, ValueError) as e:
            out[cp.name] = repr(e)
    return out


def agreed_leader(cluster: HACluster) -> tuple[str, int] | None:
    """(leader, term) when every live control plane answers ``/api/v1/cluster`` naming the same
    leader and term, and that leader's own view says it leads; None otherwise."""
    views = cluster_views(cluster)
    if not views or any(not isinstance(v, dict) for v in views.values()):
        return None
    pairs = {(v["leader"], int(v["term"])) for v in views.values()}
    if len(pairs) != 1:
        return None
    leader, term = pairs.pop()
    if not leader or leader not in views or views[leader]["me"] != leader:
        return None
    leading = [c for v in views.values() for c in v.get("control_planes", []) if c.get("leader")]
    if leading and {c["name"] for c in leading} != {leader}:
        return None
    return leader, term


class Probe(_Loop):
    """Issue 19 item 3's probes of one control plane, every ``every_s`` seconds: a read
    (``GET /api/v1/models``), a heartbeat (``POST /agent/v1/heartbeat`` over mTLS as node
    ``probe``, registered first) and an admin call (``GET /api/v1/nodes``). ``outcomes``: (time the
    call was sent, kind, ok, what it answered), a call with no answer in ``timeout_s`` counting as
    failed."""

    KINDS = ("read", "heartbeat", "admin")

    def __init__(self, cp: ControlPlane, every_s: float = 0.5, timeout_s: float = 10) -> None:
        super().__init__(every_s)
        self.cp = cp
        self.timeout_s = timeout_s
        self.outcomes: list[tuple[float, str, bool, str]] = []
        ctx = cp.install.agent_ctx("probe")
        self.agent = httpx.Client(verify=ctx, timeout=timeout_s)
        self.registered = False

    def step(self) -> None:
        calls: list[tuple[str, Any]] = [
            ("read", lambda: httpx.get(f"{self.cp.admin}/api/v1/models", headers=AUTH, timeout=self.timeout_s)),
            ("heartbeat", lambda: self.agent.post(
                f"{self.cp.agent_url}/agent/v1/{'heartbeat' if self.registered else 'register'}",
                content=heartbeat())),
            ("admin", lambda: httpx.get(f"{self.cp.admin}/api/v1/nodes", headers=AUTH, timeout=self.timeout_s)),
        ]
        for kind, call in calls:
            t0 = time.monotonic()
            try:
                r = call()
                ok, what = r.status_code == 200, f"{r.status_code} {r.text[:120]}"
            except httpx.HTTPError as e:
                ok, what = False, repr(e)
            if kind == "heartbeat" and ok:
                self.registered = True
            self.outcomes.append((t0, kind, ok, what))

    def last_failure(self, kind: str) -> tuple[float, str] | None:
        """(sent, answer) of the last failed call of ``kind``, or None."""
        bad = [(t, what) for t, k, ok, what in self.outcomes if k == kind and not ok]
        return bad[-1] if bad else None

    def successes_after(self, kind: str, t: float) -> int:
        """Calls of ``kind`` sent after ``t`` that succeeded."""
        return sum(1 for s, k, ok, _ in self.outcomes if k == kind and ok and s > t)


@dataclass
class OrphanLoad:
    """Issue 19 item 3's load: ``writers`` :class:`Writer` threads pinned to each control plane
    (every one writes through its own control plane only) and one :class:`Probe` per control plane."""

    writers: dict[str, list[Writer]]
    probes: dict[str, Probe]

    @classmethod
    def start(cls, cluster: HACluster, writers: int = 4, every_s: float = 0.25) -> OrphanLoad:
        """Start every thread."""
        names = [cp.name for cp in cluster.control_planes]
        pinned = {n: [Writer(Rotation(cluster, out=set(names) - {n}), every_s=every_s, prefix=f"{n}-{i}-")
                      for i in range(writers)] for n in names}
        load = cls(pinned, {cp.name: Probe(cp) for cp in cluster.control_planes})
        for t in load.threads():
            t.start()
        return load

    def running(self) -> bool:
        """Whether the load is under way end to end: every writer has had a write acknowledged and
        every probe has had each kind of call answered."""
        for ws in self.writers.values():
            for w in ws:
                with w.lock:
                    if not w.acked:
                        return False
        return all(p.successes_after(kind, 0.0) for p in self.probes.values() for kind in Probe.KINDS)

    def threads(self) -> list[_Loop]:
        """Every thread of the load."""
        return [w for ws in self.writers.values() for w in ws] + list(self.probes.values())

    def stop(self) -> None:
        """Stop the threads and wait for them."""
        for t in self.threads():
            t.stopping.set()
        for t in self.threads():
            t.join(40)
        for p in self.probes.values():
            p.agent.close()

    def acked(self) -> dict[str, tuple[float, float]]:
        """Every acknowledged write: name -> (sent, answered)."""
        out: dict[str, tuple[float, float]] = {}
        for ws in self.writers.values():
            for w in ws:
                with w.lock:
                    out.update(w.acked)
        return out

    def longest_gap_s(self, start: float, end: float) -> float:
        """The write outage of the worst control plane: the longest time in [start, end] in which
        one control plane acknowledged none of its writers' writes."""
        worst = 0.0
        for ws in self.writers.values():
            times: list[float] = []
            for w in ws:
                with w.lock:
                    times += [a for _s, a in w.acked.values() if start < a <= end]
            edges = [start, *sorted(times), end]
            worst = max(worst, *(b - a for a, b in itertools.pairwise(edges)))
        return worst

    def first_ack_after(self, cp: str, t: float) -> float | None:
        """When the first write sent through ``cp`` after ``t`` was acknowledged, or None."""
        got = [w.first_ack_after(t) for w in self.writers[cp]]
        done = [g for g in got if g is not None]
        return min(done) if done else None


def orphan_run(
    ha: HACluster, writers: int = 4, watch_s: float = 35,
    settled: Callable[[OrphanLoad, float], bool] | None = None, every_s: float = 0.25,
) -> tuple[OrphanLoad, float, float, float, Member]:
    """Run the load (``writers`` per control plane, each writing every ``every_s`` seconds), orphan
    the primary (its Patroni SIGKILLed, its PostgreSQL left running), wait for another member's
    promotion, watch ``watch_s`` more seconds, or less once ``settled(load, promoted)`` says what the
    caller waits for has been seen (asked every 0.1 s); returns the stopped load, the kill's, the
    promotion's and the watch's end's monotonic times, and the new primary. The orphan still runs
    afterwards (``ha.stop()`` ends it).

    Raises:
        AssertionError: the load not under way within 30 s (:meth:`OrphanLoad.running`), no
            promotion within 60 s, or the orphan's PostgreSQL died meanwhile.
    """
    load = OrphanLoad.start(ha, writers=writers, every_s=every_s)
    try:
        wait_for("the load under way (every writer acknowledged, every probe answered)", load.running, 30, 0.1)
        p = ha.patroni.primary()
        assert p is not None, "no primary"
        p.kill9_patroni()
        killed = time.monotonic()
        new = ha.patroni.wait_primary(60, not_=p)
        promoted = time.monotonic()
        while time.monotonic() < promoted + watch_s and not (settled is not None and settled(load, promoted)):
            time.sleep(0.1)
        ended = time.monotonic()
        assert p.postmaster_pid() is not None, f"the orphan {p.name}'s PostgreSQL died: it was meant to live on"
    finally:
        load.stop()
    return load, killed, promoted, ended, new
