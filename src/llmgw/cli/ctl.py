"""``llmgw ctl``: what operators ask the control plane. Tables for people, ``--json`` for scripts.

Exit codes: 0 fine; 1 an API error; 2 bad input; 3 the control plane does not answer.
``explain-placement`` exits 0 when the model is placed and 6 when it is not, so scripts can wait on it.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from llmgw.adminclient import AdminClient
from llmgw.cli.common import cli_errors, paths

app = typer.Typer(no_args_is_help=True, help="Ask the control plane: nodes, models, replicas, placement.")

ServerOpt = Annotated[str | None, typer.Option("--server", help="Admin API URL (default: this machine's).")]
TokenOpt = Annotated[str | None, typer.Option("--token", envvar="LLMGW_TOKEN", help="Admin bearer token.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]

NOT_PLACED_EXIT = 6


def _client(server: str | None, token: str | None) -> AdminClient:
    return AdminClient.from_paths(paths(), server=server, token=token)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0, int(time.time() - ts))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h"


@app.command()
@cli_errors
def nodes(server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Nodes: state, engines, resources used and free, labels."""
    data = _client(server, token).get("/api/v1/nodes")
    if as_json:
        _print_json(data)
        return
    t = Table("NODE", "STATE", "ENGINES", "CORES (reserved/all)", "MEMORY GiB (reserved/all)", "GPUS", "LABELS",
              "SEEN")
    for n in data:
        r = n.get("resources") or {}
        engines = ", ".join(
            f"{p['engine']} {p.get('version', '')} {p['state']}".replace("  ", " ") for p in n.get("provision", [])
        )
        state = n["state"] + (" (cordoned)" if n.get("cordoned") else "")
        t.add_row(
            n["id"], state, engines or "-",
            f"{r.get('cores_reserved', 0)}/{r.get('cores', 0)}" if r else "-",
            f"{_gib(r.get('memory_reserved_bytes'))}/{_gib(r.get('memory_total_bytes'))}" if r else "-",
            ", ".join(g.get("klass", "") for g in n.get("gpus", [])) or "-",
            ", ".join(f"{k}={v}" for k, v in sorted(n.get("labels", {}).items())) or "-",
            _ago(n.get("last_seen")),
        )
    Console().print(t)
    for n in data:
        for p in n.get("provision", []):
            if p["state"] in ("failed", "unsupported") and p.get("detail"):
                print(f"{n['id']}: {p['engine']}: {p['detail']}")


@app.command()
@cli_errors
def models(server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """The catalog: each model, its aliases, role, scaling and replicas ready."""
    data = _client(server, token).get("/api/v1/models")
    if as_json:
        _print_json(data)
        return
    t = Table("MODEL", "ALIASES", "ROLE", "SCALING", "READY", "SOURCE")
    for m in data:
        t.add_row(
            m["name"], ", ".join(m.get("aliases", [])) or "-", m.get("role", "chat"),
            f"{m.get('scaling_min', '?')}..{m.get('scaling_max', '?')}",
            f"{m.get('replicas_ready', 0)}/{m.get('replicas', 0)}", m.get("source", ""),
        )
    Console().print(t)


@app.command()
@cli_errors
def replicas(
    model: Annotated[str | None, typer.Argument(help="Only this model's replicas.")] = None,
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Replicas: model, node, profile, state, uptime, restarts, last error."""
    path = "/api/v1/replicas" + (f"?model={model}" if model else "")
    data = _client(server, token).get(path)
    if as_json:
        _print_json(data)
        return
    t = Table("REPLICA", "MODEL", "NODE", "PROFILE", "STATE", "UP", "RESTARTS", "ERROR")
    for r in data:
        err = (r.get("err") or "").strip().splitlines()
        t.add_row(
            r["id"], r["model"], r.get("node") or "-", r.get("profile") or "-", r["state"],
            _ago(r.get("ready_at")) if r["state"] == "ready" else "-", str(r.get("restarts", 0)),
            err[-1][:80] if err else "",
        )
    Console().print(t)


@app.command("explain-placement")
@cli_errors
def explain_placement(
    model: Annotated[str, typer.Argument(help="The model to explain.")],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Why a model runs where it does, or why it runs nowhere: every node, profile and reason."""
    ex = _client(server, token).get(f"/api/v1/explain-placement?model={model}")
    if as_json:
        _print_json(ex)
    else:
        state = "placed" if ex.get("placed") else "NOT placed"
        print(f"{ex['model']}: {state} ({ex.get('replicas', 0)}/{ex.get('wanted', 0)} replicas)")
        if ex.get("summary"):
            print(ex["summary"])
        if ex.get("rejections"):
            t = Table("NODE", "PROFILE", "KIND", "REASON")
            for r in ex["rejections"]:
                t.add_row(r["node"], r["profile"], r["kind"], r["reason"])
            Console().print(t)
    if not ex.get("placed"):
        raise typer.Exit(NOT_PLACED_EXIT)
