"""Step 7: the guardrails' judge (Qwen3Guard-Gen-0.6B, or ``--judge-source``) and a default guard
policy (in and out, ``fail: closed``); skipped offline when nothing was carried in. How many
judges and on how many cores: :mod:`llmgw.guard.sizing`."""

from __future__ import annotations

from llmgw import sourcecheck
from llmgw.catalog import Model
from llmgw.errors import LlmgwError
from llmgw.guard import sizing
from llmgw.serverinit import files, plan
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.steps import services
from llmgw.serverinit.steps.context import InitContext
from llmgw.serverinit.steps.serve import ensure_served


def source(opts: InitOptions) -> str:
    """Where the judge's weights come from: ``--judge-source``, else Qwen3Guard-Gen-0.6B Q8_0 from Hugging Face."""
    return opts.judge_source or plan.GUARD_MODEL_SOURCE


def judge_format(opts: InitOptions) -> str:
    """The judge's format: ``--judge-format``, else ``qwen3guard``."""
    return opts.judge_format or "qwen3guard"


def planned(opts: InitOptions) -> bool:
    """Whether init will try to serve a judge: not with ``--no-guard-model``, nor offline with no
    ``file:`` judge carried in (it might still be in the mirror: then it is served, and the starter
    shares its cores)."""
    if opts.no_guard_model:
        return False
    return not (opts.offline and sourcecheck.to_download(source(opts)).kind != "file")


def replicas(opts: InitOptions) -> int:
    """Judge replicas this init serves (``sizing.judge_for``): none with ``--no-guard-model``
    or when the judge will be skipped (offline with nothing carried in), so the starter keeps
    the cores a judge would have had."""
    if not planned(opts):
        return 0
    return sizing.judge_for(no_node=opts.no_node, replicas_flag=opts.judge_replicas)


def run(ctx: InitContext) -> None:
    """The guardrails' judge, then the default policy.

    The judge goes into the mirror and the catalog (role guard, CPU only, ``judge_for``
    replicas, cores from ``cpu_plan``); when this machine is a node, init waits for it to serve.
    Then, when server.yaml has no ``guard:`` policy, one is appended (with a backup) that judges
    in and out with ``fail: closed``, and the control plane is restarted to read it. A judge
    that is skipped writes no policy: a policy whose judge is missing would refuse everything.
    """
    opts = ctx.opts
    if opts.no_guard_model:
        ctx.say("skip", "the guardrails' judge (--no-guard-model): prompts and answers are not judged")
        return
    src = source(opts)
    fmt = judge_format(opts)
    if opts.offline and sourcecheck.to_download(src).kind != "file" and not in_mirror(ctx, src):
        ctx.say(
            "skip",
            "the guardrails' judge: offline, and no judge was carried in; prompts and answers are not "
            "judged (no guard policy written). Carry one in with --judge-source file:/path.gguf",
        )
        return
    name = plan.judge_name(src, fmt)
    here = not opts.no_node
    n = replicas(opts)
    cores = sizing.cpu_plan(cpus=ctx.cpus(), judges=n, no_node=opts.no_node).judge

    def entry(url: str, sha256: str, _classes: list[str]) -> Model:
        return plan.guard_model(url, n or 1, cores, sha256=sha256, fmt=fmt, name=name)

    if not ensure_served(ctx, name, src, plan.GUARD_MODEL_VERSION, here, entry):
        ctx.say("skip", "the guard policy: no judge, so prompts and answers are not judged")
        return
    cfg = ctx.config()
    if cfg.guard.on():
        ctx.say("kept", f"guard policies in server.yaml ({', '.join(p.name for p in cfg.guard.policies)})")
        return
    services.append_to_server_yaml(ctx, files.guard_block(name))
    ctx.say("done", f"server.yaml judges every prompt and answer with {name} (policy 'default', fail: closed)")
    ctx.manager.restart("server")
    services.wait_service(ctx, "server", "the control plane", ctx.admin().health)
    ctx.say("done", "control plane restarted with the guard policy")


def in_mirror(ctx: InitContext, src: str) -> bool:
    """True when the mirror already holds the judge from ``src`` (False when it does not answer)."""
    fmt = judge_format(ctx.opts)
    try:
        mirror = ctx.mirror()
        st = mirror.status(plan.judge_name(src, fmt), plan.GUARD_MODEL_VERSION)
    except LlmgwError:
        return False
    return st.state == "present"
