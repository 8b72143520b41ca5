"""``llmgw ctl node cordon|uncordon|drain|rm NODE``: what an operator does to one node.

A drain cordons the node and stops its replicas at once (a stream in flight on one ends with an
error event); their replacements are placed where they fit (docs/operating.md, "Nodes"). ``rm``
removes the node and revokes its certificates; it is refused while replicas run there unless
``--force`` (which drains first). Exit codes as ``llmgw ctl``.
"""

from __future__ import annotations

from typing import Annotated

import typer

from llmgw.cli.common import admin_client, cli_errors, print_json
from llmgw.cli.keys import JsonOpt, ServerOpt, TokenOpt

app = typer.Typer(no_args_is_help=True, help="Cordon, uncordon, drain or remove a node.")


def _node_action(action: str, node: str, server: str | None, token: str | None, as_json: bool) -> None:
    data = admin_client(server, token).node_action(node, action)
    if as_json:
        print_json(data)
    else:
        print(f"{node}: {action}ed" if action != "drain" else f"{node}: cordoned and drained")


@app.command("cordon")
@cli_errors
def node_cordon(
    node: Annotated[str, typer.Argument(help="The node id.")],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """No new replicas on NODE; the ones there keep running."""
    _node_action("cordon", node, server, token, as_json)


@app.command("uncordon")
@cli_errors
def node_uncordon(
    node: Annotated[str, typer.Argument(help="The node id.")],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Let placement use NODE again."""
    _node_action("uncordon", node, server, token, as_json)


@app.command("drain")
@cli_errors
def node_drain(
    node: Annotated[str, typer.Argument(help="The node id.")],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Cordon NODE and move its replicas elsewhere (they stop there at once)."""
    _node_action("drain", node, server, token, as_json)


@app.command("rm")
@cli_errors
def node_rm(
    node: Annotated[str, typer.Argument(help="The node id.")],
    force: Annotated[bool, typer.Option("--force", help="Drain it first when replicas are placed there.")] = False,
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Remove NODE and revoke every certificate issued for it so far; refused while replicas run there
    (--force drains)."""
    data = admin_client(server, token).remove_node(node, force=force)
    if as_json:
        print_json(data)
        return
    if data.drained:
        print(f"{node}: drained {len(data.drained)} replica(s); they will be placed when a node can run "
              "them ('llmgw ctl replicas' shows where)")
    if data.revoked:
        print(f"{node}: removed; certificate serial(s) {', '.join(data.revoked)} revoked, and every other "
              "certificate issued for it until now is refused, so its agent stops at its next heartbeat")
    else:
        print(f"{node}: removed; no certificate of it was seen, but every certificate issued for it until "
              "now is refused, so its agent stops at its next heartbeat")
    print(f"To re-join it: 'llmgw server add-node {node} --address ADDR --out DIR' (a new certificate), "
          "copy DIR to its /etc/llmgw and start its agent")
