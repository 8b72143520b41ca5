"""Before the first HA step: the flags checked and what HA changes in the other steps.

:func:`prepare` reads the plan (:func:`.database.plan_from_options`, which raises on bad flags
before anything is written), then: the server certificate names every control plane (this one's
address first, the one nodes use); the mirror's management API listens on ``:8082`` and answers
every control plane (``--api-allow`` each, as the seed's mirror unit does); the judges are two,
spread over the nodes (``sizing.judge_for(standbys=True)``).
"""

from __future__ import annotations

import ipaddress
import socket

from llmgw.serverinit.patroni import Member
from llmgw.serverinit.standby import agent_url
from llmgw.serverinit.steps import database
from llmgw.serverinit.steps.context import InitContext

LOOPBACK_MIRROR_API = "127.0.0.1:8082"
HA_MIRROR_API = ":8082"


def resolve_ip(host: str) -> str:
    """``host`` as an IP address (the mirror's ``--api-allow`` takes addresses), or ``""`` when
    it does not resolve."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])
    except (OSError, IndexError):
        return ""


def prepare(ctx: InitContext) -> Member:
    """Check the HA flags and set what HA changes in the other steps; returns this machine's member.

    Raises:
        ConfigError: the flags do not describe a cluster (see :func:`.database.plan_from_options`),
            this machine lacks PostgreSQL 15 or Patroni (:func:`.database.check_machine`), or it is
            a single-machine install whose catalog is in SQLite (:func:`.database.check_not_sqlite`).
    """
    plan = database.plan_from_options(ctx)
    database.check_not_sqlite(ctx)
    database.check_machine(ctx, plan)
    me = plan.members[0]
    opts = ctx.opts
    opts.hosts = list(dict.fromkeys([me.host, *opts.hosts, *(m.host for m in plan.members)]))
    if opts.judge_replicas is None and not opts.no_guard_model:
        opts.judge_replicas = 2
    if opts.mirror_api_listen == LOOPBACK_MIRROR_API and not opts.mirror_url:
        opts.mirror_api_listen = HA_MIRROR_API
        ctx.mirror_api_host = me.host
    allow: list[str] = []
    for m in plan.members:
        ip = resolve_ip(m.host)
        if not ip:
            ctx.say("!!", f"{m.host} does not resolve here; the mirror's management API will not answer {m.name}")
        elif not ipaddress.ip_address(ip).is_loopback and ip not in allow:
            allow.append(ip)
    ctx.mirror_allow = allow
    return me


def own_agent_url(ctx: InitContext, me: Member) -> str:
    """This control plane's agent API URL for server.yaml's ``cluster.agent_url``."""
    return agent_url(me.host, ctx.config().agent_listen)
