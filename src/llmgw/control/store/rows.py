"""The store's rows: what a :class:`~llmgw.control.store.base.Store` reads and writes.

These are storage shapes, kept apart from the API views (:mod:`llmgw.views`) and the
wire shapes (:mod:`llmgw.protocol`) even where they look alike. Every row carries a ``revision``
(starts at 1, bumped by every update) for optimistic concurrency; times are unix seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from llmgw.catalog import Model
from llmgw.errors import Conflict
from llmgw.protocol import EngineStatus, GroupMember, Heartbeat, Inventory, LogRequest, ReplicaState, ReplicaStatus


@dataclass(frozen=True)
class ModelRow:
    """A catalog entry as stored: the model, its revision and times (unix seconds)."""

    model: Model
    revision: int
    created_at: float
    updated_at: float

    @property
    def name(self) -> str:
        """The model's name (the primary key)."""
        return self.model.name


@dataclass(frozen=True)
class BrokenModel:
    """A model row that cannot be read back as a :class:`Model`: its name, why (the first
    validation problems), and when it was last written (unix seconds)."""

    name: str
    reason: str
    updated_at: float


@dataclass(frozen=True)
class NodeRow:
    """A node as stored. ``state``: ``ready`` (heartbeats arriving) or ``lost`` (the leader saw none
    for ``node_lost_after_s``). ``replicas`` is what the node last reported, verbatim."""

    id: str
    revision: int
    state: str
    cordoned: bool
    labels: dict[str, str]
    inventory: Inventory
    engines: list[EngineStatus]
    replicas: list[ReplicaStatus]
    first_seen: float
    last_seen: float
    instance: str = ""
    cached: list[str] = field(default_factory=list)
    digest: str = ""


@dataclass(frozen=True)
class NodeLiveness:
    """The columns of a node a pulse reads (:meth:`~llmgw.control.store.base.Store.read_pulse`):
    no inventory, engines or reports to parse. ``digest``: :func:`llmgw.protocol.state_digest` of
    its last full heartbeat ("" none)."""

    id: str
    state: str
    instance: str
    last_seen: float
    digest: str


@dataclass(frozen=True)
class ReplicaRow:
    """A replica the control plane wants: placed on ``node`` with ``profile``.

    ``state`` is ``pending`` until the node reports it, then what the node says
    (:class:`~llmgw.protocol.ReplicaState`). ``key`` is the engine's ``--api-key``.
    """

    id: str
    model: str
    node: str
    profile: str
    key: str
    state: str = ReplicaState.PENDING.value
    err: str = ""
    endpoint: str = ""
    revision: int = 1
    created_at: float = 0.0
    updated_at: float = 0.0
    ready_at: float | None = None
    restarts: int = 0
    gpu_indexes: tuple[int, ...] = ()
    last_error: str = ""
    spec_hash: str = ""
    members: tuple[GroupMember, ...] = ()  # a group replica's nodes, head (``node``) first; () for one node
    draining_since: float | None = None  # unix seconds it was chosen to go (routed no more); None: serving


@dataclass(frozen=True, slots=True)
class PlacementSummary:
    """A stored placement explanation as the routing table reads it: its one-line ``summary`` and
    whether the model's wanted replicas were all placed (``placed``; False: the last attempt could
    not place them, and ``summary`` says why)."""

    summary: str
    placed: bool


@dataclass(frozen=True)
class ReportResult:
    """What :meth:`~llmgw.control.store.base.Store.apply_reports` changed: the replica ids whose
    state, err or endpoint moved."""

    changed: list[str] = field(default_factory=list)


Before = TypeVar("Before", NodeRow, NodeLiveness)


@dataclass(frozen=True)
class BeatRead(Generic[Before]):
    """What a heartbeat or a pulse reads before it writes, in one read transaction
    (:meth:`~llmgw.control.store.base.Store.read_heartbeat`, :meth:`~llmgw.control.store.base.Store.read_pulse`).

    Attributes:
        refused: ``(node, revoked_at)`` when the agent's certificate is refused
            (:meth:`~llmgw.control.store.base.Store.refused_cert`), else None; the rest is empty then.
        before: the node before this beat, or None (its first one): its whole row for a heartbeat
            (:data:`HeartbeatRead`), its :class:`NodeLiveness` for a pulse (:data:`PulseRead`).
        replicas: the replicas placed on the node (head or member), by creation time then id.
        models: the readable models those replicas are of, by name (a model gone or broken is absent).
    """

    refused: tuple[str, float] | None
    before: Before | None = None
    replicas: list[ReplicaRow] = field(default_factory=list)
    models: dict[str, Model] = field(default_factory=dict)


HeartbeatRead = BeatRead[NodeRow]
"""What a heartbeat reads (:meth:`~llmgw.control.store.base.Store.read_heartbeat`)."""

PulseRead = BeatRead[NodeLiveness]
"""What a pulse reads (:meth:`~llmgw.control.store.base.Store.read_pulse`)."""


@dataclass(frozen=True)
class BeatWrite:
    """One heartbeat's write (:meth:`~llmgw.control.store.base.Store.write_heartbeats`).

    Attributes:
        node_id: the node (its certificate's CN).
        hb: the heartbeat; None for a pulse: only ``last_seen`` is written, and only while the
            node is ``ready`` with ``digest`` stored (else :attr:`BeatResult.stale`).
        now: unix seconds.
        serial: the agent certificate's serial (upper-case hex), ``""`` when unknown.
        issued_at: the certificate's ``notBefore`` (unix seconds), None when unknown.
        note: remember ``serial`` for the node (its first heartbeat with it in this process).
        logs: take the log requests queued in the store for the node.
        digest: :func:`llmgw.protocol.state_digest` of ``hb`` (computed by the control plane), or
            the pulse's digest.
    """

    node_id: str
    hb: Heartbeat | None
    now: float
    serial: str = ""
    issued_at: float | None = None
    note: bool = False
    logs: bool = False
    digest: str = ""


@dataclass
class BeatResult:
    """What one heartbeat's write did.

    Attributes:
        refused: None when it was recorded, else the :class:`~llmgw.errors.Conflict` it met
            (:class:`~llmgw.errors.Revoked`: the certificate is refused); nothing was written then.
        changed: the replica ids whose state, err or endpoint moved (as :class:`ReportResult`).
        logs: the log requests taken for the node (``logs`` asked), oldest first.
        stale: a pulse found the node not ``ready`` or its digest changed meanwhile: nothing was
            written (the agent is asked for its full state).
    """

    refused: Conflict | None = None
    changed: list[str] = field(default_factory=list)
    logs: list[LogRequest] = field(default_factory=list)
    stale: bool = False


@dataclass(frozen=True)
class LeaderRow:
    """The ``cp_leader`` row: the leadership ``term`` (the fencing token, 0 = never led), the
    ``holder`` that was granted it (a control plane's name, "" = none yet), when it was granted
    (``since``) and last renewed (``renewed_at``), unix seconds."""

    term: int
    holder: str
    since: float
    renewed_at: float


@dataclass(frozen=True)
class ControlPlaneRow:
    """A control plane sharing this database: its ``name``, the URL agents reach its agent API at,
    when it last wrote its row (``last_seen``) and started (``started_at``), unix seconds, the
    llmgw ``version`` it runs, and ``node``, the node on its own machine ("" for none)."""

    name: str
    agent_url: str
    last_seen: float
    started_at: float
    version: str
    node: str = ""  # migration 14


@dataclass(frozen=True)
class ApiKeyRow:
    """A gateway API key as stored: never the secret, only its SHA-256 (hex) and first 16 characters.

    ``models`` lists the names or aliases the key may use (``()``: every model); ``rpm``/``tpm`` are
    requests and tokens per minute, ``budget_tokens`` per ``budget_period`` (``day`` or ``month``,
    UTC; ``""`` for no budget); None is no limit. ``priority`` (0-9) is the key's band in the
    gateway's queue, higher served first. Times are unix seconds.
    """

    name: str
    prefix: str
    digest: str
    models: tuple[str, ...] = ()
    rpm: int | None = None
    tpm: int | None = None
    budget_tokens: int | None = None
    budget_period: str = ""
    expires_at: float | None = None
    created_at: float = 0.0
    revoked_at: float | None = None
    last_used_at: float | None = None
    priority: int = 0
    revision: int = 1


@dataclass(frozen=True)
class UsageDelta:
    """Counts to add to one ``usage_daily`` row (key, model, UTC day ``YYYY-MM-DD``); also the shape
    a usage row is read back in."""

    key: str
    model: str
    day: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    guard_blocks: int = 0
    errors: int = 0


@dataclass(frozen=True)
class RateDelta:
    """Counts to add for one key, one control plane and one minute (``window``: unix seconds of the
    minute's start, a multiple of 60): admitted requests and tokens."""

    key: str
    window: int
    requests: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class GatewayLoadRow:
    """One control plane's gateway load for one model at ``at`` (unix seconds): requests sent to a
    replica and not yet answered (``in_flight``), requests waiting at the gateway for a slot
    (``queued``), in flight per replica id where the gateway knows it (``replicas``), and requests
    of the model that arrived since the control plane's previous reading (``arrived``)."""

    control_plane: str
    model: str
    in_flight: int
    queued: int
    at: float
    replicas: dict[str, int] = field(default_factory=dict)
    arrived: int = 0


#: The model name of the row each control plane's load reading carries whatever its load (no model
#: is named ""): when it read, for the drainer (:func:`llmgw.control.reconcile.drainer.drained`).
READING = ""


@dataclass(frozen=True)
class DecisionRow:
    """An autoscaling decision of the leader: ``model`` went from ``from_n`` to ``to_n`` wanted
    replicas at ``at`` (unix seconds), because ``reason``; ``panic`` when decided in panic mode."""

    model: str
    at: float
    from_n: int
    to_n: int
    reason: str
    panic: bool = False


@dataclass(frozen=True)
class HistoryRow:
    """One point of an autoscaled model's last hour: at ``at`` (unix seconds) ``wanted`` replicas,
    ``ready`` ones, and ``load`` requests in flight plus queued over every control plane."""

    model: str
    at: float
    wanted: int
    ready: int
    load: float



@dataclass(frozen=True)
class DirtyRead:
    """What the leader's dirty pass reads in one transaction
    (:meth:`~llmgw.control.store.base.Store.read_dirty`).

    Attributes:
        change_ids: the ``changes`` rows read (delete them once the pass is done:
            :meth:`~llmgw.control.store.base.Store.forget_changes`).
        nodes: every node marked or asked for, as stored now (None: removed).
        models: every model marked or asked for, as stored now (None: deleted, or unreadable).
        replicas: the replicas on those nodes (head or member), of those models, and every group
            replica, as stored now.
    """

    change_ids: list[int]
    nodes: dict[str, NodeRow | None]
    models: dict[str, ModelRow | None]
    replicas: list[ReplicaRow]
