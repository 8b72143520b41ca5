"""``llmgw server init``: turn this machine into a control plane, a model mirror and a node serving
a starter model, so the first thing anyone sees is an answer (the seed's ``serverinit_cluster.go``).

A control plane on its own serves nothing: it needs a node, weights, and a model, and the install
guide made each of those a separate afternoon. init makes the machine all three. The steps, in
order, each idempotent and each printing ``done …``, ``kept …`` or ``skip …`` (progress ``.. …``,
warnings ``!! …``):

1. PKI: the cluster CA, the server certificate (every ``--host``, the primary address, localhost),
   the admin token and a gateway key.
2. server.yaml: written once; later runs keep it (and stop on one that does not load).
3. The control plane service (systemd when it is PID 1, else llmgw's supervisor).
4. The mirror on this machine (or ``--mirror URL`` on another), and server.yaml pointing at it.
5. This machine as a node: agent certificate, agent.yaml (written once; only the llama-server
   init itself put there is updated by a later ``--llama-server``, see :mod:`.agentconf`), the
   agent service, and a wait until it reports an engine.
6. The starter model: into the mirror, into the catalog, and a wait until a replica is ready.
7. The guardrails' judge (Qwen3Guard-Gen-0.6B, or ``--judge-source``) and a default guard policy
   (in and out, ``fail: closed``); skipped offline when nothing was carried in.

Before anything is written, the inputs are checked (the starter file, ``--llama-server`` run
with ``--version``, the listen ports, an agent API on loopback with nowhere for the node to
reach it, a lock against a second init; :mod:`.preflight`), so bad input leaves nothing
half-written. No wait is silent: each prints ``.. waiting for X (Ns): last state …`` at least
every 10 s (:mod:`.wait`).
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import httpx
import psutil

from llmgw import sourcecheck
from llmgw.adminclient import AdminClient
from llmgw.agent.discovery import has_nvidia_device
from llmgw.catalog import Model
from llmgw.config import ServerConfig, load_agent_config, load_server_config, parse_listen
from llmgw.errors import (
    ApiError,
    ConfigError,
    EngineError,
    LlmgwError,
    LockedError,
    MirrorError,
    PkiError,
    PortInUseError,
    ServiceError,
    SourceError,
)
from llmgw.guard.formats import FORMATS
from llmgw.mirror.client import MirrorClient
from llmgw.names import check_name
from llmgw.paths import Paths
from llmgw.serverinit import agentconf, files, plan, preflight, secure
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.wait import PROBE_TIMEOUT_S, Clock, format_duration, wait_for
from llmgw.service.manager import ServiceManager
from llmgw.service.units import SERVICE_USER, agent_unit, llmgw_binary, mirror_unit, server_unit
from llmgw.service.users import UserChoice, choose_service_user, chown_tree
from llmgw.tlsconf import CA, cert_hosts


def primary_address() -> str:
    """This machine's first non-loopback IPv4 address, or ``""`` when it has none."""
    for _name, addrs in sorted(psutil.net_if_addrs().items()):
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return ""


def port_free(listen: str) -> bool:
    """True when ``listen`` (``HOST:PORT``) can be bound now."""
    host, port = parse_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _connect_url(listen: str, scheme: str = "http") -> str:
    host, port = parse_listen(listen)
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"{scheme}://{host}:{port}"


class ServerInit:
    """One run of ``server init`` over ``paths`` with ``opts``, printing to ``out``.

    ``manager`` starts the services (systemd or the supervisor); ``clock`` paces the waits;
    ``admin_transport`` is the admin client's transport (a seam for tests). Call
    :meth:`run`; it raises an :class:`~llmgw.errors.LlmgwError` on the first step that fails,
    after printing what was done before it.
    """

    def __init__(
        self, paths: Paths, opts: InitOptions, manager: ServiceManager, *,
        out: TextIO = sys.stdout, clock: Clock | None = None,
        gpu_probe: Callable[[], list[str]] | None = None,
        admin_transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.paths = paths
        self.opts = opts
        self.manager = manager
        self.out = out
        self.clock = clock or Clock()
        self.gpu_probe = gpu_probe or (lambda: [])
        self.admin_transport = admin_transport
        self.bin = llmgw_binary()
        self._last_line = ""
        self._state = ""  # what the running wait's probe last saw, for its "waiting for" lines
        self._user: UserChoice | None = None

    # --- output -----------------------------------------------------------------------------------

    def say(self, tag: str, text: str) -> None:
        """Print one step line: ``  <tag> <text>`` (tags: done, kept, skip, .., !!)."""
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
        noted or printed)."""
        self._state = ""
        wait_for(
            limit_s, what, probe, interval_s=interval_s, clock=self.clock,
            report=lambda line: self.say("..", line), state=lambda: self._state or "no answer yet",
        )

    # --- the run ----------------------------------------------------------------------------------

    def run(self) -> str:
        """Every step in order; returns the starter's name (or ``""`` when it was skipped)."""
        with self._lock():
            started = time.monotonic()
            self.preflight()
            self.ensure_pki()
            self.ensure_server_yaml()
            self.ensure_control_plane()
            if self.opts.mirror_url:
                self.use_mirror()
            else:
                self.ensure_mirror()
            if self.opts.no_node:
                self.say("skip", "this machine as a node (--no-node)")
            else:
                self.ensure_node()
            served = self.ensure_starter()
            self.ensure_judge()
            self.finish(served, time.monotonic() - started)
            return served

    @contextmanager
    def _lock(self) -> Iterator[None]:
        """Hold ``init.lock``: two inits at once would both write server.yaml and both start services."""
        self.paths.state.mkdir(mode=0o700, parents=True, exist_ok=True)
        # O_NOFOLLOW: the state directory may be the llmgw user's, and root must not truncate
        # whatever a symlink planted there points at.
        try:
            fd = os.open(self.paths.init_lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise LockedError(f"cannot open the lock {self.paths.init_lock}: {e}; remove it if it is a symlink") from e
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
                raise LockedError(
                    f"another 'llmgw server init' is running (pid {holder}, lock {self.paths.init_lock}); "
                    "wait for it to finish, then run init again"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield
        finally:
            os.close(fd)

    # --- checks before writing anything -------------------------------------------------------------

    def preflight(self) -> None:
        """Check the inputs before anything is written.

        Raises:
            SourceError: the starter source is not a download, or its file is missing or not GGUF.
            ConfigError: ``--llama-server`` is not a working llama-server (it is run with
                ``--version``); a config that exists does not load; the agent API listens on
                loopback while this node would be pointed at another address (pass ``--host``).
            PortInUseError: a listen port is taken by a program that is not this install's service.
        """
        self._check_starter_source()
        self._check_judge_source()
        ls = self.opts.llama_server
        if ls is not None:
            version = preflight.check_llama_server(ls)
            self.say("kept", f"--llama-server {ls} is llama.cpp build {version}")
        cfg = load_server_config(self.paths.server_config) if self.paths.server_config.exists() else None
        listeners: list[tuple[str, str, str]] = []  # service, address, flag
        listeners += [
            ("server", cfg.admin_listen if cfg else self.opts.admin_listen, "--admin-listen"),
            ("server", cfg.agent_listen if cfg else self.opts.agent_listen, "--agent-listen"),
            ("server", cfg.gateway.listen if cfg else self.opts.gateway_listen, "--gateway-listen"),
        ]
        if not self.opts.mirror_url:
            listeners += [
                ("mirror", self.opts.mirror_listen, "--mirror-listen"),
                ("mirror", self.opts.mirror_api_listen, "--mirror-api-listen"),
            ]
        running = {s: self._running(s) for s in ("server", "mirror")}
        for service, listen, flag in listeners:
            if running[service]:
                continue
            if not port_free(listen):
                _host, port = parse_listen(listen)
                raise PortInUseError(
                    f"port {port} ({flag.lstrip('-')}) is already taken by another program; stop it, "
                    f"or choose another address with {flag}"
                )
        if not self.opts.no_node and not self.paths.agent_config.exists():
            preflight.check_agent_address(
                cfg.agent_listen if cfg else self.opts.agent_listen, self.opts.hosts, flag_given=cfg is None
            )

    def _check_judge_source(self) -> None:
        fmt = self.opts.judge_format
        if fmt and fmt not in FORMATS:
            raise ConfigError(f"--judge-format {fmt}: not a judge format; use one of {', '.join(FORMATS)}")
        src = self.opts.judge_source
        if not src or self.opts.no_guard_model:
            return
        d = sourcecheck.to_download(src)
        if d.kind == "file":
            path = Path(d.path or "")
            if not path.is_file() or not plan.is_gguf(path):
                raise SourceError(
                    f"--judge-source {src}: {path} is not a GGUF file; give the path of the judge's .gguf"
                )

    def _check_starter_source(self) -> None:
        src = self.opts.starter_source
        d = sourcecheck.to_download(src)
        if d.kind == "file":
            path = Path(d.path or "")
            if not path.is_file():
                raise SourceError(
                    f"--starter-source {src}: {path} does not exist; give the path of a GGUF file "
                    "(scripts/assets assembles one)"
                )
            if not plan.is_gguf(path):
                raise SourceError(
                    f"--starter-source {src}: {path} is not a GGUF file (it does not start with the "
                    "bytes 'GGUF'); give a .gguf model file"
                )

    def _running(self, service: str) -> bool:
        try:
            return self.manager.status(service).state == "running"
        except ServiceError:
            return False

    # --- 1. PKI -------------------------------------------------------------------------------------

    def reachable_addr(self) -> str:
        """The address other machines use for this one: the first ``--host``, else its first
        address, else its hostname. It is in the server certificate either way."""
        if self.opts.hosts:
            return self.opts.hosts[0]
        return primary_address() or socket.gethostname()

    def cert_names(self) -> list[str]:
        """Names the server certificate must carry: every ``--host``, the primary address, the hostname."""
        names = [*self.opts.hosts, primary_address(), socket.gethostname()]
        return list(dict.fromkeys(n for n in names if n))

    def ensure_pki(self) -> None:
        """The CA, the server certificate, the admin token and a gateway key; each kept when there."""
        pki = self.paths.pki
        ca_cert, ca_key = pki / "ca.pem", pki / "ca-key.pem"
        ca: CA | None = None
        if ca_cert.exists():
            if ca_key.exists():
                ca = CA.load(pki)
            self.say("kept", f"cluster CA in {pki}")
        elif ca_key.exists():
            raise PkiError(f"{ca_key} is there but {ca_cert} is not; restore ca.pem from a backup")
        else:
            ca = CA.create()
            ca.write(pki)
            self.say("done", f"cluster CA in {pki}")

        server_cert = pki / "server.pem"
        want = self.cert_names()
        if server_cert.exists():
            missing = [n for n in want if n not in cert_hosts(server_cert)]
            if not missing:
                self.say("kept", f"server certificate for {', '.join(want)}")
            else:
                if ca is None:
                    raise PkiError(
                        f"the server certificate lacks {', '.join(missing)} and the CA key {ca_key} is "
                        "missing, so init cannot issue a new one; run init where the CA key is"
                    )
                names = list(dict.fromkeys([*want, *cert_hosts(server_cert)]))
                ca.issue_server(names).write(pki, "server")
                self.say("done", f"server certificate now also for {', '.join(missing)}")
        else:
            if ca is None:
                raise PkiError(
                    f"the CA key {ca_key} is missing, so init cannot issue the server certificate; "
                    "restore it from a backup, or run init where the CA is"
                )
            ca.issue_server(want).write(pki, "server")
            self.say("done", f"server certificate for {', '.join(want)}")

        if self.paths.admin_token.exists():
            self.say("kept", f"admin token {self.paths.admin_token}")
        else:
            files.write_atomic(self.paths.admin_token, files.new_secret() + "\n", 0o600)
            self.say("done", f"admin token {self.paths.admin_token}")
        if self.paths.client_keys.exists():
            self.say("kept", f"gateway API key in {self.paths.client_keys}")
        else:
            files.write_atomic(self.paths.client_keys, files.new_secret("sk-llmgw-") + "\n", 0o600)
            self.say("done", f"gateway API key in {self.paths.client_keys}")

    # --- 2. server.yaml -------------------------------------------------------------------------

    def ensure_server_yaml(self) -> None:
        """Write server.yaml on a new machine; keep (and check) the one that is there."""
        path = self.paths.server_config
        if path.exists():
            load_server_config(path)
            self.say("kept", f"{path}")
            return
        body = files.server_yaml(
            admin_listen=self.opts.admin_listen, agent_listen=self.opts.agent_listen,
            gateway_listen=self.opts.gateway_listen, pki=self.paths.pki, keys_file=self.paths.client_keys,
        )
        files.write_atomic(path, body, 0o640)
        load_server_config(path)
        self.say("done", f"{path}")

    def config(self) -> ServerConfig:
        """server.yaml as it is now."""
        return load_server_config(self.paths.server_config)

    def admin(self, timeout_s: float | None = None) -> AdminClient:
        """The admin API of this machine's control plane (a wait's probe passes
        :data:`~llmgw.serverinit.wait.PROBE_TIMEOUT_S`, so no call makes the wait silent)."""
        client = AdminClient.from_paths(self.paths)
        client.transport = self.admin_transport
        if timeout_s is not None:
            client.timeout_s = timeout_s
        return client

    # --- 3. the control plane -----------------------------------------------------------------

    def _append(self, block: str) -> None:
        """Append ``block`` to server.yaml (with a backup), keeping the file readable by the server."""
        files.append_block(self.paths.server_config, block)
        secure.lock_down(self.paths, self.service_user())

    def _apply_service(self, name: str, body: str, what: str, *, config_changed: str = "") -> None:
        secure.lock_down(self.paths, self.service_user())
        was_running = self._running(name)
        changed = self.manager.install(name, body)
        if not was_running:
            self.manager.start(name)
            self.say("done", f"{what} started ({self.manager.kind})")
        elif changed:
            self.manager.restart(name)
            self.say("done", f"{what} restarted: its unit changed ({self.manager.kind})")
        elif config_changed:
            self.manager.restart(name)
            self.say("done", f"{what} restarted: {config_changed} changed ({self.manager.kind})")
        else:
            self.say("kept", f"{what} ({self.manager.kind}, running)")

    def _wait_service(self, name: str, what: str, up: Callable[[], bool]) -> None:
        def probe() -> bool:
            if up():
                return True
            st = self.manager.status(name)
            if st.state == "failed":
                raise ServiceError(
                    f"{what} failed to start: {st.detail}\n{self.manager.logs(name, 20)}\n"
                    f"see 'llmgw service logs {name}'"
                )
            self.note(f"service {name} {st.state}{': ' + st.detail if st.detail else ''}, not answering yet")
            return False

        self.wait(self.opts.service_wait_s, f"{what} to answer", probe, interval_s=0.2)

    def service_user(self) -> str | None:
        """The user the control plane and the mirror run as (``llmgw``), or None: see
        :func:`llmgw.service.users.choose_service_user`. Decided once per run, and said: ``done``
        when the user was made, ``!!`` when they run as root instead, with the reason (``skip``
        when their units already say so, and when not root: nothing can switch users then)."""
        if self._user is not None:
            return self._user.user
        for d in (self.paths.state, self.paths.mirror_store):
            d.mkdir(mode=0o700 if d == self.paths.state else 0o755, parents=True, exist_ok=True)
        reach = [self.paths.etc, self.paths.pki, self.paths.state.parent, self.paths.mirror_store.parent]
        for source in (self.opts.starter_source, self.opts.judge_source or ""):
            fetch = sourcecheck.to_download(source) if source else None
            if fetch is not None and fetch.kind == "file" and fetch.path:
                reach.append(Path(fetch.path))  # the mirror, as this user, copies it
        choice = choose_service_user(reach, systemd=self.manager.kind == "systemd")
        self._user = choice
        if choice.made:
            self.say("done", f"system user {SERVICE_USER}: the control plane and the mirror run as it")
        if choice.user is None:
            me = pwd.getpwuid(os.geteuid()).pw_name
            text = f"the control plane and the mirror run as {me}, not as {SERVICE_USER}: {choice.why}"
            unit = self.paths.unit("server")
            known = unit.exists() and "\nUser=" not in unit.read_text()
            self.say("skip" if known or os.geteuid() != 0 else "!!", text)
        secure.lock_down(self.paths, choice.user)
        return choice.user

    def ensure_control_plane(self) -> None:
        """Install and start ``llmgw-server``; wait for its admin API to answer."""
        user = self.service_user()
        self._apply_service("server", server_unit(self.paths, self.bin, user=user), "control plane")
        client = self.admin()
        self._wait_service("server", "the control plane", client.health)

    # --- 4. the mirror ------------------------------------------------------------------------

    def local_mirror_api(self) -> str:
        """The management API of the mirror beside this control plane (on loopback)."""
        return _connect_url(self.opts.mirror_api_listen)

    def mirror_api(self) -> str:
        """The mirror's management API: ``--mirror URL``, else what server.yaml says, else the local one."""
        if self.opts.mirror_url:
            return self.opts.mirror_url
        return self.config().mirror.api or self.local_mirror_api()

    def use_mirror(self) -> None:
        """Point the control plane at a mirror on another machine, set up there by ``llmgw mirror init``."""
        url = self.opts.mirror_url
        try:
            with MirrorClient(url, timeout=5.0) as client:
                client.health()
        except LlmgwError as e:
            raise MirrorError(
                f"the mirror at {url} does not answer: {e}. On that machine: "
                "sudo llmgw mirror init --control-plane <this machine's address>"
            ) from e
        cfg = self.config()
        if cfg.mirror.api == url:
            self.say("kept", f"mirror at {url}")
            return
        if cfg.mirror.api:
            self.say("kept", f"mirror at {cfg.mirror.api}, as server.yaml says; change it there to use {url}")
            return
        self._append(files.mirror_block(url, "# The model mirror, on its own machine, added by 'llmgw server init'."))
        self.say("done", f"server.yaml points at the mirror at {url}")

    def ensure_mirror(self) -> None:
        """Run a mirror on this machine and point the control plane at it.

        Its management API is on loopback, which is why it needs no certificate: nothing but this
        machine can reach it.
        """
        cfg = self.config()
        local = self.local_mirror_api()
        if cfg.mirror.api and cfg.mirror.api != local:
            self.say("kept", f"mirror at {cfg.mirror.api}, as server.yaml says")
            return
        store = self.paths.mirror_store
        store.mkdir(parents=True, exist_ok=True)
        # The mirror runs as the llmgw user (when it can) and may write only its store.
        user = self.service_user()
        if user is not None:
            chown_tree(store, user)
        _h, port = parse_listen(self.opts.mirror_listen)
        base = f"http://{self._url_host(self.reachable_addr())}:{port}"
        body = mirror_unit(
            self.paths, self.bin, listen=self.opts.mirror_listen, api_listen=self.opts.mirror_api_listen,
            base=base, allow=[], import_dirs=self.mirror_import_dirs(), user=user,
            about="'llmgw server init'. Bytes for every node; the\n# management API on loopback only, "
            "for the control plane beside it.",
        )
        self._apply_service("mirror", body, f"model mirror in {store}")
        if not cfg.mirror.api:
            self._append(
                files.mirror_block(
                    local,
                    "# The model mirror on this machine, added by 'llmgw server init'. Its\n"
                    "# management API is on loopback, so it needs no certificate.",
                ),
            )
            self.say("done", "server.yaml points at the mirror")
        client = MirrorClient(local, timeout=2.0)

        def up() -> bool:
            try:
                client.health()
            except LlmgwError:
                return False
            return True

        self._wait_service("mirror", "the mirror", up)

    def mirror_import_dirs(self) -> list[str]:
        """The directories the local mirror may import ``file:`` sources from: the real directory
        (symlinks followed, as the mirror checks it) of a ``file:`` starter and judge, once each."""
        sources = [self.opts.starter_source]
        if self.opts.judge_source and not self.opts.no_guard_model:
            sources.append(self.opts.judge_source)
        dirs: list[str] = []
        for src in sources:
            d = sourcecheck.to_download(src)
            if d.kind == "file" and d.path is not None:
                real = str(Path(os.path.realpath(d.path)).parent)
                if real not in dirs:
                    dirs.append(real)
        return dirs

    @staticmethod
    def _url_host(host: str) -> str:
        return f"[{host}]" if ":" in host else host

    # --- 5. this machine as a node --------------------------------------------------------------

    def node_id(self) -> str:
        """This node's id: ``--node-id``, else the hostname, lowercased (:mod:`llmgw.names`)."""
        node = self.opts.node_id or socket.gethostname().lower()
        if not node:
            raise ConfigError("this machine has no hostname to use as its node id; pass --node-id")
        try:
            return check_name(node, "node id")
        except ValueError as e:
            raise ConfigError(f"{e}; pass --node-id NAME") from e

    def ensure_node(self) -> str:
        """Make this machine an agent of its own control plane and wait until it has an engine."""
        node = self.node_id()
        classes = self.gpu_probe()
        if classes:
            self.say("kept", f"{len(classes)} NVIDIA GPU class(es) here: {', '.join(classes)} — the node will use them")
        elif _has_nvidia_device():
            self.say(
                "!!",
                "an NVIDIA card is on the PCI bus but nvidia-smi does not answer: install the driver and "
                "run init again to serve on it; until then this node is CPU only",
            )
        else:
            self.say("kept", "no NVIDIA GPU here; the node serves on CPU")

        etc, pki = self.paths.etc, self.paths.pki
        if (etc / "agent.pem").exists():
            self.say("kept", f"agent certificate for {node}")
        else:
            if not (pki / "ca-key.pem").exists():
                raise PkiError(
                    "the authority is not on this machine, so init cannot give it a node identity; "
                    "onboard it from where the authority is, or pass --no-node"
                )
            CA.load(pki).issue_client(node).write(etc, "agent")
            shutil.copyfile(pki / "ca.pem", etc / "ca.pem")
            self.say("done", f"agent certificate for {node}")

        conf = self.paths.agent_config
        changed = ""
        if conf.exists():
            changed = self.reconcile_agent_yaml(conf)
        else:
            _h, port = parse_listen(self.config().agent_listen)
            server = f"https://{self._url_host(self.reachable_addr())}:{port}"
            files.write_atomic(
                conf,
                files.agent_yaml(
                    server=server, node_id=node, etc=etc, label_key=plan.LOCAL_LABEL_KEY,
                    label_value=plan.LOCAL_LABEL_VALUE, llama_server=self.opts.llama_server,
                ),
                0o644,
            )
            agentconf.record_binary(self.paths.state, self.opts.llama_server)
            self.say("done", f"{conf}")

        self._apply_service("agent", agent_unit(self.paths, self.bin), "llmgw-agent", config_changed=changed)

        self.wait_node_ready(node)
        return node

    def wait_node_ready(self, node: str) -> None:
        """Wait until ``node`` is ready with a llama.cpp engine; stop at once when its llama.cpp
        failed. Registered is quick. Having an engine is not: the node may download and check its
        own llama.cpp, and a new machine is often busy with its own package updates first."""
        client = self.admin(PROBE_TIMEOUT_S)
        try:
            told = load_agent_config(self.paths.agent_config).server
        except ConfigError:
            told = "the server agent.yaml names"

        def ready() -> bool:
            try:
                nodes = client.get("/api/v1/nodes")
            except LlmgwError as e:
                self.note(f"the control plane does not answer: {e}")
                return False
            self.note(f"node {node} has not registered (its agent connects to {told}; "
                      "'llmgw service logs agent' says why not)")
            for n in nodes:
                if n["id"] != node:
                    continue
                self.note(f"node {node} is {n['state']}, no llama.cpp engine reported yet")
                if n["state"] == "ready" and "llamacpp" in n.get("engines", []):
                    return True
                for p in n.get("provision", []):
                    line = f"{p['engine']} {p.get('version', '')}: {p['state']} {p.get('detail', '')}"
                    self.progress(" ".join(line.split()))
                    # Only llama.cpp is waited for: vLLM installs for minutes after, and one this
                    # node cannot run is not a reason to stop here.
                    if p["engine"] == "llamacpp" and p["state"] in ("failed", "unsupported"):
                        raise EngineError(f"installing {p['engine']} on this node: {p.get('detail', '')}")
            return False

        self.wait(self.opts.node_wait_s, "this node to be ready with an engine", ready, interval_s=self.opts.poll_s)
        self.say("kept", f"node {node} is ready")

    def reconcile_agent_yaml(self, conf: Path) -> str:
        """Keep agent.yaml; when ``--llama-server`` differs from its binary and init wrote that
        value, update it (see :mod:`.agentconf`). Returns what changed (``""`` when nothing did)."""
        new = self.opts.llama_server
        if new is None:
            self.say("kept", f"{conf}")
            return ""
        out = agentconf.reconcile_binary(conf, self.paths.state, new)
        if out.action == "kept":
            self.say("kept", f"{conf}")
            return ""
        if out.action == "updated":
            self.say(
                "updated",
                f"{conf}: engines.llamacpp.binary {out.old or '(not set)'} -> {new} (was written by init; "
                f"the previous file is in {out.backup})",
            )
            return "agent.yaml"
        why = (
            f"init wrote {out.recorded or '(not set)'} there and it was edited since"
            if out.known
            else "init has no record of writing it"
        )
        self.say(
            "!!",
            f"{conf} says engines.llamacpp.binary: {out.old or '(not set)'}, not --llama-server {new}; "
            f"{why}, so init leaves it: edit it and run 'llmgw service restart agent' to change",
        )
        return ""

    # --- 6. the starter -----------------------------------------------------------------------

    def cpus(self) -> int:
        """This machine's cores for the plan: ``--cpus``, else what the OS reports."""
        return self.opts.cpus or os.cpu_count() or 1

    def judges(self) -> int:
        """Judge replicas this init serves (the seed's ``judgeFor``): none with ``--no-guard-model``
        or when the judge will be skipped (offline with nothing carried in), so the starter keeps
        the cores a judge would have had."""
        if not self.judge_planned():
            return 0
        return plan.judge_for(no_node=self.opts.no_node, replicas_flag=self.opts.judge_replicas)

    def judge_source(self) -> str:
        """Where the judge's weights come from: ``--judge-source``, else the seed's Qwen3Guard file."""
        return self.opts.judge_source or plan.GUARD_MODEL_SOURCE

    def judge_planned(self) -> bool:
        """Whether init will try to serve a judge: not with ``--no-guard-model``, nor offline with no
        ``file:`` judge carried in (it might still be in the mirror: then it is served, and the starter
        shares its cores)."""
        if self.opts.no_guard_model:
            return False
        return not (self.opts.offline and sourcecheck.to_download(self.judge_source()).kind != "file")

    def ensure_starter(self) -> str:
        """Fetch the starter into the mirror and serve it here (pinned when this machine is a node)."""
        pinned = not self.opts.no_node
        size = 0
        d = sourcecheck.to_download(self.opts.starter_source)
        if d.kind == "file" and d.path:
            size = Path(d.path).stat().st_size
        spec = plan.starter_spec(
            self.opts.starter_source, name=self.opts.starter_name, alias=self.opts.starter_alias, size_bytes=size
        )
        cores = plan.cpu_plan(cpus=self.cpus(), judges=self.judges(), no_node=self.opts.no_node).starter

        def entry(url: str, sha256: str, classes: list[str]) -> Model:
            return plan.starter_model(
                spec, plan.STARTER_CONTEXT, cores, url, classes, pinned=pinned, sha256=sha256
            )

        ok = self.ensure_served(spec.name, spec.source, plan.STARTER_VERSION, pinned, entry)
        return spec.name if ok else ""

    def ensure_served(
        self, name: str, source: str, version: str, here: bool,
        entry: Callable[[str, str, list[str]], Model],
    ) -> bool:
        """Fetch a model into the mirror, add it to the catalog, and when it runs here, wait for it
        to answer. Returns False when it was skipped (offline and not in the mirror)."""
        client = self.admin()
        models: list[dict[str, Any]] = client.get("/api/v1/models")
        if any(m["name"] == name for m in models):
            self.say("kept", f"{name} in the catalog")
            if here:
                self.wait_serving(name)
            return True

        kind = sourcecheck.to_download(source).kind
        mirror = MirrorClient(self.mirror_api(), timeout=15.0)
        try:
            st = mirror.status(name, version)
        except ApiError as e:
            if e.status != 404:
                raise
            if self.opts.offline and kind != "file":
                # Asked of the internet, it would fail after a timeout and stop init over a model
                # nobody carried in.
                self.say("skip", f"{name}: not in the mirror, and an offline cluster does not download it")
                return False
            st = mirror.fetch(source, name, version)
            self.progress(f"{'copying' if kind == 'file' else 'downloading'} {name} into the mirror")

        last_pct = -10

        probe_mirror = MirrorClient(self.mirror_api(), timeout=PROBE_TIMEOUT_S)

        def present() -> bool:
            nonlocal st, last_pct
            try:
                st = probe_mirror.status(name, version)
            except LlmgwError as e:
                self.note(f"the mirror does not answer: {e}")
                return False
            detail = f": {st.progress_text()}" if st.percent() is not None else ""
            self.note(f"{name} {st.state} in the mirror{detail}")
            if st.state == "present":
                return True
            if st.state == "failed":
                raise MirrorError(f"the mirror could not fetch {name}: {st.err}")
            pct = st.percent()
            if pct is not None and pct >= last_pct + 10:
                self.progress(st.progress_text())  # percent, rate, ETA
                last_pct = pct
            return False

        self.wait(self.opts.download_wait_s, f"{name} to download", present, interval_s=self.opts.poll_s)
        self.say("done", f"{name} in the mirror")

        classes = self.gpu_probe() if here else []
        model = entry(st.url, st.sha256, classes)
        try:
            client.post("/api/v1/models", model.model_dump(mode="json"))
        except ApiError as e:
            raise ApiError(f"adding {name} to the catalog: {e}", status=e.status, code=e.code) from e
        if not here:
            self.say("done", f"{name} in the catalog; it runs on a node with room for it")
            return True
        where = "on CPU"
        if classes:
            where = "on " + ", ".join(classes) + ", or CPU if the card is busy"
        self.say("done", f"{name} in the catalog, served here {where}")
        self.wait_serving(name)
        return True

    def wait_serving(self, name: str) -> None:
        """Wait for a ready replica of ``name``; believe placement's "nowhere" after the grace."""
        client = self.admin(PROBE_TIMEOUT_S)
        unplaced: float | None = None

        def serving() -> bool:
            nonlocal unplaced
            try:
                reps = client.get(f"/api/v1/replicas?model={name}")
            except LlmgwError as e:
                self.note(f"the control plane does not answer: {e}")
                return False
            # Nowhere to put it is not waited out for ten minutes: once placement has said why
            # for the grace, that is the answer. (The replicas view lists a wanted but unplaced
            # replica as pending on no node.)
            reps = [r for r in reps if r.get("node")]
            if not reps:
                try:
                    ex = client.get(f"/api/v1/explain-placement?model={name}")
                except LlmgwError as e:
                    self.note(f"the control plane does not answer: {e}")
                    return False
                self.note(f"{name}: no replica placed yet ({ex.get('summary') or 'placement has not run'})")
                if not ex.get("placed") and ex.get("rejections"):
                    now = self.clock.now()
                    unplaced = unplaced if unplaced is not None else now
                    self.progress(f"{name}: {ex.get('summary', '')}")
                    if now - unplaced > self.opts.unplaced_grace_s:
                        why = "; ".join(f"{r['node']}: {r['reason']}" for r in ex["rejections"])
                        raise EngineError(
                            f"{name} has nowhere to run ({why}); add a node with room, or free some "
                            f"('llmgw ctl explain-placement {name}')"
                        )
                return False
            unplaced = None
            for r in reps:
                if r["state"] == "ready":
                    self.say("kept", f"{name} is serving (profile {r['profile']})")
                    return True
            for r in reps:
                err = (r.get("err") or "").strip()
                if r["state"] == "failed":
                    # A model that does not load will not load on the next try either: say why
                    # now rather than wait out the deadline.
                    raise EngineError(
                        f"{name} failed to start on node {r.get('node') or '?'}: {err or 'no reason given'}\n"
                        f"fix the cause and run init again; 'llmgw ctl replicas {name}' shows its state"
                    )
                headline = err.splitlines()[0] if err else ""
                self.progress(f"{name} {r['state']}" + (f": {headline}" if headline else ""))
            return False

        self.wait(self.opts.serve_wait_s, f"{name} to start", serving, interval_s=self.opts.poll_s)

    # --- 7. the judge -------------------------------------------------------------------------

    def ensure_judge(self) -> None:
        """The guardrails' judge (the seed's ``ensureGuardModel``), then the default policy.

        The judge goes into the mirror and the catalog (role guard, CPU only, ``judge_for``
        replicas, cores from ``cpu_plan``); when this machine is a node, init waits for it to serve.
        Then, when server.yaml has no ``guard:`` policy, one is appended (with a backup) that judges
        in and out with ``fail: closed``, and the control plane is restarted to read it. A judge
        that is skipped writes no policy: a policy whose judge is missing would refuse everything.
        """
        if self.opts.no_guard_model:
            self.say("skip", "the guardrails' judge (--no-guard-model): prompts and answers are not judged")
            return
        source = self.judge_source()
        fmt = self.opts.judge_format or "qwen3guard"
        if self.opts.offline and sourcecheck.to_download(source).kind != "file" and not self._in_mirror(source):
            self.say(
                "skip",
                "the guardrails' judge: offline, and no judge was carried in; prompts and answers are not "
                "judged (no guard policy written). Carry one in with --judge-source file:/path.gguf",
            )
            return
        name = plan.judge_name(source, fmt)
        here = not self.opts.no_node
        cores = plan.cpu_plan(cpus=self.cpus(), judges=self.judges(), no_node=self.opts.no_node).judge

        def entry(url: str, sha256: str, _classes: list[str]) -> Model:
            return plan.guard_model(url, self.judges() or 1, cores, sha256=sha256, fmt=fmt, name=name)

        if not self.ensure_served(name, source, plan.GUARD_MODEL_VERSION, here, entry):
            self.say("skip", "the guard policy: no judge, so prompts and answers are not judged")
            return
        cfg = self.config()
        if cfg.guard.on():
            self.say("kept", f"guard policies in server.yaml ({', '.join(p.name for p in cfg.guard.policies)})")
            return
        self._append(files.guard_block(name))
        self.say("done", f"server.yaml judges every prompt and answer with {name} (policy 'default', fail: closed)")
        self.manager.restart("server")
        self._wait_service("server", "the control plane", self.admin().health)
        self.say("done", "control plane restarted with the guard policy")

    def _in_mirror(self, source: str) -> bool:
        fmt = self.opts.judge_format or "qwen3guard"
        try:
            mirror = MirrorClient(self.mirror_api(), timeout=15.0)
            st = mirror.status(plan.judge_name(source, fmt), plan.GUARD_MODEL_VERSION)
        except LlmgwError:
            return False
        return st.state == "present"

    # --- the end --------------------------------------------------------------------------------

    def finish(self, served: str, took_s: float) -> None:
        """Print how to ask the gateway: ``llmgw chat`` and the equivalent ``curl``."""
        cfg = self.config()
        url = _connect_url(cfg.gateway.listen)
        root = f"--root {self.paths.root} " if self.paths.prefixed else ""
        print(f"\nllmgw is ready (init took {format_duration(took_s)}).", file=self.out)
        if not served:
            print("No model is served yet: add one with 'llmgw ctl' once a node has joined.", file=self.out)
            return
        print("Ask it:\n", file=self.out)
        print(f'    llmgw {root}chat "What is the capital of France?"\n', file=self.out)
        print(
            f"    curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"      -d '{{\"model\": \"{served}\", \"messages\": [{{\"role\": \"user\", "
            f"\"content\": \"What is the capital of France?\"}}]}}'\n",
            file=self.out,
        )
        print(
            f"From another machine, add -H \"Authorization: Bearer $(head -1 {self.paths.client_keys})\" "
            f"and use this machine's address.",
            file=self.out,
        )


def _has_nvidia_device() -> bool:
    return has_nvidia_device()
