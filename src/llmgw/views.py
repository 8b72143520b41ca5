"""The admin API's JSON views (``GET /api/v1/nodes``, ``/replicas``, ``/explain-placement``, ...).

They carry at least the fields init and ``ctl`` read (``NodeView``: id, state, engines,
provision[engine, version, state, detail]; ``ReplicaView``: id, model, node, profile, state, err;
``ExplainView``: placed, rejections[node, reason]). Views are not storage rows.

They are domain types, not part of ``control/``: placement writes its verdicts as :class:`Rejection`
and :class:`ExplainView`, the store keeps the last explanation of each model, and the admin API's
clients (:mod:`llmgw.adminclient`, the CLI) read the same shapes back, so every layer speaks them
(the import contracts in pyproject.toml's ``[tool.importlinter]``).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from pydantic import BaseModel, Field, computed_field

from llmgw import gpuhealth
from llmgw.protocol import GPU, GroupMember

#: What ``POST /api/v1/nodes/{id}/{action}`` (and the dashboard's node buttons) may do to a node.
NODE_ACTIONS = ("cordon", "uncordon", "drain")


class ProvisionView(BaseModel):
    """An engine's provisioning on a node."""

    engine: str
    version: str = ""
    state: str
    detail: str = ""


class NodeResourcesView(BaseModel):
    """A node's resources: totals, what placed replicas reserve, and what is free (bytes, cores)."""

    cores: int
    cores_reserved: int
    memory_total_bytes: int
    memory_reserved_bytes: int
    memory_available_bytes: int


class NodeView(BaseModel):
    """A node. ``state``: ``ready`` (heartbeats arriving), ``lost`` (none for ``node_lost_after_s``).

    ``problems`` (derived from ``gpus``, served in the JSON): what is wrong with the node that its
    operator must fix, each line with what to check; today GPUs discovery could not measure
    (:mod:`llmgw.gpuhealth`).
    """

    id: str
    state: str
    cordoned: bool = False
    labels: dict[str, str] = Field(default_factory=dict)
    engines: list[str] = Field(default_factory=list)
    provision: list[ProvisionView] = Field(default_factory=list)
    resources: NodeResourcesView | None = None
    gpus: list[GPU] = Field(default_factory=list)
    last_seen: float | None = None  # unix seconds

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented spelling
    @property
    def problems(self) -> list[str]:
        """Node-level problems an operator must fix (a GPU reported with 0 GB memory), each with what to check."""
        return gpuhealth.discovery_problems(self.gpus)


#: :attr:`ReplicaRouting.scope`: the figures are the answering control plane's own gateway's.
ROUTING_SCOPE = "this_control_plane"


class ReplicaRouting(BaseModel):
    """How the answering control plane's gateway routes to one replica (``ctl replicas``, the
    dashboard's model page). Each control plane routes on its own, without shared state
    (docs/operating.md, Routing): with several, each reports only what it sent, and the figures
    start at zero when it starts.

    Attributes:
        scope: always :data:`ROUTING_SCOPE` (``"this_control_plane"``): whose figures these are.
        slots: requests the engine runs at once (llama-server ``GET /props`` ``total_slots``, or the
            profile's); None until the gateway has read it (before its first request there).
        in_flight: requests this gateway sent it that have not finished.
        queued: requests of its model waiting at this gateway for a free slot (on any replica of it).
        affinity_hits: requests sent here because it is where their prefix is likely cached
            (``picks["affinity"]``).
        picks: requests sent here, by reason: ``affinity``, ``least_load``, ``overflow``,
            ``round_robin`` (the gateway's balancer, :data:`llmgw.control.gateway.balancer.REASONS`).
        service_s: moving average of its answers' time, seconds (0 before the first).
        tokens_per_s: moving average of its engine's decode rate, tokens per second, from the
            engine's own timings (llama-server; 0 before the first, and for engines that report none):
            the speed the balancer compares replicas by.
    """

    scope: str = ROUTING_SCOPE
    slots: int | None = None
    in_flight: int = 0
    queued: int = 0
    affinity_hits: int = 0
    picks: dict[str, int] = Field(default_factory=dict)
    service_s: float = 0.0
    tokens_per_s: float = 0.0


class ReplicaView(BaseModel):
    """A replica: where it runs, in which profile, its state and last error; ``routing``: how this
    control plane's gateway sends to it (None from an admin API without a gateway)."""

    id: str
    model: str
    node: str = ""
    profile: str = ""
    state: str
    err: str = ""
    endpoint: str = ""
    created_at: float | None = None
    ready_at: float | None = None
    restarts: int = 0
    last_error: str = ""  # the previous replica's error when this one replaced a failed one
    gpu_indexes: list[int] = Field(default_factory=list)
    pending_reason: str = ""  # a wanted replica placed nowhere: placement's one-line summary
    members: list[GroupMember] = Field(default_factory=list)  # a group's nodes, head first (their states)
    draining_since: float | None = None  # chosen to go by autoscaling: routed no more, stops once drained
    routing: ReplicaRouting | None = None


class Rejection(BaseModel):
    """Why one node cannot take one profile of a model.

    ``kind``: ``filtered`` (a rule that adding capacity does not change: state, selector, engine,
    GPU class, a card or node too small, a GPU discovery problem) or ``exhausted`` (a resource:
    memory, cores, GPU memory; ``need``/``free`` in GB or cores). ``gpu_index`` is the card the
    reason names (too small, or short of free memory) and ``total`` its (or the node's) total GB.
    """

    node: str
    profile: str
    kind: str
    code: str
    reason: str
    need: float | None = None
    free: float | None = None
    held_by: list[str] = Field(default_factory=list)  # replicas on the node using that resource
    gpu_index: int | None = None
    total: float | None = None


class FailedReplica(BaseModel):
    """A placed replica whose engine failed: its id, its node and the first line of its error."""

    replica: str
    node: str
    error: str


class ExplainView(BaseModel):
    """Placement's explanation for one model: placed or not, a one-line summary, and every rejection."""

    model: str
    placed: bool
    wanted: int = 0
    replicas: int = 0
    summary: str = ""
    rejections: list[Rejection] = Field(default_factory=list)
    evaluated_at: float | None = None
    nodes: int = 0
    profiles: list[str] = Field(default_factory=list)  # in the order tried (priority)
    would_fit_if: list[str] = Field(default_factory=list)  # what would let one more replica fit
    # the newest replica this leader placed, and where: "placed on node-b (profile cpu; weights m/1 in its cache)",
    # with "; that replica is gone" (or "is draining") once it is no longer among the replicas placed
    last_placed: str = ""
    # replicas placed whose engine failed, read when asked: a placed model can still serve nothing,
    # and this says so (``llmgw ctl logs REPLICA`` shows the whole log)
    failed: list[FailedReplica] = Field(default_factory=list)


class ModelView(BaseModel):
    """A catalog entry as the admin API shows it: the model's fields plus its replicas' states.

    ``broken`` is non-empty for a stored row that cannot be read (the reason); such an entry has
    only its name, is served nowhere, and ``DELETE /api/v1/models/{name}`` removes it.
    """

    name: str
    aliases: list[str] = Field(default_factory=list)
    role: str = ""
    source: str = ""
    version: str = ""
    scaling_min: int = 0
    scaling_max: int = 0
    replicas_ready: int = 0
    replicas: int = 0
    replicas_failed: int = 0  # placed, and their engine failed (placed again with a backoff)
    replicas_wanted: int = 0  # scaling.min, or an autoscaled model's last decided count
    spec: dict[str, object] = Field(default_factory=dict)
    broken: str = ""


class DecisionView(BaseModel):
    """One autoscaling decision: at ``at`` (unix seconds) the wanted replicas went ``from_n`` →
    ``to_n`` because ``reason``; ``panic`` when decided in panic mode."""

    at: float
    from_n: int
    to_n: int
    reason: str
    panic: bool = False


class HistoryPoint(BaseModel):
    """One point of an autoscaled model's last hour (every 15 s): replicas ``wanted`` and ``ready``,
    and ``load`` (requests in flight plus queued over every control plane) at ``at`` (unix seconds)."""

    at: float
    wanted: int
    ready: int
    load: float


class AutoscaleView(BaseModel):
    """``GET /api/v1/models/{name}/autoscale``: a model's autoscaling now and its last decisions.

    ``autoscaled`` is ``scaling.max > scaling.min``; ``wanted`` the replicas the leader places,
    ``ready`` those ready and routed (not draining), ``draining`` those finishing their requests
    before they stop; ``in_flight`` and ``queued`` the gateways' load summed over control planes
    (rows of the last 3 s); ``target`` requests in flight per replica; ``decisions`` newest first;
    ``history`` the last hour, oldest first.
    """

    model: str
    autoscaled: bool
    min: int
    max: int
    target: float
    wanted: int
    ready: int
    draining: int
    in_flight: int
    queued: int
    decisions: list[DecisionView] = Field(default_factory=list)
    history: list[HistoryPoint] = Field(default_factory=list)


class LogView(BaseModel):
    """``GET /api/v1/replicas/{id}/logs``: the text, and the byte offset to ask from next (``--follow``)."""

    replica: str
    node: str
    text: str
    offset: int


class NodeRemovalView(BaseModel):
    """``DELETE /api/v1/nodes/{id}``: the node removed, the replicas drained from it (``force``), and
    the certificate serials (upper-case hex) now refused at the agent API."""

    node: str
    drained: list[str]
    revoked: list[str]


class RevocationView(BaseModel):
    """``GET /api/v1/revocations/{serial}``: a revoked agent certificate (``serial`` upper-case hex),
    the node it was issued to, and when ``ctl node rm`` revoked it (seconds since the epoch)."""

    serial: str
    node: str
    revoked_at: float


class ControlPlaneView(BaseModel):
    """A control plane sharing the database (``GET /api/v1/cluster``): its ``name``, the URL agents
    reach it at, whether it ``leader``-s, whether it is ``alive`` (wrote its row within three
    membership periods, 6 s), and how long ago it last wrote (``last_seen_s_ago``, seconds)."""

    name: str
    agent_url: str
    leader: bool
    alive: bool
    last_seen_s_ago: float


class DatabaseView(BaseModel):
    """Whether the answering control plane reaches the database now, and if not why (``error``)."""

    reachable: bool
    error: str = ""


class PatroniMemberView(BaseModel):
    """A member of the Patroni cluster (Patroni's ``GET /cluster``): ``role`` (``leader``,
    ``sync_standby``, ``replica``, ...), ``state`` (``running``, ``streaming``, ...), ``host`` and
    replication ``lag`` (bytes behind the primary, as Patroni reports it; None for the primary or
    when Patroni gives none, a string such as ``"unknown"`` when Patroni says so)."""

    name: str
    role: str
    state: str
    host: str
    lag: int | str | None = None


class ClusterView(BaseModel):
    """``GET /api/v1/cluster``: the HA cluster as the answering control plane (``me``) sees it.

    Attributes:
        me: the answering control plane's name.
        term: the leadership term (the fencing token; 0 before anyone led).
        leader: the leading control plane's name, "" when none leads now: the term's holder only while
            its lease is fresh (``renewed_at`` within ``cluster.lease_s``) and its control plane alive.
        no_leader_since: when ``leader`` is "": unix seconds since which none leads (the lease's end,
            or its last renewal when its holder is known to be gone); 0 when none ever led. None
            while ``leader`` names one.
        database: whether ``me`` reaches the database.
        control_planes: every control plane that wrote its row, by name.
        patroni: the database's members from the first ``cluster.patroni`` URL that answered.
        patroni_error: why there are none ("" when Patroni answered or none is configured).
    """

    me: str
    term: int
    leader: str
    no_leader_since: float | None = None
    database: DatabaseView
    control_planes: list[ControlPlaneView] = Field(default_factory=list)
    patroni: list[PatroniMemberView] = Field(default_factory=list)
    patroni_error: str = ""

    def leader_text(self, now: float | None = None) -> str:
        """The leader in words, as ``ctl cluster`` and the dashboard say it: its name,
        ``no leader since 2026-12-03 07:40:12 UTC (12 s ago)``, or ``no leader yet``."""
        if self.leader:
            return self.leader
        if not self.no_leader_since:
            return "no leader yet"
        ago = max(0.0, (time.time() if now is None else now) - self.no_leader_since)
        when = datetime.fromtimestamp(self.no_leader_since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"no leader since {when} ({ago:.0f} s ago)"


class KeyView(BaseModel):
    """A gateway API key as the admin API shows it: never the secret, its first 16 characters.

    ``state`` is ``active``, ``revoked`` or ``expired``; ``tokens_today``/``tokens_this_month`` and
    ``requests_today`` are its usage (UTC) as written by every control plane (synced every 0.5 s);
    ``priority`` (0-9) its band in the gateway's queue, higher served first; ``id`` the id a guard
    policy's ``keys`` name it by (the first 12 hex digits of its SHA-256: a script had no way to it).
    """

    name: str
    prefix: str
    models: list[str]
    rpm: int | None
    tpm: int | None
    budget_tokens: int | None
    budget_period: str | None
    expires_at: float | None
    created_at: float
    revoked_at: float | None
    last_used_at: float | None
    state: str
    priority: int = 0
    requests_today: int = 0
    tokens_today: int = 0
    tokens_this_month: int = 0
    id: str = ""


class NewKeyView(BaseModel):
    """A key just made or rotated, and its secret: the only time the secret is shown."""

    key: KeyView
    secret: str


class UsageView(BaseModel):
    """Usage of one key and model on one UTC day (``YYYY-MM-DD``)."""

    key: str
    model: str
    day: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    guard_blocks: int
    errors: int
