"""The services init installs, shared by the steps that install them (control plane, mirror,
agent) and by those that change server.yaml under a running control plane (mirror, judge):
the user they run as, install-start-or-restart, a wait until one answers, and appending a block
to server.yaml.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable

from llmgw.errors import ServiceError
from llmgw.serverinit import files, secure
from llmgw.serverinit.steps.context import InitContext
from llmgw.service.units import SERVICE_USER
from llmgw.service.users import choose_service_user


def service_user(ctx: InitContext) -> str | None:
    """The user the control plane and the mirror run as (``llmgw``), or None: see
    :func:`llmgw.service.users.choose_service_user`. Decided once per run, and said: ``done``
    when the user was made, ``kept`` when it was there, ``!!`` when they run as root instead, with
    the reason (``skip`` when their units already say so, and when not root: nothing can switch
    users then)."""
    if ctx.user is not None:
        return ctx.user.user
    paths = ctx.paths
    for d in (paths.state, paths.mirror_store):
        d.mkdir(mode=0o700 if d == paths.state else 0o755, parents=True, exist_ok=True)
    # A file: starter or judge is not among them: init copies it into the store itself (steps/serve.py).
    reach = [paths.etc, paths.pki, paths.state.parent, paths.mirror_store.parent]
    choice = choose_service_user(reach, systemd=ctx.manager.kind == "systemd")
    ctx.user = choice
    if choice.made:
        ctx.say("done", f"system user {SERVICE_USER}: the control plane and the mirror run as it")
    elif choice.user is not None:  # said each run: a user made before this one went unmentioned
        ctx.say("kept", f"system user {SERVICE_USER}: the control plane and the mirror run as it")
    if choice.user is None:
        me = pwd.getpwuid(os.geteuid()).pw_name
        text = f"the control plane and the mirror run as {me}, not as {SERVICE_USER}: {choice.why}"
        unit = paths.unit("server")
        known = unit.exists() and "\nUser=" not in unit.read_text()
        ctx.say("skip" if known or os.geteuid() != 0 else "!!", text)
    secure.lock_down(paths, choice.user)
    return choice.user


def append_to_server_yaml(ctx: InitContext, block: str) -> None:
    """Append ``block`` to server.yaml (with a backup), keeping the file readable by the server."""
    files.append_block(ctx.paths.server_config, block)
    secure.lock_down(ctx.paths, service_user(ctx))


def apply_service(ctx: InitContext, name: str, body: str, what: str, *, config_changed: str = "") -> bool:
    """Install unit ``name`` with ``body``; start it when stopped, restart it when its unit (or
    ``config_changed``, a file name) changed, else keep it. Prints one line saying which; returns
    True when it was kept running as it was."""
    secure.lock_down(ctx.paths, service_user(ctx))
    manager = ctx.manager
    was_running = ctx.running(name)
    changed = manager.install(name, body)
    if not was_running:
        manager.start(name)
        ctx.say("done", f"{what} started ({manager.kind})")
    elif changed:
        manager.restart(name)
        ctx.say("done", f"{what} restarted: its unit changed ({manager.kind})")
    elif config_changed:
        manager.restart(name)
        ctx.say("done", f"{what} restarted: {config_changed} changed ({manager.kind})")
    else:
        ctx.say("kept", f"{what} ({manager.kind}, running)")
        return True
    return False


def wait_service(ctx: InitContext, name: str, what: str, up: Callable[[], bool]) -> None:
    """Wait (``--service-wait``) until ``up()``; stop at once, with its last log lines, when the
    manager says the service failed.

    Raises:
        ServiceError: the service failed to start.
        WaitTimeout: it did not answer in time.
    """
    def probe() -> bool:
        if up():
            return True
        st = ctx.manager.status(name)
        if st.state == "failed":
            raise ServiceError(
                f"{what} failed to start: {st.detail}\n{ctx.manager.logs(name, 20)}\n"
                f"see 'llmgw service logs {name}'"
            )
        ctx.note(f"service {name} {st.state}{': ' + st.detail if st.detail else ''}, not answering yet")
        return False

    ctx.wait(ctx.opts.service_wait_s, f"{what} to answer", probe, interval_s=0.2)
