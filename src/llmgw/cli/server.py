"""`llmgw server` commands: `run` (the control plane process), `init`, `add-node`, `add-control-plane`,
`migrate-store`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from llmgw.cli.common import cli_errors, fail, paths, typer_app

app = typer_app(
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
    from llmgw.control.server import serve

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
    """Issue another machine's node identity and agent.yaml, to copy to its /etc/llmgw (under its --root)."""
    from llmgw.config import loopback_url
    from llmgw.serverinit.onboard import add_node as issue

    labels = {}
    for item in label or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--label {item!r} is not KEY=VALUE")
        labels[key] = value
    known, unasked, urls = _registered(node_id)
    made = issue(paths(), node_id, out, address=address, server=server, labels=labels, llama_server=llama_server,
                 known=urls)
    for f in made.files:
        print(f"  done {f}")
    if known is not None:
        print(f"!! node '{node_id}' is already in the cluster ({known}): this is a second identity for it, and "
              "the first stays valid. For a new machine pick another id; to move the id to a new machine, "
              f"run 'llmgw ctl node rm {node_id}' first (it revokes what was issued to the id before), then "
              "add-node again into an empty --out", file=sys.stderr)
    elif unasked:
        print(f"!! could not check whether node '{node_id}' is already in the cluster ({unasked}); if it is, this "
              f"is a second identity for it: see 'llmgw ctl nodes', and 'llmgw ctl node rm {node_id}' before "
              "moving the id to a new machine", file=sys.stderr)
    print(f"\nOn {node_id}: copy {out}/* to /etc/llmgw/ ($LLMGW_ROOT/etc/llmgw/ for an agent run under --root), "
          "then run 'llmgw agent'; under systemd, copy deploy/systemd/llmgw-agent.service from llmgw's "
          "repository (pip does not install it) to /etc/systemd/system/ and 'systemctl enable --now llmgw-agent'.")
    if loopback_url(made.server):
        print(f"!! agent.yaml names the control plane as {made.server}, a loopback address: only an agent "
              "on this machine reaches it. For another machine pass --server https://HOST:PORT with a name "
              "or address of this machine that its certificate holds (init's --host)", file=sys.stderr)


def _registered(node_id: str) -> tuple[str | None, str, dict[str, str]]:
    """Whether this machine's control plane (server.yaml's admin API and token) knows a node
    ``node_id``: ``("state ready", "")`` when it does, ``(None, "")`` when it does not, and
    ``(None, why)`` when it could not be asked; third, the control planes' own agent URLs by name
    (``GET /api/v1/cluster``, for agent.yaml's ``servers``; {} when not asked or not answered).
    add-node needs only the CA, so a failed check is no error; but it is said: every failure (a
    refused token, a 5xx, a timeout, an answer it could not read) read as 'not a node' before, and
    a new operator's add-node for a live node said nothing. Nobody to ask is still silent: no
    server.yaml or admin token here (a machine holding only the CA), or nothing listening on the
    admin address (the control plane is down)."""
    import httpx

    from llmgw.adminclient import ASK_TIMEOUT_S, AdminClient
    from llmgw.errors import LlmgwError, UnreachableError

    try:
        client = AdminClient.from_paths(paths(), timeout_s=ASK_TIMEOUT_S)
    except LlmgwError:
        return None, "", {}
    try:
        nodes = client.nodes()
    except UnreachableError as e:
        # A refused connection is a control plane that is not running; a timeout is one that is
        # there and did not answer in ASK_TIMEOUT_S (busy), which may well know the node.
        return None, "" if isinstance(e.__cause__, httpx.ConnectError) else str(e), {}
    except LlmgwError as e:
        return None, str(e), {}
    urls: dict[str, str] = {}
    if (paths().etc / "ha.yaml").exists():  # only an HA cluster's agent.yaml lists other control planes
        with contextlib.suppress(LlmgwError):  # the node's files need none of it: a guess stays
            urls = {cp.name: cp.agent_url for cp in client.cluster().control_planes if cp.agent_url}
    return next((f"state {n.state}" for n in nodes if n.id == node_id), None), "", urls


@app.command("add-control-plane")
@cli_errors
def add_control_plane(
    name: Annotated[str, typer.Argument(help="The standby's name, as init's --control-plane NAME=… gave it.")],
    out: Annotated[Path, typer.Option("--out", help="An empty directory for the standby's files (made 0700).")],
    address: Annotated[str, typer.Option("--address", help="The standby's address, as --control-plane gave it.")],
) -> None:
    """Write what a standby control plane needs (CA, its certificate, tokens, the database's
    member config and passwords, server.yaml) into --out, to carry to it for 'server init --join'."""
    from llmgw.serverinit.standby import add_control_plane as issue

    for f in issue(paths(), name, out, address=address):
        print(f"  done {f}")
    print(f"\nOn {name}: copy {out} there (it holds the CA key and database passwords: keep it 0700), "
          f"then run 'llmgw server init --join {out}'.")


@app.command("migrate-store")
@cli_errors
def migrate_store(
    to: Annotated[str, typer.Option("--to", help="The new store's URL: postgresql+psycopg://USER:PW@HOST/DB.")],
    source: Annotated[
        str, typer.Option("--from", help="The store to copy (default: server.yaml's store.url, else the SQLite file).")
    ] = "",
    config: Annotated[
        Path | None,
        typer.Option("--config", help="server.yaml (default: /etc/llmgw/server.yaml under --root)."),
    ] = None,
) -> None:
    """Copy this install's store (SQLite) into an empty database (PostgreSQL), in one transaction.

    Stop the control plane first (llmgw service stop); afterwards set store.url in server.yaml to
    the new URL and start it again.
    """
    from llmgw.config import load_server_config
    from llmgw.control.store import SqlStore, default_url
    from llmgw.control.store.copy import copy_store

    p = paths()
    cfg_path = config or p.server_config
    if not source:
        source = default_url(load_server_config(cfg_path).store.url if cfg_path.exists() else "", p.database)
    if source == to:
        raise fail("--from and --to are the same store")
    if source.startswith("sqlite:///") and not Path(source.removeprefix("sqlite:///")).is_file():
        raise fail(f"there is no store to copy at {source}; name it with --from")
    src = SqlStore.open(source)
    try:
        dst = SqlStore.open(to)
        try:
            copied = copy_store(src, dst)
        finally:
            dst.close()
    finally:
        src.close()
    for table, n in copied.items():
        print(f"  done {table}: {n} rows")
    print(f"\nSet store.url in {cfg_path} to the new URL, then start the control plane again.")
