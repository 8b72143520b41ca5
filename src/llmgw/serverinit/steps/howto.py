"""The end of ``server init``: how to ask. ``llmgw chat`` and the equivalent ``curl``, or, when
no model is served yet, what to do next."""

from __future__ import annotations

from llmgw.catalog import Role
from llmgw.errors import LlmgwError
from llmgw.serverinit.steps.context import InitContext, connect_url
from llmgw.serverinit.wait import PROBE_TIMEOUT_S, format_duration


def run(ctx: InitContext, served: str, took_s: float) -> None:
    """Print how to ask the gateway for ``served`` (a model name; ``""`` when this run's starter
    was skipped: then a chat model the catalog already serves, from an earlier init or an operator,
    :func:`serving_chat_model`), and how long init took (``took_s``, seconds)."""
    out = ctx.out
    served = served or serving_chat_model(ctx)
    url = connect_url(ctx.config().gateway.listen)
    root = f"--root {ctx.paths.root} " if ctx.paths.prefixed else ""
    print(f"\nllmgw is ready (init took {format_duration(took_s)}).", file=out)
    dashboard(ctx)
    if not served:
        print("No model is served yet: add one with 'llmgw ctl' once a node has joined.", file=out)
        return
    print("Ask it:\n", file=out)
    print(f'    llmgw {root}chat "What is the capital of France?"\n', file=out)
    print(
        f"    curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"      -d '{{\"model\": \"{served}\", \"messages\": [{{\"role\": \"user\", "
        f"\"content\": \"What is the capital of France?\"}}], \"max_tokens\": 64}}'\n",
        file=out,
    )
    print(
        f"From another machine, add -H \"Authorization: Bearer $(head -1 {ctx.paths.client_keys})\" "
        f"and use this machine's address.",
        file=out,
    )


def serving_chat_model(ctx: InitContext) -> str:
    """The first (by name) chat model of the catalog with a ready replica; ``""`` when there is
    none or the control plane does not answer (within :data:`PROBE_TIMEOUT_S`)."""
    try:
        models = ctx.admin(PROBE_TIMEOUT_S).models()
    except LlmgwError:
        return ""
    ready = sorted(m.name for m in models if m.role in ("", Role.CHAT) and m.replicas_ready > 0)
    return ready[0] if ready else ""


def dashboard(ctx: InitContext) -> None:
    """Where the web dashboard is (``/ui/`` on the admin listener) and what logs in to it."""
    cfg = ctx.config()
    url = connect_url(cfg.admin_listen)
    port = url.rsplit(":", 1)[1]
    token = cfg.admin_token_path(ctx.paths.server_config)
    print(f"Dashboard: {url}/ui/ (log in with the token in {token}; from another machine: "
          f"ssh -L {port}:127.0.0.1:{port} THIS-HOST, then the same URL).", file=ctx.out)


def standby(ctx: InitContext, took_s: float) -> None:
    """The end of ``server init --join``: this control plane serves the cluster's models (the
    catalog is the shared database's), and every gateway client needs a key, loopback ones too
    (a standby's server.yaml sets ``allow_loopback_without_key: false``)."""
    out = ctx.out
    url = connect_url(ctx.config().gateway.listen)
    root = f"--root {ctx.paths.root} " if ctx.paths.prefixed else ""
    print(f"\nThis control plane has joined the cluster (init took {format_duration(took_s)}).", file=out)
    print(f"It serves the cluster's models ('llmgw {root}ctl models'); 'llmgw {root}ctl cluster' shows the "
          "control planes and the leader.", file=out)
    print(f"Its gateway ({url}) asks every client for a key, this machine's too: "
          f"-H \"Authorization: Bearer $(head -1 {ctx.paths.client_keys})\".", file=out)
