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
    _make_room_for_a_judge(ctx, spec.name, cores)

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


def _make_room_for_a_judge(ctx: InitContext, name: str, cores: int) -> None:
    """A judge carried in on a later run (``--judge-source``) takes its cores from the starter: the
    starter kept in the catalog from a run without one holds every core init gave it, and the judge
    then had "nowhere to run (needs 2 cores, 0 of 2 free)" after 90 s, its catalog entry left pending
    (a new user's run). When the judge is planned and not yet in the catalog, and the starter's CPU
    profile still has the cores a judge-less plan gave it (an operator's own choice is kept), it gets
    the plan's share now (a profile change: the starter's replica drains while its replacement starts)."""
    opts = ctx.opts
    if not judge.replicas(opts):
        return
    alone = sizing.cpu_plan(cpus=ctx.cpus(), judges=0, no_node=opts.no_node).starter
    models = {m.name: m for m in ctx.admin().models()}
    kept, judging = models.get(name), plan.judge_name(judge.source(opts), judge.judge_format(opts))
    if kept is None or alone == cores or judging in models:
        return
    profiles = kept.spec.get("profiles")
    profiles = profiles if isinstance(profiles, list) else []
    cpu = next((p for p in profiles if isinstance(p, dict) and p.get("name") == "cpu"), None)
    if cpu is None or cpu.get("cpu_cores") != alone:
        return
    ctx.replaced[name] = {r.id for r in ctx.admin().replicas(name) if r.profile == "cpu"}
    ctx.admin().set_profiles(name, [{**p, "cpu_cores": cores} if p is cpu else p for p in profiles])
    ctx.say("updated", f"{name}: profile cpu reserves {cores} of its {alone} cores, the rest for the judge")
