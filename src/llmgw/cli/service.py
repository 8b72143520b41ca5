"""``llmgw service status|start|stop|restart|logs``: llmgw's services under systemd or its own supervisor.

The manager is :func:`llmgw.service.manager.pick_manager`'s: systemd when it is PID 1 (and no
``--root``), else llmgw's supervisor. Each command parses, calls the manager, prints.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated

import typer

from llmgw.cli.common import cli_errors, console, paths, table, typer_app
from llmgw.errors import ServiceError
from llmgw.service.check import preflight, probe_for, restart_checked, wait_up
from llmgw.service.manager import ServiceManager, pick_manager
from llmgw.service.units import (
    SERVICES,
    installed_services,
    restartable_services,
    service_name,
    startable_services,
    unit_name,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmgw.paths import Paths

app = typer_app(
    no_args_is_help=True,
    help="The control plane, agent and mirror as services: systemd's, or llmgw's own supervisor.",
)

def _names(given: list[str] | None, every: Callable[[Paths], list[str]] = installed_services) -> list[str]:
    """Each name as :func:`service_name` reads it (``llmgw-agent`` is ``agent``); with none given,
    ``every(paths)``: every installed service (:func:`installed_services`) unless said otherwise."""
    return [service_name(n) for n in given] if given else every(paths())


def _installed(given: list[str] | None, every: Callable[[Paths], list[str]]) -> list[str]:
    """:func:`_names`, refusing an empty list (nothing given, nothing installed).

    Raises:
        ServiceError: no service is installed here; the message says how to install one.
    """
    todo = _names(given, every)
    if not todo:
        raise ServiceError(f"no llmgw service is installed under {paths().root}: run 'llmgw server init' first "
                           "(a node: 'llmgw server add-node' on the control plane, docs/operating.md)")
    return todo


OptionalNames = Annotated[
    list[str] | None,
    typer.Argument(help=f"Services ({', '.join(SERVICES)}, and patroni where installed); all when none are given.",
)
]


#: ``service status``'s exit status when a service shown does not run (systemctl's for an inactive unit).
NOT_RUNNING = 3


def _manager() -> ServiceManager:
    return pick_manager(paths())


def _when(since: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "-"


@app.command()
@cli_errors
def status(
    names: OptionalNames = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Show each service's state, pid, start time and restarts. Exits 0 when every service shown
    runs, 3 when one does not (stopped, failed or unknown), as 'systemctl status' does."""
    manager = _manager()
    rows = [manager.status(n) for n in _names(names)]
    if as_json:
        print(json.dumps([asdict(r) | {"manager": manager.kind} for r in rows], indent=2))
    else:
        t = table("service", "manager", "state", "pid", "since", "restarts", "detail")
        for r in rows:
            pid = str(r.pid) if r.pid else "-"
            since, restarts = _when(r.since), str(r.restarts)
            t.add_row(unit_name(r.name), manager.kind, r.state, pid, since, restarts, r.detail)
        console().print(t)
    if any(r.state != "running" for r in rows):
        raise typer.Exit(NOT_RUNNING)


@app.command()
@cli_errors
def start(names: OptionalNames = None) -> None:
    """Start services (systemd also enables them); a running one is left as it is. With no names,
    every installed service, each after those it needs (what 'service stop' with no names stopped)."""
    manager = _manager()
    todo = _installed(names, startable_services)
    for name in todo:
        started = manager.start(name)
        if started:
            wait_up(manager, name, probe=probe_for(paths(), name, manager))
        st = manager.status(name)
        pid = f"pid {st.pid}" if st.pid else st.state
        verb = "started" if started else "already running:"
        print(f"{verb} {unit_name(name)} ({manager.kind}, {pid})")


@app.command()
@cli_errors
def restart(names: OptionalNames = None) -> None:
    """Check each service's config, stop it (the control plane drains its streams first) and start
    it again; fails, leaving the running one up, when the config does not load, and fails when
    the new one does not come up. With no names, every installed llmgw service (mirror, server,
    agent; not patroni: name it)."""
    manager = _manager()
    todo = _installed(names, restartable_services)
    for name in todo:  # every config first: one that does not load restarts none (an upgrade half done, a
        preflight(paths(), name)  # new user's finding: the mirror on new code, the server and agent on old)
    for name in todo:
        restart_checked(manager, paths(), name, checked=True)
        st = manager.status(name)
        pid = f"pid {st.pid}" if st.pid else st.state
        print(f"restarted {unit_name(name)} ({manager.kind}, {pid})")


@app.command()
@cli_errors
def stop(
    names: OptionalNames = None,
    engines: Annotated[
        bool, typer.Option("--engines", help="Also stop the engines the agent left running.")
    ] = False,
) -> None:
    """Stop services (when none are named: server, agent, mirror, then patroni where installed).
    Engines outlive the agent unless --engines."""
    manager = _manager()
    todo = _names(names)
    # the engines are the agent's: stopped under a running agent, it marked them failed and replaced them
    if engines and names and "agent" not in todo:
        raise typer.BadParameter("--engines stops the engines the agent left running: stop the agent with them "
                                 "('llmgw service stop agent --engines', or no names for everything)",
                                 param_hint="--engines")
    for name in todo:
        stopped = manager.stop(name)
        print(f"{'stopped' if stopped else 'not running:'} {unit_name(name)}")
    if engines:
        from llmgw.agent.node.records import stop_all_engines

        pids = stop_all_engines(paths().agent_state)
        print(f"stopped {len(pids)} engine(s)" + (f": pid {', '.join(map(str, pids))}" if pids else ""))


@app.command()
@cli_errors
def logs(
    name: Annotated[
        str, typer.Argument(help=f"One of {', '.join(SERVICES)} (or patroni).", show_default=False),
    ],
    lines: Annotated[int, typer.Option("-n", "--lines", min=1, help="How many of the last lines.")] = 50,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")] = False,
) -> None:
    """Print a service's last lines of output (journalctl under systemd, its log file otherwise)."""
    name = service_name(name)
    manager = _manager()
    if not follow:
        sys.stdout.write(manager.logs(name, lines))
        return
    for chunk in manager.follow(name, lines):
        sys.stdout.write(chunk)
        sys.stdout.flush()
