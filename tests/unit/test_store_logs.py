"""The store's log-request rows (migration 6) on both backends: queue, hand out once, answer, pop,
expire. These carry ``ctl logs`` between the control planes of an HA cluster
(:mod:`llmgw.control.api.logbroker`)."""

from __future__ import annotations

import threading

import pytest

from llmgw.control.store import Store, open_store
from llmgw.errors import Conflict
from llmgw.protocol import LogReply, LogRequest


def test_a_request_is_handed_out_once_answered_and_popped(store: Store) -> None:
    store.add_log_request("node-a", LogRequest(id="q1", replica_id="r1", lines=5), now=10.0)
    store.add_log_request("node-a", LogRequest(id="q2", replica_id="r2", lines=1, offset=1234), now=11.0)
    store.add_log_request("node-b", LogRequest(id="q3", replica_id="r3"), now=11.5)
    assert store.pop_log_answer("q1") is None  # not answered yet: the row stays
    assert store.log_request_nodes() == {"node-a", "node-b"}
    got = store.take_log_requests("node-a", now=12.0)
    assert store.log_request_nodes() == {"node-b"}
    assert got == [LogRequest(id="q1", replica_id="r1", lines=5, offset=None),
                   LogRequest(id="q2", replica_id="r2", lines=1, offset=1234)]
    assert store.take_log_requests("node-a", now=13.0) == []  # handed out once
    assert not store.answer_log_request("node-b", LogReply(id="q1", replica_id="r1", text="x"), now=13.0)
    reply = LogReply(id="q1", replica_id="r1", text="line 1\nline 2\n", offset=14, found=True)
    assert store.answer_log_request("node-a", reply, now=13.0)
    assert not store.answer_log_request("node-a", reply, now=13.5)  # answered once
    assert store.pop_log_answer("q1") == reply
    assert store.pop_log_answer("q1") is None  # popped: the row is gone
    assert store.answer_log_request("node-a", LogReply(id="q2", replica_id="r2", found=False), now=14.0)
    assert store.pop_log_answer("q2") == LogReply(id="q2", replica_id="r2", text="", offset=0, found=False)
    assert store.take_log_requests("node-b", now=14.0) == [LogRequest(id="q3", replica_id="r3")]


def test_forgotten_and_old_requests_go(store: Store) -> None:
    store.add_log_request("node-a", LogRequest(id="old", replica_id="r1"), now=100.0)
    store.add_log_request("node-a", LogRequest(id="gone", replica_id="r1"), now=150.0)
    store.forget_log_request("gone")
    store.forget_log_request("never")  # nothing to delete: no error
    with pytest.raises(Conflict, match="log request 'old' already exists"):
        store.add_log_request("node-a", LogRequest(id="old", replica_id="r1"), now=150.0)
    # A new request deletes the rows older than keep_s (an asker that stopped mid-read).
    store.add_log_request("node-a", LogRequest(id="new", replica_id="r1"), now=161.0, keep_s=60.0)
    assert [r.id for r in store.take_log_requests("node-a", now=162.0)] == ["new"]
    assert not store.answer_log_request("node-a", LogReply(id="old", replica_id="r1"), now=162.0)


def test_two_control_planes_racing_for_a_node_s_requests_hand_each_out_once(store_url: str) -> None:
    """Two stores on one database (two control planes' connections), each taking the node's
    requests from its own thread: every request is handed out by exactly one."""
    one, two = open_store(store_url), open_store(store_url)
    try:
        for i in range(40):
            one.add_log_request("node-a", LogRequest(id=f"q{i:02d}", replica_id="r1"), now=float(i))
        got: dict[str, list[str]] = {"one": [], "two": []}
        start = threading.Barrier(2)

        def take(name: str, s: Store) -> None:
            start.wait()
            for _ in range(20):
                got[name] += [r.id for r in s.take_log_requests("node-a", now=100.0)]

        threads = [threading.Thread(target=take, args=(n, s)) for n, s in (("one", one), ("two", two))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(got["one"] + got["two"]) == [f"q{i:02d}" for i in range(40)]
    finally:
        one.close()
        two.close()
