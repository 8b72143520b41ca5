"""``llmgw ctl``: what operators ask the control plane. Tables for people, ``--json`` for scripts.

Commands: ``nodes``, ``node cordon|uncordon|drain NODE``, ``node rm NODE [--force]``, ``models``,
``model add -f FILE`` (or flags), ``model set NAME KEY=VALUE…`` (:mod:`llmgw.cli.modelset`),
``model set-profiles NAME -f FILE``, ``model rm NAME [--delete-weights]``,
``model scale NAME N``, ``model resources NAME``, ``replicas [MODEL]``, ``restart ID``,
``explain-placement MODEL``, ``cluster`` (the control planes, which leads, the term, the
database's members), ``key create|ls|revoke|rotate`` and ``usage`` (:mod:`llmgw.cli.keys`).
``--server``/``--token`` (or ``LLMGW_TOKEN``) override this machine's server.yaml and admin-token file.

``model scale NAME N`` keeps N replicas (:func:`llmgw.catalog.scale_to`): a model that does not
autoscale stays fixed at N (``scaling.min = max = N``); an autoscaled one gets ``scaling.min`` N,
its max raised to N when below. Replicas above the new count drain (routed no more, their
requests finished, at most 30 s) before they stop.

``model rm --delete-weights`` deletes the model, then the mirror entry its ``source`` points to
(:mod:`llmgw.mirror.usage`), from the mirror named in server.yaml (``mirror.api``), unless another
model in the catalog uses the same entry (then it says which and keeps it); nodes keep their
cached copy until their cache evicts it.

Exit codes: 0 fine; 1 an API error; 2 bad input; 3 the control plane does not answer.
``explain-placement`` exits 0 when the model is placed and 6 when it is not, so scripts can wait on it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from llmgw.cli import guard as guard_cli
from llmgw.cli import keys as keys_cli
from llmgw.cli.common import admin_client as _client
from llmgw.cli.common import cli_errors, console, fail, paths, plain, table, typer_app, whole
from llmgw.cli.common import print_json as _print_json
from llmgw.cli.modelset import model_set
from llmgw.cli.modelwarn import (
    warn_drained_nowhere,
    warn_fits_nowhere,
    warn_judge_removed,
    warn_profiles_fit_no_node,
    warn_scaled_past_room,
    warn_unreadable_source,
)
from llmgw.errors import ApiError, ConfigError

if TYPE_CHECKING:
    from llmgw.views import ModelView

app = typer_app(no_args_is_help=True, help="Ask the control plane: nodes, models, replicas, placement.")

ServerOpt = Annotated[str | None, typer.Option("--server", help="Admin API URL (default: this machine's).")]
TokenOpt = Annotated[str | None, typer.Option("--token", envvar="LLMGW_TOKEN", help="Admin bearer token.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
LinesOpt = Annotated[int, typer.Option("--lines", "-n", min=1, help="How many of the last lines.")]
FollowOpt = Annotated[bool, typer.Option("--follow", "-f", help="Keep printing what the engine writes.")]
FOLLOW_POLL_S = 1.0

NOT_PLACED_EXIT = 6

node_app = typer_app(no_args_is_help=True, help="Cordon, uncordon, drain or remove a node.")
model_app = typer_app(no_args_is_help=True, help="The catalog: add, change fields or profiles, scale, remove.")
model_app.command("set")(cli_errors(model_set))
app.add_typer(node_app, name="node")
app.add_typer(model_app, name="model")
app.add_typer(guard_cli.app, name="guard")
app.add_typer(keys_cli.app, name="key")
app.command("usage")(cli_errors(keys_cli.usage))


def _gb(n: float | None) -> str:
    """Bytes as GB (10^9), the unit of ``min_memory_gb`` and of placement's reasons."""
    return "-" if n is None else f"{n / 1e9:.1f}"


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
    data = _client(server, token).nodes()
    if as_json:
        _print_json(data)
        return
    t = table("NODE", "STATE", "ENGINES", "CORES (reserved/all)", "MEMORY GB (reserved/all)", "GPUS", "LABELS",
              "SEEN")
    for n in data:
        r = n.resources
        engines = ", ".join(f"{p.engine} {p.version} {p.state}".replace("  ", " ") for p in n.provision)
        state = n.state + (" (cordoned)" if n.cordoned else "")
        t.add_row(
            n.id, state, engines or "-",
            f"{r.cores_reserved}/{r.cores}" if r else "-",
            f"{_gb(r.memory_reserved_bytes)}/{_gb(r.memory_total_bytes)}" if r else "-",
            ", ".join(g.klass for g in n.gpus) or "-",
            ", ".join(f"{k}={v}" for k, v in sorted(n.labels.items())) or "-",
            _ago(n.last_seen),
        )
    console().print(t)
    for n in data:
        for p in n.provision:
            if p.state in ("failed", "unsupported") and p.detail:
                print(plain(f"{n.id}: {p.engine}: {p.detail}"))
        for problem in n.problems:
            print(plain(f"{n.id}: {problem}"))


@app.command()
@cli_errors
def cluster(server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """The HA cluster: control planes (which one leads), the term, the database's members and lag."""
    view = _client(server, token).cluster()
    if as_json:
        _print_json(view)
        return
    db = "reachable" if view.database.reachable else f"UNREACHABLE: {view.database.error}"
    leader = f"leader {view.leader}" if view.leader else view.leader_text()
    console().print(f"term {view.term}, {leader}; answered by {view.me}, database {db}")
    t = table("CONTROL PLANE", "AGENT URL", "LEADER", "ALIVE", "SEEN")
    for cp in view.control_planes:
        t.add_row(cp.name, cp.agent_url, "yes" if cp.leader else "", "yes" if cp.alive else "NO",
                  f"{cp.last_seen_s_ago:.0f}s ago")
    console().print(t)
    if view.patroni:
        p = table("DATABASE MEMBER", "ROLE", "STATE", "HOST", "LAG (bytes)")
        for m in view.patroni:
            p.add_row(m.name, m.role, m.state, m.host, "-" if m.lag is None else str(m.lag))
        console().print(p)
    elif view.patroni_error:
        print(f"database members: {view.patroni_error}")
    else:
        print("database members: no Patroni REST URL in server.yaml (cluster.patroni)")


def ready_cell(m: ModelView) -> str:
    """``ctl models``' READY: replicas ready of the replicas wanted (``2/3``: one short, ``0/1``: none
    placed), and how many are placed when that differs from ready (``1/2 (2 placed)``: one starting),
    and how many of those failed (``0/1 (1 failed)``: it read as starting, an operator's finding)."""
    cell = f"{m.replicas_ready}/{m.replicas_wanted}"
    if m.replicas == m.replicas_ready:
        return cell
    if not m.replicas_failed:
        return f"{cell} ({m.replicas} placed)"
    if m.replicas - m.replicas_failed == m.replicas_ready:
        return f"{cell} ({m.replicas_failed} failed)"
    return f"{cell} ({m.replicas} placed, {m.replicas_failed} failed)"


@app.command()
@cli_errors
def models(server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """The catalog: each model, its aliases, role, scaling, replicas wanted and ready (of wanted);
    broken rows named."""
    data = _client(server, token).models()
    if as_json:
        _print_json(data)
        return
    t = table("MODEL", "ALIASES", "ROLE", "SCALING", "WANTED", "READY", "SOURCE")
    for m in data:
        if m.broken:
            t.add_row(m.name, "-", "BROKEN", "-", "-", "-", m.broken)
            continue
        t.add_row(
            m.name, ", ".join(m.aliases) or "-", m.role, f"{m.scaling_min}..{m.scaling_max}",
            str(m.replicas_wanted), ready_cell(m), m.source,
        )
    console().print(t)
    for m in data:
        if m.broken:
            print(f"{m.name}: broken, served nowhere: {m.broken}; 'llmgw ctl model rm {m.name}' deletes it")


@app.command()
@cli_errors
def replicas(
    model: Annotated[str | None, typer.Argument(help="Only this model's replicas (name or alias).")] = None,
    replica: Annotated[str | None, typer.Argument(help="With 'logs': the replica whose log to read.")] = None,
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
    lines: LinesOpt = 100, follow: FollowOpt = False,
) -> None:
    """Replicas: model, node, profile, state, uptime, restarts, this control plane's routing to
    each (SLOTS, IN FLIGHT, QUEUED: its model's, AFFINITY: cache-affinity hits), last error.

    ``llmgw ctl replicas logs ID [--follow]`` reads a replica's engine log (as ``ctl logs``).
    """
    if model == "logs" and replica:
        logs(replica, server=server, token=token, lines=lines, follow=follow)
        return
    data = _client(server, token).replicas(model)
    if as_json:
        _print_json(data)
        return
    # The routing figures are the answering control plane's own (each routes on its own).
    t = table("REPLICA", "MODEL", "NODE", "PROFILE", "STATE", "UP", "RESTARTS",
              "SLOTS", "IN FLIGHT", "QUEUED", "AFFINITY", "ERROR / WHY PENDING")
    for r in data:
        err = (r.err or r.pending_reason or r.last_error).strip().splitlines()
        g = r.routing
        t.add_row(
            r.id, r.model, r.node or "-", r.profile or "-", r.state + (" (draining)" if r.draining_since else ""),
            _ago(r.ready_at) if r.state == "ready" else "-", str(r.restarts),
            *((str(g.slots) if g.slots is not None else "?", str(g.in_flight), str(g.queued), str(g.affinity_hits))
              if g is not None else ("-",) * 4),
            err[0].removesuffix("; its last lines:")[:100] if err else "",
        )
        for m in r.members[1:]:  # a group's workers, under their head
            werr = m.err.strip().splitlines()
            t.add_row(
                f"  └ worker {m.rank}", "", m.node, "", m.state or "-", "", "", "", "", "", "",
                werr[0].removesuffix("; its last lines:")[:100] if werr else (m.endpoint and f"at {m.endpoint}"),
            )
    console().print(t)


@app.command()
@cli_errors
def logs(
    replica: Annotated[str, typer.Argument(help="The replica (see 'llmgw ctl replicas').")],
    server: ServerOpt = None, token: TokenOpt = None, lines: LinesOpt = 100, follow: FollowOpt = False,
) -> None:
    """A replica's engine log, read through the agent on its node (at most one heartbeat away)."""
    client = _client(server, token)
    got = client.replica_logs(replica, lines=lines)
    sys.stdout.write(got.text)
    sys.stdout.flush()
    offset = got.offset
    while follow:
        time.sleep(FOLLOW_POLL_S)
        got = client.replica_logs(replica, offset=offset)
        sys.stdout.write(got.text)
        sys.stdout.flush()
        offset = got.offset


@app.command("explain-placement")
@cli_errors
def explain_placement(
    model: Annotated[str, typer.Argument(help="The model to explain.")],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Why a model runs where it does, or why it runs nowhere: every node, profile and reason."""
    ex = _client(server, token).explain(model)
    if as_json:
        _print_json(ex)
    else:
        state = "placed" if ex.placed else "NOT placed"
        print(f"{ex.model}: {state} ({ex.replicas}/{ex.wanted} replicas)")
        if ex.summary:
            print(ex.summary)
        if ex.last_placed:
            print(f"newest replica: {ex.last_placed}")
        for f in ex.failed:
            print(plain(f"placed but its engine failed: {f.replica} on {f.node}: {f.error} (its log: 'llmgw ctl logs "
                        f"{f.replica}')"))
        if ex.rejections:
            t = table("PROFILE", "NODE", "KIND", "REASON")
            for r in ex.rejections:
                t.add_row(r.profile, r.node, r.kind, r.reason)
            console().print(t)
        for line in ex.would_fit_if:
            print(f"would fit if: {line}")
    if not ex.placed:
        raise typer.Exit(NOT_PLACED_EXIT)


@app.command()
@cli_errors
def restart(
    replica: Annotated[str, typer.Argument(help="The replica id.")],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Restart a replica: a new one replaces it on the same node and profile."""
    new = _client(server, token).restart_replica(replica)
    if as_json:
        _print_json(new)
    else:
        print(f"{replica} replaced by {new.id} on {new.node}")


def _node_action(action: str, node: str, server: str | None, token: str | None, as_json: bool) -> None:
    client = _client(server, token)
    before = client.replicas() if action == "drain" else []
    data = client.node_action(node, action)
    if as_json:
        _print_json(data)
    else:
        print(f"{node}: {action}ed" if action != "drain" else f"{node}: cordoned and drained")
    if action == "drain":
        warn_drained_nowhere(client, node, before)


@node_app.command("cordon")
@cli_errors
def node_cordon(
    node: Annotated[str, typer.Argument(help="The node id.")],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """No new replicas on NODE; the ones there keep running."""
    _node_action("cordon", node, server, token, as_json)


@node_app.command("uncordon")
@cli_errors
def node_uncordon(
    node: Annotated[str, typer.Argument(help="The node id.")],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Let placement use NODE again."""
    _node_action("uncordon", node, server, token, as_json)


@node_app.command("drain")
@cli_errors
def node_drain(
    node: Annotated[str, typer.Argument(help="The node id.")],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Cordon NODE and move its replicas elsewhere (they stop there at once)."""
    _node_action("drain", node, server, token, as_json)


@node_app.command("rm")
@cli_errors
def node_rm(
    node: Annotated[str, typer.Argument(help="The node id.")],
    force: Annotated[bool, typer.Option("--force", help="Drain it first when replicas are placed there.")] = False,
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Remove NODE and revoke every certificate issued for it so far; refused while replicas run there
    (--force drains)."""
    client = _client(server, token)
    before = client.replicas() if force else []
    data = client.remove_node(node, force=force)
    if as_json:
        _print_json(data)
        return
    if data.drained:
        print(f"{node}: drained {len(data.drained)} replica(s); they will be placed when a node can run "
              "them ('llmgw ctl replicas' shows where)")
        warn_drained_nowhere(client, node, before, removed=True)  # as a drain does (rm said nothing before)
    if data.revoked:
        print(f"{node}: removed; certificate serial(s) {', '.join(data.revoked)} revoked, and every other "
              "certificate issued for it until now is refused, so its agent stops at its next heartbeat")
    else:
        print(f"{node}: removed; no certificate of it was seen, but every certificate issued for it until "
              "now is refused, so its agent stops at its next heartbeat")
    print(f"To re-join it: 'llmgw server add-node {node} --address ADDR --out DIR' (a new certificate), "
          "copy DIR to its /etc/llmgw and start its agent")


def _read_doc(path: Path, want: tuple[type, ...], what: str) -> Any:
    """The YAML document in ``path``, which must be one of ``want`` (``what`` names it for the error).

    Raises:
        ConfigError (exit 2): the file cannot be read, is not UTF-8 text (a .gguf given for its
            model.yaml), is not YAML, or holds something else (empty, a list for a mapping).
    """
    import yaml

    from llmgw import yamlsafe

    try:
        doc = yamlsafe.load(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"{path} cannot be read: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start} is not): give a YAML file of {what}") from e
    except yamlsafe.DuplicateKeyError as e:
        raise ConfigError(f"{path}: {e.problem}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {yamlsafe.problem(e)}") from e
    if not isinstance(doc, want):
        held = "nothing" if doc is None else f"a YAML {_yaml_kind(doc)}"
        raise ConfigError(f"{path} holds {held}; give a YAML file of {what}")
    return doc


def _yaml_kind(doc: object) -> str:
    return {dict: "mapping", list: "list", str: "string", bool: "boolean"}.get(type(doc), "number")


MODEL_YAML_DOC = "model.yaml's fields, with an example: docs/operating.md, 'Adding a model'"
"""Where a ``ctl model add -f`` whose file the admin API refuses as a model (400 ``invalid_model``: a
field missing or wrong) is pointed (a reviewer's finding: the error named the field and nothing to read)."""


@model_app.command("add")
@cli_errors
def model_add(
    file: Annotated[Path | None, typer.Option("-f", "--file", help="model.yaml (the catalog fields).")] = None,
    name: Annotated[str | None, typer.Option("--name", help="Model name (without -f).")] = None,
    source: Annotated[str | None, typer.Option("--source", help="Weights URL (the mirror's).")] = None,
    version: Annotated[str, typer.Option("--version", help="Version label.")] = "1",
    alias: Annotated[list[str] | None, typer.Option("--alias", help="An alias (repeatable).")] = None,
    memory_gb: Annotated[float, typer.Option("--memory-gb", help="min_memory_gb (0: estimate).")] = 0,
    cpu_cores: Annotated[int, typer.Option("--cpu-cores", parser=whole, help="Cores per replica.")] = 0,
    ctx_size: Annotated[
        int, typer.Option("--ctx-size", parser=whole, help="--ctx-size for the engine (0: leave).")
    ] = 0,
    replicas_n: Annotated[int, typer.Option("--replicas", parser=whole, help="scaling.min and max.")] = 1,
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Add a model from model.yaml, or from flags (one CPU llama.cpp profile)."""
    if file is not None and (name or source):
        raise fail("give either -f FILE or --name/--source, not both", 2)
    if file is not None:
        spec = _read_doc(file, (dict,), "a model: a mapping of its fields (name, source, profiles...)")
    elif name and source:
        args = ["--ctx-size", str(ctx_size)] if ctx_size else []
        spec = {
            "name": name, "source": source, "version": version, "aliases": alias or [],
            "scaling": {"min": replicas_n, "max": replicas_n},
            "profiles": [{"name": "cpu", "min_memory_gb": memory_gb, "cpu_cores": cpu_cores, "args": args}],
        }
    else:
        raise fail("give -f model.yaml, or at least --name and --source", 2)
    client = _client(server, token)
    try:
        data = client.add_model(spec)
    except ApiError as e:  # model.yaml refused as a model (a field missing or wrong): say where they are written down
        if file is None or e.code != "invalid_model":
            raise
        raise ApiError(f"{e} ({MODEL_YAML_DOC})", status=e.status, code=e.code) from None
    if as_json:
        _print_json(data)
    else:
        print(f"added {data.name} (replicas {data.scaling_min}..{data.scaling_max})")
    resources = warn_unreadable_source(client, data.name)
    if resources is not None:
        warn_fits_nowhere(client, data.name, resources, wanted=data.scaling_min)


@model_app.command("set-profiles")
@cli_errors
def model_set_profiles(
    name: Annotated[str, typer.Argument(help="The model.")],
    file: Annotated[Path, typer.Option("-f", "--file", help="YAML list of profiles (or {profiles: [...]}).")],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Replace a model's profiles; its replicas restart onto the new ones."""
    client = _client(server, token)
    data = client.set_profiles(name, _read_doc(file, (list, dict), "profiles: a list of them, or {profiles: [...]}"))
    if as_json:
        _print_json(data)
    else:
        print(f"{name}: profiles set; replicas restart onto them")
    warn_profiles_fit_no_node(client, name)


@model_app.command("rm")
@cli_errors
def model_rm(
    name: Annotated[str, typer.Argument(help="The model.")],
    delete_weights: Annotated[bool, typer.Option("--delete-weights", help="Also delete it from the mirror.")] = False,
    server: ServerOpt = None, token: TokenOpt = None,
) -> None:
    """Remove a model (by name or alias): its replicas stop; the weights stay on the mirror unless
    --delete-weights."""
    client = _client(server, token)
    # The catalog's name, NAME being an alias or not: DELETE answers 204 with no body, so the name
    # comes from the GET (it printed the alias alone, and --delete-weights counted the model itself
    # among the others using its file, its name not being the alias).
    model = client.model(name)
    source = model.source
    others: list[tuple[str, str]] = []
    if delete_weights:
        others = [(m.name, m.source) for m in client.models() if m.name != model.name]
    client.remove_model(model.name)
    called = model.name if model.name == name else f"{model.name} (alias {name})"
    print(f"removed {called}; its replicas stop at their nodes' next heartbeat")
    warn_judge_removed(client, model.name, model.aliases)
    if delete_weights:
        from llmgw.config import load_server_config
        from llmgw.mirror.client import MirrorClient, local_token
        from llmgw.mirror.usage import delete_weights as delete

        api = load_server_config(paths().server_config).mirror.api
        if not api:
            raise fail("server.yaml has no mirror.api; delete the weights with 'llmgw mirror rm'", 1)
        with MirrorClient(api, token=local_token(paths())) as mirror:
            print(delete(mirror, name=model.name, source=source, others=others, api=api))


def _replica_count(n: int) -> int:
    """``scale``'s N: 0 or more (a check of its own: Typer's ``min=0`` never saw ``-1``, see below)."""
    if n < 0:
        raise typer.BadParameter(f"replicas must be 0 or more, not {n}")
    return n


# ignore_unknown_options: Click reads "-1" as an option ("No such option: -1"), so a negative N
# never reached N's check; this way it does, and options the command has still parse as options.
@model_app.command("scale", context_settings={"ignore_unknown_options": True})
@cli_errors
def model_scale(
    name: Annotated[str, typer.Argument(help="The model.")],
    n: Annotated[
        int, typer.Argument(parser=whole, callback=_replica_count, help="Replicas to keep running (scaling.min).")
    ],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Keep N replicas running: min = max = N, or for an autoscaled model min = N (max raised to N
    when below). Replicas above N drain (their requests finished) before they stop."""
    from llmgw.catalog import scale_to

    client = _client(server, token)
    cur = client.model(name)
    scaling = scale_to(n, cur_min=cur.scaling_min, cur_max=cur.scaling_max)
    data = client.patch_model(name, {"scaling": scaling})
    if as_json:
        _print_json(data)
    else:
        print(f"{name}: scaling {data.scaling_min}..{data.scaling_max}")
        warn_scaled_past_room(client, name, n)


@model_app.command("autoscale")
@cli_errors
def model_autoscale(
    name: Annotated[str, typer.Argument(help="The model.")],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Autoscaling now (wanted, ready, draining, load per replica) and the last decisions, newest first."""
    data = _client(server, token).model_autoscale(name)
    if as_json:
        _print_json(data)
        return
    if not data.autoscaled:
        print(f"{name}: not autoscaled (scaling {data.min}..{data.max}: set max above min to autoscale)")
    print(
        f"{name}: wanted {data.wanted} (scaling {data.min}..{data.max}), ready {data.ready}, draining "
        f"{data.draining}; load {data.in_flight} in flight + {data.queued} queued, target {data.target:g} per replica"
    )
    t = table("WHEN (UTC)", "FROM", "TO", "REASON")
    for d in data.decisions:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d.at))
        t.add_row(when, str(d.from_n), str(d.to_n), d.reason)
    console().print(t)


@model_app.command("resources")
@cli_errors
def model_resources(
    name: Annotated[str, typer.Argument(help="The model.")],
    server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """What one replica needs per profile (set or estimated from the GGUF), and where one could run."""
    data = _client(server, token).model_resources(name)
    if as_json:
        _print_json(data)
        return
    f = data.get("facts")
    if f:
        print(
            f"{name}: {f['architecture']}, {f['block_count']} layers, {f['file_size'] / 1e9:.2f} GB file, "
            f"trained context {f['context_length']}, sliding window {f['sliding_window'] or '-'}"
        )
    elif data.get("facts_error"):
        print(f"{name}: no estimate: {data['facts_error']}")
    t = table("PROFILE", "PRIORITY", "ENGINE", "GPU", "CORES", "MEMORY GB", "FROM", "CTX", "WEIGHTS+KV+OVERHEAD GB",
              "COULD RUN ON")
    for p in data["profiles"]:
        fits = [n["node"] for n in p["nodes"] if n["fits"]]
        if p.get("group_size", 1) > 1:  # a group: where it would go as a whole, not each node alone
            fits = [f"group of {p['group_size']}: {p.get('group') or '?'}"]
        t.add_row(
            p["name"], str(p["priority"]), p["engine"],
            f"{p['gpu_count']}x {p['gpu_class']}" if p["gpu_class"] else "-", str(p["cpu_cores"]),
            f"{p['memory_gb']:.2f}", p["memory_from"], str(p["ctx"] or "-"),
            f"{p['weights_gb']:.2f}+{p['kv_gb']:.2f}+{p['overhead_gb']:.2f}" if p["ctx"] else "-",
            ", ".join(fits) or "nowhere now",
        )
    console().print(t)
    for p in data["profiles"]:
        for n in p["nodes"]:
            if not n["fits"]:
                print(f"{p['name']} on {n['node']}: {n['reason']}")
