"""How the gateway finds a model's engines: the :class:`Router` seam between gateway and store.

The control plane keeps an in-memory routing table (refreshed from the store and on every
heartbeat) behind this protocol, so the gateway's hot path never touches the database; tests and
benchmarks give the gateway a :class:`StaticRouter`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

#: Told the catalog names of the models whose routed replicas changed (on the event loop).
RouteWatcher = Callable[[frozenset[str]], None]


@dataclass(frozen=True)
class Upstream:
    """One ready replica: ``endpoint`` is ``host:port`` of its engine, ``key`` its ``--api-key``.

    ``slots``: the requests its engine runs at once as its profile configures them (llama-server's
    ``--parallel``/``-np``, vLLM's ``--max-num-seqs``; 4, the agent's default, when the profile sets
    none); 0 when not known (a :class:`StaticRouter`'s). The gateway reads the engine's own count
    (``GET /props``) and uses this only for an engine that does not say.
    """

    replica_id: str
    endpoint: str
    key: str
    slots: int = 0


@dataclass(frozen=True)
class Route:
    """Where requests for a model go.

    Attributes:
        model: the catalog name (a request may have used an alias).
        upstreams: the ready replicas, in no particular order; empty when none is ready.
        unavailable: when ``upstreams`` is empty, why (placement's summary or the replicas' states),
            phrased for a client: no internal addresses.
        context_length: the context a client may use (tokens), 0 when not set.
        max_output: the most tokens a client may ask for, 0 when not set.
        created: unix seconds the model was added (``/v1/models``' ``created``).
        role: the catalog role, ``chat`` or ``embedding`` (which endpoints serve it).
        routing: how the gateway picks a replica, ``cache-aware`` or ``round-robin``
            (:data:`llmgw.catalog.RoutingPolicy`).
        queue_size: requests that may wait for a slot at the gateway (0: none).
        queue_wait_s: the longest a request waits for a slot (s).
        unplaceable: no replica is placed because the last placement could not place the wanted
            ones (``unavailable`` is then its explanation's summary); a model starting from zero
            stops holding requests on it (:mod:`llmgw.control.gateway.starting`).
        aliases: the model's other names in the catalog (a guard policy's ``models`` may name one).
    """

    model: str
    upstreams: tuple[Upstream, ...] = ()
    unavailable: str = ""
    context_length: int = 0
    max_output: int = 0
    created: int = 0
    role: str = "chat"
    routing: str = "cache-aware"
    queue_size: int = 64
    queue_wait_s: float = 30.0
    unplaceable: bool = False
    aliases: tuple[str, ...] = ()


class Router(Protocol):
    """What the gateway asks of the control plane."""

    def resolve(self, name: str) -> Route | None:
        """The route for a model name or alias; None when no chat model has that name."""
        ...

    def chat_models(self) -> list[Route]:
        """Every model offered to clients, chat and embedding (guard models are not), sorted by name."""
        ...

    async def resolve_settled(self, name: str) -> Route | None:
        """:meth:`resolve`, after the table updates already requested when it has no ready replica
        (:meth:`llmgw.control.gateway.table.StoreRouter.resolve_settled`); a fixed table: :meth:`resolve`."""
        ...

    def watch(self, watcher: RouteWatcher) -> None:
        """Call ``watcher`` on the event loop with the models whose routed replicas changed, after
        each change of the table (the gateway's queues offer waiting requests the new replicas)."""
        ...


@dataclass
class StaticRouter:
    """A fixed routing table (tests, benchmarks): ``routes`` by name, ``aliases`` name → model."""

    routes: dict[str, Route] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    _watchers: list[RouteWatcher] = field(default_factory=list, init=False, repr=False)

    def resolve(self, name: str) -> Route | None:
        """See :meth:`Router.resolve`."""
        return self.routes.get(self.aliases.get(name, name))

    def chat_models(self) -> list[Route]:
        """See :meth:`Router.chat_models`."""
        return [self.routes[k] for k in sorted(self.routes)]

    async def resolve_settled(self, name: str) -> Route | None:
        """See :meth:`Router.resolve_settled` (nothing to wait for)."""
        return self.resolve(name)

    def watch(self, watcher: RouteWatcher) -> None:
        """See :meth:`Router.watch`: told of each :meth:`put`."""
        self._watchers.append(watcher)

    def put(self, route: Route) -> None:
        """Replace (or add) ``route.model``'s route and tell the watchers; on the event loop."""
        self.routes[route.model] = route
        for watcher in self._watchers:
            watcher(frozenset({route.model}))
