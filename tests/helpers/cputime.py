"""What each test costs in CPU, for finding what dominates the suite (``scripts/test``'s time on a
2-core machine is bound by CPU: wall-clock ``--durations`` name the slow tests, not the costly ones).

With ``LLMGW_TEST_CPU=<file>`` set, every test appends a line ``nodeid<TAB>cpu_s<TAB>wall_s<TAB>start``
to ``<file>`` (each xdist worker too; ``start`` in Unix time), setup and teardown included (a module
fixture counts with the file's first test). ``cpu_s`` is, where the test process may make cgroups
(v1 ``cpuacct``, as root), the usage of a cgroup of the test's own: every process the test started,
detached or not (a service a test's ``llmgw server init`` started, a module fixture's engine), until
the session ends. Elsewhere it is the user and system CPU seconds of the test process and of the
children it waited for (``getrusage``): a detached process is not counted.
``sort -t$'\\t' -k2 -rn <file> | head`` lists the costly ones.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import resource
import time
from collections.abc import Generator
from pathlib import Path

import pytest

ENV = "LLMGW_TEST_CPU"
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_serial = itertools.count()


def _cpu_s() -> float:
    """User + system CPU seconds of this process and its reaped children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _own_cgroup() -> Path | None:
    """Move this process into a new cpuacct cgroup (its children will start there); its path, or
    None where cgroups cannot be made here."""
    try:
        group = CPUACCT / "llmgw-tests" / f"{os.getpid()}-{next(_serial)}"
        group.mkdir(parents=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return group


_groups: list[tuple[str, Path, float, float]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    """Time ``item``'s setup, call and teardown in CPU and wall seconds; append them to :data:`ENV`'s
    file (with cgroups: at the session's end, when the processes a module fixture started in the
    file's first test have been counted there too)."""
    path = os.environ.get(ENV)
    if not path:
        yield
        return
    group = _own_cgroup()
    cpu0, wall0, began = _cpu_s(), time.monotonic(), time.time()
    yield
    wall = time.monotonic() - wall0
    if group is not None:
        _groups.append((item.nodeid, group, wall, began))
        return
    with open(path, "a", encoding="utf-8") as out:
        out.write(f"{item.nodeid}\t{_cpu_s() - cpu0:.2f}\t{wall:.2f}\t{began:.1f}\n")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the cgroups' usage, one line per test (see :func:`pytest_runtest_protocol`), and remove
    the groups."""
    path = os.environ.get(ENV)
    if not path or not _groups:
        return
    with open(path, "a", encoding="utf-8") as out:
        for nodeid, group, wall, began in _groups:
            cpu = int((group / "cpuacct.usage").read_text()) / 1e9
            out.write(f"{nodeid}\t{cpu:.2f}\t{wall:.2f}\t{began:.1f}\n")
    # Back to the root group, then the tests' groups removed; one a leftover process still holds
    # (a test that leaked a child) stays, and names that test's process in its cgroup.procs.
    with contextlib.suppress(OSError):
        (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
    for _, group, _, _ in _groups:
        with contextlib.suppress(OSError):
            group.rmdir()
