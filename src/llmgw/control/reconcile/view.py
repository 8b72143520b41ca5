"""The leader's copy of the cluster between passes, so a pass costs what changed, not the cluster.

A **full pass** (the leader's first, then every :data:`RESYNC_S`) reads every node, model, replica
and GGUF fact into a :class:`View` (:meth:`View.read`: four store trips) and visits every model.
A **dirty pass** reads only what the store's marks name (``changes``, migration 12: a full
heartbeat marks its node; a model added, updated or deleted, a node cordoned, drained or removed,
a replica restarted mark theirs, on whichever control plane the write landed) and the nodes gone
silent (one query the database answers), in one transaction
(:meth:`~llmgw.control.store.base.Store.read_dirty`), and folds them into the view
(:meth:`View.apply`). It then visits only the models that may need work: those marked, those that
lost a replica this pass, those below or above their wanted count or draining, and every
autoscaled one (:meth:`View.visits`).

The :class:`~llmgw.control.placement.placer.Placer` is kept with the view: each pass applies the
node rows that moved (only what the fits read: :meth:`Placer.update_node`) and the reservations of
the replicas that changed or went (:meth:`Placer.release`, :meth:`Placer.hold`) instead of
building it over every node again; a node whose filters' fields moved (lost, cordoned, new labels
or engines), a node added or removed, builds a new one. Changes are applied when a pass needs
the placer, so passes that place nothing touch it not at all.

**Rolling re-reads.** Each dirty pass also reads again a part of the rows the view holds (:class:`Roll`):
the nodes and models whose id falls in the parts of :data:`ROLL_PARTS` due since the last pass, one
part every :data:`ROLL_S` / :data:`ROLL_PARTS` seconds, with their replicas (the same
:meth:`~llmgw.control.store.base.Store.read_dirty`, asked for those ids). So every node, model and
replica the view holds is read again within :data:`ROLL_S`, and every model is visited (its
explanation's verdicts for other nodes made fresh) within it, in parts of a thirtieth: the
once-a-minute full pass this replaced was the heartbeat tail at 5,000 nodes (its full read and
pass, 0.3-0.7 s of the GIL on a worker thread, every 60 s: docs/install.md, "where the remaining
tail sits").

Why re-read at all: the marks are written in the same transaction as the change, so none is lost
while the store works; the re-reads bound what could still drift (a write path that forgot to mark,
an explanation whose other nodes' verdicts moved: a model not visited keeps the explanation of the
last pass that visited it) to :data:`ROLL_S`. What a part cannot find is a row the view does not
hold and no mark names (a node or model inserted by a path that marks nothing): a **full pass**
every :data:`RESYNC_S` reads every row for that. A new leader (another control plane taking over, a
restart) starts with a full pass; a pass that raised drops the view, so the next one is full.

What it does not guarantee: a row changed by a path that marks nothing is seen within
:data:`ROLL_S` (a new one within :data:`RESYNC_S`); an explanation's verdicts for other nodes may be
up to :data:`ROLL_S` old.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from llmgw.catalog import Model
from llmgw.control.placement.checks import NodeInfo, Reservation
from llmgw.control.placement.inputs import node_info, reservations
from llmgw.control.placement.placer import Placer
from llmgw.control.store import ModelRow, NodeRow, ReplicaRow, Store
from llmgw.control.store.rows import DirtyRead

#: Seconds within which a dirty pass has read again every node and model the view holds, with their
#: replicas, and visited every model (module docstring: the full pass's old period).
ROLL_S = 60.0

#: The parts those rows are read in: one part every ``ROLL_S / ROLL_PARTS`` = 2 s, a timed pass's
#: interval (``leader.DEFAULT_INTERVAL_S``), so each timed pass reads about a thirtieth.
ROLL_PARTS = 30

#: Seconds between full passes: only a row the view does not hold and no mark names waits for one
#: (module docstring).
RESYNC_S = 600.0


@dataclass
class View:
    """The leader's copy of the store between passes (module docstring).

    Attributes:
        nodes, models, replicas: the rows by id or name, as last read or written by the leader.
        facts: the GGUF facts by source (``(body, error, updated_at)``, as the store lists them).
        full_at: when the last full read was (the leader's clock, unix seconds).
        placer: the placer kept between passes, None until a pass needs one.
        infos: the nodes as ``placer`` counts them, by id.
        held: what ``placer`` counts for each replica, by replica id.
        pending_nodes, pending: nodes and replica ids changed since ``placer`` last caught up.
    """

    nodes: dict[str, NodeRow]
    models: dict[str, ModelRow]
    replicas: dict[str, ReplicaRow]
    facts: dict[str, tuple[str, str, float]]
    full_at: float
    placer: Placer | None = None
    infos: dict[str, NodeInfo] = field(default_factory=dict)
    held: dict[str, list[Reservation]] = field(default_factory=dict)
    pending_nodes: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, store: Store, now: float) -> View:
        """Every node, model, replica and GGUF fact (four store trips)."""
        return cls(
            {n.id: n for n in store.list_nodes()},
            {m.name: m for m in store.list_models()},
            {r.id: r for r in store.list_replicas()},
            store.list_gguf_facts(),
            now,
        )

    def apply(self, got: DirtyRead) -> None:
        """Fold a dirty read in: its nodes and models as stored now (gone ones dropped), and the
        replicas on those nodes or of those models as stored now (those no longer stored dropped)."""
        for nid, row in got.nodes.items():
            if row is None:
                self.nodes.pop(nid, None)
            else:
                self.nodes[nid] = row
        for name, mrow in got.models.items():
            if mrow is None:
                self.models.pop(name, None)
            else:
                self.models[name] = mrow
        fresh = {r.id: r for r in got.replicas}
        gone = [rid for rid, r in self.replicas.items()  # read again, and not there: deleted by someone else
                if (r.node in got.nodes or r.model in got.models or r.members) and rid not in fresh]
        for rid in gone:
            del self.replicas[rid]
        self.pending.update(gone)
        self.replicas.update(fresh)
        self.pending |= fresh.keys()
        self.pending_nodes |= got.nodes.keys()

    def visits(self, models: dict[str, Model], wanted: dict[str, int], marked: Collection[str],
               lost_replicas: Iterable[ReplicaRow]) -> set[str]:
        """The models a dirty pass reconciles: ``marked``, those of ``lost_replicas`` (removed this
        pass), every autoscaled one, and those whose serving replicas are not ``wanted`` or that
        have one draining."""
        out = {m for m in marked if m in models} | {r.model for r in lost_replicas if r.model in models}
        count: dict[str, int] = dict.fromkeys(models, 0)
        for r in self.replicas.values():
            if r.model not in count:
                continue
            if r.draining_since is not None:
                out.add(r.model)
            else:
                count[r.model] += 1
        out |= {k for k, m in models.items() if m.scaling.autoscaled or count[k] != wanted[k]}
        return out

    def placer_for(self, models: dict[str, Model]) -> Placer:
        """The placer over this view (``models``: the effective ones): the kept one caught up with
        what changed since, or a new one when it cannot be (module docstring)."""
        if self.placer is None or not self._catch_up(models):
            infos = {n.id: node_info(n) for n in self.nodes.values()}
            res = reservations(list(self.replicas.values()), models)
            held: dict[str, list[Reservation]] = {}
            for r in res:
                held.setdefault(r.replica, []).append(r)
            self.placer, self.infos, self.held = Placer(list(infos.values()), res), infos, held
        self.pending_nodes.clear()
        self.pending.clear()
        return self.placer

    def _catch_up(self, models: dict[str, Model]) -> bool:
        placer = self.placer
        if placer is None:
            return False
        for nid in self.pending_nodes:
            row = self.nodes.get(nid)
            if row is None or nid not in self.infos:
                if row is None and nid not in self.infos:
                    continue  # never counted, still gone
                return False  # a node added or removed
            info = node_info(row)
            if info != self.infos[nid]:
                if not placer.update_node(info):
                    return False
                self.infos[nid] = info
        for rid in self.pending | (self.held.keys() - self.replicas.keys()):
            r = self.replicas.get(rid)
            new = reservations([r], models) if r is not None else []
            old = self.held.get(rid, [])
            if new == old:
                continue
            placer.release([(x.node, rid) for x in old])
            placer.hold(new)
            if new:
                self.held[rid] = new
            else:
                self.held.pop(rid, None)
        return True

    def placed(self, replica: str, held: list[Reservation]) -> None:
        """The leader placed ``replica`` and its placer counts ``held`` for it."""
        self.held[replica] = held

    def touch_models(self, names: Collection[str]) -> None:
        """The reservations of these models' replicas may have changed (their GGUF facts did)."""
        self.pending |= {r.id for r in self.replicas.values() if r.model in names}


@dataclass
class Roll:
    """Which rows of the view a dirty pass reads again (module docstring, "Rolling re-reads").

    Time is cut in slots of ``roll_s / parts`` seconds; slot ``k`` is part ``k % parts``, and a
    row's part is the CRC-32 of its id modulo ``parts`` (stable across passes and control planes).
    A pass reads the parts of every slot since the last pass's, all of them when ``parts`` slots or
    more went by. Passes closer than a slot (a burst's wakes) read none: the work per minute does not
    grow with the number of passes.

    Attributes:
        roll_s: seconds within which every row is read again (:data:`ROLL_S`).
        parts: :data:`ROLL_PARTS`.
        slot: the last slot read (None: none yet; :meth:`start` sets it at a full pass).
    """

    roll_s: float = ROLL_S
    parts: int = ROLL_PARTS
    slot: int | None = None
    _parts: dict[str, int] = field(default_factory=dict, repr=False)

    def start(self, now: float) -> None:
        """A full pass read everything at ``now`` (unix seconds): the next parts are those after it."""
        self.slot = self._slot(now)
        self._parts.clear()

    def due(self, view: View, now: float) -> tuple[list[str], list[str]]:
        """The node ids and model names of ``view`` to read again at ``now``, and take them as read."""
        slot, last = self._slot(now), self.slot
        if last is None:
            self.slot = slot
            return [], []
        if slot <= last:  # within the last pass's slot (or the clock stepped back): nothing new
            return [], []
        self.slot = slot
        if slot - last >= self.parts:
            return list(view.nodes), list(view.models)
        want = {k % self.parts for k in range(last + 1, slot + 1)}
        return ([k for k in view.nodes if self.part(k) in want],
                [k for k in view.models if self.part(k) in want])

    def part(self, key: str) -> int:
        """The part ``key`` (a node id or model name) is read in: 0 to ``parts - 1`` (kept per key
        until the next full pass: 5,000 CRCs were 4 ms a pass)."""
        got = self._parts.get(key)
        if got is None:
            got = self._parts[key] = zlib.crc32(key.encode()) % self.parts
        return got

    def _slot(self, now: float) -> int:
        return int(now // (self.roll_s / self.parts))
