"""Restarting a service honestly: check its config first, then say whether it came back.

``llmgw service restart server`` used to stop a running control plane, start one that could not
read its server.yaml, print ``restarted`` and exit 0, with the gateway down. Now
(:func:`restart_checked`):

1. :func:`preflight`: ``python -m llmgw.service.check NAME [CONFIG]``, run by the interpreter the
   unit's program runs on (:func:`unit_python`), as the unit's ``User=`` (the supervisor's
   :func:`~llmgw.service.unitfile.credentials`) with its environment, imports every module of
   the llmgw it would run (:func:`import_all`: an upgrade whose new code does not import stopped the
   server and left it down, a new user's finding) and reads the config the unit names
   (``--config``), so a file the service could not read fails here too. On failure nothing is
   stopped: :class:`~llmgw.errors.ServiceError` with the reason.
2. the manager restarts it (SIGTERM: the control plane drains its streams, :mod:`llmgw.control.gateway.drain`);
3. :func:`wait_up`: the service must answer (the control plane: its admin API's health) or, for
   the others, run :data:`SETTLE_S` without exiting; it failing, exiting or not answering within
   ``timeout_s`` is a ServiceError with its status and last log lines.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from llmgw.errors import LlmgwError, ServiceError
from llmgw.paths import Paths
from llmgw.service.manager import ServiceManager
from llmgw.service.unitfile import Credentials, UnitSpec, credentials, parse_unit, service_env
from llmgw.service.units import unit_name

SETTLE_S = 3.0
"""Seconds a service without a health probe must keep running after a (re)start to count as up:
a config or import error ends a Python program well within it."""

#: The services that run llmgw's code (patroni's runs none of it: nothing to check before it restarts).
LLMGW_SERVICES = ("server", "agent", "mirror")

UP_TIMEOUT_S = 60.0
"""Seconds a restarted service has to answer (the control plane opens its store and binds three
listeners: 1-3 s here)."""


def unit_spec(paths: Paths, name: str) -> UnitSpec:
    """The parsed unit of ``name``.

    Raises:
        ServiceError: no unit, or one that does not parse.
    """
    unit = paths.unit(name)
    try:
        return parse_unit(unit.read_text())
    except FileNotFoundError as e:
        raise ServiceError(f"no unit for {name} at {unit}; 'llmgw server init' writes it") from e
    except (OSError, ServiceError) as e:
        raise ServiceError(f"{unit}: {e}") from e


def config_path(spec: UnitSpec, paths: Paths, name: str) -> Path | None:
    """The ``--config`` the unit's ExecStart gives, else the default for ``name`` (None: no config)."""
    argv = spec.argv
    for i, word in enumerate(argv[:-1]):
        if word == "--config":
            return Path(argv[i + 1])
    return {"server": paths.server_config, "agent": paths.agent_config}.get(name)


def unit_python(spec: UnitSpec) -> str:
    """The Python interpreter the unit's program runs on: the program itself when it is one (its
    name starts with ``python``), else the one its ``#!`` line names when that is one (pip's
    ``llmgw`` script in the venv the unit was written from), else this process's own."""
    program = Path(spec.argv[0]) if spec.argv else Path(sys.executable)
    if program.name.startswith("python"):
        return str(program)
    try:
        with program.open("rb") as f:
            first = f.readline(512)
    except OSError:
        return sys.executable
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    if words and Path(words[0]).name.startswith("python") and os.access(words[0], os.X_OK):
        return words[0]
    return sys.executable


def preflight(paths: Paths, name: str) -> None:
    """Check ``name``'s code and config as the service would run them, without touching the running
    one (see the module docstring). Nothing for a service that runs no llmgw code (patroni).

    Raises:
        ServiceError: a module does not import or the config does not load (the error, word for
            word), or the check could not run as the unit's user.
    """
    if name not in LLMGW_SERVICES:
        return
    spec = unit_spec(paths, name)
    config = config_path(spec, paths, name)
    who = credentials(spec)
    argv = [unit_python(spec), "-m", "llmgw.service.check", name, *([str(config)] if config else [])]
    done = _run_as(who, spec, argv, name)
    if done.returncode == 0 and name == "mirror" and _serves_mirror(spec.argv):
        # the mirror has no config file: its unit's own options and files, read by 'mirror serve --check'
        done = _run_as(who, spec, [*spec.argv, "--check"], name)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        reason = (lines[-1] if lines else f"exit status {done.returncode}").removeprefix("Error: ")
        raise ServiceError(
            f"{unit_name(name)} was not restarted, and the running one is left as it is: {reason}"
        )


def _serves_mirror(argv: list[str]) -> bool:
    """Whether ``argv`` runs ``llmgw mirror serve`` (a unit written by init or 'mirror init')."""
    return any(a == "mirror" and argv[i + 1:i + 2] == ["serve"] for i, a in enumerate(argv))


def _run_as(who: Credentials, spec: UnitSpec, argv: list[str], name: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as the unit's user, with its environment and none of root's.

    Raises:
        ServiceError: it could not be run.
    """
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=60, check=False, cwd="/",
            env=service_env(spec, who, os.environ),  # the service's own, none of root's
            user=who.user, group=who.group, extra_groups=who.extra_groups,
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise ServiceError(f"checking {name}'s code and config as the service would run them: {e}") from e


def _server_probe(paths: Paths, config: Path | None, manager: ServiceManager) -> Callable[[], bool] | None:
    from llmgw.adminclient import AdminClient  # noqa: PLC0415  (only the server's probe needs it)
    from llmgw.config import load_server_config, parse_listen  # noqa: PLC0415

    try:
        cfg = load_server_config(config or paths.server_config)
        host, port = parse_listen(cfg.admin_listen)
    except LlmgwError:
        return None
    host = "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)
    base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    client = AdminClient(base, "")

    def probe() -> bool:
        # The answer must come from the service's own process: another program on admin_listen
        # (a second install, the port server.yaml now names by mistake) answered 200 while the
        # restarted control plane could not bind and crash-looped, and restart said "restarted".
        pid = client.health_pid()
        return pid is not None and pid == manager.status("server").pid

    return probe


def probe_for(paths: Paths, name: str, manager: ServiceManager) -> Callable[[], bool] | None:
    """How to tell ``name`` answers: the control plane's admin health, from its own pid; None for the others."""
    if name != "server":
        return None
    return _server_probe(paths, config_path(unit_spec(paths, name), paths, name), manager)


def wait_up(
    manager: ServiceManager, name: str, *, probe: Callable[[], bool] | None,
    timeout_s: float = UP_TIMEOUT_S, settle_s: float | None = None, poll_s: float = 0.2, restarts: int = 0,
) -> None:
    """Wait until ``name`` is up after a (re)start: ``probe`` true, or (no probe) running for ``settle_s``
    (default :data:`SETTLE_S`, read at the call).

    ``restarts``: its restart count right after the (re)start; more means it exited since.

    Raises:
        ServiceError: it failed, stopped, was restarted after exiting, or did not come up within
            ``timeout_s`` (the message has its status and last log lines).
    """
    deadline = time.monotonic() + timeout_s
    settle = SETTLE_S if settle_s is None else settle_s
    first: float | None = None
    while True:
        st = manager.status(name)
        exited = st.state in ("failed", "stopped") or st.restarts > restarts
        if exited:
            detail = st.detail or st.state
            raise ServiceError(
                f"{unit_name(name)} did not come up: {detail}; its last lines:\n"
                f"{manager.logs(name, 15).rstrip()}\nsee 'llmgw service logs {name}'"
            )
        if st.state == "running":
            first = first if first is not None else time.monotonic()
            if probe is not None and probe():
                return
            if probe is None and time.monotonic() - first >= settle:
                return
        if time.monotonic() >= deadline:
            what = "answer" if probe is not None else "start"
            raise ServiceError(
                f"{unit_name(name)} did not {what} within {timeout_s:g}s (state {st.state}); its last lines:\n"
                f"{manager.logs(name, 15).rstrip()}"
            )
        time.sleep(poll_s)


def restart_checked(
    manager: ServiceManager, paths: Paths, name: str, *, timeout_s: float = UP_TIMEOUT_S, checked: bool = False
) -> None:
    """:func:`preflight` (unless the caller just ran it: ``checked``), restart, :func:`wait_up`; see the
    module docstring.

    Raises:
        ServiceError: the config does not load (nothing restarted), or the service did not come back.
    """
    if not checked:
        preflight(paths, name)
    probe = probe_for(paths, name, manager)
    manager.restart(name)
    wait_up(manager, name, probe=probe, timeout_s=timeout_s, restarts=manager.status(name).restarts)


def import_all() -> None:
    """Import every module of the llmgw package this interpreter finds (~0.8 s, 206 modules), as the
    service will over its life (most import their dependencies lazily, on first use).

    Raises:
        ServiceError: the first module that does not import, with the file, line and error.
    """
    import importlib  # noqa: PLC0415  (the check's own)
    import pkgutil  # noqa: PLC0415
    import traceback  # noqa: PLC0415

    import llmgw  # noqa: PLC0415

    for module in pkgutil.walk_packages(llmgw.__path__, "llmgw."):
        if module.name.endswith(".__main__"):
            continue
        try:
            importlib.import_module(module.name)
        except Exception as e:  # any error: the code cannot run
            where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
            if isinstance(e, SyntaxError) and e.filename:
                at = f"{e.filename}:{e.lineno}"
            else:
                at = f"{where.filename}:{where.lineno}" if where else module.name
            raise ServiceError(f"its code does not import: {module.name} ({at}): "
                               f"{type(e).__name__}: {e}; reinstall llmgw or fix it first") from e


def main(argv: list[str] | None = None) -> int:
    """``python -m llmgw.service.check NAME [CONFIG]``: 0 when llmgw's modules import
    (:func:`import_all`) and the config loads (the agent's with its environment's
    ``LLMGW_ENGINE_MAX_THREADS``), else 2 with the error."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m llmgw.service.check server|agent|mirror [CONFIG]", file=sys.stderr)
        return 2
    name, config = args[0], Path(args[1]) if len(args) == 2 else None
    try:
        import_all()
        if config is None:
            pass
        elif name == "server":
            from llmgw.control.startcheck import check_config  # noqa: PLC0415

            check_config(config)
        elif name == "agent":
            from llmgw.agent.loop.identity import agent_tls  # noqa: PLC0415
            from llmgw.config import load_agent_config  # noqa: PLC0415

            cfg = load_agent_config(config)
            agent_tls(cfg)
            cfg.engine_max_threads(os.environ)  # LLMGW_ENGINE_MAX_THREADS, as the agent will read it
    except LlmgwError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
