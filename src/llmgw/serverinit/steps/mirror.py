"""Step 4: the model mirror. One on this machine (its management API on loopback, so it needs no
certificate), or with ``--mirror URL`` one on another machine set up by ``llmgw mirror init``;
then server.yaml points at it."""

from __future__ import annotations

from llmgw.config import parse_listen
from llmgw.errors import ApiError, LlmgwError, MirrorError
from llmgw.mirror.client import MIRROR_TOKEN, MirrorClient, token_path
from llmgw.serverinit import files
from llmgw.serverinit.steps import services
from llmgw.serverinit.steps.context import InitContext, url_host
from llmgw.serverinit.steps.pki import reachable_addr
from llmgw.service.units import MIRROR_ABOUT_STANDBYS, mirror_unit
from llmgw.service.users import chown_tree


def run(ctx: InitContext) -> None:
    """The mirror ``--mirror`` names (:func:`use_remote`), else one on this machine (:func:`ensure_local`)."""
    if ctx.opts.mirror_url:
        use_remote(ctx)
    else:
        ensure_local(ctx)


def use_remote(ctx: InitContext) -> None:
    """Point the control plane at a mirror on another machine, set up there by ``llmgw mirror init``.

    Raises:
        MirrorError: the mirror at ``--mirror`` does not answer (the message says what to run there).
    """
    url = ctx.opts.mirror_url
    try:
        with MirrorClient(url, timeout=5.0) as client:
            client.health()
    except LlmgwError as e:
        raise MirrorError(
            f"the mirror at {url} does not answer: {e}. On that machine: "
            "sudo llmgw mirror init --control-plane <this machine's address>"
        ) from e
    try:
        with ctx.mirror(5.0) as client:
            client.files()
    except ApiError as e:
        if e.status != 401:
            raise
        raise MirrorError(
            f"the mirror at {url} refuses this machine's token: {e}. Copy /etc/llmgw/{MIRROR_TOKEN} from "
            f"the mirror's machine to this machine's {ctx.paths.etc / MIRROR_TOKEN} (mode 0600) and run init again"
        ) from e
    cfg = ctx.config()
    if cfg.mirror.api == url:
        ctx.say("kept", f"mirror at {url}")
        return
    if cfg.mirror.api:
        ctx.say("kept", f"mirror at {cfg.mirror.api}, as server.yaml says; change it there to use {url}")
        return
    services.append_to_server_yaml(
        ctx, files.mirror_block(url, "# The model mirror, on its own machine, added by 'llmgw server init'.")
    )
    ctx.say("done", f"server.yaml points at the mirror at {url}")


def ensure_local(ctx: InitContext) -> None:
    """Run a mirror on this machine and point the control plane at it.

    Its management API is on loopback, which is why it needs no certificate: nothing but this
    machine can reach it. It asks for a token (``--api-token-file``: the admin token, see
    :mod:`llmgw.mirror.client`), as every local user reaches loopback. It imports from no
    directory: a ``file:`` starter or judge is copied into its store by init
    (:func:`llmgw.serverinit.steps.serve.copy_into_store`).

    Raises:
        ServiceError: the mirror failed to start. WaitTimeout: it did not answer in time.
    """
    cfg = ctx.config()
    local = ctx.local_mirror_api()
    if cfg.mirror.api and cfg.mirror.api != local:
        ctx.say("kept", f"mirror at {cfg.mirror.api}, as server.yaml says")
        return
    store = ctx.paths.mirror_store
    store.mkdir(parents=True, exist_ok=True)
    # The mirror runs as the llmgw user (when it can) and may write only its store.
    user = services.service_user(ctx)
    if user is not None:
        chown_tree(store, user)
    _h, port = parse_listen(ctx.opts.mirror_listen)
    base = f"http://{url_host(reachable_addr(ctx.opts.hosts))}:{port}"
    body = mirror_unit(
        ctx.paths, ctx.bin, listen=ctx.opts.mirror_listen, api_listen=ctx.opts.mirror_api_listen,
        base=base, allow=ctx.mirror_allow, user=user, api_token_file=str(token_path(ctx.paths)),
        about=MIRROR_ABOUT_STANDBYS if ctx.opts.ha else "'llmgw server init'. Bytes for every node; the\n"
        "# management API on loopback only, for the control plane beside it.",
    )
    services.apply_service(ctx, "mirror", body, f"model mirror in {store}")
    if not cfg.mirror.api:
        services.append_to_server_yaml(
            ctx,
            files.mirror_block(
                local,
                "# The model mirror on this machine, added by 'llmgw server init'. Its\n"
                + ("# management API answers the control planes' addresses only." if ctx.opts.ha else
                   "# management API is on loopback, so it needs no certificate."),
            ),
        )
        ctx.say("done", "server.yaml points at the mirror")
    client = MirrorClient(local, timeout=2.0)

    def up() -> bool:
        try:
            client.health()
        except LlmgwError:
            return False
        return True

    services.wait_service(ctx, "mirror", "the mirror", up)
