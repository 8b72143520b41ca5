"""``llmgw server init``: flags in, one call into :mod:`llmgw.serverinit`, lines out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmgw.agent.discovery import discover_gpus
from llmgw.cli.common import cli_errors, paths
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.plan import STARTER_SOURCE
from llmgw.serverinit.steps import ServerInit
from llmgw.service.manager import pick_manager


def _gpu_classes() -> list[str]:
    """This machine's GPU classes, asked of the agent's discovery; none is an answer."""
    return sorted({g.klass for g in discover_gpus()})


@cli_errors
def init(
    host: Annotated[
        list[str] | None,
        typer.Option("--host", help="A name or address of this machine for the certificate (repeatable); "
                     "the first is the one nodes use."),
    ] = None,
    cpus: Annotated[int | None, typer.Option(help="Cores to plan with (default: all of this machine's).")] = None,
    offline: Annotated[bool, typer.Option(help="Never download: skip what is not carried in.")] = False,
    no_node: Annotated[bool, typer.Option("--no-node", help="Do not make this machine a node.")] = False,
    no_guard_model: Annotated[
        bool, typer.Option("--no-guard-model", help="Do not install the guardrails' judge.")
    ] = False,
    starter_source: Annotated[
        str, typer.Option(help="The starter model: hf:ORG/REPO/FILE, https://…, or file:/abs/path.gguf.")
    ] = STARTER_SOURCE,
    starter_name: Annotated[str, typer.Option(help="Catalog name of the starter (default from the file).")] = "",
    starter_alias: Annotated[str, typer.Option(help="An alias clients may use for the starter.")] = "",
    llama_server: Annotated[
        Path | None, typer.Option("--llama-server", help="The llama-server binary this node runs.")
    ] = None,
    mirror: Annotated[
        str, typer.Option("--mirror", help="Use the mirror at this management URL instead of one here.")
    ] = "",
    judge_replicas: Annotated[
        int | None, typer.Option(help="Judge replicas (default: 1 when this machine is a node, else 2).")
    ] = None,
    judge_source: Annotated[
        str, typer.Option(help="The judge's weights instead of Qwen3Guard-Gen-0.6B: hf:…, https://… or file:/abs.gguf.")
    ] = "",
    judge_format: Annotated[
        str, typer.Option(help="The judge's format when it is not a Qwen3Guard: llamaguard3 or prompted.")
    ] = "",
    node_id: Annotated[str, typer.Option(help="This node's id (default: the hostname).")] = "",
    admin_listen: Annotated[str, typer.Option(help="Admin API address.")] = "127.0.0.1:9090",
    agent_listen: Annotated[str, typer.Option(help="Agent API address (TLS).")] = ":7443",
    gateway_listen: Annotated[str, typer.Option(help="Gateway address (OpenAI-compatible).")] = ":8080",
    mirror_listen: Annotated[str, typer.Option(help="Mirror bytes address.")] = ":8081",
    mirror_api_listen: Annotated[str, typer.Option(help="Mirror management API address.")] = "127.0.0.1:8082",
) -> None:
    """Make this machine a control plane, a model mirror and a node serving a starter model."""
    opts = InitOptions(
        hosts=host or [], cpus=cpus, offline=offline, no_node=no_node, no_guard_model=no_guard_model,
        starter_source=starter_source, starter_name=starter_name, starter_alias=starter_alias,
        llama_server=llama_server.resolve() if llama_server else None, mirror_url=mirror,
        judge_replicas=judge_replicas, judge_source=judge_source, judge_format=judge_format,
        node_id=node_id, admin_listen=admin_listen,
        agent_listen=agent_listen, gateway_listen=gateway_listen, mirror_listen=mirror_listen,
        mirror_api_listen=mirror_api_listen,
    )
    p = paths()
    ServerInit(p, opts, pick_manager(p), gpu_probe=_gpu_classes).run()
