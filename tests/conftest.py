"""Shared fixtures: the real test assets (llama-server and the gemma-3-270m GGUF), and ``store``.

``scripts/assets`` builds them and prints ``LLAMA_SERVER=`` / ``MODEL=``; tests read those from the
environment, else from the default cache (``~/.cache/llmgw``). When they are missing, end-to-end
tests skip on a developer's machine but FAIL when ``LLMGW_REQUIRE_ASSETS=1`` (as ``.ci/run`` sets):
an end-to-end test never skips silently in CI.

``store`` is a fresh, migrated :class:`~llmgw.control.store.Store` per test, once per backend in
:data:`STORE_BACKENDS`; every test that needs a store takes it (a test that needs the database at
a path of its own, to reopen it or to look at the file, opens it there on purpose).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw.control.store import Store, default_url, open_store

CACHE = Path(os.environ.get("LLMGW_ASSETS", Path.home() / ".cache" / "llmgw"))
DEFAULT_SERVER = CACHE / "llama-server-0.3.36" / "bin" / "llama-server"
DEFAULT_MODEL = CACHE / "models" / "gemma-3-270m-q4_k_m.gguf"


@dataclass(frozen=True)
class Assets:
    """Paths of the real llama-server binary and the gemma-3-270m model (253 MB)."""

    llama_server: Path
    model: Path


@pytest.fixture(scope="session")
def assets() -> Assets:
    """The test assets, or a skip (a failure under ``LLMGW_REQUIRE_ASSETS=1``) naming what is missing."""
    server = Path(os.environ.get("LLAMA_SERVER") or DEFAULT_SERVER)
    model = Path(os.environ.get("MODEL") or DEFAULT_MODEL)
    missing = [str(p) for p in (server, model) if not p.exists()]
    if missing:
        msg = f"test assets missing: {', '.join(missing)}; run scripts/assets"
        if os.environ.get("LLMGW_REQUIRE_ASSETS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return Assets(server, model)


#: The store backends every store test runs on: name -> the URL of a fresh, empty database for a
#: test, given its ``tmp_path``. A PostgreSQL backend is one more line here.
STORE_BACKENDS: dict[str, Callable[[Path], str]] = {
    "sqlite": lambda tmp: default_url("", tmp / "state" / "llmgw.db"),
}


@pytest.fixture(params=sorted(STORE_BACKENDS))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A fresh store on the backend ``request.param``, closed after the test."""
    s = open_store(STORE_BACKENDS[request.param](tmp_path))
    yield s
    s.close()
