"""The store's cache of parsed models (:class:`llmgw.control.store.codec.ParsedByName`) under the
threads that store calls run on: real threads, a switch interval short enough that they interleave
inside one call."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest

from llmgw.control.store.codec import ParsedByName


@pytest.fixture
def fine_switching() -> Iterator[None]:
    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(was)


def test_keep_while_another_thread_reads_new_names_does_not_fail(fine_switching: None) -> None:
    """Before the fix this raised ``dictionary changed size during iteration`` within ~0.1 s."""
    parsed: ParsedByName[str] = ParsedByName()
    until = time.monotonic() + 1.5
    errors: list[BaseException] = []

    def reader() -> None:
        i = 0
        while time.monotonic() < until:
            assert parsed.get(f"m{i % 5000}", "spec", str.upper) == "SPEC"
            i += 1

    def lister() -> None:
        while time.monotonic() < until:
            try:
                parsed.keep({f"m{k}" for k in range(10)})
            except RuntimeError as e:
                errors.append(e)
                return

    threads = [threading.Thread(target=reader), threading.Thread(target=lister)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    parsed.keep({"m1"})
    assert parsed.get("m1", "spec", lambda _: "parsed again") == "SPEC"  # kept: the same text
