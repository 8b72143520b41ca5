"""``llmgw chat``: ask the gateway as any client would, the answer streamed to the terminal."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from llmgw.cli.common import cli_errors, paths


@cli_errors
def chat(
    message: Annotated[str, typer.Argument(help="What to ask (one user message).")],
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="Model name or alias; default: the first of GET /v1/models."),
    ] = None,
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            envvar="LLMGW_SERVER",
            help="Gateway URL (http://HOST:8080); default: gateway.listen of this machine's server.yaml.",
        ),
    ] = None,
    key: Annotated[
        str | None,
        typer.Option(
            "--key",
            envvar="LLMGW_API_KEY",
            help="API key; default: the first line of this machine's gateway keys file, if readable.",
        ),
    ] = None,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, help="The longest answer to print, in tokens.")
    ] = 256,
) -> None:
    """Ask the gateway one question and print the answer as it streams."""
    from llmgw import client

    if model is not None and not model.strip():
        raise typer.BadParameter("an empty model name: leave --model out for the default, or see 'llmgw ctl models'",
                                 param_hint="--model")
    target = client.resolve_target(paths(), server=server, key=key)
    name = model or client.default_model(target.base_url, target.key)
    for delta in client.stream_chat(target.base_url, target.key, name, message, max_tokens=max_tokens):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
