"""The store's leadership rows (migration 5) on both backends: the term, fenced writes, members."""

from __future__ import annotations

import pytest

from llmgw.control.store import Store
from llmgw.control.store.rows import ControlPlaneRow
from llmgw.errors import Fenced
from llmgw.views import ExplainView


def test_terms_grow_and_name_their_holder(store: Store) -> None:
    assert store.leader().term == 0
    assert store.take_term("cp1", now=10.0) == 1
    assert store.take_term("cp2", now=11.0) == 2
    row = store.leader()
    assert (row.term, row.holder, row.since, row.renewed_at) == (2, "cp2", 11.0, 11.0)


def test_a_fenced_store_writes_only_in_its_term_and_a_refused_write_leaves_nothing(store: Store) -> None:
    term = store.take_term("cp1", now=1.0)
    store.fenced(term).set_explanation(ExplainView(model="m", placed=True, summary="first"), now=2.0)
    stale = store.fenced(term)
    store.take_term("cp2", now=3.0)
    with pytest.raises(Fenced, match=rf"term {term}\) has ended: the database's term is {term + 1}"):
        stale.set_explanation(ExplainView(model="m", placed=False, summary="stale"), now=4.0)
    got = store.get_explanation("m")
    assert got is not None
    assert got.summary == "first"
    assert stale.get_explanation("m") == got  # reads are not fenced


def test_control_planes_are_upserted_by_name(store: Store) -> None:
    store.upsert_control_plane(ControlPlaneRow("cp2", "https://b:7443", 5.0, 1.0, "0.1.0"))
    store.upsert_control_plane(ControlPlaneRow("cp1", "https://a:7443", 5.0, 1.0, "0.1.0"))
    store.upsert_control_plane(ControlPlaneRow("cp2", "https://b:7443", 7.0, 1.0, "0.1.0"))
    assert store.list_control_planes() == [
        ControlPlaneRow("cp1", "https://a:7443", 5.0, 1.0, "0.1.0"),
        ControlPlaneRow("cp2", "https://b:7443", 7.0, 1.0, "0.1.0"),
    ]
