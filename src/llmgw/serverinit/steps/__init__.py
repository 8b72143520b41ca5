"""``llmgw server init``: turn this machine into a control plane, a model mirror and a node serving
a starter model, so the first thing anyone sees is an answer.

A control plane on its own serves nothing: it needs a node, weights, and a model, and the install
guide made each of those a separate afternoon. init makes the machine all three. The steps, in
order, each idempotent and each printing ``done …``, ``kept …`` or ``skip …`` (progress ``.. …``,
warnings ``!! …``). Each step is a module of this package with a ``run`` function over a shared
:class:`~.context.InitContext` (paths, options, output, service manager, clock), so each can be
run and tested alone:

1. :mod:`.pki`: the cluster CA, the server certificate (every ``--host``, the primary address, localhost),
   the admin token and a gateway key.
2. :mod:`.serveryaml`: written once; later runs keep it (and stop on one that does not load).
3. :mod:`.controlplane`: the control plane service (systemd when it is PID 1, else llmgw's supervisor).
4. :mod:`.mirror`: the mirror on this machine (or ``--mirror URL`` on another), and server.yaml pointing at it.
5. :mod:`.node`: this machine as a node: agent certificate, agent.yaml (written once; only the llama-server
   init itself put there is updated by a later ``--llama-server``, see :mod:`llmgw.serverinit.agentconf`), the
   agent service, and a wait until it reports an engine.
6. :mod:`.starter`: the starter model: into the mirror, into the catalog, and a wait until a replica is ready.
With ``--control-plane NAME=HOST[:PORT]`` (HA, :mod:`.ha`), step 1b is :mod:`.database`: PostgreSQL
under Patroni on this machine, the llmgw database, and server.yaml's ``store``/``cluster`` pointing
at every member; the server certificate names every control plane, the mirror's management API
answers them all, and two judges are served. With ``--join DIR`` (:mod:`.join`) a standby checks
and copies its bundle, joins Patroni as a replica and starts a control plane; nothing else.

7. :mod:`.judge`: the guardrails' judge (Qwen3Guard-Gen-0.6B, or ``--judge-source``) and a default guard policy
   (in and out, ``fail: closed``); skipped offline when nothing was carried in.

Before anything is written, the inputs are checked (the starter file, ``--llama-server`` run
with ``--version``, the listen ports, an agent API on loopback with nowhere for the node to
reach it, a lock against a second init; :mod:`.checks`), so bad input leaves nothing
half-written. At the end, :mod:`.howto` prints how to ask. Models are served by :mod:`.serve`
(steps 6 and 7); the services by :mod:`.services`. No wait is silent: each prints
``.. waiting for X (Ns): last state …`` at least every 10 s (:mod:`llmgw.serverinit.wait`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import httpx

from llmgw.errors import LockedError
from llmgw.paths import Paths, exists_or_hidden
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.steps import (
    checks,
    controlplane,
    database,
    ha,
    howto,
    join,
    judge,
    mirror,
    node,
    pki,
    serveryaml,
    starter,
)
from llmgw.serverinit.steps.context import InitContext
from llmgw.serverinit.steps.pki import primary_address
from llmgw.serverinit.wait import Clock
from llmgw.service.manager import ServiceManager

__all__ = ["InitContext", "ServerInit", "primary_address"]


class ServerInit:
    """One run of ``server init`` over ``paths`` with ``opts``, printing to ``out``.

    ``manager`` starts the services (systemd or the supervisor); ``clock`` paces the waits;
    ``gpu_probe`` lists this machine's GPU classes; ``admin_transport`` is the admin client's
    transport (a seam for tests). They make :attr:`ctx`, which every step shares. Call
    :meth:`run`; it raises an :class:`~llmgw.errors.LlmgwError` on the first step that fails,
    after printing what was done before it.
    """

    def __init__(
        self, paths: Paths, opts: InitOptions, manager: ServiceManager, *,
        out: TextIO = sys.stdout, clock: Clock | None = None,
        gpu_probe: Callable[[], list[str]] | None = None,
        admin_transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.ctx = InitContext(
            paths, opts, manager, out=out, clock=clock or Clock(),
            gpu_probe=gpu_probe or (lambda: []), admin_transport=admin_transport,
        )

    def run(self) -> str:
        """Every step in order; returns the starter's name (or ``""`` when it was skipped)."""
        ctx = self.ctx
        with self.lock():
            started = time.monotonic()
            if ctx.opts.join is not None:
                join.run(ctx)
                howto.standby(ctx, time.monotonic() - started)
                return ""
            me = ha.prepare(ctx) if ctx.opts.ha else None
            checks.run(ctx)
            if me is not None:
                database.check_new_member_ports(ctx)  # with the other checks: before anything is written
            pki.run(ctx)
            serveryaml.run(ctx)
            if me is not None:
                got = database.run(ctx)
                database.point_server_yaml(ctx, got.plan, got.me, ha.own_agent_url(ctx, got.me))
            controlplane.run(ctx)
            mirror.run(ctx)
            if ctx.opts.no_node:
                ctx.say("skip", "this machine as a node (--no-node)")
            else:
                node.run(ctx)
            served = starter.run(ctx)
            judge.run(ctx)
            howto.run(ctx, served, time.monotonic() - started)
            return served

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold ``init.lock``: two inits at once would both write server.yaml and both start services.

        Raises:
            LockedError: another init holds it (the message names its pid), or the lock is a symlink.
        """
        paths = self.ctx.paths
        made = [d for d in (paths.state, *paths.state.parents) if not exists_or_hidden(d)]  # deepest first
        paths.state.mkdir(mode=0o700, parents=True, exist_ok=True)
        created = not exists_or_hidden(paths.init_lock)
        # O_NOFOLLOW: the state directory may be the llmgw user's, and root must not truncate
        # whatever a symlink planted there points at.
        try:
            fd = os.open(paths.init_lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise LockedError(f"cannot open the lock {paths.init_lock}: {e}; remove it if it is a symlink") from e
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
                raise LockedError(
                    f"another 'llmgw server init' is running (pid {holder}, lock {paths.init_lock}); "
                    "wait for it to finish, then run init again"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            try:
                yield
            except BaseException:
                if created:
                    _forget_lock(paths.init_lock, made)
                raise
        finally:
            os.close(fd)


def _forget_lock(lock: Path, made: list[Path]) -> None:
    """After a failed init: remove ``lock`` (made by this run) and the directories this run made
    for it that are still empty (``made``, deepest first), so that a failed check leaves nothing
    behind, as docs/install.md says. Removed while still held: an init that opened it meanwhile
    was refused at once (the lock is taken without waiting), and one that comes later makes its own."""
    with contextlib.suppress(OSError):
        lock.unlink()
        for d in made:
            d.rmdir()

