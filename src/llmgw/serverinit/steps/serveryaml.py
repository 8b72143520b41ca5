"""Step 2: server.yaml, written once; a later run keeps it, and stops on one that does not load."""

from __future__ import annotations

from llmgw.config import load_server_config
from llmgw.serverinit import files
from llmgw.serverinit.steps.context import InitContext


def run(ctx: InitContext) -> None:
    """Write server.yaml on a new machine; keep (and check) the one that is there.

    Raises:
        ConfigError: the server.yaml there (or the one just written) does not load.
    """
    path = ctx.paths.server_config
    if path.exists():
        load_server_config(path)
        ctx.say("kept", f"{path}")
        return
    body = files.server_yaml(
        admin_listen=ctx.opts.admin_listen, agent_listen=ctx.opts.agent_listen,
        gateway_listen=ctx.opts.gateway_listen, pki=ctx.paths.pki, keys_file=ctx.paths.client_keys,
    )
    files.write_atomic(path, body, 0o640)
    load_server_config(path)
    ctx.say("done", f"{path}")
