"""What every step of ``server init`` shares: the paths, the options, where to print, the service
manager, the clock, and a few answers more than one step asks (server.yaml, the admin client, the
mirror's API). A step is a module with a function taking an :class:`InitContext`; nothing in here
decides anything a step does.

Output: each step line is ``  <tag> <text>`` with the tags ``done``, ``kept``, ``skip``,
``updated``, ``..`` (progress) and ``!!`` (warnings); no wait is silent (:meth:`InitContext.wait`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import httpx

from llmgw.adminclient import AdminClient
from llmgw.config import ServerConfig, load_server_config, parse_listen
from llmgw.errors import ServiceError
from llmgw.mirror.client import MirrorClient, read_token, token_path
from llmgw.paths import Paths
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.wait import Clock, wait_for
from llmgw.service.manager import ServiceManager
from llmgw.service.units import installed_binary, llmgw_binary
from llmgw.service.users import UserChoice


def connect_url(listen: str, scheme: str = "http") -> str:
    """A URL this machine reaches ``listen`` (``HOST:PORT``) at: a wildcard host becomes ``127.0.0.1``."""
    host, port = parse_listen(listen)
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"{scheme}://{host}:{port}"


def url_host(host: str) -> str:
    """``host`` as it goes in a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


@dataclass
class InitContext:
    """One run of ``server init``: over ``paths`` with ``opts``, printing to ``out``.

    ``manager`` starts the services (systemd or the supervisor); ``clock`` paces the waits;
    ``gpu_probe`` lists this machine's GPU classes; ``admin_transport`` is the admin client's
    transport (a seam for tests); ``bin`` is the llmgw executable the units run. ``user`` is the
    service user once :func:`~llmgw.serverinit.steps.services.service_user` has chosen it.
    """

    paths: Paths
    opts: InitOptions
    manager: ServiceManager
    out: TextIO = field(default_factory=lambda: sys.stdout)
    clock: Clock = field(default_factory=Clock)
    gpu_probe: Callable[[], list[str]] = field(default=lambda: [])
    admin_transport: httpx.BaseTransport | None = None
    bin: str = field(default_factory=llmgw_binary)
    # Wall-clock start of this run (seconds since the epoch, the store's clock): a replica created
    # before it failed before anything this run changed, so its failure is not final.
    started_at: float = field(default_factory=time.time, init=False)
    user: UserChoice | None = field(default=None, init=False)
    # Models whose profile this run changed: the ids of their replicas on that profile then, which
    # the leader replaces (steps/serve.py wait_serving does not take them for serving at once).
    replaced: dict[str, set[str]] = field(default_factory=dict, init=False)
    # HA (steps/ha.py): the addresses the mirror's management API answers besides loopback, and
    # the host its URL names when it listens on every interface.
    mirror_allow: list[str] = field(default_factory=list, init=False)
    mirror_api_host: str = field(default="", init=False)
    _last_line: str = field(default="", init=False, repr=False)
    # What the running wait's probe last saw, for its "waiting for" lines.
    _state: str = field(default="", init=False, repr=False)

    # --- output -----------------------------------------------------------------------------------

    def __post_init__(self) -> None:
        self.bin = installed_binary(self.paths, self.bin)  # the units' own path to this same llmgw

    def say(self, tag: str, text: str) -> None:
        """Print one step line: ``  <tag> <text>`` (tags: done, kept, skip, updated, .., !!)."""
        print(f"  {tag} {text}", file=self.out, flush=True)

    def progress(self, text: str) -> None:
        """Print a ``..`` line unless it repeats the last one; it is also the running wait's state."""
        self._state = text
        if text != self._last_line:
            self.say("..", text)
            self._last_line = text

    def note(self, text: str) -> None:
        """Record what the running wait's probe saw, for its next ``waiting for`` line (not printed)."""
        self._state = text

    def wait(self, limit_s: float, what: str, probe: Callable[[], bool], *, interval_s: float) -> None:
        """:func:`~llmgw.serverinit.wait.wait_for` that prints ``.. waiting for <what> (<N>s): last
        state <…>`` every few seconds, so no wait is silent (the state is what the probe last
        noted or printed).

        Raises:
            WaitTimeout: ``probe`` did not return True within ``limit_s`` seconds.
        """
        self._state = ""
        wait_for(
            limit_s, what, probe, interval_s=interval_s, clock=self.clock,
            report=lambda line: self.say("..", line), state=lambda: self._state or "no answer yet",
        )

    # --- shared answers ---------------------------------------------------------------------------

    def config(self) -> ServerConfig:
        """server.yaml as it is now. Raises ConfigError when it does not load."""
        return load_server_config(self.paths.server_config)

    def admin(self, timeout_s: float | None = None) -> AdminClient:
        """The admin API of this machine's control plane (a wait's probe passes
        :data:`~llmgw.serverinit.wait.PROBE_TIMEOUT_S`, so no call makes the wait silent)."""
        client = AdminClient.from_paths(self.paths)
        client.transport = self.admin_transport
        if timeout_s is not None:
            client.timeout_s = timeout_s
        return client

    def running(self, service: str) -> bool:
        """True when the manager says ``service`` is running (False when it cannot say)."""
        try:
            return self.manager.status(service).state == "running"
        except ServiceError:
            return False

    def cpus(self) -> int:
        """This machine's cores for the plan: ``--cpus``, else what the OS reports."""
        return self.opts.cpus or os.cpu_count() or 1

    def local_mirror_api(self) -> str:
        """The management API of the mirror beside this control plane: on loopback, or in HA at
        this control plane's address, which the others reach too."""
        if self.mirror_api_host:
            _h, port = parse_listen(self.opts.mirror_api_listen)
            return f"http://{url_host(self.mirror_api_host)}:{port}"
        return connect_url(self.opts.mirror_api_listen)

    def mirror_api(self) -> str:
        """The mirror's management API: ``--mirror URL``, else what server.yaml says, else the local one."""
        if self.opts.mirror_url:
            return self.opts.mirror_url
        return self.config().mirror.api or self.local_mirror_api()

    def mirror(self, timeout: float = 15.0) -> MirrorClient:
        """A client of :meth:`mirror_api` with the management API's token (:mod:`llmgw.mirror.client`:
        this machine's ``mirror-token``, else the admin token).

        Raises:
            ConfigError: the token cannot be read.
        """
        return MirrorClient(self.mirror_api(), timeout=timeout, token=read_token(token_path(self.paths)))
