"""``llmgw``'s start-up: building the command tree imports no package, a command only its own.

Every ``llmgw`` run (a script's ``llmgw ctl``, each service the supervisor starts, the tests'
child processes) builds the whole command tree; when the command modules imported their packages
at the top, each run paid the agent's engines, aiohttp and numpy: 1.1 s of imports. These tests
read ``sys.modules`` in a fresh interpreter, so they hold on a loaded machine (no clock).
"""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from llmgw.cli import server_init
from llmgw.cli.main import app
from llmgw.serverinit import plan

HEAVY = ("aiohttp", "numpy", "gguf", "llmgw.agent", "llmgw.control", "llmgw.mirror", "llmgw.serverinit",
         "llmgw.catalog", "llmgw.httperrors")
"""What no ``llmgw ctl`` run needs: the runtime packages and aiohttp, numpy under them."""


def modules_after(*args: str) -> set[str]:
    """The modules a fresh interpreter holds after ``llmgw ARGS`` (run in-process there)."""
    code = (
        "import json, sys\n"
        "from typer.testing import CliRunner\n"
        "from llmgw.cli.main import app\n"
        f"CliRunner().invoke(app, {list(args)!r})\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(out.stdout.splitlines()[-1]))


def loaded(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in packages))


def test_the_command_tree_imports_no_package() -> None:
    assert loaded(modules_after("--help"), (*HEAVY, "httpx", "pydantic", "llmgw.adminclient")) == []


def test_ctl_loads_the_admin_client_alone() -> None:
    # Nothing listens on port 9: the command fails as unreachable, after loading what it needs.
    mods = modules_after("ctl", "models", "--server", "http://127.0.0.1:9", "--token", "t")
    assert "llmgw.adminclient" in mods
    assert loaded(mods, HEAVY) == []


def test_every_command_is_listed() -> None:
    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    for name in ("server", "agent", "mirror", "service", "ctl", "chat"):
        assert f" {name} " in out, out


def test_the_starter_default_its_help_names_is_the_plans() -> None:
    assert server_init.STARTER_HELP == plan.STARTER_SOURCE
