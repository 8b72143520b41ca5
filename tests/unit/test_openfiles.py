"""The control plane raises its soft limit on open files to the hard one (one socket per node)."""

from __future__ import annotations

import resource
import subprocess
import sys

from llmgw.control.openfiles import raise_open_files_limit

PROBE = (
    "import resource; from llmgw.control.openfiles import raise_open_files_limit as r; "
    "got = r(); print(got, resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
)


def _lowered() -> None:  # pragma: no cover - runs in the child before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def test_a_low_soft_limit_is_raised_to_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = min(hard if hard != resource.RLIM_INFINITY else 1_048_576, 1_048_576)
    out = subprocess.run([sys.executable, "-c", PROBE], preexec_fn=_lowered,
                         capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert out == [str(want), str(want)]


def test_already_at_the_hard_limit_is_left_alone() -> None:
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert raise_open_files_limit() >= min(before[0], 1_048_576)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[1] == before[1]
