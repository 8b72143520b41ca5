"""A heartbeat's store side: what runs on a store thread, apart from the agent API's handlers
(:mod:`llmgw.control.api.agent`, which import it): a beat's read (:func:`read_side`: the verdict on
the certificate, the node before, the replicas its agent must run), the judgement of a second agent
on one node id (:func:`id_in_use`, :func:`hold_for`), and the heartbeats' batch (:func:`beat_batch`):
a plain pulse (:class:`PulseJob`) is read, judged and written there in one hand-off from the event
loop, a full beat's write joins it (one write transaction for the batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from llmgw.control.api.desired import desired_specs
from llmgw.control.store import NodeRow, Store
from llmgw.control.store.offloop import UNREACHABLE
from llmgw.control.store.rows import BeatResult, BeatWrite, NodeLiveness
from llmgw.protocol import Heartbeat, Pulse, ReplicaSpec, desired_digest

MAX_BATCHED_PULSES = 32
"""A pulse goes into the heartbeats' batch whole (read there too, :func:`beat_batch`) only while
fewer than this wait for the next batch; past it (a reconnect storm, a slow database) it is read on
the readers' threads as a full beat is: a batch's reads run one after another under one deadline
(:data:`~llmgw.control.store.offloop.STORE_DEADLINE_S`), ~0.6 ms each on SQLite at 5,000 nodes."""


def hold_for(node_lost_after_s: float, interval_s: float) -> float:
    """How long (s) a node id stays held by the agent instance that last reported it: three
    heartbeat intervals, at most half of ``node_lost_after_s``. Long enough that a second live
    agent (beating every interval) never gets in; short enough that a restarted agent (a new
    instance) is back within seconds and well before the node would be marked lost."""
    return min(3 * interval_s, node_lost_after_s / 2)


def id_in_use(before: NodeRow | NodeLiveness | None, hb: Heartbeat | Pulse, now: float, *, hold_s: float) -> str:
    """Why this heartbeat is refused (empty: it is not): another agent instance presenting the
    same node id reported within ``hold_s`` seconds (two machines with one hostname, or a copied
    certificate). Heartbeats without an instance (older agents) are never refused."""
    if before is None or not before.instance or not hb.instance or before.instance == hb.instance:
        return ""
    if before.state != "ready" or now - before.last_seen > hold_s:
        return ""
    return (
        f"node id '{before.id}' is in use by another agent (instance {before.instance}, last heartbeat "
        f"{now - before.last_seen:.1f} s ago); two machines cannot share one node id. Give this machine "
        f"its own: set node_id in agent.yaml and issue a certificate for it with 'llmgw server init', "
        f"or stop the other agent"
    )


def recordable(before: NodeRow | NodeLiveness | None, digest: str) -> bool:
    """Whether a pulse with ``digest`` may be recorded as it is: its node is ``ready`` with that
    digest stored. Otherwise nothing is written and the agent is asked for its full state
    (``send_full``: a new node, a lost update, an agent that lies, a node marked lost)."""
    return before is not None and before.state == "ready" and bool(before.digest) and before.digest == digest


@dataclass(frozen=True)
class HeartbeatSeen:
    """What :func:`read_side` gives the handler: the refusal (``(node, revoked_at)``) or None, the
    node's row before this beat (its liveness columns for a pulse), the replicas its agent must
    run and their :func:`~llmgw.protocol.desired_digest`."""

    refused: tuple[str, float] | None
    before: NodeRow | NodeLiveness | None
    desired: list[ReplicaSpec]
    desired_digest: str = ""


def read_side(
    store: Store, node_id: str, serial: str, issued_at: float | None, *, pulse: bool = False
) -> HeartbeatSeen:
    """On a store thread: a beat's one read (:meth:`~llmgw.control.store.base.Store.read_heartbeat`,
    or :meth:`~llmgw.control.store.base.Store.read_pulse`) and the reply's replicas built from it
    (:func:`desired_specs`) with their digest, off the event loop."""
    got = store.read_pulse(node_id, serial, issued_at) if pulse else store.read_heartbeat(node_id, serial, issued_at)
    if got.refused is not None:
        return HeartbeatSeen(got.refused, None, [])
    desired = desired_specs(node_id, got.replicas, got.models)
    return HeartbeatSeen(None, got.before, desired, desired_digest(desired))


@dataclass(frozen=True)
class PulseJob:
    """A pulse that notes no certificate and takes no stored log requests, handed whole to the
    heartbeats' batch (:func:`beat_batch`): its read happens on the batch's store thread.

    Attributes:
        node_id, serial, issued_at: as :func:`read_side` takes them.
        beat: the pulse.
        hold_s: how long the node id stays held by its agent (:func:`hold_for`, :func:`id_in_use`).
    """

    node_id: str
    serial: str
    issued_at: float | None
    beat: Pulse
    hold_s: float


@dataclass(frozen=True)
class PulseDone:
    """What :func:`beat_batch` gives back for a :class:`PulseJob`: the read (:class:`HeartbeatSeen`),
    the refusal of a second agent (``clash``, the 409's message) and what
    the write said (``wrote``; None when nothing was written: refused, a clash, or a digest the
    agent must back with its full state)."""

    seen: HeartbeatSeen
    clash: str = ""
    wrote: BeatResult | None = None
    error: Exception | None = None
    """This pulse's own read or judgement failed (a bad row, a bug): raised for it alone, not for
    the batch (a database that cannot be reached fails the whole batch, as it would each beat)."""


def beat_batch(
    store: Store, clock: Callable[[], float], items: list[BeatWrite | PulseJob]
) -> list[BeatResult | PulseDone]:
    """The heartbeats' batch (``AgentContext.beats``), on one store thread: each :class:`PulseJob`'s
    read (:func:`read_side`) and judgement (refused, a second agent, a digest that is not the stored
    one), then one write transaction (:meth:`~llmgw.control.store.base.Store.write_heartbeats`) for
    the full beats' writes and the pulses to record. A pulse is so one hand-off from the event loop
    to a store thread, not two (a read, then the batch): the hand-offs were a fifth of the loop's
    time for a pulse (py-spy, 2,000 nodes, 2026-12-06)."""
    out: list[BeatResult | PulseDone] = []  # a full beat's place holds its write until the write's result
    writes: list[BeatWrite] = []
    at: list[int] = []
    for i, item in enumerate(items):
        if isinstance(item, BeatWrite):
            out.append(BeatResult(None))
            writes.append(item)
            at.append(i)
            continue
        now = clock()
        try:
            seen = read_side(store, item.node_id, item.serial, item.issued_at, pulse=True)
            clash = "" if seen.refused is not None else id_in_use(seen.before, item.beat, now, hold_s=item.hold_s)
        except UNREACHABLE:
            raise
        except Exception as e:  # handed to this pulse's handler, which raises it
            out.append(PulseDone(HeartbeatSeen(None, None, []), error=e))
            continue
        out.append(PulseDone(seen, clash))
        if seen.refused is None and not clash and recordable(seen.before, item.beat.digest):
            writes.append(BeatWrite(item.node_id, None, now, item.serial, item.issued_at, digest=item.beat.digest))
            at.append(i)
    for i, wrote in zip(at, store.write_heartbeats(writes) if writes else [], strict=True):
        done = out[i]
        out[i] = replace(done, wrote=wrote) if isinstance(done, PulseDone) else wrote
    return out
