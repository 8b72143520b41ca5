"""`llmgw server` commands: `run` (the control plane process). `init` joins this group later."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer

from llmgw.cli.common import cli_errors, paths

app = typer.Typer(
    no_args_is_help=True,
    help="The control plane: run it, or make this machine a whole llmgw (init).",
    pretty_exceptions_show_locals=False,
)


@app.callback()
def _group() -> None:
    """The control plane: run it, or make this machine a whole llmgw (init)."""
    # A callback keeps `server` a group even while `run` is its only command.


@app.command("run")
@cli_errors
def run(
    config: Annotated[
        Path | None,
        typer.Option("--config", help="server.yaml (default: /etc/llmgw/server.yaml under --root)."),
    ] = None,
) -> None:
    """Run the control plane: admin API, agent API (mTLS), gateway and the leader, until SIGTERM."""
    from llmgw.control.server import serve  # noqa: PLC0415 - keeps `llmgw --help` fast

    p = paths()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config or p.server_config, p))
