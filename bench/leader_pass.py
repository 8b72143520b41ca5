"""The leader's pass at cluster size, on a real store: its time and its store trips.

A SQLite store (a file, WAL, as ``llmgw server run`` opens it; PostgreSQL too with ``--pg URL``)
is filled with N nodes (32 cores, 128 GB, llama.cpp installed) and 4 replicas per node, all ready
(N / 25 models of 100 replicas each, CPU profiles, spread one replica per node): 20,000 replicas
at N = 5,000. Nodes are written by the store's heartbeat path (``write_heartbeats``, full beats),
replicas by one bulk insert (placing 20,000 by passes would measure the setup, not a pass).

Then, per size, passes on a clock that moves 2 s per pass (the agents' pulses keep every node
fresh: ``last_seen`` is written for all nodes each pass, which is what liveness costs the store):

* **full**: :data:`ROUNDS` full resyncs (every node, replica and model read, every model explained);
* **steady**: :data:`ROUNDS` passes with a trickle before each: 5 nodes send a full heartbeat
  (their free memory moved), and every 5th pass one replica fails (replaced after its backoff);
* **burst**: 200 models added at once (1 replica each), then passes until all are placed.

Each pass is timed whole, as the leader runs it (the facts' refresh, the silent nodes' suspects,
the pass), and its store trips are counted: transactions begun and SQL statements run, from the
engine's own events. p50/p99 over the passes of a kind (p99 of 10 passes is their maximum).
The load average is printed beside the figures (the machine is shared). Figures last, one
``name: value`` per line; ``leader_pass_p99_s`` is the steady and burst passes at the largest N.

    .venv/bin/python bench/leader_pass.py [--sizes 500,2000,5000] [--pg URL]
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import sqlalchemy as sa

from llmgw.catalog import Model, Profile, Scaling
from llmgw.control.reconcile import leader as leading
from llmgw.control.reconcile import probe as probing
from llmgw.control.store import ReplicaRow, SqlStore
from llmgw.control.store.codec import heartbeat_values, replica_values
from llmgw.control.store.rows import BeatWrite
from llmgw.control.store.schema import nodes_t, replicas_t
from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ProvisionState, ReplicaState, ReplicaStatus

GB = 1_000_000_000
ROUNDS = 10
PER_MODEL = 100
PER_NODE = 4
BURST = 200
LLAMA = EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")
T0 = 1_000_000.0


@dataclass
class Trips:
    """Store trips counted from the engine's events."""

    tx: int = 0
    stmts: int = 0

    def attach(self, engine: sa.Engine) -> None:
        sa.event.listen(engine, "begin", lambda _c: self._tx())
        sa.event.listen(engine, "before_cursor_execute", lambda *_a: self._stmt())

    def _tx(self) -> None:
        self.tx += 1

    def _stmt(self) -> None:
        self.stmts += 1


@dataclass
class Kind:
    """The passes of one kind at one size."""

    times: list[float] = field(default_factory=list)
    tx: list[int] = field(default_factory=list)
    stmts: list[int] = field(default_factory=list)

    def line(self, name: str) -> str:
        if not self.times:
            return f"  {name:7s} (none)"
        return (f"  {name:7s} p50 {pct(self.times, 50):7.3f} s  p99 {pct(self.times, 99):7.3f} s  "
                f"trips/pass tx {statistics.median(self.tx):6.0f} (max {max(self.tx)})  "
                f"stmts {statistics.median(self.stmts):6.0f} (max {max(self.stmts)})  passes {len(self.times)}")


def pct(xs: list[float], p: int) -> float:
    """The ``p``-th percentile (nearest rank) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def model(i: int, replicas: int, prefix: str = "m") -> Model:
    return Model(name=f"{prefix}{i:04d}", source=f"http://mirror/{prefix}{i}.gguf",
                 scaling=Scaling(min=replicas, max=replicas),
                 profiles=[Profile(name="cpu", min_memory_gb=4, cpu_cores=4)])


def heartbeat(i: int, reports: list[ReplicaStatus], avail_gb: float = 120) -> Heartbeat:
    inv = Inventory(cores=32, memory_total_bytes=128 * GB, memory_available_bytes=int(avail_gb * GB))
    return Heartbeat(inventory=inv, labels={"zone": f"z{i % 4}"}, engines=[LLAMA], replicas=reports,
                     instance=f"i{i}")


class Cluster:
    """N nodes with 4 ready replicas each, in ``store``."""

    def __init__(self, store: SqlStore, n: int) -> None:
        self.store, self.n = store, n
        self.ids = [f"node-{i:05d}" for i in range(n)]
        self.reports: dict[str, list[ReplicaStatus]] = {i: [] for i in self.ids}
        self.now = T0

    def fill(self) -> None:
        models = [model(m, PER_MODEL) for m in range(self.n * PER_NODE // PER_MODEL)]
        for m in models:
            self.store.add_model(m, now=self.now)
        rows = []
        for k in range(self.n * PER_NODE):
            m = models[k // PER_MODEL]
            node = self.ids[k % self.n]
            rid = f"{m.name}-{k:06x}"
            rows.append(replica_values(ReplicaRow(
                id=rid, model=m.name, node=node, profile="cpu", key=f"k{k}", state=ReplicaState.READY.value,
                endpoint=f"10.0.{k % 250}.{k % 200}:{9000 + k % 1000}", created_at=self.now, updated_at=self.now,
                ready_at=self.now, spec_hash=leading.spec_hash(m, "cpu"),
            )))
            self.reports[node].append(ReplicaStatus(id=rid, state=ReplicaState.READY,
                                                    endpoint=rows[-1]["endpoint"]))
        nodes = [{"id": self.ids[i], "revision": 1, "cordoned": False, "first_seen": self.now,
                  **heartbeat_values(heartbeat(i, self.reports[self.ids[i]]), self.now)} for i in range(self.n)]
        with self.store.engine.begin() as conn:  # the nodes' first full beats, in bulk
            for i in range(0, len(rows), 2000):
                conn.execute(replicas_t.insert(), rows[i : i + 2000])
            for i in range(0, len(nodes), 1000):
                conn.execute(nodes_t.insert(), nodes[i : i + 1000])

    def beat(self, which: range | list[int], avail_gb: float = 120) -> None:
        """Full heartbeats of nodes ``which`` (their reports as held), through the store's heartbeat path."""
        batch = [BeatWrite(self.ids[i], heartbeat(i, self.reports[self.ids[i]], avail_gb), self.now) for i in which]
        for j in range(0, len(batch), 200):
            self.store.write_heartbeats(batch[j : j + 200])

    def pulse_all(self) -> None:
        """Every node alive at ``now`` (what the agents' pulses keep true): one bulk write, not timed."""
        with self.store.engine.begin() as conn:
            conn.execute(sa.text("UPDATE nodes SET last_seen = :t"), {"t": self.now})


def timed(trips: Trips, kind: Kind, fn: Callable[[], object]) -> None:
    tx, st = trips.tx, trips.stmts
    t = time.perf_counter()
    fn()
    kind.times.append(time.perf_counter() - t)
    kind.tx.append(trips.tx - tx)
    kind.stmts.append(trips.stmts - st)


#: Whether this tree's leader has dirty passes (the bench runs on the tree before them too).
DIRTY = "dirty" in inspect.signature(leading.Leader.reconcile_once).parameters


def one_pass(leader: leading.Leader, now: float, *, dirty: bool) -> leading.PassResult:
    """What a pass does off the event loop, as :meth:`Leader.run` does it (no engine is silent, so
    no probe is sent): a dirty one when ``dirty`` and the tree has them."""
    leader.refresh_facts(now)
    if not DIRTY:
        probing.suspects(leader.store, lambda n: leader.silent(n, now))
        return leader.reconcile_once(now)
    leader.suspects(now, dirty=dirty)
    return leader.reconcile_once(now, dirty=dirty)


def run_size(url: str, n: int, rounds: int) -> dict[str, Kind]:
    store = SqlStore.open(url)
    trips = Trips()
    kinds = {"full": Kind(), "steady": Kind(), "burst": Kind()}
    try:
        c = Cluster(store, n)
        t = time.perf_counter()
        c.fill()
        print(f"N={n}: {n} nodes, {n * PER_NODE} replicas, {n * PER_NODE // PER_MODEL} models stored in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        trips.attach(store.engine)
        leader = leading.Leader(store, node_lost_after_s=30, read_facts=lambda _s: (_ for _ in ()).throw(
            AssertionError("every profile gives min_memory_gb")))
        res = one_pass(leader, c.now, dirty=False)  # the first pass of a leader
        if res.created or res.removed or res.lost:
            raise AssertionError(f"a steady cluster's first pass changed it: {res}")
        for _ in range(rounds):
            c.now += 2
            c.pulse_all()
            timed(trips, kinds["full"], lambda: one_pass(leader, c.now, dirty=False))
        for r in range(rounds):
            c.now += 2
            c.pulse_all()
            picked = [(r * 7 + j * 131) % n for j in range(5)]
            c.beat(picked, avail_gb=100 + r)
            if r % 5 == 0:
                node = c.ids[(r * 17) % n]
                first = c.reports[node][0]
                c.reports[node][0] = first.model_copy(update={"state": ReplicaState.FAILED, "err": "crashed"})
                c.beat([(r * 17) % n])
                c.reports[node][0] = first
            timed(trips, kinds["steady"], lambda: one_pass(leader, c.now, dirty=True))
        for b in range(BURST):
            store.add_model(model(b, 1, prefix="burst"), now=c.now)
        placed = 0
        for _ in range(20):
            c.now += 2
            c.pulse_all()
            got: list[leading.PassResult] = []
            timed(trips, kinds["burst"], partial(lambda out: out.append(one_pass(leader, c.now, dirty=True)), got))
            placed += sum(1 for r in got[0].created if r.startswith("burst"))
            if placed >= BURST:
                break
        if placed < BURST:
            print(f"  burst: only {placed} of {BURST} placed after 20 passes", flush=True)
    finally:
        store.close()
    return kinds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="500,2000,5000")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="full and steady passes per size")
    p.add_argument("--pg", default="", help="a PostgreSQL URL to run on instead of SQLite (emptied first)")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    figures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            url = args.pg or f"sqlite:///{Path(tmp) / f'n{n}.db'}"
            if args.pg:
                reset_pg(url)
            kinds = run_size(url, n, args.rounds)
            how = "dirty passes" if DIRTY else "before: every pass full"
            print(f"N={n} ({'postgresql' if args.pg else 'sqlite'}, {how}), "
                  f"load {os.getloadavg()[0]:.1f}:")
            for name, k in kinds.items():
                print(k.line(name), flush=True)
            moving = kinds["steady"].times + kinds["burst"].times
            figures += [f"full_pass_p99_s_{n}: {pct(kinds['full'].times, 99):.3f}",
                        f"full_pass_tx_{n}: {statistics.median(kinds['full'].tx):.0f}",
                        f"steady_pass_p50_s_{n}: {pct(kinds['steady'].times, 50):.3f}",
                        f"steady_pass_tx_{n}: {statistics.median(kinds['steady'].tx):.0f}",
                        f"burst_pass_p99_s_{n}: {pct(kinds['burst'].times, 99):.3f}",
                        f"pass_p99_s_{n}: {pct(moving, 99):.3f}"]
            if n == max(sizes):
                figures.append(f"leader_pass_p99_s: {pct(moving, 99):.3f}")
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("\n".join(figures))
    return 0


def reset_pg(url: str) -> None:
    """Drop every table of the database at ``url`` (a scratch database for the bench)."""
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
