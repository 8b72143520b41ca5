"""``llmgw server init``: flags in, one call into :mod:`llmgw.serverinit`, lines out."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from llmgw.cli.common import cli_errors, paths

STARTER_HELP = "hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf"
"""``--starter-source``'s default as its help names it: :data:`llmgw.serverinit.plan.STARTER_SOURCE`,
written out so that building the command tree does not import the catalog (0.2 s) for every
``llmgw`` run; tests/unit/test_cli_startup.py holds the two equal."""


def _listen(value: str) -> str:
    """A listen flag's value, checked before init starts (exit 2 naming the flag, not a traceback).

    Raises:
        typer.BadParameter: not ``HOST:PORT`` or ``:PORT``, or the port is outside 1..65535.
    """
    from llmgw.config import parse_listen

    try:
        parse_listen(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    return value


def _cpus(value: int | None) -> int | None:
    """``--cpus``, at most this machine's logical cores: the starter's profile is planned with it,
    and a profile asking for more cores than the node has is placed nowhere.

    Raises:
        typer.BadParameter: more cores than ``os.cpu_count()``.
    """
    have = os.cpu_count() or 1
    if value is not None and value > have:
        raise typer.BadParameter(
            f"this machine has {have} cores; plan with at most that many (the starter's profile asks for "
            "the cores given here, and a node with fewer never runs it)"
        )
    return value


def _gpu_classes() -> list[str]:
    """This machine's GPU classes, asked of the agent's discovery; none is an answer."""
    from llmgw.agent.node.discovery import discover_gpus

    return sorted({g.klass for g in discover_gpus()})


@cli_errors
def init(
    host: Annotated[
        list[str] | None,
        typer.Option("--host", help="A name or address of this machine for the certificate (repeatable); "
                     "the first is the one nodes use."),
    ] = None,
    cpus: Annotated[
        int | None,
        typer.Option(min=1, callback=_cpus, help="Cores to plan with, at most this machine's (default: all of them)."),
    ] = None,
    offline: Annotated[bool, typer.Option(help="Never download: skip what is not carried in.")] = False,
    no_node: Annotated[bool, typer.Option("--no-node", help="Do not make this machine a node.")] = False,
    no_guard_model: Annotated[
        bool, typer.Option("--no-guard-model", help="Do not install the guardrails' judge.")
    ] = False,
    starter_source: Annotated[
        str, typer.Option(help=f"The starter model: hf:ORG/REPO/FILE, https://…, or file:/abs/path.gguf "
                          f"(default: {STARTER_HELP}).")
    ] = "",
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
    admin_listen: Annotated[str, typer.Option(callback=_listen, help="Admin API address.")] = "127.0.0.1:9090",
    agent_listen: Annotated[str, typer.Option(callback=_listen, help="Agent API address (TLS).")] = ":7443",
    gateway_listen: Annotated[
        str, typer.Option(callback=_listen, help="Gateway address (OpenAI-compatible).")
    ] = ":8080",
    mirror_listen: Annotated[str, typer.Option(callback=_listen, help="Mirror bytes address.")] = ":8081",
    mirror_api_listen: Annotated[
        str, typer.Option(callback=_listen, help="Mirror management API address.")
    ] = "127.0.0.1:8082",
    control_plane: Annotated[
        list[str] | None,
        typer.Option("--control-plane", help="HA: a control plane as NAME=HOST[:PORT] (PORT: PostgreSQL's, 5432; "
                     "Patroni's REST API +2576, raft -421), repeatable; this machine first, then each standby."),
    ] = None,
    etcd: Annotated[
        list[str] | None,
        typer.Option("--etcd", help="HA: an etcd v3 URL for Patroni (http://HOST:2379), repeatable; "
                     "none: Patroni's raft (small installs, tests)."),
    ] = None,
    patroni_venv: Annotated[
        Path | None, typer.Option("--patroni-venv", help="HA: Patroni's venv (default /opt/llmgw/patroni-4.1.5; "
                                  "made from /usr/bin/python3 when missing).")
    ] = None,
    patroni_dir: Annotated[
        Path | None, typer.Option("--patroni-dir", help="HA: this member's patroni.yml and data "
                                  "(default /var/lib/llmgw-patroni).")
    ] = None,
    pg_bin_dir: Annotated[
        Path | None,
        typer.Option("--pg-bin-dir", help="HA: PostgreSQL 15's binaries (default /usr/lib/postgresql/15/bin)."),
    ] = None,
    join: Annotated[
        Path | None, typer.Option("--join", help="HA: make this machine a standby control plane from the "
                                  "directory 'llmgw server add-control-plane' wrote.")
    ] = None,
) -> None:
    """Make this machine a control plane, a model mirror and a node serving a starter model.

    HA: with --control-plane (this machine first, then each standby) PostgreSQL runs under Patroni
    here and the control plane uses it; each standby then runs 'init --join DIR' with what
    'llmgw server add-control-plane' wrote for it.
    """
    from llmgw.serverinit.options import InitOptions
    from llmgw.serverinit.plan import STARTER_SOURCE
    from llmgw.serverinit.steps import ServerInit
    from llmgw.service.manager import pick_manager

    opts = InitOptions(
        hosts=host or [], cpus=cpus, offline=offline, no_node=no_node, no_guard_model=no_guard_model,
        starter_source=starter_source or STARTER_SOURCE, starter_name=starter_name, starter_alias=starter_alias,
        llama_server=llama_server.resolve() if llama_server else None, mirror_url=mirror,
        judge_replicas=judge_replicas, judge_source=judge_source, judge_format=judge_format,
        node_id=node_id, admin_listen=admin_listen,
        agent_listen=agent_listen, gateway_listen=gateway_listen, mirror_listen=mirror_listen,
        mirror_api_listen=mirror_api_listen, control_planes=control_plane or [], etcd=etcd or [],
        patroni_venv=patroni_venv.resolve() if patroni_venv else None,
        patroni_dir=patroni_dir.resolve() if patroni_dir else None,
        pg_bin_dir=pg_bin_dir.resolve() if pg_bin_dir else None, join=join.resolve() if join else None,
    )
    if opts.join is not None:
        opts.no_node = True
        opts.no_guard_model = True
    p = paths()
    ServerInit(p, opts, pick_manager(p), gpu_probe=_gpu_classes).run()
