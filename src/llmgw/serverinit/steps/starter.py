"""Step 6: the starter model, so the first thing anyone sees is an answer. Into the mirror, into
the catalog (pinned to this machine when it is a node, on the cores :func:`llmgw.guard.sizing.cpu_plan`
leaves it beside the judges), and a wait until a replica is ready (:mod:`.serve`)."""

from __future__ import annotations

from pathlib import Path

from llmgw import sourcecheck
from llmgw.catalog import Model
from llmgw.guard import sizing
from llmgw.serverinit import plan
from llmgw.serverinit.steps import judge
from llmgw.serverinit.steps.context import InitContext
from llmgw.serverinit.steps.serve import ensure_served


def run(ctx: InitContext) -> str:
    """Fetch the starter into the mirror and serve it here (pinned when this machine is a node);
    returns its name, or ``""`` when it was skipped (offline, not carried in, not in the mirror)."""
    opts = ctx.opts
    pinned = not opts.no_node
    size = 0
    d = sourcecheck.to_download(opts.starter_source)
    if d.kind == "file" and d.path:
        size = Path(d.path).stat().st_size
    spec = plan.starter_spec(opts.starter_source, name=opts.starter_name, alias=opts.starter_alias, size_bytes=size)
    cores = sizing.cpu_plan(cpus=ctx.cpus(), judges=judge.replicas(opts), no_node=opts.no_node).starter
    _say_alias_kept(ctx, spec.name, opts.starter_alias)

    def entry(url: str, sha256: str, classes: list[str]) -> Model:
        return plan.starter_model(spec, plan.STARTER_CONTEXT, cores, url, classes, pinned=pinned, sha256=sha256)

    ok = ensure_served(ctx, spec.name, spec.source, plan.STARTER_VERSION, pinned, entry)
    return spec.name if ok else ""


def _say_alias_kept(ctx: InitContext, name: str, alias: str) -> None:
    """A ``!!`` line when ``--starter-alias`` names an alias the starter already in the catalog lacks:
    init keeps a catalog entry it finds, so the flag changes nothing (a new user's finding: dropped
    without a word, where ``--gateway-listen`` said so)."""
    if not alias:
        return
    kept = next((m for m in ctx.admin().models() if m.name == name), None)
    if kept is not None and alias not in kept.aliases:
        now = ", ".join(kept.aliases) or "none"
        ctx.say("!!", f"--starter-alias {alias} is not used: {name} is already in the catalog (aliases: {now}); "
                      f"change them with 'llmgw ctl model set {name} aliases=[{alias}]'")
