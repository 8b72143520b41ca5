"""Engine logs through the agent: the broker's queue (in memory, and through a real store shared by
two brokers as two control planes share it) and the agent's reading of the file."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw.agent.node import logs
from llmgw.control.api.logbroker import LogBroker
from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.errors import UnreachableError
from llmgw.protocol import LogReply, LogRequest


async def test_a_read_rides_the_next_heartbeat_and_is_answered() -> None:
    broker = LogBroker()
    task = asyncio.create_task(broker.read("node-a", "r1", lines=5, timeout_s=5))
    await asyncio.sleep(0)
    assert broker.take("node-b") == []
    (req,) = broker.take("node-a")
    assert (req.replica_id, req.lines, req.offset) == ("r1", 5, None)
    assert broker.take("node-a") == []  # handed out once
    assert not await broker.answer("node-b", LogReply(id=req.id, replica_id="r1", text="x"))  # not its request
    assert await broker.answer("node-a", LogReply(id=req.id, replica_id="r1", text="hello\n", offset=6))
    got = await task
    assert (got.text, got.offset) == ("hello\n", 6)
    assert broker.waiting == {}


async def test_a_silent_node_is_named() -> None:
    broker = LogBroker()
    with pytest.raises(UnreachableError, match=r"node node-a did not send replica r1's log within 0 s"):
        await broker.read("node-a", "r1", timeout_s=0.05)
    assert broker.take("node-a") == []
    assert broker.waiting == {}



@pytest.fixture
async def pool() -> AsyncIterator[OffLoop]:
    db = OffLoop(workers=2)
    yield db
    db.close()


async def test_a_read_asked_on_one_broker_is_answered_through_another(store: Store, pool: OffLoop) -> None:
    """Two brokers on one store are two control planes: B asks, the node beats to A, whose heartbeat
    hands the request out and whose /agent/v1/logs stores the answer; B finds it by polling."""
    a, b = LogBroker(store=store, db=pool, poll_s=0.05), LogBroker(store=store, db=pool, poll_s=0.05)
    assert await pool.run(a.take_stored, "node-a", 1.0) == []  # nothing queued: no store call either
    stop = asyncio.Event()
    watching = asyncio.create_task(a.watch(stop))  # A learns which nodes have requests queued
    task = asyncio.create_task(b.read("node-a", "r1", lines=7, offset=None, timeout_s=5))
    (req,) = await handed_out(a, "node-a")
    stop.set()
    await asyncio.wait_for(watching, 2)
    assert (req.replica_id, req.lines, req.offset) == ("r1", 7, None)
    assert a.take("node-a") == []  # nothing queued in memory in store mode
    assert b.take("node-a") == []
    assert not await a.answer("node-b", LogReply(id=req.id, replica_id="r1", text="x"))  # not its request
    assert await a.answer("node-a", LogReply(id=req.id, replica_id="r1", text="tail\n", offset=5))
    got = await task
    assert (got.id, got.text, got.offset, got.found) == (req.id, "tail\n", 5, True)
    assert b.waiting == {}
    assert store.pop_log_answer(req.id) is None  # the row went once read
    assert not await a.answer("node-a", LogReply(id=req.id, replica_id="r1", text="again"))


async def test_a_read_answered_to_the_control_plane_that_asked_skips_the_row(store: Store, pool: OffLoop) -> None:
    b = LogBroker(store=store, db=pool, poll_s=10)  # no poll during the test: the future answers
    task = asyncio.create_task(b.read("node-a", "r1", timeout_s=5))
    (req,) = await handed_out(b, "node-a")
    assert await b.answer("node-a", LogReply(id=req.id, replica_id="r1", text="local\n", offset=6))
    assert (await asyncio.wait_for(task, 2)).text == "local\n"
    await b.idle()
    assert not store.answer_log_request("node-a", LogReply(id=req.id, replica_id="r1"), now=0.0)  # row gone


async def test_a_silent_node_is_named_and_its_stored_request_forgotten(store: Store, pool: OffLoop) -> None:
    b = LogBroker(store=store, db=pool, poll_s=0.02)
    with pytest.raises(UnreachableError, match=r"node node-a did not send replica r1's log within 0 s"):
        await b.read("node-a", "r1", timeout_s=0.1)
    await b.idle()
    assert b.waiting == {}
    assert store.take_log_requests("node-a", now=0.0) == []  # nobody hands out a request given up


async def test_watch_returns_at_once_in_memory_mode() -> None:
    await asyncio.wait_for(LogBroker().watch(asyncio.Event()), 1)


def test_store_mode_needs_a_pool(store: Store) -> None:
    with pytest.raises(ValueError, match="needs db=OffLoop"):
        LogBroker(store=store)


async def handed_out(broker: LogBroker, node: str) -> list[LogRequest]:
    """Poll ``broker``'s store the way a heartbeat does until requests for ``node`` are handed out."""
    assert broker.db is not None
    for _ in range(200):
        got = await broker.db.run(broker.take_stored, node, 1.0)
        if got:
            return got
        await asyncio.sleep(0.01)
    raise AssertionError(f"no log request for {node} reached the store within 2 s")


def test_the_agent_reads_a_tail_then_what_follows(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    text, offset, found = logs.answer(log, lines=3, offset=None)
    assert (text, found) == ("line 7\nline 8\nline 9\n", True)
    assert offset == log.stat().st_size
    with log.open("a") as f:
        f.write("line 10\n")
    assert logs.answer(log, lines=3, offset=offset) == ("line 10\n", offset + 8, True)
    log.write_text("rotated\n")  # copy-truncate made it shorter than the offset: read from the start
    assert logs.answer(log, lines=3, offset=offset) == ("rotated\n", 8, True)
    assert logs.answer(tmp_path / "none.log", lines=3, offset=None) == ("", 0, False)
