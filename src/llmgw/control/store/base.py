"""The store's contract: :class:`Store`, the interface every backend implements, and its errors.

Callers (the admin and agent APIs, the leader, the routing table, server init) depend on this
interface only; :class:`~llmgw.control.store.sql.SqlStore` is today's backend (SQLAlchemy Core over
SQLite or PostgreSQL, with the same schema and migrations). The model is kopf's storage ABC
with two backends: one abstract class whose docstrings are the contract, one module per backend.

Rules every backend keeps:

* **Optimistic concurrency.** Every row has a ``revision`` that starts at 1. Every update is
  conditional on the revision read (``UPDATE … WHERE <key>=? AND revision=?``) and bumps it; when
  no row matched, the row changed (or went) since it was read and :class:`Conflict` is raised.
  Callers re-read and decide again; no read-then-overwrite.
* **Uniqueness is the database's.** Model names and aliases (one table of every name a model
  answers to, with a primary key on the name), node ids, replica ids and certificate serials are
  primary keys; a write that would break one raises :class:`Conflict`, never a Python scan.
* **One bad row never hides the others.** A model row that no longer validates (written by an
  older version, or by hand) is skipped by :meth:`Store.list_models` and :meth:`Store.get_model`,
  logged once, and listed by :meth:`Store.list_broken_models` with the reason, so the admin API
  names it and ``ctl model rm`` deletes it; heartbeats, placement and the gateway go on with the
  rest. Its name stays taken until it is deleted.
* **Every method is one short transaction** and synchronous. The control plane calls them on a
  bounded thread pool, never on its event loop (:mod:`llmgw.control.store.offloop`, chosen over
  SQLAlchemy's asyncio API by measurement: see :mod:`llmgw.control.store`), and the gateway's hot
  path never reaches the store (it reads :class:`~llmgw.control.gateway.table.StoreRouter`'s memory).
* **Separate shapes.** The rows (:mod:`llmgw.control.store.rows`) are storage shapes; API views
  live in :mod:`llmgw.views`, wire shapes in :mod:`llmgw.protocol`.

Errors: :class:`Conflict` (HTTP 409 at the admin API), its subclass :class:`Revoked` (a heartbeat
with a revoked certificate), :class:`StoreError` (the database cannot be opened or migrated, with
the driver's error chained).
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from llmgw.catalog import Model
from llmgw.control.store.rows import (
    ApiKeyRow,
    BeatResult,
    BeatWrite,
    BrokenModel,
    ControlPlaneRow,
    DecisionRow,
    DirtyRead,
    GatewayLoadRow,
    HeartbeatRead,
    HistoryRow,
    LeaderRow,
    ModelRow,
    NodeLiveness,
    NodeRow,
    PlacementSummary,
    PulseRead,
    RateDelta,
    ReplicaRow,
    ReportResult,
    UsageDelta,
)
from llmgw.errors import Conflict
from llmgw.protocol import Heartbeat, LogReply, LogRequest, ReplicaState, ReplicaStatus
from llmgw.views import ExplainView

#: States in which a replica's node runs something for it (what a heartbeat must report).
ISSUE_SLACK_S = 1.0
"""A certificate's issue time is known to the second (``notBefore``): one issued within this many
seconds before its node's removal is not refused for its age (only by its serial, if seen)."""

REMOVAL_PREFIX = "@"
"""``revoked_certs`` keeps a node's latest removal as the row ``serial = "@<node id>"`` (serials are
hex, so no serial takes that form): the time from which every older certificate of the node is
refused, without a migration."""

_RUNNING = frozenset({ReplicaState.FETCHING.value, ReplicaState.STARTING.value, ReplicaState.READY.value})


class Store(abc.ABC):
    """The control plane's state: models, nodes, replicas, placement explanations, GGUF facts and
    node certificates. Open one with :func:`llmgw.control.store.open_store`.

    Example::

        store = open_store("sqlite:////var/lib/llmgw/llmgw.db")
        store.add_model(model, now=time.time())
        await db.run(store.get_node, "node-1")  # on the event loop: off it (OffLoop)
    """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the backend's connections."""

    @abc.abstractmethod
    def migrate(self) -> list[int]:
        """Apply the schema migrations not yet applied; return their versions (ascending)."""

    @abc.abstractmethod
    def schema_versions(self) -> list[int]:
        """The migration versions applied, ascending."""

    # --- models ---

    @abc.abstractmethod
    def add_model(self, model: Model, *, now: float) -> ModelRow:
        """Add a catalog entry at revision 1.

        Raises:
            Conflict: the name is taken (``model 'x' already exists; …``), or a name or alias of it
                is another model's name or alias (``'a' is already a name or alias of model 'y'; …``).
        """

    @abc.abstractmethod
    def get_model(self, name: str) -> ModelRow | None:
        """The model named ``name`` (not an alias), or None (also when its row is broken)."""

    @abc.abstractmethod
    def list_models(self) -> list[ModelRow]:
        """Every readable catalog entry, by name; broken rows are skipped (:meth:`list_broken_models`)."""

    @abc.abstractmethod
    def list_broken_models(self) -> list[BrokenModel]:
        """The model rows that cannot be read as a :class:`~llmgw.catalog.Model`, by name, with the reason."""

    @abc.abstractmethod
    def update_model(self, model: Model, *, revision: int, now: float) -> ModelRow:
        """Replace the entry named ``model.name`` if it is still at ``revision``.

        Raises:
            Conflict: the row changed or went since ``revision`` was read, or an alias is another
                model's name or alias.
        """

    @abc.abstractmethod
    def delete_model(self, name: str) -> bool:
        """Delete the entry, its names, its explanation and its autoscaling decisions; True when there
        was one. Its replicas go at the leader's next pass (the agents then stop them)."""

    # --- nodes ---

    @abc.abstractmethod
    def upsert_node_heartbeat(self, node_id: str, hb: Heartbeat, now: float) -> NodeRow:
        """Record a heartbeat: the node is ``ready``, with this inventory, labels, engines and
        reported replicas; ``last_seen`` = ``now``. Inserts the node on its first heartbeat.

        A racing writer (the leader marking the node lost) makes the update miss its revision; the
        row is then re-read and the heartbeat applied again (a heartbeat always wins: it is newer).

        Raises:
            Conflict: the node kept changing over five tries, or was removed meanwhile.
        """

    @abc.abstractmethod
    def record_heartbeats(self, beats: Sequence[tuple[str, Heartbeat, float, str]]) -> list[Conflict | None]:
        """Record several heartbeats ``(node_id, heartbeat, now, serial)`` at once, as
        :meth:`upsert_node_heartbeat` records one; the result has one entry per heartbeat, None
        when it was recorded, else the :class:`Conflict` it would have raised, or :class:`Revoked`
        when ``serial`` (the agent certificate's, ``""`` when unknown) is on the deny-list.

        The deny-list is read in the same write transaction that :meth:`remove_node` takes, so a
        heartbeat that was in flight while its node was removed cannot write the node back: for a
        removed node, a ``serial`` that is not among those remembered for it since the removal
        (:meth:`note_cert`) is refused. The agent API writes through :meth:`write_heartbeats`, which
        remembers a new serial in the same transaction.
        """

    @abc.abstractmethod
    def get_node(self, node_id: str) -> NodeRow | None:
        """The node, or None."""

    @abc.abstractmethod
    def list_nodes(self) -> list[NodeRow]:
        """Every node, by id."""

    @abc.abstractmethod
    def update_node(self, node: NodeRow, *, state: str | None = None, cordoned: bool | None = None) -> NodeRow:
        """Set ``state`` and/or ``cordoned`` on ``node`` if it is still at ``node.revision``.

        Raises:
            Conflict: the node changed (a heartbeat arrived) or went since it was read.
        """

    # --- node removal and certificate revocation ---

    @abc.abstractmethod
    def note_cert(self, node_id: str, serial: str, now: float) -> None:
        """Remember that ``node_id``'s agent presented the certificate ``serial`` (upper-case hex);
        a pair already known is left as it is. ``ctl node rm`` revokes what is remembered here."""

    @abc.abstractmethod
    def node_serials(self, node_id: str) -> list[str]:
        """The certificate serials ``node_id``'s agent presented, oldest first."""

    @abc.abstractmethod
    def revoked(self, serial: str) -> tuple[str, float] | None:
        """``(node, revoked_at)`` when the certificate ``serial`` is revoked, else None."""

    @abc.abstractmethod
    def refused_cert(self, node_id: str, serial: str, issued_at: float | None) -> tuple[str, float] | None:
        """``(node, revoked_at)`` when a certificate for ``node_id`` must be refused, else None: its
        ``serial`` is revoked, or ``node_id`` was removed (:meth:`remove_node`, the latest removal)
        more than :data:`ISSUE_SLACK_S` after the certificate was issued (``issued_at``, unix seconds,
        :func:`llmgw.tlsconf.issued_at`; None: only the serial is checked).

        The second rule covers bundles issued for the node that its agent never presented (a
        second ``server add-node`` for the same id, a copy kept elsewhere): ``remove_node`` cannot
        know their serials. It compares the issuing machine's clock with the removing control
        plane's, so a certificate issued less than the clocks' difference (plus 1 s) before the
        removal and never presented may still join; one issued after it always does.
        """

    @abc.abstractmethod
    def remove_node(self, node_id: str, *, now: float) -> list[str]:
        """Delete ``node_id``, the replicas placed on it and its remembered serials, and revoke those
        serials, in one transaction; returns the serials revoked (sorted). The removal's time is kept
        too: every certificate issued for ``node_id`` before it is refused
        (:meth:`refused_cert`), presented or not.

        A node removed this way can join again only with a new certificate (``llmgw server
        add-node``, issued after the removal): its old ones stay refused for good.

        Raises:
            Conflict: there is no node ``node_id``.
        """

    # --- replicas ---

    @abc.abstractmethod
    def add_replica(self, replica: ReplicaRow) -> ReplicaRow:
        """Insert ``replica`` at revision 1. Raises :class:`Conflict` when the id exists."""

    @abc.abstractmethod
    def get_replica(self, replica_id: str) -> ReplicaRow | None:
        """The replica, or None."""

    @abc.abstractmethod
    def list_replicas(self, *, model: str | None = None, node: str | None = None) -> list[ReplicaRow]:
        """Replicas, optionally of one model and/or on one node, by creation time then id."""

    @abc.abstractmethod
    def update_replica(self, replica: ReplicaRow) -> ReplicaRow:
        """Write ``replica``'s fields if the stored row is still at ``replica.revision``.

        Raises:
            Conflict: the row changed or went since it was read.
        """

    @abc.abstractmethod
    def delete_replica(self, replica_id: str, *, revision: int | None = None) -> bool:
        """Delete a replica (only at ``revision`` when given); True when a row went."""

    def apply_reports(self, node_id: str, reports: Sequence[ReplicaStatus], now: float) -> ReportResult:
        """Copy a node's reported replica states (state, err, endpoint) onto the replicas placed there
        (:func:`report_updates` says how), each update at the revision read.

        A revision race (the leader or an admin touched the row) skips that replica until the next
        heartbeat, a couple of seconds on. Written once here, over :meth:`list_replicas` and
        :meth:`update_replica`, for every backend.
        """
        result = ReportResult()
        for row in report_updates(node_id, self.list_replicas(node=node_id), reports, now):
            try:
                self.update_replica(row)
            except Conflict:
                continue
            result.changed.append(row.id)
        return result

    # --- one heartbeat: one read, one write ---

    def read_heartbeat(self, node_id: str, serial: str, issued_at: float | None) -> HeartbeatRead:
        """Everything a heartbeat reads before it writes (one read transaction in a backend that
        overrides it; here over the single reads): whether the certificate ``serial`` (issued at
        ``issued_at``; ``""``: not checked) is refused (:meth:`refused_cert`), and if not, the
        node's row, the replicas placed on it and their models."""
        refused = self.refused_cert(node_id, serial, issued_at) if serial else None
        if refused is not None:
            return HeartbeatRead(refused)
        replicas = self.list_replicas(node=node_id)
        models = {name: row.model for name in {r.model for r in replicas} if (row := self.get_model(name))}
        return HeartbeatRead(None, self.get_node(node_id), replicas, models)

    def read_pulse(self, node_id: str, serial: str, issued_at: float | None) -> PulseRead:
        """What a pulse reads: as :meth:`read_heartbeat`, with the node's liveness columns
        (:class:`NodeLiveness`) instead of its whole row (here read whole and cut down)."""
        got = self.read_heartbeat(node_id, serial, issued_at)
        n = got.before
        before = NodeLiveness(n.id, n.state, n.instance, n.last_seen, n.digest) if n is not None else None
        return PulseRead(got.refused, before, got.replicas, got.models)

    def count_nodes(self) -> int:
        """How many nodes are stored, in any state (here by listing them)."""
        return len(self.list_nodes())

    def write_heartbeats(self, beats: Sequence[BeatWrite]) -> list[BeatResult]:
        """Everything heartbeats write (one write transaction for the batch in a backend that
        overrides it; here over the single writes), one result per beat, in order: for each, the
        certificate checked again (:meth:`record_heartbeats`' rules, in the write transaction node
        removal takes), its serial remembered (``note``, :meth:`note_cert`), the heartbeat
        recorded, its replica reports applied (:meth:`apply_reports`) and, when ``logs``, the log
        requests queued for the node taken (:meth:`take_log_requests`). A refused beat writes nothing.
        A pulse (``hb`` None) is answered :attr:`BeatResult.stale` here (its agent sends its full
        state): correct, not cheap; a backend overrides this with a conditional ``last_seen`` write."""
        out = []
        for b in beats:
            if b.hb is None:
                out.append(BeatResult(None, stale=True))
                continue
            if b.note and b.serial and self.refused_cert(b.node_id, b.serial, b.issued_at) is None:
                self.note_cert(b.node_id, b.serial, b.now)
            (refused,) = self.record_heartbeats([(b.node_id, b.hb, b.now, b.serial)])
            if refused is not None:
                out.append(BeatResult(refused))
                continue
            changed = self.apply_reports(b.node_id, b.hb.replicas, b.now).changed
            out.append(BeatResult(None, changed, self.take_log_requests(b.node_id, now=b.now) if b.logs else []))
        return out

    @abc.abstractmethod  # the leader's dirty marks (migration 12) and batched writes
    def note_changes(self, *, nodes: Collection[str] = (), models: Collection[str] = (), now: float) -> None:
        """Mark ``nodes`` and ``models`` changed for the leader's next pass (for writes that do not mark)."""

    @abc.abstractmethod
    def read_dirty(self, *, nodes: Collection[str] = (), models: Collection[str] = ()) -> DirtyRead:
        """Every mark, with the marked nodes (and ``nodes``), models (and ``models``) and their
        replicas as stored now (one transaction)."""

    @abc.abstractmethod
    def forget_changes(self, ids: Collection[int]) -> None:
        """Delete the marks ``ids`` (read by :meth:`read_dirty`; marks made since stay)."""

    @abc.abstractmethod
    def silent_nodes(self, *, before: float) -> list[str]:
        """The ``ready`` nodes whose ``last_seen`` is before ``before`` (unix seconds), by id."""

    @abc.abstractmethod
    def add_replicas(self, replicas: Sequence[ReplicaRow]) -> None:
        """:meth:`add_replica` for each, in one transaction (:class:`Conflict`: an id exists; none added)."""

    @abc.abstractmethod
    def set_explanations(self, views: Sequence[ExplainView], *, now: float) -> None:
        """:meth:`set_explanation` for each, in one transaction."""

    # --- explanations ---

    @abc.abstractmethod
    def set_explanation(self, view: ExplainView, *, now: float) -> None:
        """Store placement's explanation for ``view.model`` (replacing the previous one)."""

    @abc.abstractmethod
    def get_explanation(self, model: str) -> ExplainView | None:
        """The last explanation stored for ``model``, or None."""

    @abc.abstractmethod
    def list_explanations(self) -> dict[str, ExplainView]:
        """Every stored explanation, by model."""

    @abc.abstractmethod
    def explanation_summaries(self) -> dict[str, PlacementSummary]:
        """Every stored explanation's summary and ``placed``, by model (the routing table needs only these:
        whole explanations, a verdict per node, cost a heartbeat's CPU per model with 200 nodes)."""

    @abc.abstractmethod
    def delete_explanation(self, model: str) -> None:
        """Forget the explanation for ``model``."""

    # --- GGUF facts (memory estimates) ---

    @abc.abstractmethod
    def set_gguf_facts(self, source: str, *, body: str, error: str, now: float) -> None:
        """Store what the GGUF header at ``source`` says (``body``: estimate.GgufFacts JSON), or
        why it could not be read (``error``, body empty)."""

    @abc.abstractmethod
    def list_gguf_facts(self) -> dict[str, tuple[str, str, float]]:
        """Every stored header: ``{source: (body, error, updated_at)}``."""

    # --- leadership and membership (migration 5) ---

    @abc.abstractmethod
    def fenced(self, term: int) -> Store:
        """A store sharing this one's connections whose every write transaction first reads the
        term (``SELECT term FROM cp_leader WHERE id=1 FOR SHARE``) and aborts with
        :class:`~llmgw.errors.Fenced`, writing nothing, when it is not ``term``. The leader's
        reconcilers write through it, so a control plane that lost leadership cannot write."""

    @abc.abstractmethod
    def leader(self) -> LeaderRow:
        """The ``cp_leader`` row (term 0 and holder "" before anyone led)."""

    @abc.abstractmethod
    def take_term(self, holder: str, *, now: float) -> int:
        """Bump the term and record ``holder`` as its leader; the new term. Only for a process that
        leads by construction (SQLite: the one process that owns the file); on PostgreSQL the
        election takes the term on its own connection (:mod:`llmgw.control.reconcile.election`)."""

    @abc.abstractmethod
    def upsert_control_plane(self, row: ControlPlaneRow) -> None:
        """Insert or replace the row of control plane ``row.name`` (membership heartbeat)."""

    @abc.abstractmethod
    def list_control_planes(self) -> list[ControlPlaneRow]:
        """Every control plane that ever wrote its row, by name."""

    # --- engine-log reads between control planes (migration 6) ---

    @abc.abstractmethod
    def add_log_request(self, node: str, request: LogRequest, *, now: float, keep_s: float = 60.0) -> None:
        """Queue ``request`` for ``node``'s agent in the store, so that whichever control plane the
        agent heartbeats to hands it out (:meth:`take_log_requests`). Rows created more than
        ``keep_s`` seconds before ``now`` (asked by a control plane that stopped before reading the
        answer) are deleted in the same transaction, so the table holds only reads in flight.

        Raises:
            Conflict: a request with this id exists (ids are 64 random bits: a caller's bug).
        """

    @abc.abstractmethod
    def take_log_requests(self, node: str, *, now: float) -> list[LogRequest]:
        """The requests queued for ``node`` not yet handed out, oldest first, marked handed out: each
        is returned once, by one control plane (a conditional update, so two control planes racing
        for the same row cannot both get it). One indexed read when there are none."""

    @abc.abstractmethod
    def log_request_nodes(self) -> set[str]:
        """The nodes that have requests not yet handed out (one small read; each control plane polls
        it a few times a second so that its heartbeats call :meth:`take_log_requests` only for them)."""

    @abc.abstractmethod
    def answer_log_request(self, node: str, reply: LogReply, *, now: float) -> bool:
        """Store ``node``'s agent's answer in the request row; False when there is no unanswered
        request ``reply.id`` for ``node`` (expired, already answered, or another node's)."""

    @abc.abstractmethod
    def pop_log_answer(self, request_id: str) -> LogReply | None:
        """The stored answer to ``request_id``, deleting its row; None (and the row kept) while it is
        unanswered, or when there is no such row."""

    @abc.abstractmethod
    def forget_log_request(self, request_id: str) -> None:
        """Delete the request row ``request_id``, answered or not (the asker gave up or was answered
        another way); nothing when it is gone already."""

    # --- gateway keys, usage and rate counts (migration 7) ---

    @abc.abstractmethod
    def add_key(self, row: ApiKeyRow) -> ApiKeyRow:
        """Store a new key (revision 1). Raises :class:`Conflict` for a name (a revoked key's too) or digest taken."""

    @abc.abstractmethod
    def get_key(self, name: str) -> ApiKeyRow | None:
        """The key named ``name``, or None."""

    @abc.abstractmethod
    def list_keys(self) -> list[ApiKeyRow]:
        """Every key, revoked ones included, by name."""

    @abc.abstractmethod
    def update_key(self, row: ApiKeyRow, *, revision: int) -> ApiKeyRow:
        """Write ``row`` over its key (not ``last_used_at``: accounting's) if its revision is still ``revision``;
        returns it with the revision bumped and the stored ``last_used_at``. :class:`Conflict`: it changed or went."""

    @abc.abstractmethod
    def record_accounting(
        self, cp: str, usage: Sequence[UsageDelta], rates: Sequence[RateDelta], last_used: Mapping[str, float]
    ) -> None:
        """In one transaction: add ``usage`` to ``usage_daily`` (per key, model, day), add ``rates`` to
        control plane ``cp``'s ``rate_windows`` rows, and raise each key's ``last_used_at`` to the time
        given (without bumping its revision: a use is not an edit). Batched: one statement per table."""

    @abc.abstractmethod
    def rate_totals(self, *, since_window: int, exclude_cp: str) -> dict[tuple[str, int], tuple[int, int]]:
        """``(key, window) -> (requests, tokens)`` summed over every control plane but ``exclude_cp``,
        for windows from ``since_window`` on."""

    @abc.abstractmethod
    def key_tokens_by_day(self, *, since_day: str) -> dict[tuple[str, str], int]:
        """``(key, day) -> prompt + completion tokens`` over every control plane, days from ``since_day``
        (``YYYY-MM-DD``) on."""

    @abc.abstractmethod
    def prune_rate_windows(self, *, before_window: int) -> int:
        """Delete rate counts of windows before ``before_window``; how many rows went."""

    @abc.abstractmethod
    def usage(
        self, *, key: str | None = None, model: str | None = None, since_day: str, until_day: str | None = None
    ) -> list[UsageDelta]:
        """Usage rows from ``since_day`` to ``until_day`` (inclusive; None: no end), of one key and/or one
        model when given; ordered by day, key, model."""

    # --- autoscaling (migration 10) ---

    @abc.abstractmethod
    def write_gateway_load(self, control_plane: str, rows: Sequence[GatewayLoadRow], *, now: float,
                           keep_s: float = 60.0) -> None:
        """Replace ``control_plane``'s ``gateway_load`` rows by ``rows`` in one transaction (a model
        it no longer has load for goes), and delete any control plane's rows older than ``keep_s``."""

    @abc.abstractmethod
    def read_gateway_load(self, *, since: float) -> list[GatewayLoadRow]:
        """Every control plane's rows written at ``since`` or later."""

    @abc.abstractmethod
    def add_decision(self, row: DecisionRow, *, keep: int = 100) -> None:
        """Record an autoscaling decision; only the newest ``keep`` of its model are kept."""

    @abc.abstractmethod
    def list_decisions(self, model: str, *, limit: int = 100) -> list[DecisionRow]:
        """``model``'s decisions, newest first, at most ``limit``."""

    @abc.abstractmethod
    def last_decisions(self) -> dict[str, DecisionRow]:
        """The newest decision of every model that has one (the wanted count it set)."""

    @abc.abstractmethod
    def add_history(self, rows: Sequence[HistoryRow], *, before: float) -> None:
        """Append ``rows`` (one batched insert) and delete every row older than ``before``."""

    @abc.abstractmethod
    def list_history(self, model: str, *, since: float) -> list[HistoryRow]:
        """``model``'s points from ``since`` on, oldest first."""

    @abc.abstractmethod
    def forget_decisions(self, model: str) -> None:
        """Delete ``model``'s decisions (the model was deleted, or its autoscaling turned off)."""


def report_updates(
    node_id: str, placed: Sequence[ReplicaRow], reports: Sequence[ReplicaStatus], now: float
) -> list[ReplicaRow]:
    """The replica rows a node's reports change, as they are to be written (each at the revision
    it was read at): ``placed`` is what :meth:`Store.list_replicas` returns for ``node_id``.

    A node's reported replica states (state, err, endpoint) go onto the replicas placed there.
    Reports for replicas not placed on ``node_id`` are ignored (a node cannot speak for another's
    replicas). ``ready_at`` is set when a replica becomes ready.

    A heartbeat lists every replica its agent runs (adopted engines included: the agent adopts
    before its first heartbeat), so a replica placed here that was ``fetching``, ``starting`` or
    ``ready`` and is missing from ``reports`` is not running on this node any more (its engine
    was stopped with ``service stop --engines``, the machine rebooted): it goes back to
    ``pending`` with no endpoint, so the gateway stops routing to it at once instead of
    answering 503s from a dead port until the agent starts it again.
    """
    out: list[ReplicaRow] = []
    mine = {r.id: r for r in placed if r.node == node_id}
    out += _member_updates(node_id, [r for r in placed if r.node != node_id], reports, now)
    reported = {rep.id for rep in reports}
    for gone in mine.values():
        if gone.id in reported or gone.state not in _RUNNING:
            continue
        out.append(replace(gone, state=ReplicaState.PENDING.value, err="", endpoint="", updated_at=now))
    for rep in reports:
        row = mine.get(rep.id)
        if row is None:
            continue
        if row.members and row.state == ReplicaState.FAILED:
            continue  # a group failed by a worker stays failed: its head may still say ready
        state = rep.state.value
        members = row.members
        if members and members[0].endpoint != rep.group_endpoint:  # a vLLM head's Ray address
            members = (members[0].model_copy(update={"endpoint": rep.group_endpoint}), *members[1:])
        if (row.state, row.err, row.endpoint, row.members) == (state, rep.err, rep.endpoint, members):
            continue
        ready_at, last_error = row.ready_at, row.last_error
        if state == ReplicaState.READY and row.state != ReplicaState.READY:
            # Serving now: the failure it replaced is history, not its error (ctl replicas
            # showed it on a ready replica).
            ready_at, last_error = now, ""
        out.append(
            replace(row, state=state, err=rep.err, endpoint=rep.endpoint, updated_at=now, ready_at=ready_at,
                    last_error=last_error, members=members)
        )
    return out


def _member_updates(
    node_id: str, groups: list[ReplicaRow], reports: Sequence[ReplicaStatus], now: float
) -> list[ReplicaRow]:
    """A worker's reports onto its member entry of each group replica it belongs to (state,
    err, endpoint: the head waits for every worker's endpoint); a member its node no longer
    reports goes back to no state and no endpoint, as a head does."""
    by_id = {rep.id: rep for rep in reports}
    out = []
    for row in groups:
        rep = by_id.get(row.id)
        members = []
        for m in row.members:
            if m.node == node_id:
                if rep is not None:
                    m = m.model_copy(update={"state": rep.state.value, "err": rep.err, "endpoint": rep.endpoint})  # noqa: PLW2901
                else:
                    m = m.model_copy(update={"state": "", "err": "", "endpoint": ""})  # noqa: PLW2901
            members.append(m)
        if tuple(members) == row.members:
            continue
        out.append(replace(row, members=tuple(members), updated_at=now))
    return out
