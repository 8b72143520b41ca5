"""A throwaway PostgreSQL 15 cluster for the test session: ``initdb`` + ``pg_ctl`` on loopback.

:func:`start_cluster` makes a cluster in a temporary directory, listening on a free loopback port
(its unix socket in that directory too, never /var/run), with trust authentication for local
connections (it is reachable only from this machine, for the length of the session) and no
durability (``fsync=off``, ``synchronous_commit=off``, ``full_page_writes=off``: a crash loses the
throwaway data, which is fine, and each test's ``CREATE DATABASE`` takes ~20 ms instead of
hundreds). PostgreSQL refuses to run as root, so as root every command runs as the ``postgres``
user (``runuser -u postgres --``) in a directory that user owns.

Each test gets a fresh, empty schema as its database (:meth:`Cluster.new_schema`: under a
millisecond, where ``CREATE DATABASE`` takes 0.1-0.3 s here), so tests never see each other's rows
and the cluster is made once; a test that needs a whole database takes :meth:`Cluster.new_database`.
Under pytest-xdist each worker runs its own server on a copy of one template made per run
(:func:`start_cluster` with ``shared``): one ``initdb`` per run, not one per worker.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import psycopg

from tests.helpers.net import free_port

#: The database holding one schema per test (:meth:`Cluster.new_schema`).
SHARED_DB = "llmgw_tests"

#: The schema :meth:`Cluster.migrated_dump` migrates and dumps (and :meth:`Cluster.refill_schema` renames).
MIGRATED = "llmgw_migrated"

#: Where Debian's postgresql-15 package puts the binaries (not on PATH), tried after PATH.
DEBIAN_BIN_DIRS = ("/usr/lib/postgresql/15/bin",)

#: The binaries found by :func:`start_cluster`: tool name -> path.
_BIN: dict[str, str] = {}

#: Seconds ``pg_ctl`` waits for the server to start or stop.
PG_CTL_WAIT_S = 30

#: Server settings for the throwaway cluster (speed over durability; see the module docstring).
SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",  # tests open a store (a pool of up to 22) each; a few at once
    "shared_buffers": "32MB",
}


class ClusterUnavailable(RuntimeError):
    """PostgreSQL cannot be started here; the message says why (missing binaries, initdb's output)."""


@dataclass
class Cluster:
    """A running throwaway cluster; :meth:`stop` removes it and its directory."""

    root: Path
    port: int
    as_postgres: bool  # commands run as the postgres user (we are root)
    _names: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def data(self) -> Path:
        """The data directory."""
        return self.root / "data"

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL of ``database`` over TCP on loopback, as user ``postgres``."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """Create an empty database (``t1``, ``t2``, …) and return its SQLAlchemy URL (0.1-0.3 s:
        for tests that need a database of their own, e.g. to name it in a multi-host URL)."""
        name = f"t{next(self._names)}"
        self._admin("postgres", f"CREATE DATABASE {name} TEMPLATE template0")  # name is ours: t<int>
        return self.url(name)

    def new_schema(self) -> str:
        """Create an empty schema (``s1``, ``s2``, …) in the shared database :data:`SHARED_DB` and
        return a SQLAlchemy URL whose ``search_path`` is that schema alone: the store sees an empty
        database of its own, for under a millisecond instead of a ``CREATE DATABASE``."""
        name = f"s{next(self._names)}"
        self._admin(SHARED_DB, f"CREATE SCHEMA {name}")  # name is ours: s<int>
        return f"{self.url(SHARED_DB)}?options=-c%20search_path%3D{name}"

    def migrated_dump(self, migrate: Callable[[str], None]) -> str:
        """SQL that makes a schema :data:`MIGRATED` holding what ``migrate`` (given a fresh schema's
        URL: ``open_store``) made there, tables and rows: ``pg_dump`` of that schema, its psql
        meta-commands left out. For :meth:`refill_schema`."""
        self._admin(SHARED_DB, f"CREATE SCHEMA {MIGRATED}")
        migrate(f"{self.url(SHARED_DB)}?options=-c%20search_path%3D{MIGRATED}")
        dump = _run(["pg_dump", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-n", MIGRATED,
                     "--inserts", "--no-owner", "--no-privileges", SHARED_DB], self.as_postgres, self.root)
        self._admin(SHARED_DB, f"DROP SCHEMA {MIGRATED} CASCADE")
        return "\n".join(line for line in dump.splitlines() if not line.startswith("\\"))

    def refill_schema(self, url: str, dump: str) -> None:
        """Replace the schema of ``url`` (from :meth:`new_schema`) with one made by ``dump`` (from
        :meth:`migrated_dump`), in one transaction: the dump made under its own name, then renamed (no
        name in it is rewritten; its tables' defaults and keys refer to their sequences and tables by
        OID). 15-25 ms of CPU where migrating an empty schema took 55-75 ms, the server's included
        (a cpuacct cgroup, 30 stores each way, 2026-12-06)."""
        name = url.rsplit("search_path%3D", 1)[1]
        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname=SHARED_DB,
                             connect_timeout=5) as conn:
            conn.execute(f"DROP SCHEMA {name}")  # type: ignore[arg-type]  # name is ours: s<int>
            conn.execute(dump)  # type: ignore[arg-type]  # pg_dump's, of our own schema
            conn.execute(f"ALTER SCHEMA {MIGRATED} RENAME TO {name}")  # type: ignore[arg-type]

    def _admin(self, dbname: str, sql: str) -> None:
        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname=dbname,
                             autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql)  # type: ignore[arg-type]  # our own statements, never from input

    def pg_ctl(self, *args: str) -> None:
        """Run ``pg_ctl -D DATA -w -t 30 ARGS`` (as postgres when we are root); raises
        :class:`ClusterUnavailable` with its output on failure."""
        _run(["pg_ctl", "-D", str(self.data), "-w", "-t", str(PG_CTL_WAIT_S), *args], self.as_postgres, self.root)

    def restart(self) -> None:
        """Stop the server (fast: open sessions are ended) and start it again on the same port."""
        # -l: without a log file the new server would keep our stdout pipe open (and run() waiting)
        self.pg_ctl("-l", str(self.root / "server.log"), "-m", "fast", "restart")

    def stop(self) -> None:
        """Stop the server immediately and remove the cluster's directory."""
        with contextlib.suppress(ClusterUnavailable):
            self.pg_ctl("-m", "immediate", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


def start_cluster(shared: Path | None = None) -> Cluster:
    """Make and start a cluster (about 1-2 s on two cores).

    With ``shared`` (a directory every xdist worker of the run sees: the run's pytest base temp),
    the cluster's data directory is a copy of a template that the run's first caller made there
    (:func:`_template`, under a lock): one ``initdb`` and ``CREATE DATABASE`` per run, not per worker.
    Each worker still runs a server of its own (a test may restart it: :meth:`Cluster.restart`).

    Raises:
        ClusterUnavailable: ``initdb``/``pg_ctl``/``pg_dump`` are not on PATH, there is no ``postgres`` user to
            run them as root, or the server did not start (its log's last lines are included).
    """
    as_postgres = _find_tools()
    if shared is None:
        cluster = Cluster(_new_root("llmgw-pg-", as_postgres), free_port(), as_postgres)
        _make(cluster)
        return cluster
    template = _template(shared, as_postgres)  # before this worker's directory: a failure leaves none
    cluster = Cluster(_new_root("llmgw-pg-", as_postgres), free_port(), as_postgres)
    try:
        # as the postgres user (who owns both) when we are root; -a keeps the 0700 modes PostgreSQL checks
        _run(["cp", "-a", str(template), str(cluster.data)], cluster.as_postgres, cluster.root)
        _start(cluster)
    except (ClusterUnavailable, psycopg.Error) as e:
        _fail(cluster, e)
    return cluster


def _find_tools() -> bool:
    """Find ``initdb`` and ``pg_ctl`` (into :data:`_BIN`); whether commands run as the postgres user."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *DEBIAN_BIN_DIRS])
    tools = {tool: shutil.which(tool, path=path) for tool in ("initdb", "pg_ctl", "pg_dump")}
    missing = [tool for tool, found in tools.items() if found is None]
    if missing:
        raise ClusterUnavailable(
            f"{' and '.join(missing)} not on PATH nor in {', '.join(DEBIAN_BIN_DIRS)}: "
            "install PostgreSQL 15 (apt-get install postgresql-15)"
        )
    global _BIN  # noqa: PLW0603 - found once per session, used by every pg_ctl call
    _BIN = {tool: str(found) for tool, found in tools.items()}
    # pg_dump of the server's own version: the one beside initdb (Debian's /usr/bin/pg_dump is a
    # wrapper that runs the newest client installed, whose dump another server may not read)
    beside = Path(_BIN["initdb"]).parent / "pg_dump"
    if beside.is_file():
        _BIN["pg_dump"] = str(beside)
    return os.geteuid() == 0


def _new_root(prefix: str, as_postgres: bool) -> Path:
    """A new temporary directory for a cluster, owned by the postgres user when we are root."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    if as_postgres:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError as e:
            shutil.rmtree(root, ignore_errors=True)
            raise ClusterUnavailable("running as root and there is no 'postgres' user to run initdb as") from e
        os.chown(root, user.pw_uid, user.pw_gid)
    root.chmod(0o700)
    return root


def _make(cluster: Cluster) -> None:
    """``initdb`` the cluster's data directory, start its server and create :data:`SHARED_DB`; on
    failure the cluster is removed and :class:`ClusterUnavailable` raised (with the server's log)."""
    try:
        _run(["initdb", "-D", str(cluster.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
              "--no-locale", "--no-sync", "--no-instructions"], cluster.as_postgres, cluster.root)
        _start(cluster)
        cluster._admin("postgres", f"CREATE DATABASE {SHARED_DB}")
    except (ClusterUnavailable, psycopg.Error) as e:
        _fail(cluster, e)


def _start(cluster: Cluster) -> None:
    """Start the cluster's server on its port, its unix socket in its directory, with :data:`SETTINGS`."""
    opts = " ".join([f"-p {cluster.port}", f"-k {cluster.root}", *(f"-c {k}={v}" for k, v in SETTINGS.items())])
    cluster.pg_ctl("-l", str(cluster.root / "server.log"), "-o", opts, "start")


def _fail(cluster: Cluster, e: Exception) -> NoReturn:
    """Remove ``cluster`` and raise :class:`ClusterUnavailable`: ``e`` and the server log's last lines."""
    log = cluster.root / "server.log"
    tail = log.read_text(errors="replace").splitlines()[-10:] if log.exists() else []
    cluster.stop()
    raise ClusterUnavailable("\n".join([str(e), *tail])) from None


#: In a run's ``shared`` directory (:func:`start_cluster`): the lock taken to make the template, and
#: the file naming the template's data directory (made by :func:`_template`, removed by
#: :func:`remove_template`).
TEMPLATE_LOCK = "pg-template.lock"
TEMPLATE_PATH = "pg-template.path"


def _template(shared: Path, as_postgres: bool) -> Path:
    """The data directory of the run's template cluster: made by the first worker to ask (``initdb``,
    :data:`SHARED_DB` created, the server stopped cleanly), then named in ``shared``/:data:`TEMPLATE_PATH`
    for the others, which wait on ``shared``/:data:`TEMPLATE_LOCK` meanwhile. Outside ``shared``: the
    postgres user cannot enter root's pytest temp directory (0700). A worker that fails to make it
    raises; the next one tries again (each reports the error, as each made its own cluster before).

    Per worker, ``cp -a`` of the template took 0.14 s of CPU where ``initdb`` took 0.5 s and
    ``CREATE DATABASE`` ~0.1 s (getrusage of the children; 2-core machine, 2026-12-06).
    """
    with (shared / TEMPLATE_LOCK).open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        named = shared / TEMPLATE_PATH
        if named.exists():
            return Path(named.read_text())
        cluster = Cluster(_new_root("llmgw-pg-template-", as_postgres), free_port(), as_postgres)
        _make(cluster)
        try:
            cluster.pg_ctl("-m", "fast", "stop")  # a clean shutdown: the copies start without recovery
        except ClusterUnavailable as e:
            _fail(cluster, e)
        (shared / (TEMPLATE_PATH + ".new")).write_text(str(cluster.data))
        (shared / (TEMPLATE_PATH + ".new")).replace(named)
        return cluster.data


def remove_template(shared: Path) -> None:
    """Remove the template :func:`start_cluster` made in ``shared``, if any (the run's end, once no
    worker copies it any more)."""
    named = shared / TEMPLATE_PATH
    if named.exists():
        shutil.rmtree(Path(named.read_text()).parent, ignore_errors=True)
        named.unlink()


def _run(argv: list[str], as_postgres: bool, cwd: Path) -> str:
    """Run ``argv`` in ``cwd`` (a directory the postgres user can enter: initdb and pg_ctl check theirs);
    its standard output."""
    argv = [_BIN.get(argv[0], argv[0]), *argv[1:]]
    cmd = ["runuser", "-u", "postgres", "--", *argv] if as_postgres else argv
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=PG_CTL_WAIT_S + 30, cwd=cwd)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr).strip().splitlines()[-10:]
        raise ClusterUnavailable(f"{' '.join(argv[:1])} failed (exit {proc.returncode}): " + " | ".join(out))
    return proc.stdout
