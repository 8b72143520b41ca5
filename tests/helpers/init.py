"""``server init`` driven in-process: through the CLI with every port free, or scripted against a
fake admin API and a fake clock."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import httpx
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.paths import Paths
from llmgw.serverinit import files
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.steps import ServerInit
from llmgw.serverinit.wait import Clock
from llmgw.service.manager import SupervisorManager
from tests.helpers.processes import listen_args


class FakeClock:
    """Seconds that pass only when something sleeps."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def init_cli(root: Path, *args: str) -> tuple[int, str]:
    """Run ``server init --offline`` with every listener on a free port (unless given), so another
    install on the default ports cannot change what a test sees; returns (exit code, output)."""
    listen = listen_args(skip=args)
    r = CliRunner().invoke(app, ["--root", str(root), "server", "init", "--offline", *listen, *args])
    return r.exit_code, r.output


def written(root: Path) -> list[str]:
    """Every file under ``root``, relative and sorted (the init lock too: a failed init removes the
    one it made, with the directories it made for it)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def scripted_init(
    tmp_path: Path, answers: dict[str, Any], options: InitOptions
) -> tuple[ServerInit, io.StringIO, FakeClock]:
    """A :class:`ServerInit` over a written server.yaml and admin token whose admin API answers
    ``answers[path?query]`` (200, JSON) and whose clock is a :class:`FakeClock`."""
    paths = Paths(tmp_path)
    files.write_atomic(paths.server_config, files.server_yaml(
        admin_listen="127.0.0.1:9", agent_listen=":7443", gateway_listen=":8080", pki=paths.pki,
        keys_file=paths.client_keys))
    files.write_atomic(paths.admin_token, "t\n", 0o600)

    def handler(request: httpx.Request) -> httpx.Response:
        key = request.url.path + ("?" + request.url.query.decode() if request.url.query else "")
        return httpx.Response(200, json=answers[key])

    out = io.StringIO()
    c = FakeClock()
    init = ServerInit(paths, options, SupervisorManager(paths), out=out, clock=Clock(c.now, c.sleep),
                      admin_transport=httpx.MockTransport(handler))
    return init, out, c
