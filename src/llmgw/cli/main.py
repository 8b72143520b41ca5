"""``llmgw``: the one command. Each command group lives in its own module, joined here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from llmgw import __version__
from llmgw.cli import agent, chat, ctl, mirror, server, server_init, service
from llmgw.cli.common import typer_app
from llmgw.paths import ROOT_ENV

app = typer_app(
    name="llmgw",
    help="A self-hosted LLM service: control plane, model mirror, nodes, and a guarded gateway.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        print(f"llmgw {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    root: Annotated[
        Path | None,
        typer.Option(
            "--root",
            help="Prefix every llmgw path with DIR (as LLMGW_ROOT does): the whole system in a directory.",
            envvar=ROOT_ENV,
        ),
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    if root is not None:
        # Children (services, engines) inherit it, so they see the same layout.
        os.environ[ROOT_ENV] = str(root.resolve())


server.app.command("init")(server_init.init)
app.add_typer(server.app, name="server")
app.add_typer(agent.app, name="agent")
app.add_typer(mirror.app, name="mirror")
app.add_typer(service.app, name="service")
app.add_typer(ctl.app, name="ctl")
app.command("chat")(chat.chat)


def main() -> None:
    """Console entry point."""
    app()
