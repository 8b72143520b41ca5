"""init's preflight and waits.

``--llama-server``: an executable ``--llama-server`` that is not llama-server is run (``--version``) and refused
before anything is written, and the llama-server init itself wrote into agent.yaml is updated by a
later init (``updated …``, a ``.bak``), while one the operator edited is left alone. The "not a
llama-server" binaries are real shell scripts, run for real; the real one is the assets'.

Waits: a loopback ``--agent-listen`` without a loopback ``--host`` is refused, and every wait prints a
``waiting for …`` line at least every 10 s (against a scripted admin API, httpx.MockTransport,
and a fake clock: what is under test is init's output, not the control plane).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.engines import llamacpp
from llmgw.config import load_agent_config
from llmgw.errors import ConfigError, WaitTimeout
from llmgw.paths import Paths
from llmgw.serverinit import agentconf, files, preflight
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.steps import ServerInit, checks, node, serve
from llmgw.service.manager import SupervisorManager
from tests.conftest import Assets
from tests.helpers.init import FakeClock, init_cli, scripted_init, written
from tests.helpers.net import free_port
from tests.helpers.processes import listen_args, llmgw, stop_install


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def gguf(tmp_path: Path) -> Path:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 100)
    return model


def opts(tmp_path: Path, **kw: Any) -> InitOptions:
    """Options whose every listener is a free loopback port and whose starter is a local GGUF."""
    ports = {f: f"127.0.0.1:{free_port()}" for f in
             ("admin_listen", "agent_listen", "gateway_listen", "mirror_listen", "mirror_api_listen")}
    return InitOptions(offline=True, starter_source=f"file:{gguf(tmp_path)}", **{**ports, **kw})


def make(tmp_path: Path, o: InitOptions) -> tuple[ServerInit, io.StringIO]:
    out = io.StringIO()
    paths = Paths(tmp_path / "root")
    return ServerInit(paths, o, SupervisorManager(paths), out=out), out


# --- --llama-server is run before anything is written ---


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ('echo "usage: tool [options]"\n', "exited 0 and printed 'usage: tool [options]'"),
        ("echo 'llama-server: cannot open shared object file' >&2\nexit 127\n",
         "exited 127 and printed 'llama-server: cannot open shared object file'"),
        ("exit 0\n", "exited 0 and printed nothing"),
        # Says "version:", as the agent's own looser probe accepts, but not llama.cpp's line.
        ("echo 'version: 1.2.3'\n", "exited 0 and printed 'version: 1.2.3'"),
    ],
)
def test_an_executable_that_is_not_llama_server_fails_preflight(tmp_path: Path, body: str, said: str) -> None:
    fake = script(tmp_path, "llama-server", body)
    init, _ = make(tmp_path, opts(tmp_path, llama_server=fake, hosts=["127.0.0.1"]))
    with pytest.raises(ConfigError) as e:
        checks.run(init.ctx)
    assert f"--llama-server {fake} is not a working llama-server: 'llama-server --version' {said}" in str(e.value)
    assert "not llama.cpp's 'version: <build> (<commit>)'" in str(e.value)


def test_a_llama_server_that_hangs_is_refused_after_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(preflight, "VERSION_TIMEOUT_S", 1.0)
    fake = script(tmp_path, "llama-server", "exec sleep 30\n")
    with pytest.raises(ConfigError, match=r"'llama-server --version' did not answer within 1 s"):
        preflight.check_llama_server(fake)


def test_a_hanging_llama_server_leaves_no_process_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrapper script that starts a child and hangs: the timeout kills its whole process group
    (before, only the script was killed and its child was left running, reparented to init)."""
    monkeypatch.setattr(preflight, "VERSION_TIMEOUT_S", 1.0)
    pidfile = tmp_path / "child.pid"
    fake = script(tmp_path, "llama-server", f"sleep 300 &\necho $! > {pidfile}\nwait\n")
    with pytest.raises(ConfigError, match="did not answer within 1 s"):
        preflight.check_llama_server(fake)
    child = int(pidfile.read_text())
    for _ in range(50):
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail(f"the --version probe's child {child} outlived the timeout")


def test_a_fake_llama_server_leaves_nothing_written(tmp_path: Path) -> None:
    """Through the CLI: exit 2, the reason, and no file under the root (before, init wrote
    server.yaml, agent.yaml and the PKI and started services with it)."""
    fake = script(tmp_path, "llama-server", 'echo "hello"\n')
    root = tmp_path / "root"
    code, out = init_cli(root, "--host", "127.0.0.1", "--starter-source", f"file:{gguf(tmp_path)}",
                      "--llama-server", str(fake))
    assert code == 2, out
    assert "is not a working llama-server" in out
    assert written(root) == []
    # not even the init lock or the directory made for it (they were left behind before)
    assert [str(p.relative_to(root)) for p in root.rglob("*")] == []


def test_the_real_llama_server_passes_preflight(tmp_path: Path, assets: Assets) -> None:
    build = preflight.check_llama_server(assets.llama_server)
    done = subprocess.run([assets.llama_server, "--version"], capture_output=True, text=True, timeout=60, check=True)
    assert build == llamacpp.parse_version(done.stderr + done.stdout) != ""  # the agent's reading of it
    init, out = make(tmp_path, opts(tmp_path, llama_server=assets.llama_server, hosts=["127.0.0.1"]))
    checks.run(init.ctx)
    assert f"done --llama-server {assets.llama_server} is llama.cpp build {build}" in out.getvalue()


# --- the llama-server init wrote into agent.yaml may be corrected by a later init ---


def written_by_init(tmp_path: Path, binary: Path | None) -> tuple[Paths, Path]:
    """agent.yaml as init's node step writes it, with its record."""
    paths = Paths(tmp_path / "root")
    conf = paths.agent_config
    files.write_atomic(conf, files.agent_yaml(
        server="https://127.0.0.1:7443", node_id="n1", etc=paths.etc, label_key="llmgw.control-plane",
        label_value="true", llama_server=binary), 0o644)
    agentconf.record_binary(paths.state, binary)
    return paths, conf


def reconcile(tmp_path: Path, paths: Paths, new: Path) -> tuple[str, str]:
    init = ServerInit(paths, InitOptions(llama_server=new), SupervisorManager(paths), out=io.StringIO())
    changed = node.reconcile_agent_yaml(init.ctx, paths.agent_config)
    assert isinstance(init.ctx.out, io.StringIO)
    return changed, init.ctx.out.getvalue()


def test_a_llama_server_init_wrote_is_updated_with_a_backup(tmp_path: Path) -> None:
    wrong = script(tmp_path, "old-llama-server", "exit 0\n")
    right = tmp_path / "bin" / "llama-server"
    paths, conf = written_by_init(tmp_path, wrong)
    before = conf.read_text()
    changed, out = reconcile(tmp_path, paths, right)
    assert changed == "agent.yaml"
    assert f"updated {conf}: engines.llamacpp.binary {wrong} -> {right} (was written by init" in out
    assert load_agent_config(conf).engines.llamacpp.binary == right
    assert conf.with_name("agent.yaml.bak").read_text() == before
    assert conf.read_text() == before.replace(str(wrong), str(right))  # nothing else changed
    record = json.loads((paths.state / "init-written.json").read_text())
    assert record == {"agent.yaml": {"engines.llamacpp.binary": str(right)}}
    # the same flag again: kept, no second backup over the first
    changed, out = reconcile(tmp_path, paths, right)
    assert (changed, out.strip()) == ("", f"kept {conf}")


def test_an_engines_block_is_added_when_init_wrote_none(tmp_path: Path) -> None:
    right = tmp_path / "bin" / "llama-server"
    paths, conf = written_by_init(tmp_path, None)
    changed, out = reconcile(tmp_path, paths, right)
    assert changed == "agent.yaml"
    assert "engines.llamacpp.binary (not set) -> " in out
    assert load_agent_config(conf).engines.llamacpp.binary == right


def test_a_value_the_operator_edited_is_never_overwritten(tmp_path: Path) -> None:
    paths, conf = written_by_init(tmp_path, tmp_path / "a" / "llama-server")
    conf.write_text(conf.read_text().replace(str(tmp_path / "a"), "/opt/mine"))
    edited = conf.read_text()
    changed, out = reconcile(tmp_path, paths, tmp_path / "b" / "llama-server")
    assert changed == ""
    assert conf.read_text() == edited
    assert not conf.with_name("agent.yaml.bak").exists()
    assert "says engines.llamacpp.binary: /opt/mine/llama-server, not --llama-server" in out
    assert "it was edited since, so init leaves it: edit it and run 'llmgw service restart agent'" in out


def test_an_agent_yaml_init_has_no_record_of_is_left_alone(tmp_path: Path) -> None:
    paths, conf = written_by_init(tmp_path, tmp_path / "a" / "llama-server")
    (paths.state / "init-written.json").unlink()
    before = conf.read_text()
    changed, out = reconcile(tmp_path, paths, tmp_path / "b" / "llama-server")
    assert (changed, conf.read_text()) == ("", before)
    assert "init has no record of writing it" in out


# --- a loopback agent API needs a loopback --host ---


def test_a_loopback_agent_listen_without_host_is_refused(tmp_path: Path) -> None:
    o = opts(tmp_path)
    init, _ = make(tmp_path, o)
    with pytest.raises(ConfigError) as e:
        checks.run(init.ctx)
    assert str(e.value) == (
        f"--agent-listen {o.agent_listen} accepts agents on loopback only, but this machine's node would be "
        f"pointed at this machine's network address (no --host was given) on port {o.agent_listen.split(':')[1]}, "
        f"where nothing listens; pass --host 127.0.0.1 for a one-machine cluster, or listen on every address "
        f"(--agent-listen :{o.agent_listen.split(':')[1]}) so other machines' nodes can join too"
    )


@pytest.mark.parametrize(
    ("listen", "hosts", "refused"),
    [
        ("127.0.0.1:7443", [], True),
        ("127.0.0.1:7443", ["10.1.2.3"], True),
        ("[::1]:7443", [], True),
        ("localhost:7443", ["gpu-box.example"], True),
        ("127.0.0.1:7443", ["127.0.0.1"], False),
        ("127.0.0.1:7443", ["localhost"], False),
        (":7443", [], False),
        ("0.0.0.0:7443", [], False),
        ("10.1.2.3:7443", [], False),
        ("127.0.0.1:7443", ["127.0.0.2"], True),
        ("127.0.0.1:7443", ["::1"], True),
        ("[::1]:7443", ["::1"], False),
    ],
)
def test_check_agent_address(listen: str, hosts: list[str], refused: bool) -> None:
    if refused:
        with pytest.raises(ConfigError, match=r"nothing (listens|would answer it); pass --host"):
            preflight.check_agent_address(listen, hosts)
    else:
        preflight.check_agent_address(listen, hosts)


def test_on_ha_the_address_is_named_as_the_control_plane_s_not_a_host_never_given() -> None:
    """A new user's HA init (``--host 127.0.0.1 --control-plane cp1=10.99.0.1 --agent-listen
    127.0.0.1:P``) was told of "the first --host, 10.99.0.1": the member's address, not a --host."""
    with pytest.raises(ConfigError) as e:
        preflight.check_agent_address("127.0.0.1:22443", ["10.99.0.1", "127.0.0.1"], ha=True)
    assert "pointed at this control plane's --control-plane address, 10.99.0.1, on port 22443" in str(e.value)
    assert "first --host" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        preflight.check_agent_address("127.0.0.1:22443", ["127.0.0.2"], ha=True)
    advice = "give this control plane 127.0.0.1 in --control-plane, or make --agent-listen 127.0.0.2:22443"
    assert advice in str(e.value)


def test_a_loopback_host_the_loopback_listener_does_not_accept_is_refused(tmp_path: Path) -> None:
    """A new user's item 24: ``--host 127.0.0.2 --agent-listen 127.0.0.1:P`` passed preflight, and
    init then waited for an agent pointed at 127.0.0.2, where nothing listens."""
    root = tmp_path / "root"
    code, out = init_cli(root, "--host", "127.0.0.2", "--agent-listen", f"127.0.0.1:{free_port()}",
                         "--starter-source", f"file:{gguf(tmp_path)}")
    assert code == 2, out
    assert "accepts agents at 127.0.0.1 only, but this machine's node would be pointed at the first --host, " \
        "127.0.0.2" in out
    assert "pass --host 127.0.0.1 first" in out
    assert written(root) == []


def test_the_cli_refuses_it_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    code, out = init_cli(root, "--starter-source", f"file:{gguf(tmp_path)}")
    assert code == 2, out
    assert "accepts agents on loopback only" in out
    assert "pass --host 127.0.0.1" in out
    assert written(root) == []


def test_cpus_below_one_is_refused_and_nothing_written(tmp_path: Path) -> None:
    """``--cpus 0`` was accepted and silently ignored (a new user's report)."""
    root = tmp_path / "root"
    code, out = init_cli(root, "--host", "127.0.0.1", "--cpus", "0")
    assert code == 2, out
    assert "--cpus" in out
    assert "greater than or equal to 1" in out, out
    assert written(root) == []


def test_cpus_above_the_machines_cores_is_refused_and_nothing_written(tmp_path: Path) -> None:
    """``--cpus 99999`` was accepted: init wrote the install, started the services and waited ~90 s
    for a starter planned for more cores than the node has (a new user's report, 2026-12-04)."""
    root = tmp_path / "root"
    code, out = init_cli(root, "--host", "127.0.0.1", "--cpus", str((os.cpu_count() or 1) + 1))
    assert code == 2, out
    assert f"this machine has {os.cpu_count()} cores" in out, out
    assert written(root) == []


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--gateway-listen", "127.0.0.1:99999", "'127.0.0.1:99999' has port 99999, outside 1..65535"),
    ("--admin-listen", "localhost", "'localhost' is not HOST:PORT or :PORT"),
    ("--mirror-listen", ":0", "':0' has port 0, outside 1..65535"),
])
def test_a_listen_flag_that_is_not_an_address_is_refused_naming_it(
    tmp_path: Path, flag: str, value: str, says: str
) -> None:
    """``--gateway-listen 127.0.0.1:99999`` ended in a traceback from the port check (a new user's
    report, 2026-12-04): now exit 2 naming the flag, and nothing written."""
    root = tmp_path / "root"
    code, out = init_cli(root, "--host", "127.0.0.1", flag, value)
    assert code == 2, out
    assert f"Invalid value for '{flag}'" in out, out
    assert says in " ".join(out.replace("│", " ").split()), out  # Rich wraps the message in a box
    assert "Traceback" not in out
    assert written(root) == []


def test_a_starter_alias_equal_to_its_name_is_refused_by_the_cli_before_anything_is_written(tmp_path: Path) -> None:
    """The real CLI in a child process (issue 19, item 17): ``--starter-alias`` equal to the
    starter's name used to pass every check, set up the control plane, the mirror and the starter's
    copy, then end in a pydantic traceback at the catalog entry. Now: exit 2, what was wrong and
    what to pass, no traceback, nothing written."""
    root = tmp_path / "root"
    model = gguf(tmp_path)  # named "m" after its file
    try:
        for args, says in (
            (["--starter-name", "tiny", "--starter-alias", "tiny"],
             "--starter-alias tiny is the starter's own name (--starter-name)"),
            (["--starter-alias", "m"], "--starter-alias m is the starter's own name (the name derived from "
                                       "--starter-source ('m'))"),
            (["--starter-alias", "Bad Alias"], "--starter-alias: 'Bad Alias' is not a valid alias"),
        ):
            r = llmgw(root, "server", "init", "--offline", "--host", "127.0.0.1", "--no-node",
                      "--no-guard-model", "--starter-source", f"file:{model}", *listen_args(), *args,
                      timeout=120)
            out = r.stdout + r.stderr
            assert r.returncode == 2, out
            assert says in out, out
            assert "Traceback" not in out, out
            assert written(root) == [], out
    finally:
        stop_install(root)


# --- no wait is silent ---


def scripted(tmp_path: Path, answers: dict[str, Any], **kw: Any) -> tuple[ServerInit, io.StringIO, FakeClock]:
    return scripted_init(tmp_path, answers, InitOptions(poll_s=0.5, **kw))


def waiting_lines(out: str) -> list[tuple[int, str]]:
    found = re.finditer(r"\.\. waiting for .*? \((\d+)s\): last state (.*)", out)
    return [(int(m.group(1)), m.group(2)) for m in found]


def assert_never_silent(lines: list[tuple[int, str]], until: float) -> None:
    times = [0, *(t for t, _ in lines), until]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) <= 10, gaps


def test_waiting_for_a_node_that_never_registers_says_so(tmp_path: Path) -> None:
    """The item's case: the agent points where nothing listens, so the node never registers.
    Every few seconds init says what it waits for, and the last state names where the agent connects."""
    init, out, clock = scripted(tmp_path, {"/api/v1/nodes": []}, node_wait_s=60)
    files.write_atomic(init.ctx.paths.agent_config, files.agent_yaml(
        server="https://10.9.9.9:7443", node_id="n1", etc=init.ctx.paths.etc, label_key="k", label_value="v",
        llama_server=None), 0o644)
    with pytest.raises(WaitTimeout, match=r"gave up waiting for this node to be ready with an engine after 1m0s "
                                          r"\(last state: node n1 has not registered"):
        node.wait_node_ready(init.ctx, "n1")
    lines = waiting_lines(out.getvalue())
    assert lines, out.getvalue()
    assert_never_silent(lines, clock.t)
    assert lines[0][1] == (
        "node n1 has not registered (its agent connects to https://10.9.9.9:7443; "
        "'llmgw service logs agent' says why not)"
    )


def test_waiting_for_a_model_placement_has_not_explained_is_not_silent(tmp_path: Path) -> None:
    """Before, a model with no replica and no explanation yet waited its ten minutes in silence."""
    init, out, clock = scripted(tmp_path, {
        "/api/v1/replicas?model=m": [],
        "/api/v1/explain-placement?model=m": {"model": "m", "placed": False, "summary": "", "rejections": []},
    }, serve_wait_s=45)
    with pytest.raises(WaitTimeout):
        serve.wait_serving(init.ctx, "m")
    lines = waiting_lines(out.getvalue())
    assert lines, out.getvalue()
    assert_never_silent(lines, clock.t)
    assert lines[-1][1] == "m: no replica placed yet (placement has not run)"


def test_a_listen_flag_server_yaml_already_overrides_is_said_not_used(tmp_path: Path) -> None:
    """A second init with ``--gateway-listen`` other than server.yaml's printed ``kept server.yaml``
    and nothing else: the flag was silently dropped (a new user's report, 2026-12-04). Now a ``!!``
    line names the flag, the value in force and what to do; a flag left at its default, or equal to
    the file's value, says nothing."""
    from llmgw.serverinit.steps import pki, serveryaml  # noqa: PLC0415

    first = opts(tmp_path, hosts=["127.0.0.1"])
    init, _ = make(tmp_path, first)
    checks.run(init.ctx)
    pki.run(init.ctx)
    serveryaml.run(init.ctx)
    moved = f"127.0.0.1:{free_port()}"
    again, out = make(tmp_path, InitOptions(**{**first.__dict__, "gateway_listen": moved}))
    checks.run(again.ctx)
    said = out.getvalue()
    assert f"!! --gateway-listen {moved} is not used: {init.ctx.paths.server_config} already says " \
        f"{first.gateway_listen}" in said, said
    assert "'llmgw service restart server'" in said
    assert "--admin-listen" not in said  # the same as the file's
    assert "--agent-listen" not in said
    default, out = make(tmp_path, InitOptions(**{**first.__dict__, "gateway_listen": ":8080"}))
    checks.run(default.ctx)  # the flag's default: not given, so nothing to say
    assert "!!" not in out.getvalue()


def test_a_starter_alias_the_kept_starter_lacks_is_said_not_used(tmp_path: Path) -> None:
    """A second init with ``--starter-alias gemma2`` kept the starter already in the catalog, alias
    ``gemma``, without a word (a new user's finding): a ``!!`` line names the flag, the aliases in force
    and the command that changes them; an alias it has, or none given, says nothing."""
    from llmgw.serverinit.steps import starter  # noqa: PLC0415

    catalog = {"/api/v1/models": [{"name": "gemma-3-270m-q4-k-m", "aliases": ["gemma"]}]}
    for alias, said in (("gemma2", True), ("gemma", False), ("", False)):
        init, out, _ = scripted(tmp_path, catalog, starter_alias=alias)
        starter._say_alias_kept(init.ctx, "gemma-3-270m-q4-k-m", alias)
        assert ("!! --starter-alias gemma2 is not used: gemma-3-270m-q4-k-m is already in the catalog (aliases: "
                "gemma); change them with 'llmgw ctl model set gemma-3-270m-q4-k-m aliases=[gemma2]'"
                in out.getvalue()) is said, out.getvalue()
