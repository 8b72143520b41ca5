"""An HA cluster on loopback from real processes, for ``tests/ha`` and ``bench/failover.py``.

- :class:`PatroniCluster`: three Patroni 4.1.5 members (raft DCS; ``ttl 20, loop_wait 2,
  retry_timeout 4, synchronous_mode true``: docs/ha.md §1.3/§1.4) each with its own PostgreSQL 15, all
  running as user ``postgres`` through ``setpriv`` (it execs, so the pid we hold is Patroni's own and
  ``kill -9`` hits exactly it; PostgreSQL refuses root), data under a temporary directory owned by
  ``postgres`` (never under /root, which that user cannot enter). The Patroni venv is the one
  ``scripts/assets`` builds (``PATRONI=``, default :data:`DEFAULT_PATRONI`).
- :class:`ControlPlane`: ``python -m llmgw server run`` as a child process with its own
  ``LLMGW_ROOT`` and server.yaml; the three share one CA, server certificate and admin token, and
  ``store.url`` is the libpq multi-host URL over the three members with
  ``target_session_attrs=read-write`` (:meth:`PatroniCluster.store_url`).
- :class:`Agent`: ``python -m llmgw agent`` with the real llama-server, listing every control plane
  (``server`` then ``servers``).
- :class:`FileServer`: ``python -m http.server`` serving the gemma GGUF as the mirror would.
- :class:`HACluster`: all of the above, started and stopped together.

Faults are pids, never names (docs/ha.md §1.5): Patroni's pid from its ``setpriv`` child, the postmaster's
from line 1 of ``postmaster.pid``. Timings measured on 2 cores: the 3 members bootstrap in ~15 s
(docs/ha.md §1.4: 14.7 s), a killed member rejoins in ~5 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import yaml

from llmgw.agent.node.records import stop_all_engines
from llmgw.paths import Paths
from tests.helpers.control import TOKEN, Install, make_install
from tests.helpers.net import free_port
from tests.helpers.waits import wait_for

#: Where ``scripts/assets`` builds the Patroni venv (override: env ``PATRONI``, the binary's path).
DEFAULT_PATRONI = Path(os.environ.get("LLMGW_PATRONI_VENV", "/var/cache/llmgw/patroni-4.1.5")) / "bin" / "patroni"
#: Debian's PostgreSQL 15 binaries (not on PATH).
PG_BIN = Path("/usr/lib/postgresql/15/bin")
#: The superuser's password (the cluster lives for one test module, on loopback only).
SUPERUSER_PASSWORD = "ha-test-superuser"
#: The database the control planes share.
DATABASE = "llmgw"
#: The sha256 of gemma-3-270m-q4_k_m.gguf (``scripts/assets`` pins it).
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
#: The admin API's bearer header.
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: Patroni's dynamic settings (docs/ha.md §1.3-1.4: ttl 20 is Patroni's floor; sync mode loses no
#: acknowledged write when a primary is orphaned).
DCS_SETTINGS: dict[str, Any] = {
    "ttl": 20,
    "loop_wait": 2,
    "retry_timeout": 4,
    "synchronous_mode": True,
    "maximum_lag_on_failover": 1048576,
    "postgresql": {"use_pg_rewind": True, "parameters": {"wal_log_hints": "on", "wal_retrieve_retry_interval": "1s"}},
}


class HAUnavailable(RuntimeError):
    """The HA cluster cannot run here; the message says what is missing and how to get it."""


def patroni_binary() -> Path:
    """The Patroni binary (env ``PATRONI``, else :data:`DEFAULT_PATRONI`).

    Raises:
        HAUnavailable: not root, or it is missing, or ``setpriv``, the PostgreSQL 15 binaries or the
            ``postgres`` user are (each named, with what to install).
    """
    if os.geteuid() != 0:
        raise HAUnavailable("the HA cluster runs PostgreSQL as user postgres through setpriv: run the tests as root")
    patroni = Path(os.environ.get("PATRONI") or DEFAULT_PATRONI)
    if not os.access(patroni, os.X_OK):
        raise HAUnavailable(f"no Patroni at {patroni}: run scripts/assets (it builds the Patroni venv)")
    if shutil.which("setpriv") is None:
        raise HAUnavailable("setpriv is not on PATH: apt-get install util-linux")
    if not (PG_BIN / "postgres").exists():
        raise HAUnavailable(f"no PostgreSQL 15 in {PG_BIN}: apt-get install postgresql-15")
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise HAUnavailable("no 'postgres' user to run PostgreSQL as (apt-get install postgresql-15)") from None
    return patroni


def _kill9(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError, ValueError, IndexError):  # a zombie counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    return True


@dataclass
class Member:
    """One Patroni member with its PostgreSQL: ``name`` (``pg1``…), loopback ports and its directory."""

    name: str
    dir: Path
    rest_port: int
    pg_port: int
    raft_port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def rest_url(self) -> str:
        """Patroni's REST API."""
        return f"http://127.0.0.1:{self.rest_port}"

    @property
    def config(self) -> Path:
        """This member's patroni.yml."""
        return self.dir / "patroni.yml"

    @property
    def data(self) -> Path:
        """PostgreSQL's data directory."""
        return self.dir / "data"

    def write_config(self, partners: list[int]) -> None:
        """Write patroni.yml (docs/ha.md §1.3, with :data:`DCS_SETTINGS` at bootstrap); ``partners`` are the
        other members' raft ports."""
        doc = {
            "scope": "llmgw-ha-test",
            "name": self.name,
            "log": {"level": "INFO", "dir": str(self.dir / "log")},
            "restapi": {"listen": f"127.0.0.1:{self.rest_port}", "connect_address": f"127.0.0.1:{self.rest_port}"},
            "raft": {
                "data_dir": str(self.dir / "raft"),
                "self_addr": f"127.0.0.1:{self.raft_port}",
                "partner_addrs": [f"127.0.0.1:{p}" for p in partners],
            },
            "bootstrap": {
                "dcs": DCS_SETTINGS,
                "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}, "data-checksums"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.pg_port}",
                "connect_address": f"127.0.0.1:{self.pg_port}",
                "data_dir": str(self.data),
                "bin_dir": str(PG_BIN),
                "pgpass": str(self.dir / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": SUPERUSER_PASSWORD},
                    "replication": {"username": "replicator", "password": "ha-test-replication"},
                    "rewind": {"username": "rewinder", "password": "ha-test-rewind"},
                },
                # small: three instances plus three control planes and llama-server on 2 cores
                "parameters": {"unix_socket_directories": str(self.dir), "shared_buffers": "16MB",
                               "max_connections": 100},
                # as llmgw.serverinit.patroni writes it: the leader's checkpoint for each standby's
                # pg_basebackup at once, not spread (1.1 s of the cluster's start here)
                "basebackup": [{"checkpoint": "fast"}],
                "pg_hba": [
                    "local all all trust",
                    "host replication replicator 127.0.0.1/32 scram-sha-256",
                    "host all all 127.0.0.1/32 scram-sha-256",
                ],
            },
            "watchdog": {"mode": "off"},  # no /dev/watchdog here; production turns it on (docs/ha.md §0)
        }
        for sub in ("log", "raft"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.config.write_text(yaml.safe_dump(doc))

    def start(self, patroni: Path) -> None:
        """Start Patroni as user postgres (``setpriv`` execs: :attr:`proc`'s pid is Patroni's)."""
        out = (self.dir / "patroni.out").open("ab")
        self.proc = subprocess.Popen(
            ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", str(patroni), str(self.config)],
            env={"PATH": "/usr/bin:/bin", "HOME": str(self.dir), "LC_ALL": "C.UTF-8"},
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
        )
        out.close()

    def patroni_alive(self) -> bool:
        """Whether Patroni runs."""
        return self.proc is not None and self.proc.poll() is None

    def postmaster_pid(self) -> int | None:
        """The running postmaster's pid (``postmaster.pid`` line 1), or None."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((self.data / "postmaster.pid").read_text().splitlines()[0])
            if _alive(pid):
                return pid
        return None

    def kill9_patroni(self) -> None:
        """``kill -9`` Patroni alone (its PostgreSQL keeps running: the orphan of docs/ha.md §1.4 s2/s5)."""
        if self.proc is not None:
            _kill9(self.proc.pid)
            self.proc.wait(10)

    def kill9_postmaster(self) -> int:
        """``kill -9`` the postmaster (Patroni restarts it in place: docs/ha.md §1.4 r3); returns its pid.

        Raises:
            AssertionError: no postmaster runs.
        """
        pid = self.postmaster_pid()
        assert pid is not None, f"{self.name}: no postmaster runs"
        _kill9(pid)
        return pid

    def stop(self) -> None:
        """Kill Patroni and its PostgreSQL (SIGKILL; the data is thrown away)."""
        pm = self.postmaster_pid()
        self.kill9_patroni()
        if pm is not None:
            _kill9(pm)
            wait_for(f"{self.name}'s postmaster to exit", lambda: not _alive(pm), 10)

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of Patroni's output, for failure messages."""
        out = self.dir / "patroni.out"
        return "\n".join(out.read_text(errors="replace").splitlines()[-lines:]) if out.exists() else ""


@dataclass
class PatroniCluster:
    """Three :class:`Member` s under ``root`` (owned by user postgres)."""

    root: Path
    patroni: Path
    members: list[Member] = field(default_factory=list)

    @classmethod
    def create(cls, patroni: Path, size: int = 3) -> PatroniCluster:
        """Make the directories (a new temp dir chowned to postgres, mode 700) and patroni.yml files."""
        root = Path(tempfile.mkdtemp(prefix="llmgw-ha-"))
        pg = pwd.getpwnam("postgres")
        members = [
            Member(f"pg{i + 1}", root / f"pg{i + 1}", free_port(), free_port(), free_port()) for i in range(size)
        ]
        for m in members:
            m.write_config([o.raft_port for o in members if o is not m])
        for path in [root, *root.rglob("*")]:
            os.chown(path, pg.pw_uid, pg.pw_gid)
        root.chmod(0o700)
        return cls(root, patroni, members)

    def start(self, within_s: float = 120, *, healthy: bool = True) -> None:
        """Start every member, wait for a primary that takes writes and create :data:`DATABASE` on
        it; then (unless not ``healthy``: the caller calls :meth:`wait_healthy_or_dump` itself) wait for
        the others streaming, one of them the sync standby. The standbys' bootstrap (~6 s of the
        cluster's ~11 s) needs nothing of the database, so the control planes can start meanwhile.

        Raises:
            AssertionError: not up within ``within_s`` (with each member's last log lines).
        """
        deadline = time.monotonic() + within_s
        for m in self.members:
            m.start(self.patroni)

        def created() -> bool:
            try:
                with self.connect() as conn:
                    conn.execute(f"CREATE DATABASE {DATABASE}")  # type: ignore[arg-type]  # our constant
            except psycopg.errors.DuplicateDatabase:
                return True  # an earlier try's CREATE went through, its answer lost
            except psycopg.Error:
                return False  # no primary that takes writes yet
            return True

        try:
            wait_for("a primary that takes writes", lambda: self.primary() is not None and created(), within_s, 0.2)
        except AssertionError as e:
            raise AssertionError(self._with_logs(e)) from None
        if healthy:
            self.wait_healthy_or_dump(max(1.0, deadline - time.monotonic()))

    def wait_healthy_or_dump(self, within_s: float) -> None:
        """:meth:`wait_healthy`, failing with each member's last log lines."""
        try:
            self.wait_healthy(within_s)
        except AssertionError as e:
            raise AssertionError(self._with_logs(e)) from None

    def _with_logs(self, e: AssertionError) -> str:
        return f"{e}\n" + "\n".join(f"--- {m.name}\n{m.log_tail()}" for m in self.members)

    def member(self, name: str) -> Member:
        """The member called ``name``."""
        return next(m for m in self.members if m.name == name)

    def state(self) -> list[dict[str, Any]]:
        """Patroni's ``GET /cluster`` ``members`` from the first member that answers (each has
        ``name``, ``role`` — leader, sync_standby, replica —, ``state``, ``host``, ``port``, ``lag``,
        ``timeline``); [] when none answers."""
        for m in self.members:
            if not m.patroni_alive():
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(f"{m.rest_url}/cluster", timeout=2)
                members: list[dict[str, Any]] = r.json().get("members", [])
                return members
        return []

    def primary(self) -> Member | None:
        """The member Patroni reports as a running leader (primary), or None."""
        for s in self.state():
            if s.get("role") == "leader" and s.get("state") == "running":
                return self.member(s["name"])
        return None

    def wait_primary(self, within_s: float, not_: Member | None = None) -> Member:
        """Wait for a running primary (other than ``not_``) and return it."""
        return wait_for(
            "a primary" + (f" other than {not_.name}" if not_ else ""),
            lambda: (p := self.primary()) and p is not not_ and p,
            within_s,
        )

    def wait_healthy(self, within_s: float) -> None:
        """Wait for one running primary and every other member streaming (one of them the sync standby)."""

        def healthy() -> bool:
            st = self.state()
            roles = sorted(s.get("role", "") for s in st)
            running = all(s.get("state") in ("running", "streaming") for s in st)
            return len(st) == len(self.members) and running and roles.count("leader") == 1 and (
                "sync_standby" in roles
            ) and all(s.get("state") == "streaming" for s in st if s.get("role") != "leader")

        wait_for(f"{len(self.members)} Patroni members: one primary, the others streaming", healthy, within_s, 0.2)

    def store_url(self, database: str = DATABASE) -> str:
        """The control planes' SQLAlchemy URL: every member, libpq tries them in order and keeps the
        one that takes writes (``target_session_attrs=read-write``)."""
        hosts = "&".join(f"host=127.0.0.1:{m.pg_port}" for m in self.members)
        return (f"postgresql+psycopg://postgres:{SUPERUSER_PASSWORD}@/{database}?{hosts}"
                "&target_session_attrs=read-write")

    def connect(self, database: str = "postgres", member: Member | None = None) -> psycopg.Connection[Any]:
        """A psycopg autocommit connection to the primary (any host that takes writes), or to ``member``."""
        ports = [member.pg_port] if member else [m.pg_port for m in self.members]
        return psycopg.connect(
            host=",".join("127.0.0.1" for _ in ports), port=",".join(map(str, ports)), dbname=database,
            user="postgres", password=SUPERUSER_PASSWORD, autocommit=True, connect_timeout=2,
            target_session_attrs="read-write" if member is None else "any",
        )

    def patronictl(self, *args: str) -> str:
        """Run ``patronictl -c <pg1's config> ARGS`` as postgres; returns its output.

        Raises:
            AssertionError: it failed (with its output).
        """
        ctl = self.patroni.with_name("patronictl")
        cfg = next(m for m in self.members if m.patroni_alive()).config
        p = subprocess.run(
            ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", str(ctl), "-c", str(cfg), *args],
            capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(self.root),
                                                            "LC_ALL": "C.UTF-8"}, check=False,
        )
        assert p.returncode == 0, f"patronictl {' '.join(args)} failed ({p.returncode}): {p.stdout}{p.stderr}"
        return p.stdout

    def switchover(self) -> tuple[Member, Member]:
        """``patronictl switchover --force`` to the sync standby; returns (old primary, candidate)."""
        old = self.primary()
        assert old is not None, "no primary to switch over from"
        cand = next(s["name"] for s in self.state() if s.get("role") == "sync_standby")
        self.patronictl("switchover", "llmgw-ha-test", "--primary", old.name, "--candidate", cand, "--force")
        return old, self.member(cand)

    def stop(self) -> None:
        """Kill every member and remove the directory."""
        for m in self.members:
            m.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class ControlPlane:
    """``llmgw server run`` over ``install`` (a child process; :meth:`kill9` and :meth:`start` again)."""

    name: str
    install: Install
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def admin(self) -> str:
        """The admin API."""
        return self.install.admin

    @property
    def agent_url(self) -> str:
        """The agent API."""
        return self.install.agent_url

    @property
    def gateway(self) -> str:
        """The gateway (keyless from loopback)."""
        return f"http://127.0.0.1:{self.install.ports['gateway']}"

    def start(self) -> None:
        """Start ``python -m llmgw server run`` (output appended to :attr:`log`)."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw", "server", "run"],
                env={**os.environ, "LLMGW_ROOT": str(self.install.root)},
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def alive(self) -> bool:
        """Whether the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def wait_health(self, within_s: float = 60) -> dict[str, Any]:
        """Wait for ``GET /api/v1/health`` to answer 200 and return its JSON; fails with the log's tail
        when the process exits first."""

        def up() -> dict[str, Any] | None:
            assert self.alive(), f"{self.name} exited:\n{self.log_tail()}"
            r = httpx.get(f"{self.admin}/api/v1/health", timeout=2)
            return r.json() if r.status_code == 200 else None  # type: ignore[no-any-return]

        return wait_for(f"{self.name}'s /api/v1/health", up, within_s)

    def kill9(self) -> None:
        """``kill -9`` the control plane."""
        if self.proc is not None:
            _kill9(self.proc.pid)
            self.proc.wait(10)

    def stop(self, *, signalled: bool = False) -> None:
        """SIGTERM (unless ``signalled``: it was sent already), then SIGKILL after 15 s."""
        if self.proc is not None and self.proc.poll() is None:
            if not signalled:
                self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill9()

    def cluster(self, timeout: float = 2) -> dict[str, Any] | None:
        """``GET /api/v1/cluster`` (PREAMBLE's interface: ``me``, ``term``, ``leader``, …), or None when
        it does not answer 200."""
        try:
            r = httpx.get(f"{self.admin}/api/v1/cluster", headers=AUTH, timeout=timeout)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None  # type: ignore[no-any-return]

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the control plane's output."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""


@dataclass
class Agent:
    """``python -m llmgw agent`` under its own ``LLMGW_ROOT``."""

    root: Path
    config: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the agent (output appended to :attr:`log`)."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw", "agent", "--config", str(self.config)],
                env={**os.environ, "LLMGW_ROOT": str(self.root)},
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 20 s; then its engines, which an agent leaves running for the next
        one (they outlived the test session before)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        stop_all_engines(Paths(self.root).agent_state, grace_s=2)


@dataclass
class FileServer:
    """``python -m http.server`` over one directory on a free loopback port (a real process)."""

    dir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The base URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start it and wait until it answers."""
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(self.dir), str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for("the file server", lambda: httpx.get(self.url + "/", timeout=1).status_code == 200, 15, 0.1)

    def stop(self) -> None:
        """Stop it."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)


@dataclass
class HACluster:
    """The whole topology (module docstring): ``patroni``, ``control_planes`` (cp1-3), ``agent``."""

    root: Path
    patroni: PatroniCluster
    control_planes: list[ControlPlane]
    agent: Agent | None
    files: FileServer | None

    def live(self) -> list[ControlPlane]:
        """The control planes whose process runs."""
        return [cp for cp in self.control_planes if cp.alive()]

    def cp(self, name: str) -> ControlPlane:
        """The control plane called ``name``."""
        return next(cp for cp in self.control_planes if cp.name == name)

    def views(self) -> dict[str, dict[str, Any] | None]:
        """Each live control plane's ``GET /api/v1/cluster`` (None where it did not answer)."""
        return {cp.name: cp.cluster() for cp in self.live()}

    def stop(self) -> None:
        """Stop the agent (and so its engines), the control planes, the file server and Patroni."""
        if self.agent is not None:
            self.agent.stop()
        # SIGTERM to every control plane at once, then wait for each: one after the other, each
        # drain (and, after an orphan, each store thread still in a commit) was waited out in turn.
        running = {cp.name for cp in self.control_planes if cp.proc is not None and cp.proc.poll() is None}
        for cp in self.control_planes:
            if cp.name in running and cp.proc is not None:
                cp.proc.terminate()
        for cp in self.control_planes:
            cp.stop(signalled=cp.name in running)
        if self.files is not None:
            self.files.stop()
        self.patroni.stop()


def gemma_model(files_url: str, replicas: int = 1) -> dict[str, Any]:
    """The admin API's body for gemma-3-270m on one CPU core, ``replicas`` of it (``scaling.min``)."""
    return {
        "name": "gemma",
        "version": "q4",
        "source": f"{files_url}/gemma.gguf",
        "sha256": GEMMA_SHA256,
        "profiles": [{"name": "cpu", "cpu_cores": 1, "args": ["--ctx-size", "512", "-np", "1"]}],
        "scaling": {"min": replicas, "max": replicas},
    }


def _control_plane_installs(root: Path, store_url: str, patroni: PatroniCluster, count: int) -> list[Install]:
    first = make_install(root / "cp1")
    installs = [first]
    for i in range(2, count + 1):
        paths = Paths(root / f"cp{i}")
        paths.etc.mkdir(parents=True)
        shutil.copytree(first.paths.pki, paths.pki)
        paths.admin_token.write_text(TOKEN + "\n")
        ports = {"admin": free_port(), "agent": free_port(), "gateway": free_port()}
        installs.append(Install(paths.root, paths, paths.server_config, ports, first.ca))
    patroni_urls = [m.rest_url for m in patroni.members]
    for i, inst in enumerate(installs, 1):
        inst.write(
            store={"url": store_url},
            cluster={"name": f"cp{i}", "agent_url": inst.agent_url, "patroni": patroni_urls},
            gateway={"listen": f"127.0.0.1:{inst.ports['gateway']}", "allow_loopback_without_key": True},
            node_lost_after_s=3600,  # a node whose control plane is down for a fault is not lost
        )
    return installs


def start_ha_cluster(
    root: Path, *, llama_server: Path | None = None, model: Path | None = None, control_planes: int = 3
) -> HACluster:
    """Start Patroni (3 members), ``control_planes`` control planes on the shared database, and, when
    ``llama_server`` and ``model`` are given, a file server with the model and an agent (node
    ``node-1``) listing every control plane. Stops what it started if any step fails.

    Raises:
        HAUnavailable: see :func:`patroni_binary`.
        AssertionError: a part did not come up in time (with its log's tail).
    """
    patroni = PatroniCluster.create(patroni_binary())
    cluster = HACluster(root, patroni, [], None, None)
    try:
        # The control planes start once the primary has the database, while the standbys still
        # bootstrap; the cluster is returned only with both streaming (one the sync standby), as before.
        patroni.start(healthy=False)
        for i, inst in enumerate(_control_plane_installs(root, patroni.store_url(), patroni, control_planes), 1):
            cp = ControlPlane(f"cp{i}", inst, root / f"cp{i}.log")
            cluster.control_planes.append(cp)
            cp.start()
        patroni.wait_healthy_or_dump(120)
        for cp in cluster.control_planes:
            cp.wait_health()
        if llama_server is not None and model is not None:
            files = root / "files"
            files.mkdir()
            (files / "gemma.gguf").symlink_to(model)
            cluster.files = FileServer(files)
            cluster.files.start()
            cluster.agent = _make_agent(root, cluster, llama_server)
            cluster.agent.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _make_agent(root: Path, cluster: HACluster, llama_server: Path) -> Agent:
    node_root = root / "node-1"
    first = cluster.control_planes[0].install
    cert, key = first.ca.issue_client("node-1").write(node_root / "etc", "agent")
    urls = [cp.agent_url for cp in cluster.control_planes]
    config = node_root / "etc" / "agent.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": urls[0],
                "servers": urls[1:],
                "node_id": "node-1",
                "tls": {"ca": str(first.paths.pki / "ca.pem"), "cert": str(cert), "key": str(key)},
                "engines": {"llamacpp": {"binary": str(llama_server)}},
                "heartbeat_interval_s": 0.5,
            }
        )
    )
    return Agent(node_root, config, root / "agent.log")


def post_model(cp: ControlPlane, body: dict[str, Any], timeout: float = 5) -> httpx.Response:
    """``POST /api/v1/models`` on ``cp``'s admin API."""
    return httpx.post(f"{cp.admin}/api/v1/models", json=body, headers=AUTH, timeout=timeout)


def wait_ready_replica(cluster: HACluster, model: str, within_s: float = 180) -> None:
    """Wait until a chat to ``model`` through the first live control plane's gateway answers 200."""

    def answers() -> bool:
        return chat(cluster.live()[0], model).status_code == 200

    wait_for(f"a ready replica of {model} answering through the gateway", answers, within_s, 1)


def chat(cp: ControlPlane, model: str, timeout: float = 30) -> httpx.Response:
    """One short chat completion through ``cp``'s gateway: one token, the engine's least work (the
    HA tests send one every 0.25 s for minutes: with 4 tokens the engine took ~0.3 of a core)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 1, "temperature": 0}
    return httpx.post(f"{cp.gateway}/v1/chat/completions", json=body, timeout=timeout)


def catalog_names(cluster: PatroniCluster) -> set[str]:
    """Every model name in the catalog, read on the current primary (psycopg, not through llmgw)."""
    with cluster.connect(DATABASE) as conn:
        rows = conn.execute("SELECT name FROM models").fetchall()
    return {r[0] for r in rows}


def dump(obj: Any) -> str:
    """Compact JSON for assertion messages."""
    return json.dumps(obj, default=str)[:2000]


@contextlib.contextmanager
def ha_cluster(root: Path, **kw: Any) -> Iterator[HACluster]:
    """:func:`start_ha_cluster`, stopped at the end."""
    cluster = start_ha_cluster(root, **kw)
    try:
        yield cluster
    finally:
        cluster.stop()


