"""``GET /api/v1/cluster`` (admin API, bearer token): the HA cluster as this control plane sees it.

The answer (:class:`~llmgw.views.ClusterView`) is built from memory, never a store call, so it
answers while the database is down (and says so in ``database``): the control planes and the
term from :class:`~llmgw.control.reconcile.membership.Membership`'s last read, the leader from
this control plane's election and that read, and the database's members from Patroni's REST API
(``GET /cluster`` on each ``cluster.patroni`` URL in turn, :data:`PATRONI_TIMEOUT_S` each; the
first that answers wins). A Patroni that does not answer is reported in ``patroni_error``, never
an error of the route.

Patroni's ``GET /cluster`` answers ``{"members": [{"name", "role", "state", "host", "port",
"timeline", "lag"?}, ...], "scope"}``; ``role`` is ``leader``, ``sync_standby``, ``replica``...,
``lag`` (replicas only) is bytes behind the primary or ``"unknown"``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from llmgw.control.reconcile.membership import Membership
from llmgw.views import ClusterView, ControlPlaneView, DatabaseView, PatroniMemberView

#: Seconds each Patroni REST URL is given to answer ``GET /cluster``.
PATRONI_TIMEOUT_S = 2.0


def parse_patroni(body: Any) -> list[PatroniMemberView]:
    """The members of a Patroni ``GET /cluster`` answer, by name.

    Raises:
        ValueError: ``body`` is not that shape (no ``members`` list of objects with a ``name``).
    """
    members = body.get("members") if isinstance(body, dict) else None
    if not isinstance(members, list):
        raise ValueError("the answer has no 'members' list; is this Patroni's REST API?")  # noqa: TRY004
    out = []
    for m in members:
        if not isinstance(m, dict) or not isinstance(m.get("name"), str):
            raise ValueError("a member has no name; is this Patroni's REST API?")  # noqa: TRY004
        host = str(m.get("host", ""))
        if m.get("port"):
            host = f"{host}:{m['port']}"
        lag = m.get("lag")
        out.append(
            PatroniMemberView(
                name=m["name"], role=str(m.get("role", "")), state=str(m.get("state", "")), host=host,
                lag=lag if isinstance(lag, int | str) else None,
            )
        )
    return sorted(out, key=lambda v: v.name)


async def read_patroni(
    urls: Sequence[str], timeout_s: float = PATRONI_TIMEOUT_S
) -> tuple[list[PatroniMemberView], str]:
    """Patroni's members from the first of ``urls`` that answers, and "" (or how many configured
    members its list lacks: a member that is down drops out of it); or none, and why each failed."""
    if not urls:
        return [], ""
    errors = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for url in urls:
            target = url.rstrip("/") + "/cluster"
            try:
                async with session.get(target) as resp:
                    if resp.status != 200:
                        errors.append(f"{target}: HTTP {resp.status}")
                        continue
                    got = parse_patroni(await resp.json(content_type=None))
                    missing = len(urls) - len(got)
                    return got, (
                        f"{missing} of the {len(urls)} members in cluster.patroni are not in Patroni's list "
                        "(down, or not joined yet)" if missing > 0 else ""
                    )
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                errors.append(f"{target}: {e.__class__.__name__} {e}".strip())
    return [], "Patroni does not answer: " + "; ".join(errors)


def cluster_view(members: Membership, *, now: float | None = None) -> ClusterView:
    """The control planes, leader, term and database reachability as ``members`` last saw them
    (Patroni's members are added by the route)."""
    now = time.time() if now is None else now
    leader = members.leader_name()
    return ClusterView(
        me=members.name,
        term=members.term(),
        leader=leader,
        no_leader_since=members.no_leader_since(),
        database=DatabaseView(reachable=members.database_ok, error=members.database_error),
        control_planes=[
            ControlPlaneView(
                name=m.name, agent_url=m.agent_url, leader=m.name == leader, alive=members.alive(m, now),
                last_seen_s_ago=round(max(0.0, now - m.last_seen), 3),
            )
            for m in members.members()
        ],
    )


@dataclass(frozen=True)
class ClusterContext:
    """What :func:`cluster` reads, kept on the admin app under :data:`CLUSTER` by
    :func:`add_cluster_routes`: this control plane's membership and Patroni's REST API URLs."""

    members: Membership
    patroni: Sequence[str]


#: Where the admin app keeps its :class:`ClusterContext`.
CLUSTER: web.AppKey[ClusterContext] = web.AppKey("cluster", ClusterContext)


async def cluster(request: web.Request) -> web.Response:
    """``GET /api/v1/cluster``: :func:`cluster_view` from memory, with Patroni's members."""
    ctx = request.app[CLUSTER]
    view = cluster_view(ctx.members)
    view.patroni, view.patroni_error = await read_patroni(ctx.patroni)
    return web.json_response(text=view.model_dump_json())


#: The cluster's route.
ROUTES = [web.get("/api/v1/cluster", cluster)]


def add_cluster_routes(app: web.Application, members: Membership, patroni: Sequence[str]) -> None:
    """Add ``GET /api/v1/cluster`` to the admin API ``app`` (its auth middleware applies), with a
    :class:`ClusterContext` from the arguments under :data:`CLUSTER`."""
    app[CLUSTER] = ClusterContext(members=members, patroni=patroni)
    app.add_routes(ROUTES)


def health_fields(members: Membership) -> dict[str, Any]:
    """What ``GET /api/v1/health`` adds: ``leader`` (bool), ``term``, ``database`` (``ok`` or ``unreachable``)."""
    return {
        "leader": members.election.leading,
        "term": members.term(),
        "database": "ok" if members.database_ok else "unreachable",
    }
