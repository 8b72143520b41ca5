"""`llmgw mirror` commands: serve the model mirror."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from llmgw.cli.common import cli_errors, paths
from llmgw.mirror import server

app = typer.Typer(
    no_args_is_help=True, help="The model mirror: download weights once, serve them to every node."
)


@app.command("serve")
@cli_errors
def serve(
    base: Annotated[
        str,
        typer.Option(
            "--base",
            help="The URL nodes reach the bytes server at (http://ADDR:8081); status URLs start with it.",
        ),
    ],
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir", help="The store: <model>/<version>/<file> plus manifests. Default /srv/models."
        ),
    ] = None,
    listen: Annotated[
        str, typer.Option("--listen", help="Bytes server, for every node (HOST:PORT or :PORT).")
    ] = ":8081",
    api_listen: Annotated[
        str,
        typer.Option("--api-listen", help="Management API (HOST:PORT); answers loopback and --api-allow."),
    ] = "127.0.0.1:8082",
    api_allow: Annotated[
        list[str] | None,
        typer.Option(
            "--api-allow", help="An address or network (CIDR) the management API also answers; repeatable."
        ),
    ] = None,
) -> None:
    """Serve the mirror until SIGTERM or Ctrl-C; fetches left running resume at the next start."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = directory if directory is not None else paths().mirror_store
    print(f"mirror of {root}: bytes on {listen}, management API on {api_listen}, served as {base}")
    server.run(root=root, listen=listen, api_listen=api_listen, base=base, api_allow=api_allow or [])
