"""`llmgw agent`: run this node's agent (``llmgw agent --config /etc/llmgw/agent.yaml``).

The group's callback runs the agent when no subcommand is given, so subcommands can join later.
SIGTERM and SIGINT stop the agent only: engines run in their own sessions and keep serving, and
the next agent adopts them (``llmgw service stop agent --engines`` stops them too).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from llmgw.cli.common import cli_errors, paths, typer_app
from llmgw.errors import NodeRemoved

if TYPE_CHECKING:
    from llmgw.config import AgentConfig
    from llmgw.paths import Paths

app = typer_app(help="The node agent: reports this machine, runs the replicas the control plane asks for.")

ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", help="agent.yaml to use (default: /etc/llmgw/agent.yaml under --root)."),
]


def setup_logging(verbose: bool = False) -> None:
    """Log to stderr with timestamps (journald and the supervisor keep stderr)."""
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


async def _serve(cfg: AgentConfig, p: Paths) -> None:
    from llmgw.agent.loop.loop import run_agent

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await run_agent(cfg, p, stop=stop)


@app.callback(invoke_without_command=True)
@cli_errors
def agent(
    ctx: typer.Context,
    config: ConfigOption = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Run the node agent until SIGTERM/SIGINT; engines keep running after it stops."""
    if ctx.invoked_subcommand is not None:
        return
    from llmgw.config import load_agent_config

    p = paths()
    cfg = load_agent_config(config or p.agent_config)
    setup_logging(verbose)
    try:
        asyncio.run(_serve(cfg, p))
    except NodeRemoved as e:
        # Exit 0: a removed node is stopped on purpose, and Restart=on-failure must not start it again.
        print(f"Stopped: {e}", file=sys.stderr)
        raise typer.Exit(0) from None


@app.command("inventory")
@cli_errors
def inventory(config: ConfigOption = None) -> None:
    """Print this node's inventory (cores, memory, GPUs and their classes) as JSON."""
    from llmgw.agent.node.discovery import discover_inventory
    from llmgw.config import load_agent_config

    p = paths()
    cfg = load_agent_config(config or p.agent_config)
    print(discover_inventory(cfg).model_dump_json(indent=2))


@app.command("install-engine")
@cli_errors
def install_engine(
    source: Annotated[
        Path,
        typer.Option("--from", help="A llama-server binary (e.g. a CUDA build) or a release tarball holding one."),
    ],
) -> None:
    """Install llama-server from a file as this node's engine (preferred over downloaded builds).

    The agent picks it up at its next engine check (within a minute) or restart.
    """
    from llmgw.agent.engines.provision import install_from_file

    p = paths()
    binary, version, digest = install_from_file(p.agent_state, source)
    print(f"installed llama-server {version} at {binary}")
    print(f"sha256 of {source}: {digest}")

