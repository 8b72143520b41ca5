"""A heartbeat's store work at cluster size: the CPU of one pulse's read and one pulse's write.

A SQLite store (a file, WAL, as ``llmgw server run`` opens it) is filled as bench/leader_pass.py
fills it (N nodes, 4 ready replicas each: 20,000 replicas at N = 5,000), every node ``ready`` with
a stored digest. Then, for random nodes, in this one process (no event loop, no TLS: the store's
part alone):

* ``read``: :func:`llmgw.control.api.beatside.read_side` for a pulse (the certificate's verdict, the
  node's liveness, its replicas and their models, the reply's desired list and digest);
* ``write``: :meth:`~llmgw.control.store.base.Store.write_heartbeats` of one pulse (a batch of one:
  the revocation check and the conditional ``last_seen`` update, one transaction).

Each is run ``--n`` times after 50 not counted; CPU per call from ``getrusage`` (µs). Figures last,
``name: value``, labelled with N. What it found (2026-12-06): at N = 5,000 a pulse's read took
3.8 ms of CPU, 3.0 of them scanning every replica for the node's group replicas (fixed by migration
15's partial index); then 1,120-1,134 µs of read and 403-406 µs of write, of which building the
statements (SQLAlchemy expressions and their cache keys, at every call) was about half: built once
with bound parameters (control/store/sqlbeats.py), 585-646 µs and 128-132 µs.

    .venv/bin/python bench/beat_store.py [--sizes 100,5000] [--n 1000]
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from leader_pass import Cluster  # noqa: E402

from llmgw.control.api.beatside import read_side  # noqa: E402
from llmgw.control.store import SqlStore  # noqa: E402
from llmgw.control.store.rows import BeatWrite  # noqa: E402

SERIAL = "5EED"
DIGEST = "d" * 16


def cpu_s() -> float:
    """This process's user + system CPU seconds."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def per_call_us(fn: Callable[[int], object], n: int, nodes: int, rng: random.Random) -> float:
    """CPU µs per call of ``fn(node index)`` over ``n`` calls on random nodes (after 50 not counted)."""
    for _ in range(50):
        fn(rng.randrange(nodes))
    c0 = cpu_s()
    for _ in range(n):
        fn(rng.randrange(nodes))
    return (cpu_s() - c0) / n * 1e6


def run_size(n_nodes: int, n: int) -> dict[str, float]:
    """The figures at ``n_nodes`` nodes."""
    with tempfile.TemporaryDirectory() as tmp:
        store = SqlStore.open(f"sqlite:///{tmp}/llmgw.db")
        try:
            c = Cluster(store, n_nodes)
            c.fill()
            with store.engine.begin() as conn:  # every node ready, its last full beat's digest stored
                conn.execute(sa.text("UPDATE nodes SET state = 'ready', digest = :d, last_seen = :t"),
                             {"d": DIGEST, "t": c.now})
            rng = random.Random(1)
            read = per_call_us(lambda i: read_side(store, c.ids[i], SERIAL, c.now - 86400, pulse=True), n, n_nodes, rng)
            write = per_call_us(
                lambda i: store.write_heartbeats([BeatWrite(c.ids[i], None, c.now + 1, SERIAL, c.now - 86400,
                                                            digest=DIGEST)]), n, n_nodes, rng)
        finally:
            store.close()
    return {"pulse_read_cpu_us": read, "pulse_write_cpu_us": write, "replicas": float(n_nodes * 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--sizes", default="100,5000", help="node counts, comma-separated (default 100,5000)")
    ap.add_argument("--n", type=int, default=1000, help="calls measured per figure (default 1000)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    out: list[str] = []
    for size in sizes:
        t = time.perf_counter()
        figs = run_size(size, args.n)
        print(f"N = {size}: {int(figs['replicas'])} replicas, measured in {time.perf_counter() - t:.1f} s", flush=True)
        out += [f"{name}_{size}: {value:.0f}" for name, value in figs.items()]
    print("\n".join(out))


if __name__ == "__main__":
    main()
