"""What agents and the control plane say to each other over the agent API (mTLS, JSON).

``POST /agent/v1/heartbeat`` (and ``/agent/v1/register``, the same exchange on start): the agent
sends a :class:`Heartbeat` (its whole state) or a :class:`Pulse` (liveness: the digest of that
state, :func:`state_digest`); the control plane answers with a :class:`HeartbeatReply` listing the
replicas this node must run. The node id is never in the body: it is the CN of the agent's client
certificate, which the control plane reads from the TLS session.

Liveness apart from state (after Kubernetes' node Lease beside its status): an agent sends its full
state only when :func:`state_digest` of it differs from the digest the control plane last
acknowledged (``HeartbeatReply.digest``) or when a reply asks (``send_full``); every other beat is a
:class:`Pulse` of ~150 bytes. The control plane never trusts a digest it did not compute: it
computes :func:`state_digest` from each full state it stores and keeps it with the node; a pulse
whose digest differs from the stored one is answered ``send_full``. Likewise the reply leaves out
``desired`` when the agent's ``desired_digest`` (:func:`desired_digest` of the list it last
applied) is the control plane's (``desired_unchanged``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from enum import StrEnum

from pydantic import BaseModel, Field, field_validator, model_validator

from llmgw.names import check_labels


class GPU(BaseModel):
    """One GPU as discovery saw it. Memory in bytes; ``klass`` is the GPU class (``h100-80gb``)."""

    index: int = Field(ge=0)
    uuid: str = ""
    name: str
    klass: str
    memory_total_bytes: int = Field(ge=0)
    memory_used_bytes: int = Field(default=0, ge=0)


class Inventory(BaseModel):
    """A node's hardware: logical cores, memory in bytes, GPUs (empty is an answer, not an error).

    No count is negative (a 400 at the agent API: a security tester's node reported -4 cores and
    GPUs of negative memory, and every view and capacity sum took them); available memory above
    the total is read as the total (a reading, not a lie worth refusing a node for)."""

    hostname: str = ""
    cores: int = Field(ge=0)
    memory_total_bytes: int = Field(ge=0)
    memory_available_bytes: int = Field(ge=0)
    gpus: list[GPU] = Field(default_factory=list)

    @model_validator(mode="after")
    def _available_within_total(self) -> Inventory:
        self.memory_available_bytes = min(self.memory_available_bytes, self.memory_total_bytes)
        return self


class ProvisionState(StrEnum):
    """An engine's provisioning state on a node, as the nodes view shows it."""

    INSTALLED = "installed"
    INSTALLING = "installing"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"


class EngineStatus(BaseModel):
    """One engine on a node: ``detail`` says where it is, or what to do when it is not there."""

    engine: str
    version: str = ""
    state: ProvisionState
    detail: str = ""
    binary: str = ""
    features: list[str] = Field(default_factory=list)  # "rpc" (llama.cpp's rpc-server beside it), "ray" (vLLM's)


class ReplicaState(StrEnum):
    """A replica's state as its node reports it.

    ``fetching`` (weights coming from the mirror) → ``starting`` (engine launched, loading) →
    ``ready`` (``/health`` 200) ; ``failed`` (err says why: the engine's last log lines) ;
    ``stopped``. The control plane adds ``pending`` for a replica placed on no node yet.
    """

    PENDING = "pending"
    FETCHING = "fetching"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class ReplicaStatus(BaseModel):
    """A replica as the agent reports it. ``endpoint`` is ``host:port`` of its engine."""

    id: str
    state: ReplicaState
    err: str = ""
    endpoint: str = ""
    pid: int | None = None
    started_at: float | None = None  # unix seconds
    group_endpoint: str = ""  # a vLLM group's head: its Ray cluster's address (``host:port``), for the workers


class GroupRole(StrEnum):
    """A node's part in a replica spread over several nodes (a profile's ``nodes`` above 1)."""

    HEAD = "head"  # serves the API: llama-server --rpc …, or vllm serve on the Ray head
    WORKER = "worker"  # rpc-server, or a Ray worker


class GroupMember(BaseModel):
    """One node of a group replica, as the control plane keeps it and sends it to every member.

    Attributes:
        node: the member's node id.
        rank: 0 for the head, 1… for the workers (the order of ``--rpc`` and of pipeline stages).
        memory_gb: its share of the model's memory (GB, 10^9 bytes), what placement reserved there.
        gpu_indexes: its cards (GPU profiles).
        endpoint: a worker's address for the head (``host:port`` of its RPC tunnel, or its Ray
            node address), as its agent reported it; empty until then.
        state: a worker's state as its agent reported it (``starting``, ``ready``, ``failed``).
        err: a worker's error, with its engine's last lines.
    """

    node: str
    rank: int
    memory_gb: float = 0.0
    gpu_indexes: list[int] = Field(default_factory=list)
    endpoint: str = ""
    state: str = ""
    err: str = ""


class ReplicaSpec(BaseModel):
    """A replica the control plane wants on this node.

    Attributes:
        source_url: the mirror's URL of the weights file.
        sha256: the digest to verify after download (empty: use the mirror's ``X-Checksum-Sha256``).
        args: the profile's engine args; the agent adds ``--port``, ``--threads`` and ``--api-key``.
        cpu_cores: cores reserved for it (``--threads``); 0 means share the node's cores.
        key: the API key the engine must require (``--api-key``); the gateway sends it.
        role: None for a replica on one node; for a group replica (a profile's ``nodes`` above 1)
            this node's part, ``head`` or ``worker``. Every member gets a spec with the same ``id``.
        members: a group's members, head first (rank 0), with the workers' endpoints as they
            are reported: the head starts its engine once every worker has one.
        env: the profile's engine environment (NCCL/Gloo settings).
        draining: the replica is leaving (routed no more; stopped once its requests end), or was placed
            from a profile, source or version the catalog no longer has (the leader drains or replaces
            it): the agent keeps the engine it runs as it is, even when the rest of the spec changed
            (restarting it onto a new version's weights in place cut its streams).
    """

    id: str
    model: str
    version: str
    profile: str
    engine: str
    source_url: str
    sha256: str = ""
    file_name: str
    args: list[str] = Field(default_factory=list)
    cpu_cores: int = 0
    gpu_indexes: list[int] = Field(default_factory=list)
    key: str
    role: GroupRole | None = None
    members: list[GroupMember] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    draining: bool = False


class Heartbeat(BaseModel):
    """What an agent reports each ``heartbeat_interval_s``."""

    agent_version: str = ""
    inventory: Inventory
    labels: dict[str, str] = Field(default_factory=dict)
    """agent.yaml's labels; keys follow :mod:`llmgw.names` (a bad one is a 400 at the agent API)."""
    engines: list[EngineStatus] = Field(default_factory=list)
    replicas: list[ReplicaStatus] = Field(default_factory=list)
    instance: str = ""
    """Random per agent process start: the control plane refuses a second agent (another instance)
    presenting a node id whose heartbeats are still arriving (HTTP 409 ``node_id_in_use``)."""
    cached: list[str] = Field(default_factory=list)
    """Weights in the node's cache, as ``model/version``: placement prefers nodes that hold them."""

    desired_digest: str = ""
    """:func:`desired_digest` of the ``desired`` list this agent last applied ("" from older agents,
    or none applied yet): when it is the control plane's, the reply leaves the list out."""

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)


KEEPALIVE_S = 300.0
"""How long the agent keeps its idle connection to the control plane (s), above the longest beat
interval the control plane hands out at the default rate (111 s at 5,000 nodes), so a beat reuses
the connection instead of making a new mTLS handshake. With aiohttp's default (15 s) every beat
past ~675 nodes (interval 15 s at 50 beats/s) was a new handshake: bench/scale.py's control plane,
at 0.2-0.3 cores of a loaded machine, spent 45 % of its time in handshakes (py-spy) and stalled at
751 of 2,000 agents (509 at 25 beats/s); with 300 s, 1,000 registered in 102 s. The control plane's
agent listener keeps idle connections as long (``llmgw.control.server``)."""

#: The fields of a :class:`Heartbeat` the control plane stores (``nodes`` columns, the replica
#: reports): what :func:`state_digest` covers, nothing else (``agent_version`` is not stored).
STATE_FIELDS = frozenset({"inventory", "labels", "engines", "replicas", "instance", "cached"})


def state_digest(hb: Heartbeat) -> str:
    """The sha256 (64 hex digits) of :data:`STATE_FIELDS` of ``hb`` in a canonical JSON form
    (keys sorted, no spaces, ``cached`` sorted as the store keeps it): the one definition the agent
    (to decide whether its state changed) and the control plane (to store with the node) share."""
    state = hb.model_dump(mode="json", include=set(STATE_FIELDS))
    state["cached"] = sorted(state["cached"])
    return hashlib.sha256(json.dumps(state, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Pulse(BaseModel):
    """A small beat: the agent is alive and its state is the one whose :func:`state_digest` it
    names (the one the control plane last acknowledged). Sent to the same path as a
    :class:`Heartbeat`; a body without ``inventory`` is a pulse.

    Attributes:
        digest: :func:`state_digest` of the agent's current state (64 hex digits).
        instance: as :attr:`Heartbeat.instance`.
        term: the highest leadership term this agent has seen (informational: the control plane
            does not act on it today; the agent itself refuses a reply with a lower one).
        desired_digest: as :attr:`Heartbeat.desired_digest`.
        agent_version: the agent's version.
    """

    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    instance: str = ""
    term: int = 0
    desired_digest: str = ""
    agent_version: str = ""


class LogRequest(BaseModel):
    """The control plane asks for a replica's engine log: the last ``lines`` lines, or, with
    ``offset``, what follows that byte of the current log file (``--follow``)."""

    id: str
    replica_id: str
    lines: int = 100
    offset: int | None = None


class LogReply(BaseModel):
    """An agent's answer to a :class:`LogRequest`: the text, and the byte offset to ask from next.

    ``found`` is False when the node has no log for that replica.
    """

    id: str
    replica_id: str
    text: str = ""
    offset: int = 0
    found: bool = True


class HeartbeatReply(BaseModel):
    """The control plane's answer: the node id it read from the certificate, the desired replicas,
    and what the agent needs to follow an HA cluster.

    Attributes:
        term: the leadership term the answering control plane read from the database with
            ``desired`` (the fencing token: bumped on every leader change). An agent keeps the
            highest term it has seen and ignores a reply carrying a lower one (a control plane left
            on a stale database); 0 means the control plane knows no term yet.
        leader: the agent-API URL (``https://HOST:7443``) of the leading control plane, "" when
            none leads now.
        control_planes: the agent-API URLs of every live control plane; the agent adds them to
            the list it rotates through (agent.yaml's ``servers`` stay first).
        interval_s: seconds until the next beat: ``max(2, nodes / (0.9 × cluster.max_heartbeats_per_s))``
            (:mod:`llmgw.control.api.cadence`); the agent beats at a jittered 80-100 % of it.
        digest: the :func:`state_digest` the control plane holds for this node after this beat
            (computed from a full state, never taken from the agent); "" when it holds none.
        send_full: the pulse's digest is not the one held (a new node, a lost update, a lie, a
            node marked lost): nothing was recorded; send the full :class:`Heartbeat` now.
        desired_digest: :func:`desired_digest` of the replicas this node must run.
        desired_unchanged: ``desired`` is left out (empty) because the agent's ``desired_digest``
            is ``desired_digest``: keep running what it runs. Never True for an older agent
            (it sends no ``desired_digest``).
    """

    node_id: str
    desired: list[ReplicaSpec] = Field(default_factory=list)
    interval_s: float = 2.0
    log_requests: list[LogRequest] = Field(default_factory=list)
    term: int = 0
    leader: str = ""
    control_planes: list[str] = Field(default_factory=list)
    digest: str = ""
    send_full: bool = False
    desired_digest: str = ""
    desired_unchanged: bool = False


def desired_digest(desired: Sequence[ReplicaSpec]) -> str:
    """The sha256 (64 hex digits) of a desired list in canonical JSON (in its order, which the
    control plane keeps: by creation time, then id)."""
    specs = [s.model_dump(mode="json") for s in desired]
    return hashlib.sha256(json.dumps(specs, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class EngineMetricsText(BaseModel):
    """One engine's ``/metrics`` page as its agent read it (Prometheus text format), for the control
    plane to relay with ``replica``, ``model`` and ``node`` labels (``POST /agent/v1/metrics``)."""

    replica: str = Field(max_length=80)
    model: str = Field(max_length=63)
    text: str = Field(max_length=256 * 1024)
