"""PostgreSQL kept highly available by Patroni, for an HA ``server init``.

What is decided and written here, each a function that a step (:mod:`.steps.database`) or a test
calls:

- :class:`Member`: one control plane's database member, ``NAME=HOST[:PORT]``. PORT is
  PostgreSQL's (default 5432); Patroni's REST API listens ``+2576`` above it (8008 for 5432) and
  Patroni's raft ``-421`` below it (5011 for 5432), the ports docs/ha.md §1.3 used, so three members on
  one machine need only three PostgreSQL ports (5432, 5433, 5434).
- :class:`HaPlan`: the whole cluster (scope, members, DCS, passwords, where Patroni lives), kept
  in ``/etc/llmgw/ha.yaml`` (0600: it holds the database passwords) and carried to each standby in
  its bundle (:mod:`llmgw.serverinit.standby`).
- :func:`patroni_yml`: one member's ``patroni.yml`` (docs/ha.md §1.3 with the tuned dynamic settings: ``ttl 20,
  loop_wait 2, retry_timeout 4``, ``synchronous_mode: true``, ``use_pg_rewind``, TCP keepalives; §1.4: 0 lost writes).
- :func:`ensure_venv`: Patroni 4.1.5 from PyPI in its own venv made from ``/usr/bin/python3``
  (docs/ha.md §1.5: with pyenv's Python under /root the postmaster's spawn child cannot exec as
  ``postgres`` and Patroni says "bootstrap in progress" forever).
- :class:`PatroniRest`: the member's REST API (``GET /primary``, ``/replica``, ``/cluster``).
- :func:`create_database`: the llmgw role and database on the primary, idempotent.

Raises :class:`~llmgw.errors.ConfigError` for bad input (a member spec that does not parse, two
members on one address) and :class:`~llmgw.errors.ServiceError` for a venv that cannot be made.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import yaml

from llmgw.errors import ConfigError, ServiceError
from llmgw.httpverify import verify_context
from llmgw.names import check_name

PATRONI_VERSION = "4.1.5"
"""The Patroni release docs/ha.md measured (Debian bookworm's package is 3.0.2, too old)."""

PATRONI_REQUIREMENT = f"patroni[psycopg3,raft,etcd3]=={PATRONI_VERSION}"
"""What :func:`ensure_venv` installs: psycopg 3 for PostgreSQL, raft and etcd v3 for the DCS."""

DEFAULT_VENV = Path("/opt/llmgw/patroni-4.1.5")
"""Where init puts Patroni's venv (``--patroni-venv``); readable by ``postgres``, not under /root."""

SYSTEM_PYTHON = Path("/usr/bin/python3")
"""The interpreter Patroni's venv is made from: one the ``postgres`` user can execute (docs/ha.md §1.5)."""

PG_BIN_DIR = Path("/usr/lib/postgresql/15/bin")
"""Debian's PostgreSQL 15 binaries (not on PATH)."""

PG_PORT = 5432
REST_OFFSET = 8008 - 5432
"""Patroni's REST API port minus PostgreSQL's: 8008 for 5432 (docs/ha.md §1.3)."""

RAFT_OFFSET = 5011 - 5432
"""Patroni's raft port minus PostgreSQL's: 5011 for 5432 (docs/ha.md §1.3)."""

DB_USER = "llmgw"
DB_NAME = "llmgw"
DB_OS_USER = "postgres"
"""The system user Patroni and PostgreSQL run as (PostgreSQL refuses root)."""

DYNAMIC = {
    # docs/ha.md §0/§1.5: ttl 20 is Patroni's floor (a lower one is silently raised), and
    # loop_wait + 2*retry_timeout <= ttl. Node crash → new primary in 19-24 s (§1.4).
    "ttl": 20,
    "loop_wait": 2,
    "retry_timeout": 4,
    "maximum_lag_on_failover": 1048576,
    # An orphaned old primary cannot acknowledge a commit: 0 lost writes measured, 335 without.
    "synchronous_mode": True,
}
"""Patroni's bootstrap dynamic settings (``bootstrap.dcs``), as docs/ha.md §0 recommends."""

PG_PARAMETERS = {
    "wal_log_hints": "on",  # pg_rewind needs it (or checksums)
    "max_connections": 200,  # each control plane's pool takes up to 22 (12 + 10 overflow), plus its leader's lock
    # A client (or a standby) on a crashed machine is noticed in about 5 + 2*3 = 11 s.
    "tcp_keepalives_idle": 5, "tcp_keepalives_interval": 2, "tcp_keepalives_count": 3,
    # A standby retries streaming after 1 s, not 5: a joining one asks before the leader made its slot, and after a
    # failover synchronous commits wait for a standby to reconnect. Each member's streaming 1-4 s sooner.
    "wal_retrieve_retry_interval": "1s",
}
"""PostgreSQL settings every member shares (``bootstrap.dcs.postgresql.parameters``)."""

REST_KEY = "restapi"
RAFT_KEY = "raft"
PASSWORD_KEYS = ("superuser", "replication", "rewind", DB_USER, REST_KEY, RAFT_KEY)
"""The passwords an HA plan holds: Patroni's three PostgreSQL users, the store's, the one that
guards Patroni's REST API's writes (user ``llmgw``), and raft's (pysyncobj encrypts and
authenticates every message between members with it)."""

OPTIONAL_KEYS = (RAFT_KEY,)
"""Passwords an ha.yaml written by an older init lacks: :meth:`HaPlan.from_doc` makes one and
names it in :attr:`HaPlan.generated` (the caller writes it back, or refuses, and says so)."""

_SPEC = re.compile(r"^(?P<name>[^=]+)=(?P<addr>.+)$")


@dataclass(frozen=True)
class Member:
    """One control plane's database member.

    Attributes:
        name: the control plane's name (:func:`llmgw.names.check_name`), also Patroni's member name.
        host: the address the other members and the control planes reach it at (name or IP).
        pg_port: PostgreSQL's port (5432); the REST API and raft ports follow from it.
    """

    name: str
    host: str
    pg_port: int = PG_PORT

    @classmethod
    def parse(cls, spec: str) -> Member:
        """``NAME=HOST``, ``NAME=HOST:PORT`` or ``NAME=[V6]:PORT``.

        Raises:
            ConfigError: the spec does not parse, the name is not a valid name, or a port is out
                of range (the message quotes the spec and shows the form).
        """
        m = _SPEC.match(spec.strip())
        if not m:
            raise ConfigError(f"{spec!r} is not NAME=HOST[:PORT] (for example cp1=10.0.0.1 or cp2=10.0.0.2:5433)")
        name, addr = m.group("name").strip(), m.group("addr").strip()
        try:
            check_name(name, "control plane name")
        except ValueError as e:
            raise ConfigError(f"{spec!r}: {e}") from e
        host, port = _split_host_port(addr, spec)
        member = cls(name, host, port)
        member.check_ports(spec)
        return member

    def check_ports(self, what: str) -> None:
        """Raise :class:`ConfigError` unless the PostgreSQL, REST and raft ports are all valid."""
        for label, port in (("PostgreSQL", self.pg_port), ("REST API", self.rest_port), ("raft", self.raft_port)):
            if not 1024 <= port <= 65535:
                raise ConfigError(
                    f"{what}: the {label} port is {port}, outside 1024-65535; choose a PostgreSQL port from "
                    f"{1024 - RAFT_OFFSET} to {65535 - REST_OFFSET} (REST API = port+{REST_OFFSET}, "
                    f"raft = port{RAFT_OFFSET})"
                )

    @property
    def rest_port(self) -> int:
        """Patroni's REST API port: PostgreSQL's + 2576."""
        return self.pg_port + REST_OFFSET

    @property
    def raft_port(self) -> int:
        """Patroni's raft port: PostgreSQL's - 421."""
        return self.pg_port + RAFT_OFFSET

    @property
    def url_host(self) -> str:
        """The host as it goes in a URL (an IPv6 address in brackets)."""
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def rest_url(self) -> str:
        """``http://HOST:RESTPORT``, Patroni's REST API (server.yaml's ``cluster.patroni``)."""
        return f"http://{self.url_host}:{self.rest_port}"

    @property
    def spec(self) -> str:
        """The member as ``NAME=HOST:PORT`` (what :meth:`parse` reads)."""
        return f"{self.name}={self.url_host}:{self.pg_port}"


def _split_host_port(addr: str, spec: str) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT``, ``[V6]`` or ``[V6]:PORT`` → (host, port)."""
    if addr.startswith("["):
        host, sep, rest = addr[1:].partition("]")
        port_text = rest.removeprefix(":") if rest.startswith(":") else ""
        if not sep or (rest and not rest.startswith(":")):
            raise ConfigError(f"{spec!r}: an IPv6 address goes in brackets, as NAME=[::1]:5432")
    elif addr.count(":") == 1:
        host, port_text = addr.split(":")
    elif ":" in addr:
        raise ConfigError(f"{spec!r}: an IPv6 address goes in brackets, as NAME=[::1]:5432")
    else:
        host, port_text = addr, ""
    if not host:
        raise ConfigError(f"{spec!r} names no host; give NAME=HOST[:PORT]")
    if not port_text:
        return host, PG_PORT
    if not port_text.isdigit():
        raise ConfigError(f"{spec!r}: the port {port_text!r} is not a number")
    return host, int(port_text)


def _new_password() -> str:
    """48 hex digits (192 bits): never a leading ``-`` (token_urlsafe: 1 in 64), an option to ``syncobj_admin``."""
    import secrets  # noqa: PLC0415

    return secrets.token_hex(24)


@dataclass
class HaPlan:
    """The HA cluster as init sets it up, kept in ``/etc/llmgw/ha.yaml`` and carried to standbys.

    Attributes:
        scope: Patroni's cluster name (``llmgw``).
        members: every control plane's database member, the first control plane first.
        etcd: etcd v3 URLs (``http://HOST:2379``) for Patroni's DCS; empty means Patroni's raft
            (small installs and tests; documented "deprecated" but tested in 4.1.5, docs/ha.md §1.1).
        passwords: ``superuser``, ``replication``, ``rewind`` (Patroni's), ``llmgw`` (the store's),
            ``restapi`` (Patroni's REST API's writes: switchover, restart, config) and ``raft``
            (Patroni's raft messages between members), each 192 random bits.
        venv: Patroni's venv on every member.
        bin_dir: PostgreSQL 15's binaries.
        dir: where each member keeps ``patroni.yml``, ``data``, ``raft``, ``run`` (owned by ``postgres``).
    """

    members: list[Member]
    scope: str = "llmgw"
    etcd: list[str] = field(default_factory=list)
    passwords: dict[str, str] = field(default_factory=dict)
    venv: Path = DEFAULT_VENV
    bin_dir: Path = PG_BIN_DIR
    dir: Path = Path("/var/lib/llmgw-patroni")
    generated: list[str] = field(default_factory=list, compare=False)
    """Passwords of :data:`OPTIONAL_KEYS` that ha.yaml lacked and :meth:`from_doc` made here: not
    yet written anywhere, so another member does not have them."""

    def __post_init__(self) -> None:
        for key in PASSWORD_KEYS:
            self.passwords.setdefault(key, _new_password())
        self.check()

    def check(self) -> None:
        """Raise :class:`ConfigError` on no members, a name or address used twice, or a bad etcd URL."""
        if not self.members:
            raise ConfigError("an HA cluster needs its control planes: give --control-plane NAME=HOST[:PORT]")
        seen_names: set[str] = set()
        seen_ports: dict[tuple[str, int], str] = {}
        for m in self.members:
            if m.name in seen_names:
                raise ConfigError(f"the control plane name {m.name!r} is given twice; each needs its own")
            seen_names.add(m.name)
            for port in (m.pg_port, m.rest_port, m.raft_port):
                other = seen_ports.get((m.host, port))
                if other is not None:
                    raise ConfigError(
                        f"{m.name} and {other} would both use {m.url_host}:{port}; give members on one "
                        "host PostgreSQL ports whose REST API (+2576) and raft (-421) ports differ too "
                        "(NAME=HOST:PORT, for example 5432, 5433, 5434)"
                    )
                seen_ports[(m.host, port)] = m.name
        for url in self.etcd:
            if not re.match(r"^https?://[^/\s]+:\d+/?$", url):
                raise ConfigError(f"--etcd {url!r} is not an etcd v3 client URL such as http://10.0.0.1:2379")

    def member(self, name: str) -> Member:
        """The member called ``name``.

        Raises:
            ConfigError: no member has that name (the message lists them).
        """
        for m in self.members:
            if m.name == name:
                return m
        names = ", ".join(m.name for m in self.members)
        raise ConfigError(f"no control plane {name!r} in this HA cluster; it has {names}")

    def store_url(self) -> str:
        """The control planes' store URL: libpq multi-host over every member, the primary chosen
        by ``target_session_attrs=read-write`` (docs/ha.md §2), ``connect_timeout=2``.

        Shape: ``postgresql+psycopg://llmgw:PW@/llmgw?host=a:5432&host=b:5432&target_session_attrs=read-write&connect_timeout=2``.
        """
        hosts = "&".join(f"host={m.url_host}:{m.pg_port}" for m in self.members)
        pw = quote(self.passwords[DB_USER], safe="")
        return (
            f"postgresql+psycopg://{DB_USER}:{pw}@/{DB_NAME}?{hosts}"
            "&target_session_attrs=read-write&connect_timeout=2"
        )

    def rest_urls(self) -> list[str]:
        """Every member's Patroni REST API URL (server.yaml's ``cluster.patroni``)."""
        return [m.rest_url for m in self.members]

    def to_doc(self) -> dict[str, Any]:
        """The plan as ``ha.yaml`` holds it."""
        return {
            "scope": self.scope,
            "members": [m.spec for m in self.members],
            "etcd": list(self.etcd),
            "passwords": dict(self.passwords),
            "venv": str(self.venv),
            "bin_dir": str(self.bin_dir),
            "dir": str(self.dir),
        }

    def to_yaml(self) -> str:
        """``ha.yaml``'s text, with a comment saying what it is."""
        head = (
            "# The HA cluster, written by 'llmgw server init --control-plane …'. It holds the database passwords:\n"
            "# keep it 0600. 'llmgw server add-control-plane' copies it into each standby's bundle.\n"
        )
        return head + yaml.safe_dump(self.to_doc(), sort_keys=False)

    @classmethod
    def from_doc(cls, doc: object, where: str) -> HaPlan:
        """A plan from ``ha.yaml``'s mapping.

        Raises:
            ConfigError: a key is missing or wrong (the message names ``where`` and the key).
        """
        if not isinstance(doc, dict):
            raise ConfigError(f"{where} is not a mapping; restore it from the first control plane's /etc/llmgw/ha.yaml")
        try:
            members = [Member.parse(str(s)) for s in doc["members"]]
            passwords = {str(k): str(v) for k, v in doc["passwords"].items()}
            missing = [k for k in PASSWORD_KEYS if k not in passwords and k not in OPTIONAL_KEYS]
            if missing:
                raise ConfigError(f"{where}: passwords lacks {', '.join(missing)}")
            made = [k for k in OPTIONAL_KEYS if k not in passwords]
            return cls(
                members=members, scope=str(doc.get("scope", "llmgw")), etcd=[str(u) for u in doc.get("etcd") or []],
                passwords=passwords, venv=Path(str(doc["venv"])), bin_dir=Path(str(doc["bin_dir"])),
                dir=Path(str(doc["dir"])), generated=made,
            )
        except (KeyError, AttributeError, TypeError) as e:
            raise ConfigError(f"{where}: missing or malformed {e}; restore it from the first control plane") from e

    @classmethod
    def load(cls, path: Path) -> HaPlan:
        """Read ``ha.yaml``. Raises ConfigError when it does not parse."""
        try:
            doc = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from e
        return cls.from_doc(doc, str(path))

    def same_cluster(self, other: HaPlan) -> list[str]:
        """What differs between this plan and ``other`` in what init was told (members, DCS):
        empty when a second run was given the same flags."""
        diffs = []
        if [m.spec for m in self.members] != [m.spec for m in other.members]:
            diffs.append(f"control planes {', '.join(m.spec for m in self.members)} "
                         f"(now {', '.join(m.spec for m in other.members)})")
        if self.etcd != other.etcd:
            diffs.append(f"etcd {self.etcd or 'none (raft)'} (now {other.etcd or 'none (raft)'})")
        return diffs


def member_dirs(plan: HaPlan) -> dict[str, Path]:
    """This member's directories under ``plan.dir``: ``data`` (PostgreSQL's, 0700), ``raft``,
    ``run`` (the unix socket, pgpass), ``home`` (Patroni's ``$HOME``)."""
    return {k: plan.dir / k for k in ("data", "raft", "run", "home")}


def patroni_yml_path(plan: HaPlan) -> Path:
    """``<plan.dir>/patroni.yml``: beside the data, readable by ``postgres`` only."""
    return plan.dir / "patroni.yml"


def _listen_host(host: str) -> str:
    """What a member binds: its address when it is an IP literal, else every interface (a name may
    resolve to an address that is not this machine's own, behind NAT)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "0.0.0.0"
    return host


def patroni_yml(plan: HaPlan, me: Member) -> str:
    """Member ``me``'s ``patroni.yml`` (docs/ha.md §1.3, with §0's tuned settings).

    Raft when ``plan.etcd`` is empty (``self_addr`` this member's raft port, ``partner_addrs`` the
    others', none on the first member; ``bind_addr`` the member's address, as PostgreSQL's and the
    REST API's listeners: without it pysyncobj binds every interface; ``password`` the plan's
    ``raft``, without which a peer's messages are refused), else ``etcd3: {hosts: …}``. Passwords are SCRAM over TCP
    from anywhere (the members and the control planes are on other machines), trust over the
    member's own unix socket. The watchdog is off: none in VMs and containers (docs/ha.md §0 says turn
    ``softdog`` on in production), and on a machine that also runs a control plane it would reboot
    all of it when Patroni dies, where the supervisor restarts Patroni (which then demotes the orphan
    in 2-5 s) and the control planes end stuck commits on an orphan themselves
    (:mod:`llmgw.control.store.postgres`, docs/operating.md "An orphaned primary").
    """
    dirs = member_dirs(plan)
    bind = _listen_host(me.host)
    doc: dict[str, Any] = {
        "scope": plan.scope,
        "name": me.name,
        # Reads (GET /cluster, /primary) stay open for 'llmgw ctl cluster' and health checks;
        # what changes the cluster (switchover, restart, config) needs this password.
        "restapi": {"listen": f"{bind}:{me.rest_port}", "connect_address": f"{me.host}:{me.rest_port}",
                    "authentication": {"username": "llmgw", "password": plan.passwords[REST_KEY]}},
    }
    if plan.etcd:
        doc["etcd3"] = {"hosts": [u.split("://", 1)[-1].rstrip("/") for u in plan.etcd],
                        "protocol": plan.etcd[0].split("://", 1)[0]}
    else:
        doc["raft"] = {
            "data_dir": str(dirs["raft"]),
            "self_addr": f"{me.host}:{me.raft_port}",
            # pysyncobj binds 0.0.0.0 (or ::) unless told (transport.py _createServer), and
            # without a password it takes any peer's messages, a leader key write included.
            "bind_addr": f"{bind}:{me.raft_port}",
            "password": plan.passwords[RAFT_KEY],
            # The first member starts a raft of one, which leads alone; each other member asks
            # the ones listed for the members and adds itself (pysyncobj's dynamic membership,
            # wheel:patroni/dcs/raft.py DynMemberSyncObj). Listing all three on the first would
            # leave it waiting for a quorum that cannot form until the standbys exist.
            "partner_addrs": [] if me == plan.members[0] else
            [f"{m.host}:{m.raft_port}" for m in plan.members if m.name != me.name],
        }
    doc["bootstrap"] = {
        "dcs": {**DYNAMIC, "postgresql": {"use_pg_rewind": True, "parameters": dict(PG_PARAMETERS)}},
        "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}, "data-checksums"],
    }
    doc["postgresql"] = {
        "listen": f"{bind}:{me.pg_port}",
        "connect_address": f"{me.host}:{me.pg_port}",
        "data_dir": str(dirs["data"]),
        "bin_dir": str(plan.bin_dir),
        "pgpass": str(dirs["run"] / "pgpass"),
        "authentication": {
            "superuser": {"username": "postgres", "password": plan.passwords["superuser"]},
            "replication": {"username": "replicator", "password": plan.passwords["replication"]},
            "rewind": {"username": "rewinder", "password": plan.passwords["rewind"]},
        },
        "parameters": {"unix_socket_directories": str(dirs["run"])},
        # A standby copies the primary with pg_basebackup, whose default spread checkpoint on an
        # idle primary waits most of checkpoint_timeout (minutes): ask for an immediate one.
        "basebackup": [{"checkpoint": "fast"}],
        "pg_hba": [
            "local all all trust",
            "host replication replicator 0.0.0.0/0 scram-sha-256",
            "host replication replicator ::/0 scram-sha-256",
            "host all all 0.0.0.0/0 scram-sha-256",
            "host all all ::/0 scram-sha-256",
        ],
    }
    doc["watchdog"] = {"mode": "off"}
    head = f"# Patroni member {me.name} of '{plan.scope}', written by 'llmgw server init'. Holds passwords: 0600.\n"
    return head + yaml.safe_dump(doc, sort_keys=False)


Runner = Callable[[list[str]], subprocess.CompletedProcess[str]]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)


def venv_ok(venv: Path) -> bool:
    """True when ``venv/bin/patroni`` is there and executable."""
    return os.access(venv / "bin" / "patroni", os.X_OK)


def ensure_venv(venv: Path, *, python: Path = SYSTEM_PYTHON, offline: bool = False, run: Runner = _run) -> bool:
    """Patroni's venv at ``venv``: kept when ``bin/patroni`` is there (returns False), else made
    from ``python`` with pip installing :data:`PATRONI_REQUIREMENT` (returns True; about 30 s with
    PyPI reachable). Made world-readable so ``postgres`` can run it.

    Raises:
        ServiceError: ``python`` is missing, the venv would be under /root (``postgres`` cannot
            read it), offline with no venv, or venv/pip failed (their output in the message;
            a half-made venv is removed).
    """
    if venv_ok(venv):
        return False
    if str(venv.resolve()).startswith("/root"):
        raise ServiceError(f"Patroni's venv {venv} is under /root, which the postgres user cannot read; "
                           "choose another --patroni-venv")
    if offline:
        raise ServiceError(f"no Patroni at {venv}/bin/patroni and --offline: make it elsewhere with "
                           f"'{python} -m venv {venv} && {venv}/bin/pip install \"{PATRONI_REQUIREMENT}\"', "
                           "carry it in, or give --patroni-venv")
    if not os.access(python, os.X_OK):
        raise ServiceError(f"{python} is missing; Patroni's venv needs a system Python the postgres user can run "
                           "(apt-get install python3-venv)")
    made_here = not venv.exists()
    for argv in ([str(python), "-m", "venv", str(venv)],
                 [str(venv / "bin" / "pip"), "install", "-q", PATRONI_REQUIREMENT]):
        r = run(argv)
        if r.returncode != 0:
            if made_here:
                shutil.rmtree(venv, ignore_errors=True)
            out = (r.stderr or r.stdout or "").strip().splitlines()[-15:]
            raise ServiceError(f"{' '.join(argv)} failed ({r.returncode}):\n" + "\n".join(out))
    venv.chmod(venv.stat().st_mode | 0o755)  # postgres runs it, whatever root's umask was
    return True


@dataclass
class PatroniRest:
    """A Patroni member's REST API (``http://HOST:8008``), with a short timeout per call (seconds)."""

    url: str
    timeout_s: float = 2.0

    def _get(self, path: str) -> httpx.Response | None:
        try:
            return httpx.get(self.url + path, timeout=self.timeout_s, verify=verify_context())
        except httpx.HTTPError:
            return None

    def is_primary(self) -> bool:
        """``GET /primary`` answers 200: this member is the leader and PostgreSQL runs read-write."""
        r = self._get("/primary")
        return r is not None and r.status_code == 200

    def is_replica(self) -> bool:
        """``GET /replica`` answers 200: a running replica (streaming or about to)."""
        r = self._get("/replica")
        return r is not None and r.status_code == 200

    def is_streaming(self) -> bool:
        """``GET /patroni`` says this member is a replica whose ``replication_state`` is ``streaming``."""
        r = self._get("/patroni")
        if r is None or r.status_code != 200:
            return False
        try:
            doc = r.json()
        except ValueError:
            return False
        return bool(doc.get("role") == "replica" and doc.get("replication_state") == "streaming")

    def state(self) -> str:
        """``GET /patroni``'s ``role``/``state`` as ``role state`` (``replica streaming``), or why not."""
        r = self._get("/patroni")
        if r is None:
            return f"no answer from {self.url}"
        try:
            doc = r.json()
        except ValueError:
            return f"{self.url} answered {r.status_code}"
        parts = [str(doc.get("role", "?")), str(doc.get("state", "?"))]
        if doc.get("replication_state"):
            parts.append(str(doc["replication_state"]))
        return " ".join(parts)

    def cluster(self) -> dict[str, Any]:
        """``GET /cluster``: ``{"members": [{"name", "role", "state", "host", "port", "lag", …}], …}``.

        Raises:
            ServiceError: no answer, or not JSON.
        """
        r = self._get("/cluster")
        if r is None or r.status_code != 200:
            raise ServiceError(f"Patroni's REST API at {self.url} did not answer /cluster")
        doc = r.json()
        if not isinstance(doc, dict):
            raise ServiceError(f"{self.url}/cluster answered {doc!r}")
        return doc


def create_database(plan: HaPlan, primary: Member, *, timeout_s: float = 10.0) -> list[str]:
    """Create the ``llmgw`` role (with ``plan.passwords['llmgw']``) and database on ``primary``,
    connecting as Patroni's superuser over TCP; what exists is kept (its password reset to the
    plan's). Returns ``done``/``kept`` lines for what it did.

    Raises:
        ServiceError: psycopg is not installed, or PostgreSQL refused (its message).
    """
    try:
        import psycopg  # noqa: PLC0415
        from psycopg import sql  # noqa: PLC0415
    except ImportError as e:
        raise ServiceError(
            "psycopg is missing although llmgw depends on it: reinstall llmgw (pip install --force-reinstall llmgw)"
        ) from e
    lines = []
    try:
        with psycopg.connect(
            host=primary.host, port=primary.pg_port, user="postgres", password=plan.passwords["superuser"],
            dbname="postgres", connect_timeout=int(timeout_s), autocommit=True,
        ) as conn:
            pw = plan.passwords[DB_USER]
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (DB_USER,)).fetchone()
            verb = "ALTER" if exists else "CREATE"
            conn.execute(sql.SQL(verb + " ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(DB_USER), sql.Literal(pw)))
            lines.append(f"{'kept' if exists else 'done'} database role {DB_USER}")
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,)).fetchone():
                lines.append(f"kept database {DB_NAME}")
            else:
                conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(DB_NAME),
                                                                           sql.Identifier(DB_USER)))
                lines.append(f"done database {DB_NAME} (owner {DB_USER})")
    except psycopg.Error as e:
        raise ServiceError(
            f"creating the llmgw database on {primary.host}:{primary.pg_port}: {e}".strip()
        ) from e
    return lines
