"""The control plane process (``llmgw server run``): store, leader loop, admin API, agent API, gateway.

:func:`serve` starts, in this order:

1. the **store** (SQLite WAL by default, ``store.url`` otherwise; migrations applied at open);
2. the three **listeners**: admin API on ``admin_listen`` (bearer token), agent API on
   ``agent_listen`` (TLS, client certificates from the cluster CA), gateway on ``gateway.listen``
   (API keys from ``gateway.keys_file``, re-read when the file changes and on SIGHUP,
   :mod:`llmgw.control.gateway.keys`; its handlers are cancelled when their client disconnects, which
   frees the engine's slot). All three bind before anything is served, so a port already taken
   stops the process with a :class:`~llmgw.errors.PortInUseError` naming it, nothing half-started left;
3. the **election** (:mod:`llmgw.control.reconcile.election`: PostgreSQL, a session advisory lock
   with a written lease and a term; SQLite, this process) and **membership**
   (:mod:`llmgw.control.reconcile.membership`: this control plane's row, the others', the term);
4. while, and only while, this control plane leads: the **leader** loop, the autoscaler
   (:mod:`~llmgw.control.reconcile.autoscale`; every control plane writes its gateway's load for it
   each second) and the judge keeper, on a
   store fenced by the term (:meth:`~llmgw.control.store.base.Store.fenced`), cancelled at once
   when leadership ends.

Every control plane serves the three listeners, leader or not. Store calls of the APIs and the
routing refresh have a deadline (:data:`~llmgw.control.store.offloop.STORE_DEADLINE_S`): with the
database down, the admin API and heartbeats answer 503 ``store_unavailable`` within it, and the
gateway keeps routing from its last table. The leader's passes run on a pool of their own without
a deadline (a pass reads GGUF headers over the network).

It runs until SIGTERM/SIGINT or ``stop`` is set, then shuts down gracefully
(:mod:`llmgw.control.gateway.drain`): every listener stops accepting, the gateway's requests in flight may
finish for up to ``gateway.drain_s`` and are then cut with an error event and ``data: [DONE]``,
and only then are the listeners, the leader and the store closed.

The pieces are wired with events, not timers (:class:`Wakes`): a heartbeat that changed something
requests a routing table refresh once it is answered (the agent never waits for it), and one from
a new or returning node wakes the leader (a replica that became ready gives the leader nothing to
do; one that failed is replaced after its backoff, 10 s at least, by the leader's timed pass); an
admin write does both, and is answered once the refresh ran; a leader pass that changed replicas
refreshes the routing table.

No store call and no reconcile pass runs on the event loop that serves the three listeners
(done there, a burst of admin writes made heartbeats wait 2 s at p50): store calls go through one
bounded pool (:class:`~llmgw.control.store.offloop.OffLoop`), routing rebuilds are coalesced
(:class:`~llmgw.control.store.offloop.Coalescer`: a burst of events costs one or two rebuilds) and
the leader's passes run on that pool too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
import socket
import ssl
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from llmgw import __version__, tlsconf
from llmgw.adminclient import connect_host
from llmgw.config import ServerConfig, load_server_config, parse_listen
from llmgw.control.agentproc import AgentProcess
from llmgw.control.api.admin import build_admin_app
from llmgw.control.api.agent import build_agent_app
from llmgw.control.api.cadence import Cadence
from llmgw.control.api.cluster import add_cluster_routes, health_fields
from llmgw.control.api.enginemetrics import EngineMetrics
from llmgw.control.api.keys import add_key_routes
from llmgw.control.api.logbroker import LogBroker
from llmgw.control.api.metrics import ControlPlaneMetrics, add_metrics_route
from llmgw.control.api.nodelabels import own_node
from llmgw.control.gateway.accesslog import log_exchange
from llmgw.control.gateway.accounting import Accounting
from llmgw.control.gateway.callers import KEYS_STALE_S, Callers
from llmgw.control.gateway.drain import Drain
from llmgw.control.gateway.inspect import Exchange
from llmgw.control.gateway.keys import GatewayKeys
from llmgw.control.gateway.limits import Limiter
from llmgw.control.gateway.load import LOAD, LOAD_KICK, LoadCounter, LoadReporter
from llmgw.control.gateway.table import StoreRouter
from llmgw.control.gcpauses import GcPauses
from llmgw.control.listeners import CANCEL_ON_DISCONNECT, bind_sockets, new_runner
from llmgw.control.openfiles import MIN_OPEN_FILES, raise_open_files_limit
from llmgw.control.reconcile.autoscale import Autoscaler
from llmgw.control.reconcile.election import OP_TIMEOUT_S, Election, PgElection, SoloElection, while_leading
from llmgw.control.reconcile.leader import Leader
from llmgw.control.reconcile.membership import Membership, default_agent_url
from llmgw.control.startcheck import agent_api_tls, read_admin_token, read_gateway_keys, ui_tls
from llmgw.control.store import Store, api_pool, default_url, open_store
from llmgw.control.store.offloop import ROUTES_MIN_GAP_S, SWITCH_INTERVAL_S, Coalescer, OffLoop
from llmgw.control.ui.adminapi import AdminApi
from llmgw.control.ui.app import build_ui_app
from llmgw.control.ui.auth import Tokens
from llmgw.control.ui.mount import mount_ui, ui_site
from llmgw.control.ui.throttle import LoginThrottle
from llmgw.errors import ConfigError, PortInUseError, ServiceError
from llmgw.guard.config import closed_judges
from llmgw.httperrors import start_site
from llmgw.mirror.client import MIRROR_TOKEN, read_token
from llmgw.paths import Paths

if TYPE_CHECKING:
    from llmgw.control.gateway.balancer import ReplicaLoad
    from llmgw.control.gateway.guard import GuardInspector
    from llmgw.control.reconcile.judgekeeper import JudgeKeeper

log = logging.getLogger(__name__)



class Wakes:
    """What the control plane's events wake (:func:`serve` wires them): the routing table's refresh
    and the leader of the current term. Every method only requests (cheap, on the loop): the
    refresh runs off the loop, coalesced (:class:`~llmgw.control.store.offloop.Coalescer`), and a
    woken leader starts its next pass at most once a second (:data:`~llmgw.control.reconcile.leader.MIN_GAP_S`).

    Args:
        routes: the routing table's refresh.

    Attributes:
        leaders: the leader of the current term while this control plane leads, else empty
            (:func:`serve`'s ``lead`` keeps it).
    """

    def __init__(self, routes: Coalescer) -> None:
        self.routes = routes
        self.leaders: list[Leader] = []

    def heartbeat(self, _node: str, changed: bool) -> None:
        """The agent API's ``on_heartbeat``, called once the reply was sent: a routing refresh when
        a replica's state moved or the node was new or lost (a replica that became ready gives the
        leader nothing to do)."""
        if changed:
            self.routes.request()

    def node_came(self, _node: str) -> None:
        """The agent API's ``on_node``: a node registered or came back from ``lost``, new capacity
        to place on: the leader's next pass."""
        self.wake_leader()

    def relayed(self, node: str, came: bool) -> None:
        """A heartbeat the agent API process answered changed something (:mod:`llmgw.control.agentproc`):
        :meth:`heartbeat`, and :meth:`node_came` when the node registered or came back."""
        self.heartbeat(node, True)
        if came:
            self.node_came(node)

    def wake_leader(self) -> None:
        """The leader's next pass now (nothing while this control plane does not lead)."""
        for leader in self.leaders:
            leader.wake()

    def changed(self) -> None:
        """An admin write (or a judge added to the mirror): both a routing refresh and a leader pass."""
        self.routes.request()
        self.wake_leader()


async def _start(
    app: web.Application,
    listen: str,
    setting: str,
    config_path: Path,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, tuple[str, int]]:
    """Bind ``app`` on ``listen`` (its runner: :func:`~llmgw.control.listeners.new_runner`); a taken
    port is a PortInUseError naming ``setting``."""
    host, port = parse_listen(listen)
    if ssl_context is not None:
        tlsconf.small_read_buffers()  # 58 KiB instead of 297 KiB per kept connection (one per node)
    runner = new_runner(app, setting)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_address=True)
    try:
        await start_site(site, what=f"{setting} {listen}", host=host, port=port,
                         fix=f"change {setting} in {config_path}")
    except PortInUseError:
        await runner.cleanup()
        raise
    bound = runner.addresses[0]
    return runner, (str(bound[0]), int(bound[1]))


def _gateway_app(
    router: StoreRouter,
    config: ServerConfig,
    inspector: GuardInspector | None = None,
    drain: Drain | None = None,
    keys: GatewayKeys | None = None,
    accounting: Accounting | None = None,
    observers: tuple[Callable[[Exchange], None], ...] = (),
    metrics: ControlPlaneMetrics | None = None,
) -> web.Application:
    from llmgw.control.gateway.app import build_gateway_app  # noqa: PLC0415 - its upstream client: this listener's alone

    def observe(ex: Exchange) -> None:
        for each in observers:
            each(ex)

    load = LoadCounter()  # the autoscaler's demand: a judge at zero replicas starts on the judgments it missed
    if inspector is not None:
        inspector.client.on_missing = load.missed
    app = build_gateway_app(
        router,
        keys=keys if keys is not None else read_gateway_keys(config),
        allow_loopback_without_key=config.gateway.allow_loopback_without_key,
        inspector=inspector,
        observe=observe if observers else None,
        callers=accounting.callers if accounting is not None else None,
        limiter=accounting.limiter if accounting is not None else None,
        routing_metrics=metrics,
        holds=lambda name: any(m.name == name and m.scaling.min == 0 < m.scaling.max for m in router.catalog()),
        load=load,
    )
    # A client that goes away cancels its handler, which closes the upstream request and frees the
    # engine's slot (an abandoned non-streamed request would otherwise generate to its end).
    app[CANCEL_ON_DISCONNECT] = True
    if inspector is not None:

        async def _close_judges(_: web.Application) -> None:
            await inspector.client.close()

        app.on_cleanup.append(_close_judges)
    if drain is not None:
        app.middlewares.append(drain.middleware)
        app.on_response_prepare.append(drain.on_prepare)
    return app


def _loads_of(gateway: web.Application) -> Callable[[], Mapping[str, ReplicaLoad]]:
    """The gateway app's per-replica figures (``UpstreamPool.loads``: slots, in flight, queued,
    picks), the one thing of the gateway the admin API reads (``GET /api/v1/replicas``' ``routing``)."""
    from llmgw.control.gateway.app import gateway_pool  # noqa: PLC0415 (as in _gateway_app)

    return gateway_pool(gateway).loads


def _guard(config: ServerConfig, router: StoreRouter) -> GuardInspector | None:
    """The guard inspector when server.yaml has a guard policy (guard.on()), else None."""
    if not config.guard.on():
        return None
    from llmgw.control.gateway.guard import CatalogFormats, route_judges  # noqa: PLC0415
    from llmgw.control.gateway.guard import GuardInspector as _GI  # noqa: PLC0415
    from llmgw.guard.judge import JudgeClient  # noqa: PLC0415

    formats = CatalogFormats(router.catalog)  # the routing snapshot: no store read on the gateway's path
    log.info("guardrails on: %s", ", ".join(p.name for p in config.guard.policies))
    return _GI(config.guard, JudgeClient(route_judges(router.resolve_any, formats)))


def _admin_app(
    store: Store, token: str, changed: Callable[[], None], config: ServerConfig, guard: GuardInspector | None,
    logs: LogBroker, db: OffLoop, settle: Callable[[], Awaitable[None]], members: Membership,
    metrics: ControlPlaneMetrics, paths: Paths, callers: Callers, loads: Callable[[], Mapping[str, ReplicaLoad]],
) -> web.Application:
    """The admin API with the guard's routes (``/api/v1/guard/...``, :mod:`llmgw.control.api.guard`), the
    cluster's (``/api/v1/cluster``, :mod:`llmgw.control.api.cluster`) and the keys' and usage (``/api/v1/keys``,
    ``/api/v1/usage``, :mod:`llmgw.control.api.keys`: a write updates the gateway's ``callers`` before its answer)."""
    from llmgw.control.api.guard import MirrorServe, add_guard_routes  # noqa: PLC0415

    app = build_admin_app(
        store, token=token, on_change=changed, logs=logs, db=db, settle=settle,
        max_replicas_per_model=config.max_replicas_per_model, health_fields=lambda: health_fields(members),
        closed_judges=closed_judges(config.guard),
        loads=loads,
    )
    mirror_token = _mirror_token(paths, token)
    serve = None
    if config.mirror.api:
        serve = MirrorServe(store, config.mirror.api, on_added=changed, mirror_token=mirror_token)
    add_guard_routes(app, inspector=guard, config=config.guard, store=store, serve=serve, db=db)
    add_cluster_routes(app, members, config.cluster.patroni)
    add_key_routes(app, store, db, callers=callers, on_change=changed)
    add_metrics_route(app, metrics, token)
    return app


def _election(store: Store, url: str, config: ServerConfig, name: str, db: OffLoop) -> Election:
    """PostgreSQL: :class:`PgElection` on the store's URL; any other database leads alone."""
    if url.startswith("postgresql"):
        lease = config.cluster.lease_s
        return PgElection(
            url, name, lease_s=lease, renew_s=config.cluster.renew_s, op_timeout_s=min(OP_TIMEOUT_S, lease / 2)
        )
    return SoloElection(store, name, db.run)


def _mirror_token(paths: Paths, admin_token: str) -> str:
    """The mirror management API's token (:mod:`llmgw.mirror.client`): this machine's
    ``mirror-token`` when it has one (a mirror on its own machine), else the admin token."""
    own = paths.etc / MIRROR_TOKEN
    if not own.exists():
        return admin_token
    try:
        return read_token(own)
    except ConfigError as e:
        log.error("%s; fetching judges into the mirror will be refused (401)", e)  # noqa: TRY400 (the reason is the message)
        return ""


def _keeper(
    store: Store, config: ServerConfig, changed: Callable[[], None], mirror_token: str
) -> JudgeKeeper | None:
    """The judge keeper (leader only: with SQLite this process is the leader) when guard is on and
    there is a mirror to fetch judges with."""
    if not config.guard.on() or not config.mirror.api:
        return None
    from llmgw.control.api.guard import MirrorServe, build_keeper  # noqa: PLC0415

    guard = config.guard
    serve = MirrorServe(store, config.mirror.api, on_added=changed, mirror_token=mirror_token)
    return build_keeper(store, lambda: guard, serve)


async def serve(
    config_path: Path,
    paths: Paths,
    *,
    stop: asyncio.Event | None = None,
    on_started: Callable[[dict[str, tuple[str, int]]], None] | None = None,
) -> None:
    """Run the control plane until SIGTERM/SIGINT or ``stop`` is set.

    Args:
        config_path: server.yaml.
        paths: the file layout (the SQLite database is ``paths.database`` unless ``store.url`` is set).
        stop: set it to shut down (tests); signals set it too when running in the main thread.
        on_started: called once every listener is bound, with ``{"admin_listen": (host, port),
            "agent_listen": …, "gateway.listen": …}`` (ports as bound: ``:0`` picks a free one).

    Raises:
        ConfigError: server.yaml, the admin token or the keys file is invalid.
        PkiError: the TLS files cannot be loaded.
        PortInUseError: a listen port is taken; the message names the setting.
        StoreError: the database cannot be opened.
    """
    config = load_server_config(config_path)
    open_files = raise_open_files_limit()
    if open_files < MIN_OPEN_FILES:
        log.warning("open files are limited to %d: the agent API keeps a connection per node; raise it "
                    "(LimitNOFILE= in the unit, ulimit -n) above the node count", open_files)
    token = read_admin_token(config, config_path)
    keys = read_gateway_keys(config)
    tls = agent_api_tls(config)
    stop = stop or asyncio.Event()
    url = default_url(config.store.url, paths.database)
    store = open_store(url)
    db = api_pool(store)  # the APIs' and the routing table's calls, each under a deadline
    work = OffLoop(workers=2)  # the leader's passes: long, no deadline (fenced writes)
    router = StoreRouter(store)
    routes = Coalescer(functools.partial(router.refresh_in, db.run), name="routing table refresh",
                       min_gap_s=ROUTES_MIN_GAP_S)
    router.on_stale, router.settled = routes.request, routes.idle
    wakes = Wakes(routes)
    name = config.cluster.name or socket.gethostname()
    election = _election(store, url, config, name, db)
    guard = _guard(config, router)
    # PostgreSQL: the agents beat to any control plane, so log reads cross them through the store;
    # SQLite: one control plane, reads stay in memory (no store call for them at all).
    # The agent API in a process of its own (cluster.agent_api_process) reaches this one's log reads
    # through the store too.
    apart = config.cluster.agent_api_process
    logs = LogBroker(store=store, db=db) if url.startswith("postgresql") or apart else LogBroker()
    drain = Drain()
    # Keys from the store and the keys file, limits, usage: memory on the request path, synced with
    # the store every 0.5 s (control/gateway/accounting.py).
    accounting = Accounting(store, db, name, Callers(keys, stale_after_s=KEYS_STALE_S), Limiter())
    engines = EngineMetrics()
    observers: tuple[Callable[[Exchange], None], ...] = (accounting.observe, log_exchange)
    counted = asyncio.Event()
    counting: asyncio.Task[None] | None = None

    def lost_after(seconds: float) -> None:
        """The cadence's new lost threshold (the cluster grew or shrank): the leader's from now on."""
        for running in wakes.leaders:
            running.node_lost_after_s = seconds

    # The heartbeat interval and node-lost threshold, sized by the node count (control/api/cadence.py).
    cadence = Cadence(
        config.cluster.max_heartbeats_per_s, config.node_lost_after_s,
        count=lambda: db.read(store.count_nodes), on_lost_after=lost_after,
    )

    async def lead(term: int, ended: asyncio.Event) -> None:
        """The reconcilers of one term, on the store fenced by it; cancelled when leadership ends."""
        fenced = store.fenced(term)
        leader = Leader(
            fenced,
            node_lost_after_s=cadence.lost_after_s,
            backoff_reset_s=config.backoff_reset_s,
            on_change=routes.request,
            db=work,
        )
        wakes.leaders[:] = [leader]
        keeper = _keeper(fenced, config, wakes.changed, _mirror_token(paths, token))
        scaler = Autoscaler(fenced, wake=leader.wake, db=work, on_decision=metrics.decided,
                            closed_judges=closed_judges(config.guard))
        try:
            await asyncio.gather(
                leader.run(ended), scaler.run(ended), *([keeper.run(ended)] if keeper is not None else [])
            )
        finally:
            wakes.leaders.clear()

    runners: list[web.AppRunner] = []
    apps: list[tuple[str, str, web.Application, ssl.SSLContext | None]] = []
    loop = asyncio.get_running_loop()
    signals: list[signal.Signals] = []
    pauses = GcPauses(freeze=True)  # a long collection is logged; the survivors of each full one frozen
    agent_port = parse_listen(config.agent_listen)[1]
    members = Membership(
        store, db, election, name=name, version=__version__, lease_s=config.cluster.lease_s,
        agent_url=config.cluster.agent_url or default_agent_url(config.agent_listen, agent_port),
        find_node=functools.partial(own_node, paths),  # its llmgw.control-plane label is honoured (nodelabels.py)
    )
    metrics = ControlPlaneMetrics(
        store, db, members=members, guard=guard.stats if guard is not None else None, engines=engines
    )
    observers = (*observers, metrics.observe)
    # The dashboard calls this process's own admin API (same checks as ctl) once it is bound.
    ui_tokens = Tokens(token, config.ui.viewer_token(config_path))
    ui_api = AdminApi(lambda: _admin_base(bound), token)
    ui_throttle = LoginThrottle()  # one for both listeners: no second guessing budget on ui.listen
    bound: dict[str, tuple[str, int]] = {}
    agent_proc: AgentProcess | None = None
    switch_was = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # restored below: a test may serve in its own process
    try:
        await router.refresh_in(db.run)  # the gateway's first requests see the catalog
        await accounting.sync()  # ... and the stored keys
        counting = asyncio.create_task(accounting.run(counted))  # stops after the drain: nothing uncounted
        gateway = _gateway_app(router, config, guard, drain, keys, accounting, observers, metrics)
        admin = _admin_app(
            store, token, wakes.changed, config, guard, logs, db, routes.done, members, metrics, paths,
            accounting.callers, _loads_of(gateway),
        )
        token_file = str(config.admin_token_path(config_path))
        mount_ui(admin, build_ui_app(ui_api, ui_tokens, ttl_s=config.ui.session_ttl_s, secure=False,
                                     token_file=token_file, throttle=ui_throttle))
        if apart:  # bound here, served by the process started before the admin API below
            host, port = parse_listen(config.agent_listen)
            socks = await bind_sockets(host, port, what=f"agent_listen {config.agent_listen}",
                                       fix=f"change agent_listen in {config_path}")
            agent_proc = AgentProcess(config_path, url, socks, on_changed=wakes.relayed, engines=engines,
                                      cadence=cadence, cluster=members.reply_fields, own_nodes=members.own_nodes)
            at = socks[0].getsockname()
            bound["agent_listen"] = (str(at[0]), int(at[1]))
        else:
            apps.append((
                "agent_listen",
                config.agent_listen,
                build_agent_app(
                    store, on_heartbeat=wakes.heartbeat, node_lost_after_s=config.node_lost_after_s, logs=logs,
                    db=db, on_node=wakes.node_came, cluster=members.reply_fields, engines=engines, cadence=cadence,
                    own_nodes=members.own_nodes,
                ),
                tls,
            ))
        apps.append(("gateway.listen", config.gateway.listen, gateway, None))
        if config.ui.listen:  # the dashboard alone, over TLS with the server certificate
            ui = build_ui_app(ui_api, ui_tokens, ttl_s=config.ui.session_ttl_s, secure=True, token_file=token_file,
                              throttle=ui_throttle)
            apps.append(("ui.listen", config.ui.listen, ui_site(ui), ui_tls(config)))
        # The admin API last: its /api/v1/health answering means every listener is bound (init and
        # the tests wait for it, then connect to the agent API: CI saw that refused in between).
        apps.append(("admin_listen", config.admin_listen, admin, None))
        # the gateway's load, every second and at once when a model's first request is held
        reporter = LoadReporter(store, db, name, gateway[LOAD], kick=gateway.get(LOAD_KICK))
        # SIGTERM/SIGINT set ``stop`` from before the first listener answers: a signal that arrives
        # once the admin API's health answers, while the other listeners start, is a graceful stop,
        # not the default action (killed by the signal: exit -15, seen under load).
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
                signals.append(sig)
        for setting, listen, app, ctx in apps:
            if setting == "admin_listen" and agent_proc is not None:
                try:
                    await agent_proc.start()
                except ServiceError:
                    # SIGTERM to the unit's every process (systemctl stop) while it started: the process
                    # died of it before serving, and this one was told to stop by the same signal
                    if not stop.is_set():
                        raise
                    log.info("stopped while the agent API process started")
                    return
            runner, addr = await _start(app, listen, setting, config_path, ctx)
            runners.append(runner)
            bound[setting] = addr
            log.info("%s on %s:%d", setting, *addr)
        # SIGHUP re-reads gateway.keys_file now (it is also re-read within a second of a change).
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, keys.reload)
            signals.append(signal.SIGHUP)
        # Everything made at startup (modules, config, apps) lives as long as the process: keep it
        # out of the cyclic GC's scans, which otherwise stop every thread for a full collection
        # of ~120,000 objects (measured 70-260 ms on 2 busy cores) a few times a minute.
        gc.freeze()
        pauses.install()
        if on_started is not None:
            on_started(bound)
        await members.tick()  # the first heartbeat replies name this control plane
        await asyncio.gather(
            election.run(stop), members.run(stop), while_leading(election, lead, stop), logs.watch(stop),
            reporter.run(stop), pauses.run(stop), *([agent_proc.run(stop)] if agent_proc is not None else []),
        )
    finally:
        sys.setswitchinterval(switch_was)
        pauses.remove()
        for sig in signals:
            loop.remove_signal_handler(sig)
        if stop.is_set() and len(runners) == len(apps):
            if agent_proc is not None:
                agent_proc.stop_accepting()
            await _drain(runners, drain, config.gateway.drain_s)
        # together: SHUTDOWN_TIMEOUT_S
        await asyncio.gather(*(runner.cleanup() for runner in reversed(runners)),
                             *([agent_proc.close()] if agent_proc is not None else []))
        if counting is not None:
            counted.set()
            await counting  # the last sync writes what the last requests used
        await routes.idle()
        await logs.idle()  # the rows of log reads just finished (store mode)
        await ui_api.close()
        db.close()
        work.close()
        store.close()


def _admin_base(bound: dict[str, tuple[str, int]]) -> str:
    """The admin API's URL on this machine, from the address it is bound to."""
    host, port = bound["admin_listen"]
    return f"http://{connect_host(host)}:{port}"


async def _drain(runners: list[web.AppRunner], drain: Drain, deadline_s: float) -> None:
    """Stop accepting on every listener, then drain the gateway (:meth:`Drain.drain`)."""
    for runner in runners:
        for site in list(runner.sites):
            await site.stop()
    finished, cut = await drain.drain(deadline_s)
    if finished or cut:
        log.info("shutdown: %d request(s) finished, %d cut at the %gs deadline", finished, cut, deadline_s)
