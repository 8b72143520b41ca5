"""The tree names no path of one machine: the suite runs on a clean clone anywhere.

A test that fell back to a developer's build directory (``/work/rpcbuild/...``) passed on that
machine and failed on every other one. Binaries and models come from ``scripts/assets`` (or the
environment variables it prints), never from a literal path; this test fails on any tracked file that
names a developer's working tree, a home directory or root's cache. ``.ci/run`` also runs the suite
with a ``HOME`` of its own, so a path derived from the developer's home fails there too.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Paths that belong to one machine: a session's working tree, a user's home, root's caches.
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|home/\w+|root/\.cache|root/\.local)/")


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if out.returncode != 0:  # not a git checkout (an sdist): every file under the tree
        return [p for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts and ".git" not in p.parts]
    return [ROOT / name for name in out.stdout.decode().split("\0") if name]


def test_no_tracked_file_names_a_path_of_one_machine() -> None:
    this = Path(__file__).resolve()
    hits: list[str] = []
    for path in _tracked_files():
        if path.resolve() == this or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (vendored assets)
        for n, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "paths of one machine (take them from scripts/assets or the environment):\n" + "\n".join(hits)


def test_the_pattern_catches_the_paths_it_is_for() -> None:
    for bad in ('BUILD = Path("/work/rpcbuild/build/bin")', "/home/alice/llama.cpp/build", "/root/.cache/llmgw/x"):
        assert MACHINE_PATH.search(bad), bad
    for fine in ("/var/cache/llmgw/patroni", "--lora /root/.ssh/id_rsa", "/etc/llmgw/server.yaml", "a/work/b"):
        assert not MACHINE_PATH.search(fine), fine
