"""Counted nouns and name lists for operators' sentences (:mod:`llmgw.words`)."""

from __future__ import annotations

from llmgw.words import counted, names, plural


def test_counted_nouns_agree() -> None:
    assert [counted(n, "core") for n in (0, 1, 2)] == ["0 cores", "1 core", "2 cores"]
    assert counted(1, "replica is", "replicas are") == "1 replica is"
    assert plural(3, "is", "are") == "are"


def test_names_read_as_a_sentence_and_stay_short() -> None:
    assert names([]) == ""
    assert names(["a"]) == "a"
    assert names(["a", "b"]) == "a and b"
    assert names(["a", "b", "c"]) == "a, b and c"
    assert names([f"n{i}" for i in range(7)]) == "n0, n1, n2 and 4 more"
