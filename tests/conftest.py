"""Shared fixtures: the real test assets (llama-server and the gemma-3-270m GGUF), and ``store``.

``scripts/assets`` builds them and prints ``LLAMA_SERVER=`` / ``MODEL=``; tests read those from the
environment, else from the default cache (``~/.cache/llmgw``). When they are missing, end-to-end
tests skip on a developer's machine but FAIL when ``LLMGW_REQUIRE_ASSETS=1`` (as ``.ci/run`` sets):
an end-to-end test never skips silently in CI.

``store`` is a fresh, migrated :class:`~llmgw.control.store.Store` per test, once per backend in
:data:`STORE_BACKENDS` (SQLite, and PostgreSQL on a throwaway cluster started once per session:
:mod:`tests.helpers.postgres`); every test that needs a store takes it (a test that needs the
database at a path of its own, to reopen it or to look at the file, opens it there on purpose).
When PostgreSQL cannot start, the ``postgresql`` tests skip with the reason on a developer's
machine and FAIL under ``LLMGW_REQUIRE_ASSETS=1``, as the end-to-end tests do.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest
from _pytest.config import Config

from llmgw.control.store import Store, default_url, open_store
from llmgw.tlsconf import CA
from tests.helpers import lanes
from tests.helpers.postgres import Cluster, ClusterUnavailable, remove_template, start_cluster

#: Each test's CPU seconds, with LLMGW_TEST_CPU=<file> (:mod:`tests.helpers.cputime`).
pytest_plugins = ("tests.helpers.cputime",)

TRUST_PREFIX = "llmgw-tests-trust-"


def _one_ca_trust_store() -> None:
    """Point ``SSL_CERT_FILE`` at a bundle of one throwaway CA that signs nothing, for this run and
    every process it starts (an xdist worker keeps its parent's).

    httpx loads the bundle ``SSL_CERT_FILE`` names (this machine's environment names the system's,
    ~140 CAs), else certifi's, into each client it makes: 30-45 ms of CPU each here, and the tests
    make thousands (``httpx.get`` in polls, an admin client per ``llmgw ctl`` request):
    tests/unit/test_catalog_trust.py took 44.3 s of CPU, 16.7 s of it in 410 such loads, and 24.8 s
    with this bundle. The tests run offline and trust their own CAs explicitly, so no test relies
    on a public CA; a certificate that no CA of the test signed is refused all the same. Readable by
    all: init's services may run as another user.
    """
    if TRUST_PREFIX in os.environ.get("SSL_CERT_FILE", ""):
        return
    directory = Path(tempfile.mkdtemp(prefix=TRUST_PREFIX))
    directory.chmod(0o755)
    bundle = directory / "one-ca.pem"
    bundle.write_bytes(CA.create("llmgw tests: trusted for nothing").cert_pem)
    bundle.chmod(0o644)
    os.environ["SSL_CERT_FILE"] = str(bundle)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)


_one_ca_trust_store()


def _build_each_cli_once() -> None:
    """Make typer's ``CliRunner`` build an app's click command once per process, not at every
    ``invoke``: building llmgw's whole command tree took 26 ms of CPU, and the suite's ~400 invokes
    spent ~10 CPU-s in it (py-spy over the parallel part's workers, 2026-12-05). A click command
    keeps no state between ``main`` calls (each makes its own context), so one serves every invoke.
    RuntimeError: typer no longer builds it through ``typer.testing._get_command`` (see its
    ``CliRunner.invoke``): then adapt this, do not drop it silently."""
    import typer.testing  # noqa: PLC0415 - patched here, once, before any test module imports it

    build = getattr(typer.testing, "_get_command", None)
    if build is None:
        raise RuntimeError("typer.testing._get_command is gone: tests/conftest.py's CLI cache needs adapting")
    typer.testing._get_command = functools.cache(build)  # type: ignore[attr-defined]  # by the app's identity


_build_each_cli_once()

CACHE = Path(os.environ.get("LLMGW_ASSETS", Path.home() / ".cache" / "llmgw"))
DEFAULT_SERVER = CACHE / "llama-cpp-0.3.36-rpc" / "bin" / "llama-server"
DEFAULT_MODEL = CACHE / "models" / "gemma-3-270m-q4_k_m.gguf"


@dataclass(frozen=True)
class Assets:
    """Paths of the real llama-server and rpc-server binaries (llama.cpp with its RPC backend) and the
    gemma-3-270m model (253 MB)."""

    llama_server: Path
    model: Path
    rpc_server: Path


@pytest.fixture(scope="session")
def assets() -> Assets:
    """The test assets, or a skip (a failure under ``LLMGW_REQUIRE_ASSETS=1``) naming what is missing."""
    server = Path(os.environ.get("LLAMA_SERVER") or DEFAULT_SERVER)
    model = Path(os.environ.get("MODEL") or DEFAULT_MODEL)
    rpc = Path(os.environ.get("RPC_SERVER") or server.parent / "rpc-server")
    missing = [str(p) for p in (server, model, rpc) if not p.exists()]
    if missing:
        skip_or_fail(f"test assets missing: {', '.join(missing)}; run scripts/assets")
    return Assets(server, model, rpc)


def skip_or_fail(msg: str) -> NoReturn:
    """Skip with ``msg``, or fail with it under ``LLMGW_REQUIRE_ASSETS=1`` (CI: nothing skips silently)."""
    if os.environ.get("LLMGW_REQUIRE_ASSETS") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def pg_cluster_or_reason(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                         ) -> Iterator[Cluster | str]:
    """The session's throwaway PostgreSQL cluster, or why it could not start (asked once per session,
    not once per test); stopped and removed at the end of the session. An xdist worker's is a copy
    of a template made once per run in the run's base temp (the workers' base temps are in it), which
    :func:`pytest_sessionfinish` removes when the run ends (:func:`tests.helpers.postgres.start_cluster`)."""
    shared = tmp_path_factory.getbasetemp().parent if hasattr(request.config, "workerinput") else None
    try:
        cluster = start_cluster(shared)
    except ClusterUnavailable as e:
        yield f"PostgreSQL could not start: {e}"
        return
    yield cluster
    cluster.stop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """At the end of an xdist run (in the controller, after every worker has ended), remove the
    PostgreSQL template the workers copied, if one was made (:func:`pg_cluster_or_reason`)."""
    if session.config.pluginmanager.hasplugin("dsession"):  # xdist's controller: there were workers
        remove_template(session.config._tmp_path_factory.getbasetemp())  # type: ignore[attr-defined]


@pytest.fixture
def pg_cluster(pg_cluster_or_reason: Cluster | str) -> Cluster:
    """The running cluster, or a skip (a failure under ``LLMGW_REQUIRE_ASSETS=1``) with the reason."""
    if isinstance(pg_cluster_or_reason, str):
        skip_or_fail(pg_cluster_or_reason)
    return pg_cluster_or_reason


def _sqlite_db(tmp: Path) -> Path:
    """Where a test's SQLite store lives under its ``tmp_path``."""
    return tmp / "state" / "llmgw.db"


#: The store backends every store test runs on: name -> the URL of a fresh, empty database for a
#: test, given the test's request (for the fixtures a backend needs) and its ``tmp_path``.
STORE_BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], str]] = {
    "sqlite": lambda _req, tmp: default_url("", _sqlite_db(tmp)),
    "postgresql": lambda req, _tmp: req.getfixturevalue("pg_cluster").new_schema(),
}


@pytest.fixture(params=sorted(STORE_BACKENDS))
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a fresh, empty database on the backend ``request.param``, for a test that opens
    (and reopens) the store itself."""
    return STORE_BACKENDS[request.param](request, tmp_path)


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database file that ``open_store`` made and migrated, once per session (a worker's):
    :func:`store` copies it rather than migrating each test's own (16 ms of CPU an open, ~1 ms a
    copy). The migrations themselves are tested from empty databases (tests/unit/test_store*.py open
    ``store_url`` themselves)."""
    path = tmp_path_factory.mktemp("migrated") / "llmgw.db"
    open_store(default_url("", path)).close()
    return path


@pytest.fixture(scope="session")
def migrated_postgresql(pg_cluster_or_reason: Cluster | str) -> str:
    """SQL that makes a schema as ``open_store`` made and migrated it, once per session (a worker's):
    :func:`store` makes each test's schema with it (:meth:`Cluster.refill_schema`) rather than
    migrating an empty one, as :func:`migrated_sqlite` does for SQLite."""
    if isinstance(pg_cluster_or_reason, str):
        skip_or_fail(pg_cluster_or_reason)
    return pg_cluster_or_reason.migrated_dump(lambda url: open_store(url).close())


@pytest.fixture
def store(request: pytest.FixtureRequest, store_url: str, tmp_path: Path) -> Iterator[Store]:
    """A fresh store on each backend of :data:`STORE_BACKENDS`, closed after the test (on SQLite a
    copy of :func:`migrated_sqlite`, at the path ``store_url`` names; on PostgreSQL a schema made by
    :func:`migrated_postgresql`'s dump)."""
    if store_url.startswith("sqlite"):
        path = _sqlite_db(tmp_path)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # as the store makes it (store/sqlite.py)
        shutil.copyfile(request.getfixturevalue("migrated_sqlite"), path)
        path.chmod(0o600)
    else:
        request.getfixturevalue("pg_cluster").refill_schema(store_url, request.getfixturevalue("migrated_postgresql"))
    s = open_store(store_url)
    yield s
    s.close()


#: The slowest test files, longest first (``.ci/run``'s ``--durations`` on 2 cores; a file's total of
#: setup and calls). ``scripts/test`` runs files in parallel workers (pytest-xdist, ``--dist loadfile``:
#: a file's module fixtures are set up once, on one worker, and the files are dealt to the workers
#: in this order: ``--no-loadscope-reorder``, else xdist deals the files with the most tests first);
#: these go first so that no worker starts a long file near the end while the others idle
#: (longest-processing-time-first scheduling). Files not named keep their order after them. A stale
#: entry is harmless. The ``timed`` and ``ha`` files are dealt to lanes by tests/helpers/lanes.py.
SLOW_FILES_FIRST = (
    # Not slow, but its full collections walk the worker's whole heap, which grows as the worker runs
    # tests: first, 3.5 CPU-s (all tests collected, this file run); dealt late in a run, 9.1 (2026-12-06).
    "tests/unit/test_gcpauses.py",
    "tests/unit/test_placer_no_cycles.py",  # its two gc.collect() too
    "tests/ha/test_failover.py",
    "tests/e2e/test_routing_e2e.py",
    "tests/ha/test_orphan.py",
    "tests/ha/test_frozen_lock.py",
    "tests/e2e/test_init_ha.py",
    "tests/e2e/test_scale_bench.py",
    "tests/e2e/test_init.py",
    "tests/e2e/test_init_rejoin.py",
    "tests/e2e/test_init_llama_server.py",
    "tests/e2e/test_autoscale_e2e.py",
    "tests/e2e/test_lost_agent.py",
    "tests/e2e/test_group_rpc.py",
    "tests/e2e/test_engine_metrics.py",
    "tests/e2e/test_init_users.py",
    "tests/browser/test_dashboard.py",
    # Files that mostly wait (a service's 3 s settle, login throttles, a control plane's back-off):
    # 5-26 s each at 0-0.4 of a core. Started last they left a ~25 s tail with one or two workers busy
    # (LLMGW_TEST_CPU, 2026-12-05); started among the engines they wait while the cores are full.
    "tests/unit/test_service_cli.py",
    "tests/unit/test_ui_login_trust.py",
    "tests/unit/test_groupnet.py",
    "tests/unit/test_agent_controlplanes.py",
    "tests/unit/test_catalog_trust.py",
    "tests/unit/test_offloop.py",
    "tests/unit/test_gateway_routing.py",
    "tests/unit/test_keys_cluster.py",
    "tests/unit/test_cluster_api.py",
    "tests/unit/test_node_trust.py",
    "tests/unit/test_ui.py",
    "tests/unit/test_listener_shutdown.py",
    "tests/unit/test_ctl_model_add_source.py",
    "tests/unit/test_judge_admission.py",
)

def pytest_collection_modifyitems(config: Config, items: list[pytest.Item]) -> None:
    """Mark the tests of :data:`tests.helpers.lanes.TIMED` ``timed`` (and refuse an ``ha`` test outside
    tests/ha/), and put the files of :data:`SLOW_FILES_FIRST` first, in that order (a stable sort:
    tests inside a file, and the other files, keep their order)."""
    for item in items:
        if item.nodeid.startswith(lanes.TIMED):
            item.add_marker(pytest.mark.timed)
        if item.get_closest_marker("ha") and not item.nodeid.startswith(lanes.HA_DIR):
            # scripts/test's lanes collect only lanes.files(): an ``ha`` test elsewhere would run in neither part
            raise pytest.UsageError(f"{item.nodeid} is marked ha: the ha tests live in {lanes.HA_DIR}")
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_xdist_make_scheduler(config: Config, log: object) -> object:
    """The lanes of ``scripts/test``'s second part (:mod:`tests.helpers.lanes`), else xdist's own."""
    return lanes.make_scheduler(config, log)
