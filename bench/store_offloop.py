"""Store calls off the event loop: a bounded thread pool against SQLAlchemy's asyncio API,
the choice made by measurement (the figures below).

The same heartbeat-shaped work both ways, ``OPS`` times with ``CONCURRENCY`` in flight, on one
SQLite WAL file with 200 nodes: read the node row and parse it (``NodeRow``), write the heartbeat's
columns, read it back. Measured: throughput, and the lag of a probe on the event loop (a 5 ms sleep
that wakes late by this much) -- what a heartbeat or a gateway request would wait.

1. ``pool``: :class:`llmgw.control.store.offloop.OffLoop` running the synchronous
   :class:`~llmgw.control.store.Store` methods (query, row parsing and all) on its threads;
2. ``asyncio``: ``sqlalchemy.ext.asyncio`` with ``aiosqlite``, the same Core statements awaited
   on the loop and the rows parsed there (skipped when aiosqlite or greenlet is not installed:
   they are not llmgw dependencies; ``pip install aiosqlite greenlet``).

Figures last, one ``name: value unit`` per line.

    .venv/bin/python bench/store_offloop.py
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import sqlalchemy as sa

from llmgw.control.store import open_store
from llmgw.control.store.codec import heartbeat_values, node_row
from llmgw.control.store.offloop import OffLoop
from llmgw.control.store.schema import nodes_t
from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ProvisionState

OPS = 2000
CONCURRENCY = 8
NODES = 200
GB = 1_000_000_000

HB = Heartbeat(
    inventory=Inventory(cores=8, memory_total_bytes=32 * GB, memory_available_bytes=30 * GB),
    labels={"zone": "a"},
    engines=[EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")],
    instance="bench",
)


async def measure(op: Callable[[int], Awaitable[object]]) -> tuple[float, float, float]:
    """(ops per second, loop lag p50 ms, loop lag p99 ms) for OPS calls of ``op``."""
    lags: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append((time.perf_counter() - t - 0.005) * 1000)

    async def worker(k: int) -> None:
        for i in range(k, OPS, CONCURRENCY):
            await op(i)

    p = asyncio.create_task(probe())
    t = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(CONCURRENCY)))
    wall = time.perf_counter() - t
    done.set()
    await p
    lags.sort()
    return OPS / wall, statistics.median(lags), lags[int(0.99 * len(lags))]


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llmgw.db"
        store = open_store(f"sqlite:///{path}")
        for i in range(NODES):
            store.upsert_node_heartbeat(f"node-{i:03d}", HB, time.time())
        db = OffLoop()

        async def pool_op(i: int) -> object:
            node = f"node-{i % NODES:03d}"
            await db.run(store.get_node, node)
            return await db.run(store.upsert_node_heartbeat, node, HB, time.time())

        pool = await measure(pool_op)
        db.close()
        store.close()

        results = {"pool": pool}
        try:
            import aiosqlite  # noqa: F401, PLC0415 - only to know it is there
            from sqlalchemy.ext.asyncio import create_async_engine  # noqa: PLC0415
        except ImportError as e:
            print(f"asyncio variant skipped: {e}")
        else:
            engine = create_async_engine(f"sqlite+aiosqlite:///{path}")

            async def async_op(i: int) -> object:
                node = f"node-{i % NODES:03d}"
                values = heartbeat_values(HB, time.time())
                async with engine.connect() as conn:
                    row = (await conn.execute(sa.select(nodes_t).where(nodes_t.c.id == node))).first()
                    assert row is not None
                    node_row(row)
                async with engine.begin() as conn:
                    await conn.execute(
                        nodes_t.update()
                        .where(nodes_t.c.id == node, nodes_t.c.revision == row.revision)
                        .values(revision=row.revision + 1, **values)
                    )
                async with engine.connect() as conn:
                    again = (await conn.execute(sa.select(nodes_t).where(nodes_t.c.id == node))).first()
                    assert again is not None
                    return node_row(again)

            results["asyncio"] = await measure(async_op)
            await engine.dispose()
    for name, (rate, p50, p99) in results.items():
        print(f"{name}_ops_per_s: {rate:.0f} ops/s")
        print(f"{name}_loop_lag_p50_ms: {p50:.2f} ms")
        print(f"{name}_loop_lag_p99_ms: {p99:.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())
