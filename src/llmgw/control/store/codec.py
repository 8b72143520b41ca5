"""Rows to columns and back: how the store's rows are written into the tables' columns.

JSON columns (labels, inventory, engines, reported replicas, GPU indexes) are written compact with
sorted keys so that an unchanged value is an unchanged string. No database.

A ``replicas`` row read again with the same column values gives the same :class:`ReplicaRow`
object (:class:`ParsedRows`): the routing table's refresh, the autoscaler's tick and the leader
read every replica, up to several times a second while models are added, and parsing each row
again was most of their cost (400 replicas: 29 ms a listing on the 2-core machine at load 4, 2 ms
with the rows kept; py-spy on a control plane of 500 simulated nodes during 200 model adds: a
third of the process's GIL time in the routing refresh, most of it parsing rows, while heartbeats
waited for the GIL). Rows are frozen dataclasses: the one object handed to several readers is
never written to.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any, Generic, TypeVar

import sqlalchemy as sa
from pydantic import ValidationError

from llmgw.control.store.rows import NodeRow, PlacementSummary, ReplicaRow
from llmgw.protocol import EngineStatus, GroupMember, Heartbeat, Inventory, ReplicaStatus, state_digest

R = TypeVar("R")


def dumps(value: Any) -> str:
    """``value`` as compact JSON with sorted keys."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def heartbeat_values(hb: Heartbeat, now: float, digest: str = "") -> dict[str, Any]:
    """The ``nodes`` columns a heartbeat sets; ``digest``: its :func:`~llmgw.protocol.state_digest`
    when the caller computed it already (else computed here)."""
    return {
        "digest": digest or state_digest(hb),
        "state": "ready",
        "labels": dumps(hb.labels),
        "inventory": hb.inventory.model_dump_json(),
        "engines": dumps([e.model_dump(mode="json") for e in hb.engines]),
        "replicas": dumps([r.model_dump(mode="json") for r in hb.replicas]),
        "last_seen": now,
        "instance": hb.instance,
        "cached": dumps(sorted(hb.cached)),
    }


def explanation_summary(body: str) -> PlacementSummary:
    """A stored explanation's ``summary`` and ``placed`` (its JSON body's)."""
    view = json.loads(body)
    return PlacementSummary(str(view.get("summary", "")), bool(view.get("placed", False)))


def first_problems(err: ValidationError) -> str:
    """``profiles.0.min_memory_gb: Input should be a valid number`` (at most three problems)."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(spec)'}: {e['msg']}" for e in err.errors()[:3]
    )


def from_columns(cls: Callable[..., R], row: sa.Row[Any], **decoded: Any) -> R:
    """A row dataclass ``cls`` from a table row whose columns are named as its fields (every table
    the store reads whole: ``nodes``, ``replicas``, ``api_keys``); ``decoded``: the columns stored
    otherwise than the field holds them (JSON, SQLite's integer for a bool), already converted.

    Raises:
        TypeError: the row has a column ``cls`` has no field for, or lacks one it needs.
    """
    return cls(**{**row._mapping, **decoded})


def node_row(row: sa.Row[Any]) -> NodeRow:
    """A ``nodes`` row as a :class:`NodeRow`. Its JSON columns are parsed once per node while their
    text stays the same (:data:`_NODE_STATES`: a pulse moves ``last_seen``, not them): the leader's
    full read of 5,000 nodes parsed 20,000 JSON texts and 10,000 pydantic models, 0.32 s of the GIL
    once a minute. The containers are the row's own; the pydantic objects in them are shared, and
    nothing writes to those (changes go through ``model_copy`` and a store write)."""
    text = "\x00".join((row.labels, row.inventory, row.engines, row.replicas, row.cached))
    labels, inventory, engines, replicas, cached = _NODE_STATES.get(row.id, text, lambda _: _node_state(row))
    return from_columns(
        NodeRow,
        row,
        cordoned=bool(row.cordoned),
        labels=dict(labels),
        inventory=inventory,
        engines=list(engines),
        replicas=list(replicas),
        cached=list(cached),
    )


_NodeState = tuple[dict[str, str], Inventory, list[EngineStatus], list[ReplicaStatus], list[str]]


def _node_state(row: sa.Row[Any]) -> _NodeState:
    return (
        json.loads(row.labels),
        Inventory.model_validate_json(row.inventory),
        [EngineStatus.model_validate(e) for e in json.loads(row.engines)],
        [ReplicaStatus.model_validate(r) for r in json.loads(row.replicas)],
        json.loads(row.cached),
    )


def keep_node_states(ids: AbstractSet[str]) -> None:
    """Forget the parsed state of every node but ``ids`` (after a listing of every node)."""
    _NODE_STATES.keep(ids)


ROWS_PER_GENERATION = 32_768
"""Rows :class:`ParsedRows` keeps per generation (two generations: at most twice this many). Above
the replicas one listing returns (20,000 at the largest cluster the benches model), so a steady
cluster's listings always hit; a ``ReplicaRow`` and its key take ~1.5 KB, so ~100 MB at most."""


class ParsedRows:
    """Rows already parsed, by their column values (all of them: a row written again, its revision
    bumped, is a new key; nothing is ever stale).

    Two generations: a lookup looks in the young one, then in the old one (moving the row to the
    young one); when the young one holds ``per_generation`` rows it becomes the old one and the
    previous old one is dropped, so the rows still read stay and rows no longer read go within two
    generations. Thread-safe: the store's threads share it (a race at a swap parses a row twice)."""

    def __init__(self, per_generation: int = ROWS_PER_GENERATION) -> None:
        self.per_generation = per_generation
        self._young: dict[tuple[Any, ...], ReplicaRow] = {}
        self._old: dict[tuple[Any, ...], ReplicaRow] = {}
        self._lock = threading.Lock()

    def replica(self, row: sa.Row[Any]) -> ReplicaRow:
        """``row`` as a :class:`ReplicaRow` (:func:`parse_replica`), the one parsed before when a
        row with the same values was."""
        key = tuple(row)
        hit = self._young.get(key)
        if hit is not None:
            return hit
        hit = self._old.get(key) or parse_replica(row)
        with self._lock:
            if len(self._young) >= self.per_generation:
                self._old, self._young = self._young, {}
            self._young[key] = hit
        return hit

    def __len__(self) -> int:
        return len(self._young) + len(self._old)


_REPLICAS = ParsedRows()

V = TypeVar("V")


class ParsedByName(Generic[V]):
    """One parsed value per name, kept while the name's stored text is the same (a model's spec,
    an explanation's body): :meth:`get` compares the text (one string comparison) instead of
    parsing it again. Readers share the value: nothing may write to it (nothing in llmgw writes to
    a Model read from the store: changes go through ``model_copy`` and a store write).

    Store calls run on several threads at once (:mod:`llmgw.control.store.offloop`), so :meth:`keep`
    filters a copy: iterating the dict itself while another thread's :meth:`get` added a name raised
    ``RuntimeError: dictionary changed size during iteration`` (an admin list answered 500 in CI's
    HA orphan test). A name added meanwhile may be dropped: it is parsed again at its next read."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[str, V]] = {}

    def get(self, name: str, text: str, parse: Callable[[str], V]) -> V:
        """``parse(text)``, or the value kept for ``name`` when it was parsed from this ``text``;
        ``parse``'s exception propagates (nothing is kept then)."""
        hit = self._kept.get(name)
        if hit is not None and hit[0] == text:
            return hit[1]
        value = parse(text)
        self._kept[name] = (text, value)
        return value

    def keep(self, names: AbstractSet[str]) -> None:
        """Forget every name but ``names`` (after a listing of all of them: the rest were deleted).
        A set (or a dict's keys): each kept name is looked up in it (5,000 names in a list: 197 ms)."""
        if len(self._kept) > len(names):
            kept = self._kept.copy()  # one C call: no other thread runs during it
            self._kept = {k: v for k, v in kept.items() if k in names}


_NODE_STATES: ParsedByName[_NodeState] = ParsedByName()
"""Each node's parsed JSON columns, by node id, while their text is the same (:func:`node_row`)."""


def replica_row(row: sa.Row[Any]) -> ReplicaRow:
    """A ``replicas`` row as a :class:`ReplicaRow`, parsed once per distinct row (:class:`ParsedRows`)."""
    return _REPLICAS.replica(row)


def parse_replica(row: sa.Row[Any]) -> ReplicaRow:
    """A ``replicas`` row as a new :class:`ReplicaRow` (~30 µs: 18 columns, two JSON ones)."""
    return from_columns(
        ReplicaRow,
        row,
        gpu_indexes=tuple(json.loads(row.gpu_indexes)),
        members=tuple(GroupMember.model_validate(m) for m in json.loads(row.members)),
    )


def replica_values(r: ReplicaRow) -> dict[str, Any]:
    """The ``replicas`` columns of ``r``."""
    return {
        "id": r.id,
        "model": r.model,
        "node": r.node,
        "profile": r.profile,
        "key": r.key,
        "state": r.state,
        "err": r.err,
        "endpoint": r.endpoint,
        "revision": r.revision,
        "created_at": r.created_at,
        "updated_at": r.updated_at,
        "ready_at": r.ready_at,
        "restarts": r.restarts,
        "gpu_indexes": dumps(list(r.gpu_indexes)),
        "last_error": r.last_error,
        "spec_hash": r.spec_hash,
        "members": dumps([m.model_dump(mode="json") for m in r.members]),
        "draining_since": r.draining_since,
    }
