"""``server init --join DIR``: a standby control plane of an HA cluster.

In order: the bundle checked (:func:`llmgw.serverinit.standby.check_bundle`: a server certificate
the bundle's CA did not sign, or a CA other than this machine's, refuses before anything is
written; on a first join :func:`~llmgw.serverinit.standby.check_cluster_ca` also has the first
control plane's agent API verify with the bundle's CA, so a bundle from another cluster is
refused), its files copied into ``/etc/llmgw`` (``kept`` when there already; ``--admin-listen``,
``--agent-listen``, ``--gateway-listen`` when given replace the first control plane's), this machine's
database member started as a streaming replica (:mod:`.database`), then the control plane against
the shared database (:mod:`.controlplane`). No mirror, starter or judge: those are the cluster's,
served by the first control plane and placed on the nodes by whichever control plane leads.
"""

from __future__ import annotations

from llmgw.errors import ConfigError
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.standby import check_bundle, check_cluster_ca, install_bundle
from llmgw.serverinit.steps import controlplane, database
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
    if (ctx.paths.etc / "ha-me").exists():
        ctx.say("kept", f"bundle {bundle_dir}: control plane {b.me.name} of {len(b.plan.members)}")
    else:
        where = check_cluster_ca(b)
        ctx.say("done", f"bundle {bundle_dir}: control plane {b.me.name} of {len(b.plan.members)}; the first "
                        f"control plane at {where} is of the bundle's CA")
    defaults = InitOptions()
    listen = {k: getattr(ctx.opts, k) for k in ("admin_listen", "agent_listen", "gateway_listen")
              if getattr(ctx.opts, k) != getattr(defaults, k)}
    for tag, path in install_bundle(b, ctx.paths, listen):
        ctx.say(tag, str(path))
    database.run(ctx, role="replica")
    controlplane.run(ctx)
