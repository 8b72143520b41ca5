"""``server init --join DIR``: a standby control plane of an HA cluster.

In order: the bundle checked (:func:`llmgw.serverinit.standby.check_bundle`: a server certificate
the bundle's CA did not sign, or a CA other than this machine's, refuses before anything is
written), this machine checked (:func:`preflight`: the listen ports, what a database member
needs, its ports; nothing is copied before they pass); on a first join
:func:`~llmgw.serverinit.standby.check_cluster_ca` also has the first
control plane's agent API verify with the bundle's CA, so a bundle from another cluster is
refused), its files copied into ``/etc/llmgw`` (``kept`` when there already; ``--admin-listen``,
``--agent-listen``, ``--gateway-listen`` when given replace the first control plane's), this machine's
database member started as a streaming replica (:mod:`.database`), then the control plane against
the shared database (:mod:`.controlplane`). No mirror, starter or judge: those are the cluster's,
served by the first control plane and placed on the nodes by whichever control plane leads.
"""

from __future__ import annotations

from llmgw.config import load_server_config, parse_listen
from llmgw.errors import ConfigError, PortInUseError
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.patroni import patroni_yml_path
from llmgw.serverinit.standby import Bundle, check_bundle, check_cluster_ca, install_bundle, load_bundle_yaml
from llmgw.serverinit.steps import controlplane, database
from llmgw.serverinit.steps.checks import port_free
from llmgw.serverinit.steps.context import InitContext


def run(ctx: InitContext) -> None:
    """Join the HA cluster whose bundle is at ``--join``.

    Raises:
        ConfigError, PkiError: the bundle is incomplete, or does not belong to this machine's cluster.
        ServiceError, WaitTimeout: Patroni or the control plane did not come up.
    """
    bundle_dir = ctx.opts.join
    if bundle_dir is None:
        raise ConfigError("--join needs the directory 'llmgw server add-control-plane' wrote")
    if ctx.opts.control_planes:
        raise ConfigError("--join and --control-plane do not go together: the bundle names the control planes")
    b = check_bundle(bundle_dir, ctx.paths)
    listen = listen_flags(ctx)
    preflight(ctx, b, listen)
    if (ctx.paths.etc / "ha-me").exists():
        ctx.say("kept", f"bundle {bundle_dir}: control plane {b.me.name} of {len(b.plan.members)}")
    else:
        where = check_cluster_ca(b)
        ctx.say("done", f"bundle {bundle_dir}: control plane {b.me.name} of {len(b.plan.members)}; the first "
                        f"control plane at {where} is of the bundle's CA")
    for tag, path in install_bundle(b, ctx.paths, listen):
        ctx.say(tag, str(path))
    database.run(ctx, role="replica")
    controlplane.run(ctx)


LISTEN_FLAGS = {
    "admin_listen": "--admin-listen", "agent_listen": "--agent-listen", "gateway_listen": "--gateway-listen",
}
"""The listen flags ``--join`` takes (they replace the first control plane's in the standby's
server.yaml); its mirror's flags do not apply: a standby runs no mirror."""


def listen_flags(ctx: InitContext) -> dict[str, str]:
    """The listen addresses given on this ``--join`` (those that differ from the defaults)."""
    defaults = InitOptions()
    return {k: getattr(ctx.opts, k) for k in LISTEN_FLAGS if getattr(ctx.opts, k) != getattr(defaults, k)}


def preflight(ctx: InitContext, b: Bundle, listen: dict[str, str]) -> None:
    """What ``--join`` checks after the bundle and before anything is copied from it (the CA key
    and the database passwords are in it: they used to be written first, then a taken port
    refused the join and left them behind).

    In order: the bundle's ha.yaml carries raft's password; the control plane's listen ports
    (this machine's server.yaml's when it has one, else the bundle's with ``listen`` over them)
    are free unless this install's control plane holds them; this machine can run a database
    member (:func:`.database.check_machine`); and, for a member not yet written, its
    PostgreSQL, REST API and raft ports are free (:func:`.database.check_member_ports`). Every
    message names only what ``--join`` accepts: the listen flags, or what to stop.

    Raises:
        ConfigError: the bundle's ha.yaml has no raft password, or the machine lacks what a
            member needs. PortInUseError: a port is taken.
    """
    if b.plan.generated:
        raise ConfigError(database.no_raft_password(b.dir / "ha.yaml"))
    have = ctx.paths.server_config
    cfg = load_server_config(have) if have.exists() else load_bundle_yaml(b.dir / "server.yaml")
    current = {"admin_listen": cfg.admin_listen, "agent_listen": cfg.agent_listen,
               "gateway_listen": cfg.gateway.listen}
    if not have.exists():
        current.update(listen)
    # Every taken port at once: a new user learned of --admin-listen, --agent-listen and
    # --gateway-listen in three runs, one refusal each.
    taken = [] if ctx.running("server") else [(k, a) for k, a in current.items() if not port_free(a)]
    if taken:
        ports = ", ".join(f"{parse_listen(a)[1]} ({LISTEN_FLAGS[k].lstrip('-')}, {a})" for k, a in taken)
        fix = (f"or change {' and '.join(k for k, _ in taken)} in {have} (written by the first --join; the flags "
               "are not read again)" if have.exists()
               else f"or give this standby other addresses with {' '.join(LISTEN_FLAGS[k] for k, _ in taken)}")
        raise PortInUseError(
            f"{'port' if len(taken) == 1 else 'ports'} {ports} {'is' if len(taken) == 1 else 'are'} already taken "
            f"by another program; stop it, {fix}; nothing of the bundle was copied"
        )
    plan = database.local_dirs(ctx, b.plan)
    database.check_machine(ctx, plan)
    if not patroni_yml_path(plan).exists():
        database.check_member_ports(plan, b.me, joining=True)
