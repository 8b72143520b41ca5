"""``llmgw service …`` driven through the real CLI, on llmgw's own supervisor in a temp LLMGW_ROOT."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

import llmgw as llmgw_package
from llmgw.cli.main import app
from llmgw.paths import Paths
from llmgw.service.files import read_live
from llmgw.service.manager import SupervisorManager
from llmgw.service.units import SERVICES, restartable_services, startable_services

SLEEPER = "import time; print('hello from the service', flush=True); time.sleep(60)"


#: Seconds a started service here must keep running to count as up, against the product's
#: llmgw.service.check.SETTLE_S (3 s, for a Python program's config or import error): these services
#: are SLEEPER, or exit at once where that is the point; 3 s made this file ~57 s of waiting.
SETTLE_S = 0.5


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setattr("llmgw.service.check.SETTLE_S", SETTLE_S)
    yield tmp_path
    manager = SupervisorManager(Paths.from_env(tmp_path))
    for name in (*SERVICES, "patroni"):
        manager.stop(name)


def llmgw(root: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["service", *args], env={"LLMGW_ROOT": str(root)})
    return result.exit_code, result.output


def install(root: Path, name: str, code: str) -> None:
    exec_start = shlex.join([sys.executable, "-c", code])
    body = f"[Service]\nExecStart={exec_start}\nRestart=on-failure\nRestartSec=50ms\n"
    SupervisorManager(Paths.from_env(root)).install(name, body)


def logs_saying(root: Path, name: str, text: str, within_s: float = 10.0) -> str:
    """``service logs NAME -n 5`` once it shows ``text``. ``start`` returns when the supervisor has
    launched the program, which prints only after its interpreter has started: reading the log at
    once could come first."""
    deadline = time.monotonic() + within_s
    while True:
        code, out = llmgw(root, "logs", name, "-n", "5")
        assert code == 0, out
        if text in out:
            return out
        assert time.monotonic() < deadline, f"{text!r} not in {name}'s log within {within_s} s: {out}"
        time.sleep(0.05)


def test_status_of_a_fresh_root(root: Path) -> None:
    """Nothing installed: each service unknown, and the exit status 3 (not running), as systemctl's."""
    code, out = llmgw(root, "status", "--json")
    assert code == 3
    rows = json.loads(out)
    assert [r["name"] for r in rows] == list(SERVICES)
    assert {(r["state"], r["manager"]) for r in rows} == {("unknown", "supervisor")}

    code, out = llmgw(root, "status")
    assert code == 3
    assert "llmgw-mirror" in out
    assert "supervisor" in out


def test_start_with_no_names_starts_every_installed_service_in_order(root: Path) -> None:
    """What ``service stop`` with no names stopped, ``service start`` with none starts again: the
    installed ones only, the mirror before the agent (a new user's report: it wanted names)."""
    code, out = llmgw(root, "start")
    assert code != 0
    assert "no llmgw service is installed" in out
    assert "llmgw server init" in out
    install(root, "agent", SLEEPER)
    install(root, "mirror", SLEEPER)
    code, out = llmgw(root, "start")
    assert code == 0, out
    assert [line.split(" (")[0] for line in out.splitlines()] == ["started llmgw-mirror", "started llmgw-agent"]
    code, out = llmgw(root, "stop")
    assert code == 0, out
    code, out = llmgw(root, "start")
    assert code == 0, out
    assert [line.split(" (")[0] for line in out.splitlines()] == ["started llmgw-mirror", "started llmgw-agent"]


def test_restart_with_no_names_means_llmgws_own_installed_services(root: Path) -> None:
    """``service restart`` with no names (after an upgrade: README) acts on the installed llmgw
    services in start order, never on an HA database member (a new user's report: it wanted names)."""
    code, out = llmgw(root, "restart")
    assert code != 0
    assert "no llmgw service is installed" in out
    paths = Paths.from_env(root)
    for name in ("agent", "patroni", "mirror"):
        install(root, name, SLEEPER)
    assert restartable_services(paths) == ["mirror", "agent"]
    assert startable_services(paths) == ["patroni", "mirror", "agent"]


def test_status_that_cannot_read_the_supervisors_files_says_unknown_not_stopped(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run as a user who may not read root's supervisor files (mode 0700), ``service status`` said
    "stopped" for a running service (a new user's report). It says "unknown" and why. (This suite
    runs as root, who may read anything: the refusal, os.access's answer, is patched.)"""
    install(root, "agent", SLEEPER)
    code, out = llmgw(root, "start", "agent")
    assert code == 0, out
    monkeypatch.setattr("llmgw.service.manager._may_read", lambda _dir: False)
    code, out = llmgw(root, "status", "agent", "--json")
    assert code == 3, out
    [row] = json.loads(out)
    assert row["state"] == "unknown"
    assert "cannot read" in row["detail"]
    assert "as root" in row["detail"]


def test_start_status_logs_stop(root: Path) -> None:
    install(root, "agent", SLEEPER)
    code, out = llmgw(root, "start", "agent")
    assert code == 0, out
    assert out.startswith("started llmgw-agent (supervisor, pid ")

    code, out = llmgw(root, "start", "agent")
    assert (code, out.split(" (")[0]) == (0, "already running: llmgw-agent")

    code, out = llmgw(root, "status", "agent", "--json")
    assert code == 0, out  # every service shown runs
    [row] = json.loads(out)
    assert row["state"] == "running"
    pid = row["pid"]
    assert psutil.pid_exists(pid)
    code, out = llmgw(root, "status", "--json")
    assert code == 0, out  # with no names: the installed services (a node's agent alone)
    assert [r["name"] for r in json.loads(out)] == ["agent"]

    logs_saying(root, "agent", "hello from the service")

    code, out = llmgw(root, "stop")
    assert code == 0
    assert out.splitlines() == ["stopped llmgw-agent"]  # what is installed here
    code, out = llmgw(root, "status")
    assert code == 3, out  # the agent does not run
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_service_may_be_named_as_status_shows_it(root: Path) -> None:
    """``service status`` prints ``llmgw-agent``; that name (and the systemd unit's) works everywhere."""
    install(root, "agent", SLEEPER)
    code, out = llmgw(root, "start", "llmgw-agent")
    assert code == 0, out
    logs_saying(root, "llmgw-agent.service", "hello from the service")
    code, out = llmgw(root, "stop", "llmgw-agent")
    assert out.splitlines() == ["stopped llmgw-agent"]


def test_an_installed_patroni_unit_is_shown_and_stopped_last(root: Path) -> None:
    """On an HA control plane the database member is one of the services: ``status`` shows it and a
    bare ``stop`` stops it after the control plane."""
    for name in (*SERVICES, "patroni"):
        install(root, name, SLEEPER)
    code, out = llmgw(root, "start", "patroni", "server")
    assert code == 0, out
    code, out = llmgw(root, "status", "--json")
    assert [r["name"] for r in json.loads(out)] == [*SERVICES, "patroni"]
    assert json.loads(out)[-1]["state"] == "running"
    code, out = llmgw(root, "stop")
    assert out.splitlines()[0] == "stopped llmgw-server"
    assert out.splitlines()[-1] == "stopped llmgw-patroni"


def test_errors_are_one_line_and_an_exit_code(root: Path) -> None:
    code, out = llmgw(root, "start", "gateway")
    assert code == 1
    assert "Error: unknown service 'gateway'; the services are server, agent, mirror" in out

    code, out = llmgw(root, "start", "server")
    assert code == 1
    assert "'llmgw server init' writes it" in out
    assert "Traceback" not in out

    code, out = llmgw(root, "logs", "agent", "-n", "-3")  # was accepted (a new user's finding)
    assert code == 2
    assert "'--lines': Input should be greater than or equal to 1" in " ".join(out.replace("│", " ").split())


def test_stop_engines(root: Path) -> None:
    pytest.importorskip("llmgw.agent.node.records")
    code, out = llmgw(root, "stop", "agent", "--engines")
    assert code == 0, out
    assert out.splitlines() == ["not running: llmgw-agent", "stopped 0 engine(s)"]


def test_stop_engines_without_the_agent_is_refused(root: Path) -> None:
    """A new user's finding: ``service stop mirror --engines`` stopped the mirror and every engine while
    the agent served them (it marked them failed and placed new ones). The engines are the agent's:
    refused unless the agent is stopped with them (or no service is named)."""
    code, out = llmgw(root, "stop", "mirror", "--engines")
    assert code == 2, out
    assert "--engines stops the engines the agent left running: stop the agent with them" in " ".join(
        out.replace("│", " ").split())
    assert "stopped" not in out.replace("stops", "")


def test_restart_checks_every_config_before_restarting_any(root: Path) -> None:
    """A new user's finding: ``service restart`` with no names restarted the mirror, then refused the
    server for its broken config and never reached the agent: an upgrade left half on new code. Every
    config is checked first; one that does not load restarts none."""
    paths = Paths.from_env(root)
    for name in ("mirror", "server"):
        install(root, name, SLEEPER)
    paths.server_config.parent.mkdir(parents=True, exist_ok=True)
    paths.server_config.write_text("admin_listen: [\n")
    code, out = llmgw(root, "start", "mirror")
    assert code == 0, out
    before = SupervisorManager(paths).status("mirror").pid
    code, out = llmgw(root, "restart")
    assert code != 0
    assert "server.yaml" in out
    assert "restarted llmgw-mirror" not in out
    assert SupervisorManager(paths).status("mirror").pid == before


def test_restart_after_an_upgrade_whose_code_does_not_import_restarts_nothing(
    root: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A new user's finding: an upgrade whose new code had a syntax error, then ``service restart``:
    the config checked out, the running server was stopped and the new one never came up. The check
    now imports every llmgw module the unit's own interpreter finds, with the unit's environment
    (here ``PYTHONPATH`` naming a copy of llmgw with one module broken: the upgrade), and restarts
    nothing; the message names the module, its file and line."""
    broken = tmp_path_factory.mktemp("upgrade")
    shutil.copytree(Path(llmgw_package.__file__).parent, broken / "llmgw",
                    ignore=shutil.ignore_patterns("__pycache__"))
    app_py = broken / "llmgw" / "control" / "gateway" / "app.py"
    app_py.write_text(app_py.read_text() + "\ndef half_written(:\n")
    lines = len(app_py.read_text().splitlines())
    exec_start = shlex.join([sys.executable, "-c", SLEEPER])
    body = f"[Service]\nExecStart={exec_start}\nEnvironment=PYTHONPATH={broken}\nRestart=on-failure\n"
    paths = Paths.from_env(root)
    SupervisorManager(paths).install("mirror", body)  # the mirror: a service with no config to read
    code, out = llmgw(root, "start", "mirror")
    assert code == 0, out
    before = SupervisorManager(paths).status("mirror").pid
    code, out = llmgw(root, "restart")
    assert code != 0, out
    said = " ".join(out.split())
    assert "llmgw-mirror was not restarted, and the running one is left as it is" in said, out
    assert f"its code does not import: llmgw.control.gateway.app ({app_py}:{lines})" in said, out
    assert "SyntaxError" in said, out
    assert SupervisorManager(paths).status("mirror").pid == before

    app_py.write_text(app_py.read_text().replace("def half_written(:\n", ""))  # the fix
    code, out = llmgw(root, "restart")
    assert code == 0, out
    assert out.split(" (")[0] == "restarted llmgw-mirror", out


def test_restart_agent_with_a_tls_path_that_is_not_there_restarts_nothing(root: Path) -> None:
    """A new user's finding: ``cert: agnt.pem`` (a typo) in agent.yaml, then ``service restart agent``:
    the check read the YAML only, the running agent was stopped and the new one crash-looped on
    "[Errno 2] No such file or directory", naming none of the three files. The check loads the TLS
    files as the agent does; the message names the one missing and its key; nothing is restarted."""
    paths = Paths.from_env(root)
    install(root, "agent", SLEEPER)
    etc = paths.agent_config.parent
    etc.mkdir(parents=True, exist_ok=True)
    for name in ("ca.pem", "agent.pem", "agent-key.pem"):
        (etc / name).write_text("not read: the check stops at the missing one\n")
    paths.agent_config.write_text(
        "server: https://127.0.0.1:7443\nnode_id: node-1\n"
        "tls: {ca: ca.pem, cert: agnt.pem, key: agent-key.pem}\n"
    )
    code, out = llmgw(root, "start", "agent")
    assert code == 0, out
    before = SupervisorManager(paths).status("agent").pid
    code, out = llmgw(root, "restart", "agent")
    said = " ".join(out.split())
    assert code != 0, out
    assert f"agent.yaml: tls.cert {etc / 'agnt.pem'} does not exist; fix the path in agent.yaml" in said, out
    assert SupervisorManager(paths).status("agent").pid == before


def test_restart_mirror_checks_the_units_own_options_first(
    root: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The mirror has no config file, and its check imported code only: a typo in its unit's
    --api-token-file took it down, crash-looping (found checking this stop's changes). The check runs
    the unit's own 'llmgw mirror serve ... --check' as the service would; nothing is restarted."""
    here = tmp_path_factory.mktemp("mirror")
    argv = [sys.executable, "-m", "llmgw", "mirror", "serve", "--base", "http://m.test:8081", "--dir", str(here),
            "--listen", "127.0.0.1:1", "--api-listen", "127.0.0.1:2", "--api-token-file", str(here / "tokn")]
    SupervisorManager(Paths.from_env(root)).install("mirror", f"[Service]\nExecStart={shlex.join(argv)}\n")
    code, out = llmgw(root, "restart", "mirror")
    assert code != 0, out
    said = " ".join(out.split())
    assert f"--api-token-file {here / 'tokn'} does not exist; fix the path in the unit" in said, out
    assert SupervisorManager(Paths.from_env(root)).status("mirror").state == "stopped"
    (here / "tokn").write_text("a-token-of-thirty-two-characters-x\n")
    r = CliRunner().invoke(app, ["mirror", "serve", *argv[5:], "--check"], env={"LLMGW_ROOT": str(root)})
    assert r.exit_code == 0, r.output  # read as serving would, and nothing served


def test_a_service_killed_with_its_supervisor_is_failed_not_stopped(root: Path) -> None:
    """A supervisor SIGKILLed with its program (the OOM killer, a kill -9 of the group) leaves no
    'stopped' behind: ``status`` said "stopped", as after a requested stop, and exited 0 (a new
    user's finding). It says failed, why, and what to run; a requested stop after is "stopped"."""
    install(root, "agent", SLEEPER)
    code, out = llmgw(root, "start", "agent")
    assert code == 0, out
    manager = SupervisorManager(Paths.from_env(root))
    files = manager.files("agent")
    supervisor, program = read_live(files.pid), read_live(files.child_pid)
    assert supervisor is not None
    assert program is not None
    for proc in (supervisor, program):
        proc.kill()
        proc.wait(10)
    code, out = llmgw(root, "status", "agent", "--json")
    assert code == 3, out
    [row] = json.loads(out)
    assert row["state"] == "failed", row
    assert "no stop was recorded" in row["detail"], row
    assert "llmgw service start agent" in row["detail"], row

    code, out = llmgw(root, "start", "agent")
    assert code == 0, out
    code, out = llmgw(root, "stop", "agent")
    assert out.splitlines() == ["stopped llmgw-agent"]
    code, out = llmgw(root, "status", "agent", "--json")
    assert (code, json.loads(out)[0]["state"]) == (3, "stopped"), out


def test_a_service_log_that_is_a_symlink_is_refused_saying_so(
    root: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The supervisor (root) never writes through a link in its log's place; it said only
    "[Errno 40] Too many levels of symbolic links" (found checking this stop's changes)."""
    install(root, "agent", SLEEPER)
    files = SupervisorManager(Paths.from_env(root)).files("agent")
    files.dir.mkdir(parents=True, mode=0o700, exist_ok=True)
    files.log.symlink_to(tmp_path_factory.mktemp("elsewhere") / "agent.log")
    code, out = llmgw(root, "start", "agent")
    assert code != 0
    assert "is a symbolic link, which the supervisor never writes through" in " ".join(out.split()), out
