"""`llmgw server` commands: `run` (the control plane process), `init`, `add-node`."""

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


@app.command("add-node")
@cli_errors
def add_node(
    node_id: Annotated[str, typer.Argument(help="The new node's id (its certificate's CN).")],
    out: Annotated[Path, typer.Option("--out", help="An empty directory for the node's files.")],
    address: Annotated[str, typer.Option("--address", help="The node's address the gateway dials.")],
    server: Annotated[str, typer.Option(help="Agent API URL (default: from server.yaml and the cert).")] = "",
    label: Annotated[list[str] | None, typer.Option("--label", help="KEY=VALUE, repeatable.")] = None,
    llama_server: Annotated[
        Path | None, typer.Option("--llama-server", help="The llama-server binary's path on the node.")
    ] = None,
) -> None:
    """Issue another machine's node identity and agent.yaml, to copy to its /etc/llmgw."""
    from llmgw.serverinit.onboard import add_node as issue  # noqa: PLC0415

    labels = {}
    for item in label or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--label {item!r} is not KEY=VALUE")
        labels[key] = value
    for f in issue(paths(), node_id, out, address=address, server=server, labels=labels,
                   llama_server=llama_server):
        print(f"  done {f}")
    print(f"\nOn {node_id}: copy {out}/* to /etc/llmgw/, then run 'llmgw agent' "
          "(or install deploy/systemd/llmgw-agent.service).")
