"""The agent API: agents report their node and receive the replicas it must run (mTLS, JSON).

``POST /agent/v1/register`` (an agent's first call) and ``POST /agent/v1/heartbeat`` (every
``heartbeat_interval_s``) are the same exchange: body :class:`~llmgw.protocol.Heartbeat`, answer
:class:`~llmgw.protocol.HeartbeatReply`.

The node id is the CN of the agent's client certificate, read from the TLS session
(``request.transport.get_extra_info("peercert")``, measured to work with aiohttp, which is why
every server is aiohttp). The TLS context (:func:`agent_ssl_context`) requires a certificate signed by
the cluster CA, so a client without one never reaches a handler. A node cannot speak for another's
replicas: only replicas placed on the CN's node take its reports.

Revocation: a node removed with ``llmgw ctl node rm`` has the serials of the certificates its agent
presented put on a deny-list in the store (:meth:`~llmgw.control.store.sql.Store.remove_node`), and
the time of its removal kept: a certificate for that node issued before it (by its ``notBefore``,
:func:`llmgw.tlsconf.issued_at`) is refused too, so a second bundle issued for the node and never
presented cannot bring it back. Every request is checked after the handshake
(:meth:`~llmgw.control.store.base.Store.refused_cert`): a refused certificate gets 403
``certificate_revoked``, with what to do to re-join, and its agent stops (:mod:`llmgw.agent.loop.loop`).
The serials a node presents are remembered as its heartbeats arrive (in the heartbeat's own write).

A pulse (the regular beat: liveness and a digest) that has nothing else to record is one store trip
(:func:`plain_pulse`: handed whole to the heartbeats' batch, :func:`beat_batch`, which reads and
writes it on the batch's store thread).
A full heartbeat is two store trips (:func:`heartbeat`): one read
(:meth:`~llmgw.control.store.base.Store.read_heartbeat`: the verdict on the certificate, the node's
row before, the replicas placed on it and their models, from which :func:`desired_specs` builds the
reply on the same store thread) and one batched write
(:meth:`~llmgw.control.store.base.Store.write_heartbeats`, through a
:class:`~llmgw.control.store.offloop.Batcher`: the revocation checked again in the write
transaction, the serial remembered, the heartbeat recorded, the replica reports applied and the
log requests queued in the store taken, one transaction for every heartbeat of the batch). The
reply is sent before ``on_node`` and ``on_heartbeat`` are called: the routing table's refresh and
the leader's wake-up are requested after it, never awaited by the agent.

``POST /agent/v1/metrics`` (a list of :class:`~llmgw.protocol.EngineMetricsText`): the node's engines'
``/metrics`` pages, relayed on the control plane's ``GET /metrics``
(:mod:`llmgw.control.api.enginemetrics`).

Errors are JSON ``{"error": {"code", "message"}}``: 400 for a body that is not a Heartbeat (or
not bounded JSON: :mod:`llmgw.jsonbody`; label keys per :mod:`llmgw.names`), 401 when the session
carries no certificate (a server run without client verification), 403 for a revoked certificate
or when its CN is not a valid node id, 409 ``node_id_in_use``, 500 ``internal`` for anything else
(handlers raise :class:`~llmgw.errors.HttpError`; :mod:`llmgw.httperrors` answers it).

The handlers (:func:`heartbeat`, :func:`log_reply`, :func:`engine_metrics`, :func:`not_found`) are
module-level and listed in :data:`ROUTES`; what they share (the store, the off-loop pool, the
heartbeat batcher, the callbacks) is one :class:`AgentContext` on the app under :data:`AGENT`, which
:func:`build_agent_app` builds from its arguments.
"""

from __future__ import annotations

import functools
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from aiohttp import web
from pydantic import TypeAdapter, ValidationError

from llmgw import jsonbody, tlsconf
from llmgw.config import ServerConfig
from llmgw.control.api.beatside import (
    MAX_BATCHED_PULSES,
    HeartbeatSeen,
    PulseDone,
    PulseJob,
    beat_batch,
    hold_for,
    id_in_use,
    read_side,
    recordable,
)
from llmgw.control.api.cadence import MIN_INTERVAL_S, Cadence
from llmgw.control.api.logbroker import LogBroker
from llmgw.control.api.nodelabels import honoured
from llmgw.control.store import Store
from llmgw.control.store.offloop import Batcher, OffLoop
from llmgw.control.store.rows import BeatResult, BeatWrite
from llmgw.errors import HttpError, Revoked, StoreUnavailable
from llmgw.httperrors import error_middleware
from llmgw.names import NAME_RE, NAME_RULE
from llmgw.protocol import (
    EngineMetricsText,
    Heartbeat,
    HeartbeatReply,
    LogReply,
    LogRequest,
    Pulse,
    state_digest,
)

log = logging.getLogger(__name__)

_PAGES = TypeAdapter(list[EngineMetricsText])
_LOG_REPLY = TypeAdapter(LogReply)
_Report = TypeVar("_Report")

class PagesSink(Protocol):
    """Where ``POST /agent/v1/metrics`` puts a node's engine pages: the control plane's
    :class:`~llmgw.control.api.enginemetrics.EngineMetrics`, or (the agent API in a process of its
    own) the channel to it (:class:`llmgw.control.agentworker.RelayedPages`)."""

    def put(self, node: str, pages: list[EngineMetricsText]) -> None:
        """Keep (or pass on) ``node``'s latest pages."""


#: The shortest heartbeat interval the control plane asks agents for (seconds; it grows with the
#: cluster: :mod:`llmgw.control.api.cadence`).
HEARTBEAT_INTERVAL_S = MIN_INTERVAL_S

MAX_ISSUED = 100_000
"""Certificates whose ``notBefore`` the agent API keeps parsed (one per node; cleared past this)."""

STORE_KEY: web.AppKey[Store] = web.AppKey("store", Store)


@dataclass(frozen=True)
class AgentContext:
    """The agent API's shared state, kept on the app under :data:`AGENT` (what its handlers were
    closures over before); :func:`build_agent_app` says what each field is.

    Attributes:
        store: the state store; every call goes through ``db`` (off the event loop).
        db: the off-loop pool (:mod:`llmgw.control.store.offloop`).
        beats: batches the heartbeats' writes (:meth:`~llmgw.control.store.base.Store.write_heartbeats`:
            one write transaction per batch).
        clock: unix seconds.
        cadence: the heartbeat interval replies ask for (s), sized by the node count
            (:mod:`llmgw.control.api.cadence`).
        node_lost_after_s: bounds how long a node id stays held (:func:`hold_for`).
        logs: log reads waiting for agents; None: no log requests go out.
        on_heartbeat: ``(node_id, changed)`` after each stored heartbeat's reply was sent.
        on_node: a node registered or came back from ``lost`` (called after the reply was sent).
        cluster: ``(term, leader's agent URL, live control planes' agent URLs)`` for each reply.
        engines: keeps the engine metrics pages agents post; None: posts are dropped.
        seen: ``(node, serial)`` pairs this process already remembered in the store.
        issued: a certificate's ``notBefore`` (unix s) by serial, parsed once (``strptime`` took
            ~0.14 ms of every beat).
        own_nodes: the control planes' own nodes, the only ones whose ``llmgw.control-plane`` label
            is stored (:mod:`llmgw.control.api.nodelabels`); None: no node's. ``warned``: those logged.
    """

    store: Store
    db: OffLoop
    beats: Batcher[BeatWrite | PulseJob, BeatResult | PulseDone]
    clock: Callable[[], float] = time.time
    cadence: Cadence = field(default_factory=Cadence)
    node_lost_after_s: float = 30.0
    logs: LogBroker | None = None
    on_heartbeat: Callable[[str, bool], None] | None = None
    on_node: Callable[[str], None] | None = None
    cluster: Callable[[], tuple[int, str, list[str]]] | None = None
    engines: PagesSink | None = None
    seen: set[tuple[str, str]] = field(default_factory=set)
    issued: dict[str, float | None] = field(default_factory=dict)
    own_nodes: Callable[[], frozenset[str]] | None = None
    warned: set[str] = field(default_factory=set)


#: Where the agent app keeps its :class:`AgentContext`.
AGENT: web.AppKey[AgentContext] = web.AppKey("agent", AgentContext)


def is_name(node_id: str) -> bool:
    """Whether a certificate's CN is a node id of :mod:`llmgw.names` (else the agent API answers 403)."""
    return bool(NAME_RE.fullmatch(node_id))


def agent_ssl_context(config: ServerConfig) -> ssl.SSLContext:
    """The agent API's TLS context from ``config.tls``: client certificates REQUIRED from its CA."""
    return tlsconf.server_context(config.tls.ca, config.tls.cert, config.tls.key)


def peer_serial(peercert: dict[str, object] | None) -> str:
    """The serial of a verified peer certificate (``getpeercert()``) as upper-case hex without
    leading zeros (the form the store keeps), or ``""``."""
    raw = peercert.get("serialNumber") if peercert else None
    try:
        return format(int(str(raw), 16), "X") if raw else ""
    except ValueError:
        return ""


def revoked_message(node_id: str, serial: str, revoked_at: float) -> str:
    """What a removed node's agent is told (403 ``certificate_revoked``), and logs before it stops."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(revoked_at))
    return (
        f"node '{node_id}' was removed from the cluster ('llmgw ctl node rm') at {when}, and every "
        f"certificate issued for it until then, this agent's (serial {serial}) too, was revoked with it. "
        "To re-join, run 'llmgw server add-node "
        f"{node_id} --address ADDR --out DIR' on the control plane, copy DIR to this node's /etc/llmgw "
        "(a new certificate, issued after the removal) and start the agent again"
    )


def node_of(request: web.Request) -> str | None:
    """The CN of the session's client certificate, or None (no certificate, or no transport)."""
    return tlsconf.peer_common_name(
        request.transport.get_extra_info("peercert") if request.transport else None
    )


def peercert_of(request: web.Request) -> dict[str, object] | None:
    """The session's client certificate as :meth:`ssl.SSLSocket.getpeercert` gives it, or None."""
    return request.transport.get_extra_info("peercert") if request.transport else None


def serial_of(request: web.Request) -> str:
    """The serial of the session's client certificate (:func:`peer_serial`), or ``""``."""
    return peer_serial(peercert_of(request))


def revoked_error(node_id: str, serial: str, revoked_at: float) -> HttpError:
    """The 403 ``certificate_revoked`` for ``node_id``'s ``serial`` (logged as a warning)."""
    log.warning("node %s: refused a request with revoked certificate serial %s", node_id, serial)
    return HttpError(403, "certificate_revoked", revoked_message(node_id, serial, revoked_at))


def raise_refused(node_id: str, wrote: BeatResult) -> None:
    """Raise what the heartbeat's write refused it for: 403 for a certificate revoked meanwhile
    (checked again in the write transaction), else the write's own error (a 409 that kept racing)."""
    if isinstance(wrote.refused, Revoked):
        raise revoked_error(node_id, wrote.refused.serial, wrote.refused.revoked_at)
    if wrote.refused is not None:
        raise wrote.refused


def id_in_use_error(node_id: str, beat: Heartbeat | Pulse, clash: str) -> HttpError:
    """The 409 ``node_id_in_use`` for a second agent instance (:func:`id_in_use`'s ``clash``), logged."""
    log.warning("node %s: refused a heartbeat from a second agent (instance %s)", node_id, beat.instance)
    return HttpError(409, "node_id_in_use", clash)


def check_serial(
    ctx: AgentContext, node_id: str, serial: str, issued_at: float | None
) -> tuple[str, float] | None:
    """On a store thread: the revocation refusing this certificate, else remember its serial for
    the node (once)."""
    store, seen = ctx.store, ctx.seen
    gone = store.refused_cert(node_id, serial, issued_at)
    if gone is None and (node_id, serial) not in seen:
        store.note_cert(node_id, serial, ctx.clock())
        seen.add((node_id, serial))
    return gone


async def check_revoked(request: web.Request, node_id: str) -> None:
    """Raise 403 when the session's certificate is revoked; else remember its serial (once)."""
    serial = serial_of(request)
    if not serial:
        return
    ctx = request.app[AGENT]
    gone = await ctx.db.run(check_serial, ctx, node_id, serial, tlsconf.issued_at(peercert_of(request)))
    if gone is not None:
        raise revoked_error(node_id, serial, gone[1])


def identify(request: web.Request) -> str:
    """The node id (the certificate's CN); raises 401/403 for a session without a valid one."""
    node_id = node_of(request)
    if not node_id:
        raise HttpError(
            401,
            "no_client_certificate",
            "the agent API needs a client certificate from the cluster CA; "
            "issue one with 'llmgw server init' on the control plane",
        )
    if not is_name(node_id):
        raise HttpError(
            403, "invalid_node_id",
            f"the client certificate's CN {node_id[:80]!r} is not a valid node id ({NAME_RULE}); "
            "issue a certificate for a valid id with 'llmgw server add-node'",
        )
    return node_id


def parse_beat(body: object) -> Heartbeat | Pulse:
    """A beat's JSON body as a :class:`~llmgw.protocol.Pulse` (it has ``digest`` and no
    ``inventory``) or a :class:`~llmgw.protocol.Heartbeat` (a full beat, as every older agent
    sends); raises the 400 naming what is wrong with it."""
    pulse = isinstance(body, dict) and "digest" in body and "inventory" not in body
    shape: type[Heartbeat | Pulse] = Pulse if pulse else Heartbeat
    try:
        return shape.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(body)"
        raise HttpError(400, "invalid_heartbeat", f"{where}: {first['msg']}") from e


async def read_heartbeat(request: web.Request) -> Heartbeat | Pulse:
    """The body as a Heartbeat or a Pulse (:func:`parse_beat`); raises the 400/413 naming what is wrong."""
    return parse_beat(await jsonbody.read_json(request))


async def plain_pulse(request: web.Request, node_id: str, beat: Pulse, serial: str, issued_at: float | None
                      ) -> web.StreamResponse:
    """:func:`heartbeat` for a pulse that notes nothing and takes no stored log requests: handed
    whole to the heartbeats' batch (:func:`beat_batch`), the same answers."""
    ctx = request.app[AGENT]
    job = PulseJob(node_id, serial, issued_at, beat, hold_for(ctx.cadence.lost_after_s, ctx.cadence.interval_s))
    done = await ctx.beats.submit(job)
    if not isinstance(done, PulseDone):  # beat_batch answers each item in kind
        raise TypeError(f"the heartbeats' batch answered a pulse with a {type(done).__name__}")
    if done.error is not None:
        raise done.error
    seen, wrote = done.seen, done.wrote
    if seen.refused is not None:
        raise revoked_error(node_id, serial, seen.refused[1])
    if done.clash:
        raise id_in_use_error(node_id, beat, done.clash)
    if wrote is not None:
        raise_refused(node_id, wrote)
    if wrote is None or wrote.stale:  # lost, or another full beat moved its digest: its full state, please
        return await send(request, reply_for(ctx, node_id, seen, beat.desired_digest, send_full=True))
    logs = (ctx.logs.take(node_id) if ctx.logs is not None else []) + wrote.logs
    reply = reply_for(ctx, node_id, seen, beat.desired_digest, digest=beat.digest, logs=logs)
    return await send(request, reply, node_id=node_id, changed=bool(wrote.changed))


async def heartbeat(request: web.Request) -> web.StreamResponse:
    """``POST /agent/v1/register`` and ``/agent/v1/heartbeat``: store the node's report (or, for a
    pulse, its liveness), answer a :class:`~llmgw.protocol.HeartbeatReply` (409 ``node_id_in_use``,
    403 ``certificate_revoked``).

    Two store trips: one read (:func:`read_side`), one batched write (``ctx.beats``); one, the
    batch, for a pulse that notes no certificate and takes no stored log requests (:func:`plain_pulse`). ``on_node`` and
    ``on_heartbeat`` are called once the reply was sent. A pulse whose digest is not the stored one
    (or whose node is not ``ready``) writes nothing and is answered ``send_full``."""
    ctx = request.app[AGENT]
    node_id = identify(request)
    beat = await read_heartbeat(request)
    ctx.cadence.tick()
    serial = serial_of(request)
    if serial not in ctx.issued:
        if len(ctx.issued) > MAX_ISSUED:
            ctx.issued.clear()
        ctx.issued[serial] = tlsconf.issued_at(peercert_of(request))
    issued_at = ctx.issued[serial]
    note = bool(serial) and (node_id, serial) not in ctx.seen  # remember the serial in this beat's write
    if (
        isinstance(beat, Pulse)
        and not note
        and ctx.beats.pending < MAX_BATCHED_PULSES
        and not (ctx.logs is not None and ctx.logs.stored_waiting(node_id))
    ):
        return await plain_pulse(request, node_id, beat, serial, issued_at)
    # Checked here, and again inside the batched write (Store.write_heartbeats, in the write
    # transaction node removal takes): a node removed meanwhile is never written back.
    pulse = isinstance(beat, Pulse)
    seen = await ctx.db.read(read_side, ctx.store, node_id, serial, issued_at, pulse=pulse)
    if seen.refused is not None:
        raise revoked_error(node_id, serial, seen.refused[1])
    now = ctx.clock()
    before = seen.before
    clash = id_in_use(before, beat, now, hold_s=hold_for(ctx.cadence.lost_after_s, ctx.cadence.interval_s))
    if clash:
        raise id_in_use_error(node_id, beat, clash)
    if isinstance(beat, Pulse):
        hb, digest = None, beat.digest
        kept = digest
        if not recordable(before, digest):
            return await send(request, reply_for(ctx, node_id, seen, beat.desired_digest, send_full=True))
    else:
        hb, digest = honoured(node_id, beat, ctx.own_nodes, ctx.warned), state_digest(beat)  # as the agent sent it
        # stored other than sent (a label dropped): no digest kept, so the agent's next pulse gets send_full
        # and its next full beat is judged again (a control plane's own node seen before its row named it)
        kept = digest if hb is beat else ""
    wants_logs = ctx.logs is not None and ctx.logs.wants_stored(node_id)
    wrote = await ctx.beats.submit(BeatWrite(node_id, hb, now, serial, issued_at, note=note, logs=wants_logs,
                                             digest=kept))
    if not isinstance(wrote, BeatResult):
        raise TypeError(f"the heartbeats' batch answered a heartbeat with a {type(wrote).__name__}")
    raise_refused(node_id, wrote)
    if note:
        ctx.seen.add((node_id, serial))
    if wrote.stale:  # lost, or another full beat moved its digest, between the read and the write
        return await send(request, reply_for(ctx, node_id, seen, beat.desired_digest, send_full=True))
    if before is None:
        log.info("node %s registered", node_id)
        ctx.cadence.node_added()
    node_changed = hb is not None and (before is None or before.state != "ready")
    logs = (ctx.logs.take(node_id) if ctx.logs is not None else []) + wrote.logs
    reply = reply_for(ctx, node_id, seen, beat.desired_digest, digest=digest, logs=logs)
    return await send(request, reply, node_id=node_id, changed=bool(wrote.changed) or node_changed,
                      node_came=node_changed)


def reply_for(
    ctx: AgentContext, node_id: str, seen: HeartbeatSeen, agent_desired: str, *, digest: str = "",
    send_full: bool = False, logs: list[LogRequest] | None = None,
) -> HeartbeatReply:
    """The reply to a beat: ``desired`` left out when the agent's ``agent_desired`` digest is the
    list's (``desired_unchanged``); the interval for the cluster's size (``ctx.cadence``)."""
    term, leader, members = ctx.cluster() if ctx.cluster is not None else (0, "", [])
    same = bool(agent_desired) and agent_desired == seen.desired_digest
    return HeartbeatReply(
        node_id=node_id, desired=[] if same else seen.desired, interval_s=ctx.cadence.interval_s,
        log_requests=logs or [], term=term, leader=leader, control_planes=members, digest=digest,
        send_full=send_full, desired_digest=seen.desired_digest, desired_unchanged=same,
    )


async def send(
    request: web.Request, reply: HeartbeatReply, *, node_id: str = "", changed: bool = False, node_came: bool = False
) -> web.StreamResponse:
    """Send ``reply`` now; then (``node_id`` given: a beat was recorded) call ``on_node`` (when
    ``node_came``) and ``on_heartbeat``: what follows (a routing refresh, the leader's wake-up) is
    requested, never waited for; requested even when the agent went away meanwhile (the write is
    committed)."""
    ctx = request.app[AGENT]
    response = web.json_response(text=reply.model_dump_json())
    try:
        await response.prepare(request)
        await response.write_eof()
    finally:
        if node_id and ctx.on_node is not None and node_came:
            ctx.on_node(node_id)
        if node_id and ctx.on_heartbeat is not None:
            ctx.on_heartbeat(node_id, changed)
    return response


async def read_report(request: web.Request, shape: TypeAdapter[_Report], code: str) -> tuple[str, _Report]:
    """A post beside the heartbeat (logs, metrics): its node id and its body as ``shape``; 401
    without a client certificate, 403 when it is revoked, 400 ``code`` naming what is wrong."""
    node_id = node_of(request)
    if not node_id:
        raise HttpError(
            401, "no_client_certificate", "the agent API needs a client certificate from the cluster CA"
        )
    await check_revoked(request, node_id)
    try:
        return node_id, shape.validate_python(await jsonbody.read_json(request))
    except ValidationError as e:
        raise HttpError(400, code, str(e.errors()[0]["msg"])) from e


async def log_reply(request: web.Request) -> web.Response:
    """``POST /agent/v1/logs`` (a :class:`~llmgw.protocol.LogReply`): answers a waiting log read."""
    logs = request.app[AGENT].logs
    node_id, answer = await read_report(request, _LOG_REPLY, "invalid_log_reply")
    if logs is None or not await logs.answer(node_id, answer):
        raise HttpError(404, "no_such_request", f"no log request {answer.id} waits for node {node_id}")
    return web.json_response({"status": "ok"})


async def engine_metrics(request: web.Request) -> web.Response:
    """``POST /agent/v1/metrics`` (a list of :class:`~llmgw.protocol.EngineMetricsText`)."""
    engines = request.app[AGENT].engines
    node_id, pages = await read_report(request, _PAGES, "invalid_metrics")
    if engines is not None:
        engines.put(node_id, pages)
    return web.json_response({"status": "ok"})


async def not_found(request: web.Request) -> web.Response:
    """Any other path or method: 404 ``not_found`` in the error shape."""
    raise HttpError(404, "not_found", f"{request.method} {request.path} is not an agent API route")


#: The agent API's routes; the catch-all :func:`not_found` last.
ROUTES = [
    web.post("/agent/v1/register", heartbeat),
    web.post("/agent/v1/heartbeat", heartbeat),
    web.post("/agent/v1/logs", log_reply),
    web.post("/agent/v1/metrics", engine_metrics),
    web.route("*", "/{tail:.*}", not_found),
]


def build_agent_app(
    store: Store,
    *,
    on_heartbeat: Callable[[str, bool], None] | None = None,
    clock: Callable[[], float] = time.time,
    cadence: Cadence | None = None,
    node_lost_after_s: float = 30.0,
    logs: LogBroker | None = None,
    db: OffLoop | None = None,
    on_node: Callable[[str], None] | None = None,
    cluster: Callable[[], tuple[int, str, list[str]]] | None = None,
    engines: PagesSink | None = None,
    own_nodes: Callable[[], frozenset[str]] | None = None,
) -> web.Application:
    """The agent API app (serve it with :func:`agent_ssl_context`): an :class:`AgentContext` from
    the arguments under :data:`AGENT`, the error middleware and :data:`ROUTES`.

    Args:
        store: the state store.
        on_heartbeat: called with ``(node_id, changed)`` after each heartbeat is stored and its
            reply sent; ``changed`` is True when a replica's state moved or the node was new or
            lost (the control plane requests a routing table refresh on it: the gateway routes to
            a replica a refresh after its ready report was answered, not before).
        clock: unix seconds.
        cadence: sizes the heartbeat interval replies ask for by the node count
            (:mod:`llmgw.control.api.cadence`); default: ``cluster.max_heartbeats_per_s`` 50, the
            count read from ``store``.
        node_lost_after_s: ``ServerConfig.node_lost_after_s``; bounds how long a node id stays
            held by the agent instance that last reported it (see :func:`id_in_use`).
        logs: log reads waiting for this node's agent, in memory or, in an HA cluster, in the shared
            store (:mod:`llmgw.control.api.logbroker`): each reply carries the node's pending ones and
            ``/agent/v1/logs`` answers them, whichever control plane asked.
        on_node: called with the node id when a node registers or comes back from ``lost``, after
            the reply (the control plane wakes the leader on it: there is new capacity to place on).
        db: runs the store calls off the event loop (:mod:`llmgw.control.store.offloop`); default: a
            pool of this app's own, closed with it.
        cluster: ``(term, leader's agent URL, live control planes' agent URLs)`` for each reply
            (:meth:`~llmgw.control.reconcile.membership.Membership.reply_fields`, read from memory);
        engines: keeps the engine metrics pages agents post to ``/agent/v1/metrics``
            (:mod:`llmgw.control.api.enginemetrics`); None: posts are accepted and dropped.
            default: term 0, no leader, no members.
        own_nodes: the control planes' own nodes (:meth:`~llmgw.control.reconcile.membership.Membership.own_nodes`),
            the only ones whose ``llmgw.control-plane`` label is stored; None: no node's.

    A heartbeat whose store calls fail (the database is down or does not answer within the pool's
    deadline) is answered 503 ``store_unavailable``: the agent tries another control plane.
    """
    own_pool = db is None
    pool = db or OffLoop()

    async def _close(_: web.Application) -> None:
        pool.close()

    app = web.Application(
        middlewares=[error_middleware(service="the agent API", known={StoreUnavailable: (503, "store_unavailable")})]
    )
    app[STORE_KEY] = store
    app[AGENT] = AgentContext(
        store=store, db=pool, beats=Batcher(pool, functools.partial(beat_batch, store, clock)), clock=clock,
        cadence=cadence or Cadence(node_lost_after_s=node_lost_after_s, count=lambda: pool.read(store.count_nodes)),
        node_lost_after_s=node_lost_after_s, logs=logs, on_heartbeat=on_heartbeat, on_node=on_node,
        cluster=cluster, engines=engines, own_nodes=own_nodes,
    )
    ctx = app[AGENT]

    async def _count(_: web.Application) -> None:
        await ctx.cadence.start()

    app.on_startup.append(_count)
    if own_pool:
        app.on_cleanup.append(_close)
    app.add_routes(ROUTES)
    return app
