"""The systemd unit texts of llmgw's three services, and writing them.

The agent's and the mirror's texts keep every line of the units the original (Go) llmgw's ``server
init`` wrote, comments included, which carry the reasons (``tests/unit/test_units.py`` holds those
lines). They are also the only description of a service that llmgw's own supervisor
(:mod:`llmgw.service.supervisor`) reads on machines without systemd, so one text serves both.

``deploy/systemd/llmgw-{server,agent,mirror}.service`` hold :func:`deploy_units`'s output (the
default paths, ``/usr/local/bin/llmgw``); ``tests/unit/test_units.py`` keeps them equal.

When ``paths.prefixed`` (``LLMGW_ROOT`` is set), every unit also carries
``Environment=LLMGW_ROOT=<root>`` so the service sees the same layout as the command that wrote it.

Words in ``ExecStart=`` are escaped for systemd (``%`` -> ``%%``, ``$`` -> ``$$``, double quotes
around words with spaces or quotes); :func:`llmgw.service.unitfile.parse_unit` undoes exactly that.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from llmgw.errors import ServiceError
from llmgw.paths import ROOT_ENV, Paths
from llmgw.service.unitfile import parse_unit

SERVICES = ("server", "agent", "mirror")
"""The services llmgw runs; unit ``llmgw-<name>.service`` each."""

HA_SERVICES = ("patroni",)
"""The services an HA control plane runs besides (:mod:`llmgw.service.haunits`): PostgreSQL under
Patroni. Not in :data:`SERVICES`, so ``llmgw service status`` on a single machine lists what it has;
name them (``llmgw service status patroni``) on an HA one."""

DEFAULT_BINARY = "/usr/local/bin/llmgw"
"""Where the install guide puts llmgw, and what ``deploy/systemd`` names."""

MIRROR_LISTEN = ":8081"
"""The mirror's bytes, for every node (docs/operating.md, "The mirror")."""

MIRROR_API_LISTEN = "127.0.0.1:8082"
"""The mirror's management API on loopback, for the control plane beside it."""

MIRROR_ABOUT_LOCAL = (
    "'llmgw server init'. Bytes on :8081 for every node; the\n"
    "# management API on loopback only, for the control plane beside it."
)
"""``about`` for a mirror beside a single control plane (the original llmgw's wording)."""

MIRROR_ABOUT_STANDBYS = (
    "'llmgw server init'. Bytes on :8081 for every node; the\n"
    "# management API for the control planes only, whichever leads."
)
"""``about`` for a mirror whose management API answers standby control planes too."""

DEPLOY_MIRROR_BASE = "http://ADDR:8081"
"""The placeholder ``--base`` of ``deploy/systemd/llmgw-mirror.service``: ADDR is to be replaced."""

DEPLOY_MIRROR_ABOUT = (
    MIRROR_ABOUT_LOCAL + "\n"
    "# ADDR in --base stands for the address nodes reach this machine by: replace\n"
    "# it, or let 'llmgw server init' write this unit with it filled in."
)
"""``about`` of ``deploy/systemd/llmgw-mirror.service``: says what to do with the placeholder."""


def unit_name(service: str) -> str:
    """``llmgw-<service>``, the systemd unit name (without ``.service``).

    Raises:
        ServiceError: ``service`` is not one of :data:`SERVICES`.
    """
    check_service(service)
    return f"llmgw-{service}"


def check_service(service: str) -> None:
    """Raise :class:`ServiceError` unless ``service`` is one of :data:`SERVICES` or :data:`HA_SERVICES`."""
    if service not in SERVICES and service not in HA_SERVICES:
        raise ServiceError(
            f"unknown service '{service}'; the services are {', '.join(SERVICES)}, "
            f"and on an HA control plane {', '.join(HA_SERVICES)}"
        )


def service_name(given: str) -> str:
    """A service as an operator may type it: ``agent``, ``llmgw-agent`` (as ``service status`` and
    systemd show it) or ``llmgw-agent.service`` are all ``agent``.

    Raises:
        ServiceError: it names none of :data:`SERVICES` or :data:`HA_SERVICES`.
    """
    name = given.strip().removesuffix(".service").removeprefix("llmgw-")
    check_service(name)
    return name


def installed_services(paths: Paths) -> list[str]:
    """What ``service status`` and ``service stop`` act on when given no names: each of
    :data:`SERVICES`, then of :data:`HA_SERVICES`, whose unit is installed (an HA control plane's
    database member is stopped after its control plane, and shown beside it); all of
    :data:`SERVICES` when none is (each then says it is not installed). A node that runs only an
    agent is not shown a server and a mirror it does not have (whose "unknown" made ``status`` exit
    3 with its agent running: a new user's finding)."""
    have = [s for s in (*SERVICES, *HA_SERVICES) if paths.unit(s).exists()]
    return have or list(SERVICES)


#: The order ``service start`` starts every installed service in when given no names: the database
#: member before its control plane, the mirror and the control plane before the agent that uses them.
START_ORDER = ("patroni", "mirror", "server", "agent")


def restartable_services(paths: Paths) -> list[str]:
    """What ``service restart`` restarts when given no names (after an upgrade, say): llmgw's own
    services whose unit is installed, in :data:`START_ORDER`; not an HA database member, whose
    restart is a PostgreSQL failover and which runs no llmgw code (name it to restart it)."""
    return [s for s in startable_services(paths) if s not in HA_SERVICES]


def startable_services(paths: Paths) -> list[str]:
    """What ``service start`` starts when given no names: each service whose unit is installed
    (``paths.unit``; init writes them for systemd and the supervisor alike), in :data:`START_ORDER`."""
    return [s for s in START_ORDER if paths.unit(s).exists()]


def _escape(word: str, *, dollar: bool = True) -> str:
    """One word for a unit line: ``%`` and (for ExecStart) ``$`` doubled, quoted when it has spaces."""
    out = word.replace("%", "%%")
    if dollar:
        out = out.replace("$", "$$")
    if not out or any(c.isspace() or c in "\"'\\;" for c in out):
        out = '"' + out.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return out


def _exec(argv: list[str]) -> str:
    return " ".join(_escape(a) for a in argv)


def _root_env(paths: Paths) -> str:
    """The ``Environment=LLMGW_ROOT=…`` line (with its newline) for a prefixed install, else ``""``."""
    if not paths.prefixed:
        return ""
    return "Environment=" + _escape(f"{ROOT_ENV}={paths.root}", dollar=False) + "\n"


SERVICE_USER = "llmgw"
"""The unprivileged system user the control plane and the mirror run as (``User=``/``Group=``)."""

_SANDBOX = (
    "# The sandbox systemd offers, for a process that serves the network and\n"
    "# writes only its own directory: no new privileges and no capabilities at\n"
    "# all (it binds its ports above 1024, and runs as its own user), a private\n"
    "# /tmp and /dev, the system read-only and /home, /root hidden, no kernel\n"
    "# knobs, modules, logs or clock, and only the sockets and system calls a\n"
    "# network service uses (AF_NETLINK: the interface list, for addresses).\n"
    "NoNewPrivileges=true\n"
    "CapabilityBoundingSet=\n"
    "AmbientCapabilities=\n"
    "UMask=0077\n"
    "PrivateTmp=true\n"
    "PrivateDevices=true\n"
    "PrivateUsers=true\n"
    "PrivateMounts=true\n"
    "ProtectSystem=strict\n"
    "ProtectHome=true\n"
    "ProtectKernelTunables=true\n"
    "ProtectKernelModules=true\n"
    "ProtectKernelLogs=true\n"
    "ProtectControlGroups=true\n"
    "ProtectClock=true\n"
    "ProtectHostname=true\n"
    "ProtectProc=invisible\n"
    "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK\n"
    "RestrictNamespaces=true\n"
    "RestrictRealtime=true\n"
    "RestrictSUIDSGID=true\n"
    "LockPersonality=true\n"
    "RemoveIPC=true\n"
    "SystemCallArchitectures=native\n"
    "SystemCallFilter=@system-service\n"
    "SystemCallFilter=~@privileged @resources\n"
    "SystemCallErrorNumber=EPERM\n"
)
"""Sandboxing shared by the server and mirror units (``systemd-analyze security`` rates them 1.3 OK).

Not set, with the reason: ``MemoryDenyWriteExecute`` (libffi closures, which ctypes and cffi
callbacks need, map writable+executable pages), ``PrivateNetwork``/``IPAddressDeny`` (both serve
the network), ``ProcSubset=pid`` (psutil reads ``/proc/meminfo`` and ``/proc/stat``).
"""


def _user_lines(user: str | None, what: str) -> str:
    """``User=``/``Group=`` for ``user``, or a comment saying why there are none."""
    if user is None:
        return (
            f"# No User=: this install is under LLMGW_ROOT and {what} runs as whoever\n"
            "# starts it ('llmgw server init' said why).\n"
        )
    return f"User={user}\nGroup={user}\n"


def agent_unit(paths: Paths, llmgw_bin: str) -> str:
    """The node agent's unit: ``<llmgw_bin> agent --config <paths.agent_config>``.

    Root, for the engines (the comment in the text names what of root they use). ``KillMode=process``:
    engines outlive a restart of the agent and are adopted on its next start.
    ``LimitMEMLOCK=infinity``: RDMA/NCCL pin more than systemd's default 8 MB lock limit.
    Engines inherit this unit's sandbox, so it holds only what no engine needs.
    """
    return (
        "[Unit]\n"
        "Description=llmgw node agent\n"
        "After=network-online.target\n"
        "Wants=network-online.target\n"
        "[Service]\n"
        f"ExecStart={_exec([llmgw_bin, 'agent', '--config', str(paths.agent_config)])}\n"
        f"{_root_env(paths)}"
        "# Root, because the agent launches engines and needs device access. Engines\n"
        "# outlive a restart of this unit and are adopted again on the next start, so\n"
        "# KillMode must not take the whole process group with it.\n"
        "KillMode=process\n"
        "Restart=on-failure\n"
        "RestartSec=2s\n"
        "# RDMA pins the buffers it registers, and NCCL registers a great deal: with\n"
        "# systemd's default 8 MB lock limit, an engine that drops the capability that\n"
        "# lets root ignore it fails its first collective over InfiniBand.\n"
        "LimitMEMLOCK=infinity\n"
        "StateDirectory=llmgw-agent\n"
        "StateDirectoryMode=0700\n"
        "UMask=0077\n"
        "# What of root the engines use, and nothing else: CAP_IPC_LOCK (the pinned\n"
        "# memory above); CAP_SYS_MODULE and CAP_MKNOD (CUDA's setuid nvidia-modprobe\n"
        "# loads nvidia-uvm and makes /dev/nvidia-uvm on first use when boot did not,\n"
        "# which is also why there is no NoNewPrivileges, PrivateDevices or\n"
        "# ProtectKernelModules here); CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH,\n"
        "# CAP_FOWNER and CAP_CHOWN (root's files: the model cache, engine installs\n"
        "# unpacked with their owners); CAP_SYS_NICE (llama-server --prio);\n"
        "# CAP_SYSLOG (the agent reads the kernel log to name an out-of-memory kill);\n"
        "# CAP_SYS_ADMIN and CAP_NET_ADMIN, for network namespaces alone (below): a\n"
        "# group worker's rpc-server, whose protocol has no authentication, runs in one\n"
        "# of its own (its loopback brought up) and the agent joins it to reach the\n"
        "# engine (agent/groups/isolation.py).\n"
        "CapabilityBoundingSet=CAP_IPC_LOCK CAP_SYS_MODULE CAP_MKNOD CAP_DAC_OVERRIDE "
        "CAP_DAC_READ_SEARCH CAP_FOWNER CAP_CHOWN CAP_SYS_NICE CAP_SYSLOG CAP_SYS_ADMIN CAP_NET_ADMIN\n"
        "# Neither the agent nor an engine sets the clock or the hostname, changes\n"
        "# cgroups (it only reads them), takes realtime priority, makes namespaces\n"
        "# other than a worker's network one or uses sockets beyond IP, local and\n"
        "# netlink (NCCL's RDMA uses netlink).\n"
        "ProtectClock=true\n"
        "ProtectHostname=true\n"
        "ProtectControlGroups=true\n"
        "RestrictRealtime=true\n"
        "RestrictNamespaces=net\n"
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK\n"
        "LockPersonality=true\n"
        "SystemCallArchitectures=native\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def server_unit(paths: Paths, llmgw_bin: str, *, user: str | None = SERVICE_USER) -> str:
    """The control plane's unit: ``<llmgw_bin> server run --config <paths.server_config>``.

    Runs as ``user`` (:data:`SERVICE_USER`; None: no ``User=``, see :func:`_user_lines`) in
    :data:`_SANDBOX`. ``TimeoutStopSec=60s``: SIGTERM drains the gateway's streams for up to
    ``gateway.drain_s`` (at most 50 s) before the store is closed.
    """
    return (
        "[Unit]\n"
        "Description=llmgw control plane\n"
        "After=network-online.target\n"
        "Wants=network-online.target\n"
        "[Service]\n"
        f"ExecStart={_exec([llmgw_bin, 'server', 'run', '--config', str(paths.server_config)])}\n"
        "# 'systemctl reload llmgw-server' re-reads the gateway's keys file (SIGHUP).\n"
        "ExecReload=/bin/kill -HUP $MAINPID\n"
        f"{_root_env(paths)}"
        "# The unprivileged llmgw user. It reads server.yaml (group llmgw), its admin\n"
        "# token, server key and gateway keys (owned by llmgw, mode 0600) in /etc/llmgw;\n"
        "# the CA key stays root's. It writes only its state, the SQLite database by\n"
        "# default, in /var/lib/llmgw (mode 0700), which StateDirectory makes.\n"
        f"{_user_lines(user, 'the control plane')}"
        "Restart=on-failure\n"
        "RestartSec=2s\n"
        "# SIGTERM drains the gateway's streams for up to gateway.drain_s (20 s by\n"
        "# default, at most 50) and then closes the store: time for both.\n"
        "TimeoutStopSec=60s\n"
        "# The agent API keeps one connection per node open between beats: room for\n"
        "# tens of thousands of nodes (the server also raises its soft limit to this).\n"
        "LimitNOFILE=65536\n"
        "StateDirectory=llmgw\n"
        "StateDirectoryMode=0700\n"
        f"{_SANDBOX}"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def mirror_unit(
    paths: Paths,
    llmgw_bin: str,
    *,
    listen: str,
    api_listen: str,
    base: str,
    allow: list[str],
    about: str,
    import_dirs: Sequence[str] = (),
    allow_source_nets: Sequence[str] = (),
    user: str | None = SERVICE_USER,
    api_token_file: str = "",
) -> str:
    """A mirror's unit, serving ``paths.mirror_store``.

    Args:
        listen: the bytes listener, ``:8081`` (:data:`MIRROR_LISTEN`) for every node.
        api_listen: the management API, ``127.0.0.1:8082`` (:data:`MIRROR_API_LISTEN`) on one machine.
        base: the URL nodes fetch from, ``http://<this machine>:8081``.
        allow: who, besides the machine itself, may use the management API (``--api-allow`` each).
        about: the text after ``# Written by``; may span lines, each after the first starting ``# ``
            (:data:`MIRROR_ABOUT_LOCAL`, :data:`MIRROR_ABOUT_STANDBYS`).
        import_dirs: directories ``file:`` sources may come from (``--import-dir`` each); none
            refuses every ``file:`` source.
        allow_source_nets: private addresses or networks ``http(s):`` sources may reach
            (``--allow-source-net`` each).
        user: who it runs as (:data:`SERVICE_USER`, owner of the store); None: no ``User=``.
        api_token_file: the management API's token (``--api-token-file``); ``""``: the mirror's
            default (:func:`llmgw.mirror.client.token_path`).

    It may write only its store (``ReadWritePaths=``) inside :data:`_SANDBOX`.
    """
    argv = [llmgw_bin, "mirror", "serve", "--dir", str(paths.mirror_store), "--listen", listen]
    argv += ["--api-listen", api_listen, "--base", base]
    for a in allow:
        argv += ["--api-allow", a]
    for d in import_dirs:
        argv += ["--import-dir", d]
    for n in allow_source_nets:
        argv += ["--allow-source-net", n]
    if api_token_file:
        argv += ["--api-token-file", api_token_file]
    return (
        "[Unit]\n"
        "Description=llmgw model mirror\n"
        "After=network-online.target\n"
        "Wants=network-online.target\n"
        "[Service]\n"
        f"# Written by {about}\n"
        f"ExecStart={_exec(argv)}\n"
        f"{_root_env(paths)}"
        f"{_user_lines(user, 'the mirror')}"
        "Restart=on-failure\n"
        "RestartSec=2s\n"
        f"ReadWritePaths={_escape(str(paths.mirror_store), dollar=False)}\n"
        f"{_SANDBOX}"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def deploy_units() -> dict[str, str]:
    """The texts of ``deploy/systemd/llmgw-<name>.service``, by service name.

    Default paths, :data:`DEFAULT_BINARY`, and for the mirror the single-machine listeners with
    the placeholder base :data:`DEPLOY_MIRROR_BASE` explained in its ``about`` comment.
    """
    paths = Paths(Path("/"))
    return {
        "server": server_unit(paths, DEFAULT_BINARY),
        "agent": agent_unit(paths, DEFAULT_BINARY),
        "mirror": mirror_unit(
            paths,
            DEFAULT_BINARY,
            listen=MIRROR_LISTEN,
            api_listen=MIRROR_API_LISTEN,
            base=DEPLOY_MIRROR_BASE,
            allow=[],
            about=DEPLOY_MIRROR_ABOUT,
        ),
    }


def llmgw_binary() -> str:
    """The absolute path of the llmgw executable running now, for ``ExecStart=``.

    ``sys.argv[0]`` when it is an ``llmgw`` script (a venv or pipx install names its own), else
    the ``llmgw`` script beside the running Python (``python -m llmgw`` from a venv), else
    ``llmgw`` on ``PATH``, else :data:`DEFAULT_BINARY`. Links are kept as given (a unit naming
    ``/usr/local/bin/llmgw`` follows the link to whatever it points at after an upgrade);
    :func:`installed_binary` keeps a unit's path when it is the same program.
    """
    arg0 = sys.argv[0] if sys.argv else ""
    if arg0 and Path(arg0).name == "llmgw":
        found = arg0 if os.sep in arg0 else shutil.which(arg0)
        if found and Path(found).is_file():
            return os.path.abspath(found)
    beside = Path(sys.executable).parent / "llmgw"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("llmgw") or DEFAULT_BINARY


def installed_binary(paths: Paths, binary: str) -> str:
    """``binary``, or the llmgw an installed unit already names when both lead to the same file:
    init run once through ``/usr/local/bin/llmgw`` (a link into a venv) and once through the venv's
    own path wrote different units and restarted every service (a new user's report)."""
    for name in SERVICES:
        try:
            argv = parse_unit(paths.unit(name).read_text()).argv
        except (OSError, ServiceError):
            continue
        if argv and argv[0] != binary and os.path.realpath(argv[0]) == os.path.realpath(binary):
            return argv[0]
    return binary


def write_unit(path: Path, body: str) -> bool:
    """Install a unit when it differs from what is there, keeping somebody's edited copy beside it.

    Identical text: nothing is written, returns False. Otherwise an existing different file is
    copied to ``<path>.bak`` (replacing an older .bak), the new text is written atomically
    (temp file + rename, mode 0644, parent directories made) and it returns True.

    Raises:
        ServiceError: the file or its directory cannot be read or written (the OSError chained).
    """
    try:
        old = path.read_text() if path.exists() else None
        if old == body:
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        if old is not None:
            path.with_name(path.name + ".bak").write_text(old)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(body)
        tmp.chmod(0o644)
        tmp.replace(path)
    except OSError as e:
        raise ServiceError(f"writing the unit {path}: {e}; run as root, or set LLMGW_ROOT") from e
    return True
