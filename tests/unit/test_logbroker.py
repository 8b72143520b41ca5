"""Engine logs through the agent: the broker's queue and the agent's reading of the file."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from llmgw.agent import logs
from llmgw.control.api.logbroker import LogBroker
from llmgw.errors import UnreachableError
from llmgw.protocol import LogReply


async def test_a_read_rides_the_next_heartbeat_and_is_answered() -> None:
    broker = LogBroker()
    task = asyncio.create_task(broker.read("node-a", "r1", lines=5, timeout_s=5))
    await asyncio.sleep(0)
    assert broker.take("node-b") == []
    (req,) = broker.take("node-a")
    assert (req.replica_id, req.lines, req.offset) == ("r1", 5, None)
    assert broker.take("node-a") == []  # handed out once
    assert not broker.answer("node-b", LogReply(id=req.id, replica_id="r1", text="x"))  # not its request
    assert broker.answer("node-a", LogReply(id=req.id, replica_id="r1", text="hello\n", offset=6))
    got = await task
    assert (got.text, got.offset) == ("hello\n", 6)
    assert broker.waiting == {}


async def test_a_silent_node_is_named() -> None:
    broker = LogBroker()
    with pytest.raises(UnreachableError, match=r"node node-a did not send replica r1's log within 0 s"):
        await broker.read("node-a", "r1", timeout_s=0.05)
    assert broker.take("node-a") == []
    assert broker.waiting == {}


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
