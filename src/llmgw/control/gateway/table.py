"""The control plane's routing table: a :class:`~llmgw.routing.Router` built from the store.

The gateway asks :meth:`StoreRouter.resolve` on every request, so it answers from memory: a
snapshot of models, replicas and explanations' summaries, rebuilt whenever :meth:`StoreRouter.refresh`
is called (a heartbeat that changed a replica, an admin write, a leader pass that changed
something) and when it is older than ``max_age_s`` (0.5 s).

In the control plane (:mod:`llmgw.control.server`) the router is built with ``on_stale``: a stale
snapshot then asks for a rebuild off the event loop (:class:`~llmgw.control.store.offloop.Coalescer`)
and the request is answered from the snapshot it has, so the gateway's hot path never waits on
the store, which is slow under a burst of writes. Without ``on_stale`` (tests, tools) the rebuild
runs inline.

A heartbeat's routing refresh is requested once its reply is sent, not awaited before it
(:mod:`llmgw.control.api.agent`), so a client told "ready" (by the agent, or ``ctl replicas``) may
ask the gateway while that refresh still runs. :meth:`StoreRouter.resolve_settled` (the gateway's
chat and embedding requests) then waits for the refreshes already requested (``settled``, the
control plane's :meth:`~llmgw.control.store.offloop.Coalescer.idle`, at most
:data:`SETTLE_WAIT_S`) before it answers that a model has no ready replica; a model that has one
never waits.

Snapshots are swapped whole (one attribute assignment), so a request never sees half a table.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field

from llmgw.catalog import DEFAULT_SLOTS, Model, Role
from llmgw.catalog import profile_slots as slots_of
from llmgw.control.store import ReplicaRow, Store
from llmgw.control.store.rows import PlacementSummary
from llmgw.protocol import ReplicaState
from llmgw.routing import Route, RouteWatcher, Upstream

log = logging.getLogger(__name__)

#: The roles clients may ask for (guard models are only for the guard).
_OFFERED = frozenset({Role.CHAT, Role.EMBEDDING})

#: Longest a snapshot is used before the next resolve rebuilds it (seconds).
MAX_AGE_S = 0.5

#: The longest (s) :meth:`StoreRouter.resolve_settled` waits for the refreshes in flight (a routing
#: refresh is a few ms; with the database down it fails at its deadline, and the request is
#: answered from the table it has after this).
SETTLE_WAIT_S = 1.0

_ADDRESS = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b|\[[0-9a-fA-F:]+\](?::\d+)?|\blocalhost:\d+\b")


def _scrub(text: str) -> str:
    """Replace internal addresses (``10.0.0.5:8123``, ``[::1]:80``, ``localhost:9000``) in client text."""
    return _ADDRESS.sub("<internal>", text)


@dataclass(frozen=True)
class _Snapshot:
    routes: dict[str, Route] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    roles: dict[str, Role] = field(default_factory=dict)
    models: tuple[Model, ...] = ()
    built_at: float = float("-inf")


def unavailable_reason(replicas: list[ReplicaRow], summary: str) -> str:
    """Why a model has no ready replica, for a client: placement's summary when nothing is placed,
    else the replicas' states and last errors; never an internal address. The gateway prefixes
    the model's name (``model 'x' is not available: <this>``)."""
    if not replicas:
        return _scrub(summary) if summary else "it has not been placed on a node yet"
    if all(r.draining_since is not None for r in replicas):  # read "not ready yet (ready)": a new user's finding
        return "its replicas are being stopped (scaled down, or their node drained)"
    parts = []
    for r in replicas:
        text = "draining" if r.draining_since is not None else r.state
        if r.state == ReplicaState.FAILED and r.err:
            # The first line is the cause (the agent puts it there); the rest is the engine's log.
            text += f" ({_scrub(r.err.strip().splitlines()[0].removesuffix('; its last lines:'))})"
        parts.append(text)
    return f"no replica is ready yet ({', '.join(parts)})"


def profile_slots(model: Model, profile: str) -> int:
    """Requests a replica of ``model`` on ``profile`` runs at once (:func:`llmgw.catalog.profile_slots`;
    :data:`~llmgw.catalog.DEFAULT_SLOTS` for a profile it does not have)."""
    prof = next((p for p in model.profiles if p.name == profile), None)
    return DEFAULT_SLOTS if prof is None else slots_of(prof)


def build_routes(
    models: list[Model], replicas: list[ReplicaRow], summaries: dict[str, PlacementSummary], created: dict[str, float]
) -> tuple[dict[str, Route], dict[str, str], dict[str, Role]]:
    """Pure: the routes (by name), aliases (alias → name) and roles from store contents."""
    routes: dict[str, Route] = {}
    aliases: dict[str, str] = {}
    roles: dict[str, Role] = {}
    by_model: dict[str, list[ReplicaRow]] = {}
    for r in replicas:
        by_model.setdefault(r.model, []).append(r)
    for m in models:
        mine = by_model.get(m.name, [])
        slots: dict[str, int] = {}  # per profile: its args are scanned once per model, not once per replica
        for r in mine:
            if r.profile not in slots:
                slots[r.profile] = profile_slots(m, r.profile)
        ready = tuple(
            Upstream(r.id, r.endpoint, r.key, slots[r.profile])
            for r in mine
            if r.state == ReplicaState.READY and r.endpoint and r.draining_since is None  # draining: routed no more
        )
        placement = summaries.get(m.name)
        summary = placement.summary if placement is not None else ""
        off = m.scaling.max == 0 and not ready  # switched off: no replica may run, a retry cannot help
        if off:
            summary = (f"scaling.max is 0, so no replica may run; raise it: "
                       f"llmgw ctl model set {m.name} scaling.max=1")
        routes[m.name] = Route(
            model=m.name,
            upstreams=ready,
            unavailable="" if ready else unavailable_reason(mine, summary),
            unplaceable=off or (not mine and placement is not None and not placement.placed),
            context_length=m.context_length,
            max_output=m.max_output,
            created=int(created.get(m.name, 0)),
            role=m.role.value,
            routing=m.routing,
            queue_size=m.queue.size,
            queue_wait_s=m.queue.wait_s,
            aliases=tuple(m.aliases),
        )
        roles[m.name] = m.role
        for a in m.aliases:
            aliases[a] = m.name
    return routes, aliases, roles


@dataclass(eq=False, repr=False)
class StoreRouter:
    """A :class:`~llmgw.routing.Router` over the store, cached in memory.

    Args:
        store: the state store.
        clock: monotonic seconds (injected for tests).
        max_age_s: the longest a snapshot is used before a resolve asks for a rebuild.
        on_stale: called (instead of rebuilding inline) when a resolve finds the snapshot older
            than ``max_age_s``; it must return at once and have :meth:`refresh` run elsewhere
            (the control plane runs it on a store thread).
        settled: awaited by :meth:`resolve_settled` for the refreshes requested so far to finish
            (the control plane's ``Coalescer.idle``); None: nothing to wait for.
    """

    store: Store
    _: KW_ONLY
    clock: Callable[[], float] = time.monotonic
    max_age_s: float = MAX_AGE_S
    on_stale: Callable[[], None] | None = None
    settled: Callable[[], Awaitable[None]] | None = None
    _snap: _Snapshot = field(default_factory=_Snapshot, init=False)
    _watchers: list[RouteWatcher] = field(default_factory=list, init=False)

    async def refresh_in(self, run: Callable[[Callable[[], frozenset[str]]], Awaitable[frozenset[str]]]) -> None:
        """:meth:`refresh` through ``run`` (the control plane's store thread, ``OffLoop.run``), then,
        on the loop, tell the watchers (:meth:`watch`) which models' routed replicas changed."""
        changed = await run(self.refresh)
        if changed:
            for watcher in self._watchers:
                watcher(changed)

    def watch(self, watcher: RouteWatcher) -> None:
        """See :meth:`llmgw.routing.Router.watch`: told after each :meth:`refresh_in` that changed a route."""
        self._watchers.append(watcher)

    def refresh(self) -> frozenset[str]:
        """Rebuild the snapshot from the store now (blocking: three reads). Thread-safe: the new
        snapshot replaces the old one in one assignment.

        Returns the models whose routed replicas changed (ids or slots; a model added or removed
        included), so that requests waiting in a model's queue can be handed a replica added while
        they wait (:meth:`~llmgw.control.gateway.upstream.UpstreamPool.routes_changed`)."""
        started = self.clock()
        rows = self.store.list_models()
        routes, aliases, roles = build_routes(
            [r.model for r in rows],
            self.store.list_replicas(),
            self.store.explanation_summaries(),
            {r.name: r.created_at for r in rows},
        )
        before = self._snap.routes
        self._snap = _Snapshot(routes, aliases, roles, tuple(r.model for r in rows), started)
        return frozenset(
            m for m in before.keys() | routes.keys()
            if (old := before.get(m)) is None or (new := routes.get(m)) is None or old.upstreams != new.upstreams
        )

    def _current(self) -> _Snapshot:
        if self.clock() - self._snap.built_at > self.max_age_s:
            if self.on_stale is not None:
                self.on_stale()
                return self._snap
            try:
                self.refresh()
            except Exception:
                # The database hiccuped: serve the last table rather than fail every request.
                log.exception("routing table refresh failed; serving the previous one")
        return self._snap

    def catalog(self) -> list[Model]:
        """Every model of the catalog as of the snapshot (the guard reads judge formats from it)."""
        return list(self._current().models)

    def resolve(self, name: str) -> Route | None:
        """The route of a chat or embedding model by name or alias; None for unknown names and guard models."""
        snap = self._current()
        real = snap.aliases.get(name, name)
        if snap.roles.get(real) not in _OFFERED:
            return None
        return snap.routes.get(real)

    async def resolve_settled(self, name: str) -> Route | None:
        """:meth:`resolve`; when the route has no ready replica, again once a refresh requested now
        (``on_stale``) and those requested before have run (``settled``, at most
        :data:`SETTLE_WAIT_S`): a replica whose ready heartbeat was answered is routed to, whether
        or not its refresh had been requested yet (the agent API in a process of its own asks for
        it over a channel, which may come after the client's request: :mod:`llmgw.control.agentproc`)."""
        route = self.resolve(name)
        if route is None or route.upstreams or self.settled is None:
            return route
        if self.on_stale is not None:
            self.on_stale()
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(self.settled())), SETTLE_WAIT_S)
        except TimeoutError:
            return route
        return self.resolve(name)

    def resolve_any(self, name: str) -> Route | None:
        """Like :meth:`resolve`, guard models included (the guard finds its judge with this)."""
        snap = self._current()
        return snap.routes.get(snap.aliases.get(name, name))

    def chat_models(self) -> list[Route]:
        """Every chat and embedding model's route (what clients may ask for), sorted by name."""
        snap = self._current()
        return [snap.routes[k] for k in sorted(snap.routes) if snap.roles.get(k) in _OFFERED]
