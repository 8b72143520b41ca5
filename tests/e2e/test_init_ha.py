"""``server init``'s database step for HA on real processes: Patroni 4.1.5 members with PostgreSQL 15,
each run as ``postgres`` by llmgw's supervisor on loopback (raft as the DCS), one per install root
as if each were its own machine.

Needs Patroni's venv (``LLMGW_PATRONI_VENV``, default ``/var/cache/llmgw/patroni-4.1.5``, made by
scripts/assets) and the PostgreSQL 15 binaries; without them the test skips on a developer's
machine and FAILS under ``LLMGW_REQUIRE_ASSETS=1``. Nothing is mocked.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import sqlalchemy
import yaml

from llmgw.config import load_agent_config, load_server_config
from llmgw.errors import LlmgwError, PortInUseError
from llmgw.paths import Paths
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.patroni import PG_BIN_DIR, HaPlan, PatroniRest, venv_ok
from llmgw.serverinit.steps import database
from llmgw.serverinit.steps.context import InitContext
from llmgw.service.manager import SupervisorManager
from llmgw.tlsconf import CA
from tests.conftest import Assets, skip_or_fail
from tests.helpers.processes import ENGINE_CORES, exposed, listen_args, llmgw, stop_installs

pytestmark = pytest.mark.e2e

VENV = Path(os.environ.get("LLMGW_PATRONI_VENV", "/var/cache/llmgw/patroni-4.1.5"))


@pytest.fixture
def patroni_venv() -> Path:
    """Patroni's venv, or a skip (a failure under LLMGW_REQUIRE_ASSETS=1) naming what is missing."""
    missing = [str(p) for p in (VENV / "bin" / "patroni", PG_BIN_DIR / "postgres") if not p.exists()]
    if missing or os.geteuid() != 0:
        skip_or_fail(f"HA init needs root, Patroni and PostgreSQL 15: missing {', '.join(missing) or 'root'}; "
                     "run scripts/assets (or set LLMGW_PATRONI_VENV)")
    assert venv_ok(VENV)
    return VENV


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pg_ports(n: int) -> list[int]:
    """``n`` PostgreSQL ports 3 apart whose REST (+2576) and raft (-421) ports are free too."""
    base = 20000 + (os.getpid() * 7) % 9000
    while True:
        ports = [base + 3 * i for i in range(n)]
        if all(_free(p) and _free(p + 2576) and _free(p - 421) for p in ports):
            return ports
        base += 3 * n


@pytest.fixture
def roots() -> Iterator[list[Path]]:
    """Three install roots the postgres user can traverse (pytest's tmp_path is root's 0700)."""
    made = [Path(tempfile.mkdtemp(prefix="llmgw-ha-")) for _ in range(3)]
    for r in made:
        r.chmod(0o755)
    yield made

    def stop(r: Path) -> None:  # all at once: see stop_installs
        with contextlib.suppress(LlmgwError):
            SupervisorManager(Paths(r)).stop("patroni")
        shutil.rmtree(r, ignore_errors=True)

    with ThreadPoolExecutor(len(made)) as pool:
        list(pool.map(stop, made))


def ctx_for(root: Path, **kw: object) -> tuple[InitContext, io.StringIO]:
    paths = Paths(root)
    out = io.StringIO()
    opts = InitOptions(patroni_dir=root / "patroni", patroni_wait_s=60, **kw)  # type: ignore[arg-type]
    return InitContext(paths, opts, SupervisorManager(paths), out=out), out


def test_three_members_bootstrap_a_primary_and_two_streaming_replicas(
    patroni_venv: Path, roots: list[Path]
) -> None:
    ports = pg_ports(3)
    specs = [f"cp{i + 1}=127.0.0.1:{p}" for i, p in enumerate(ports)]
    t0 = time.monotonic()
    ctx1, out1 = ctx_for(roots[0], control_planes=specs, patroni_venv=patroni_venv)
    got = database.run(ctx1)
    first_s = time.monotonic() - t0
    assert got.me.name == "cp1"
    assert "  done database llmgw (owner llmgw)" in out1.getvalue()
    assert PatroniRest(got.me.rest_url).is_primary()

    # The standbys: the plan carried over as add-control-plane's bundle would (ha.yaml + ha-me).
    for i in (1, 2):
        etc = Paths(roots[i]).etc
        etc.mkdir(parents=True)
        shutil.copy(database.ha_yaml(ctx1.paths), etc / "ha.yaml")
        (etc / "ha-me").write_text(f"cp{i + 1}\n")
        ctx, out = ctx_for(roots[i], patroni_venv=patroni_venv)
        database.run(ctx, role="replica")
        assert f"  done database member cp{i + 1} is the replica" in out.getvalue()

    # /cluster shows what the members last wrote to the DCS (every loop_wait, 2 s).
    deadline = time.monotonic() + 15
    while True:
        cluster = PatroniRest(got.me.rest_url).cluster()
        roles = {m["name"]: (m["role"], m["state"]) for m in cluster["members"]}
        if all(roles.get(n, ("", ""))[1] == "streaming" for n in ("cp2", "cp3")) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert roles["cp1"] == ("leader", "running")
    # synchronous_mode: true makes one replica the synchronous standby.
    assert sorted(roles[n][0] for n in ("cp2", "cp3")) == ["replica", "sync_standby"]
    assert all(roles[n][1] == "streaming" for n in ("cp2", "cp3")), roles

    # The store URL reaches the primary through libpq's multi-host list, as the llmgw user.
    plan = HaPlan.load(database.ha_yaml(ctx1.paths))
    engine = sqlalchemy.create_engine(plan.store_url())
    try:
        with engine.connect() as conn:
            row = conn.execute(sqlalchemy.text("SELECT current_user, current_database(), pg_is_in_recovery()")).one()
            assert tuple(row) == ("llmgw", "llmgw", False)
    finally:
        engine.dispose()
    print(f"member 1 up in {first_s:.1f} s, all three in {time.monotonic() - t0:.1f} s")

    # A second run keeps everything.
    again, out = ctx_for(roots[0], control_planes=specs, patroni_venv=patroni_venv)
    database.run(again)
    tags = [ln.split()[0] for ln in out.getvalue().splitlines()]
    assert "done" not in tags, out.getvalue()
    assert tags.count("kept") == 7, out.getvalue()  # venv, ha.yaml, patroni.yml, unit, member, role, database
    assert "  kept database member cp1 is up (primary running)" in out.getvalue()

    # After a switchover cp1 is a replica: init on it again accepts that, and stops nothing.
    rest = PatroniRest(got.me.rest_url)
    r = httpx.post(f"{got.me.rest_url}/switchover", json={"leader": "cp1"}, timeout=30,
                   auth=("llmgw", plan.passwords["restapi"]))
    assert r.status_code == 200, r.text
    # Streaming can show while PostgreSQL is still "starting" (its restart as a replica): wait for both.
    deadline = time.monotonic() + 30
    while rest.state() != "replica running streaming" and time.monotonic() < deadline:
        time.sleep(0.5)
    again, out = ctx_for(roots[0], control_planes=specs, patroni_venv=patroni_venv)
    database.run(again)
    assert "  kept database member cp1 is up (replica running streaming)" in out.getvalue()
    assert "  kept database llmgw: made when cp1 led; another member leads now" in out.getvalue()
    assert rest.is_streaming()


def _listening(port: int) -> list[str]:
    """The local addresses (``IP``) with a TCP socket listening on ``port`` (IPv4, /proc/net/tcp)."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hexport = local.split(":")
        if state == "0A" and int(hexport, 16) == port:
            found.append(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return found


def test_a_member_s_raft_binds_its_address_and_refuses_a_peer_without_its_password(
    patroni_venv: Path, roots: list[Path]
) -> None:
    """Issue 19, item 7, on a real Patroni member: its raft listened on every interface and took
    any peer's messages (anyone reaching the port could write the DCS). Now it listens on the
    member's address and answers only a peer with ha.yaml's raft password: pysyncobj's own admin
    tool (in Patroni's venv) asks for its status without the password, then with it."""
    port = pg_ports(1)[0]
    ctx, _out = ctx_for(roots[0], control_planes=[f"cp1=127.0.0.1:{port}"], patroni_venv=patroni_venv)
    got = database.run(ctx)
    plan = HaPlan.load(database.ha_yaml(ctx.paths))
    cfg = roots[0] / "patroni" / "patroni.yml"
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
    raft = yaml.safe_load(cfg.read_text())["raft"]
    assert raft["bind_addr"] == f"127.0.0.1:{got.me.raft_port}"
    assert raft["password"] == plan.passwords["raft"]
    assert _listening(got.me.raft_port) == ["127.0.0.1"]  # before: ["0.0.0.0"]

    admin = str(patroni_venv / "bin" / "syncobj_admin")
    conn = f"127.0.0.1:{got.me.raft_port}"

    def status(*extra: str) -> str:
        r = subprocess.run([admin, "-conn", conn, "-status", *extra], capture_output=True, text=True,
                           timeout=30, check=False)
        return r.stdout + r.stderr

    with_pw = status("-pass", plan.passwords["raft"])
    assert f"self: {conn}" in with_pw, with_pw
    assert "leader: " in with_pw, with_pw
    without = status()
    assert "self:" not in without, without
    assert "leader:" not in without, without
    wrong = status("-pass", "not-the-password")
    assert "self:" not in wrong, wrong
    print(f"raft without the password: {without.strip()!r}; with a wrong one: {wrong.strip()!r}")


def test_a_taken_member_port_is_refused_before_anything_is_written(patroni_venv: Path, roots: list[Path]) -> None:
    """Another cluster's PostgreSQL (or Patroni) on this member's port would answer init's waits in
    its stead (a new operator saw init wait on another cluster's replica, then fail on its primary
    leaving Patroni running): the ports are checked first."""
    port = pg_ports(1)[0]
    for taken_port, what in ((port, "PostgreSQL port"), (port + 2576, "Patroni's REST API"),
                             (port - 421, "Patroni's raft")):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", taken_port))
            taken.listen()
            ctx, _out = ctx_for(roots[0], control_planes=[f"cp1=127.0.0.1:{port}"], patroni_venv=patroni_venv)
            with pytest.raises(PortInUseError) as err:
                database.run(ctx)
        assert what in str(err.value)
        assert f"127.0.0.1:{taken_port} is already in use" in str(err.value)
        assert "--control-plane cp1=127.0.0.1:PORT" in str(err.value)
        assert not (roots[0] / "patroni").exists()
        assert not database.ha_yaml(ctx.paths).exists()
        assert not ctx.paths.unit("patroni").exists()


def test_a_patroni_that_cannot_start_stops_init_with_its_log_and_leaves_nothing(
    patroni_venv: Path, roots: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL's port taken after init's check (another program started meanwhile): its
    postmaster cannot start, and Patroni says so. The check is skipped here to make that happen."""
    port = pg_ports(1)[0]
    monkeypatch.setattr(database, "check_member_ports", lambda plan, me: None)
    with socket.socket() as taken:  # PostgreSQL's port is taken: its postmaster cannot start
        taken.bind(("127.0.0.1", port))
        taken.listen()
        ctx, _out = ctx_for(roots[0], control_planes=[f"cp1=127.0.0.1:{port}"], patroni_venv=patroni_venv)
        ctx.opts.patroni_wait_s = 25
        with pytest.raises(LlmgwError) as err:
            database.run(ctx)
    text = str(err.value)
    assert "nothing of the database member is left" in text
    # Patroni's own lines, saying why.
    assert "ERROR: postmaster is not running" in text
    assert "Failed to bootstrap cluster" in text
    assert not (roots[0] / "patroni").exists()
    assert not database.ha_yaml(ctx.paths).exists()
    assert not ctx.paths.unit("patroni").exists()


def test_ha_init_then_a_standby_joins_and_a_foreign_bundle_is_refused(
    patroni_venv: Path, roots: list[Path], assets: Assets
) -> None:
    """The whole of HA init through the CLI, as two machines on loopback: the first control plane
    (Patroni primary, the llmgw database, the control plane on it, mirror, node, the starter
    served), add-control-plane's bundle, and the standby joining (streaming replica, its own
    control plane on the shared database); a machine of another cluster refuses the bundle."""
    first, standby, foreign = roots
    ports = pg_ports(2)
    # cp2 on 127.0.0.2, as another machine: its agent API on the same port as cp1's, as ha.yaml
    # and agent.yaml's servers assume of the control planes.
    members = ["--control-plane", f"cp1=127.0.0.1:{ports[0]}", "--control-plane", f"cp2=127.0.0.2:{ports[1]}"]
    listen = listen_args()
    agent_port = int(listen[listen.index("--agent-listen") + 1].rsplit(":", 1)[1])
    args = ["server", "init", "--offline", "--host", "127.0.0.1", "--node-id", "e2e-node", "--no-guard-model",
            "--starter-source", f"file:{assets.model}", "--starter-alias", "gemma",
            "--llama-server", str(assets.llama_server), "--cpus", str(ENGINE_CORES),
            "--patroni-venv", str(patroni_venv), *listen, *members]
    standby_listen = [*listen_args(skip=("--mirror-listen", "--mirror-api-listen", "--agent-listen")),
                      "--agent-listen", f"127.0.0.2:{agent_port}"]
    try:
        t0 = time.monotonic()
        r = llmgw(first, *args)
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stdout + r.stderr
        for line in ("done database member cp1 is the primary", "done database llmgw (owner llmgw)",
                     "done server.yaml: store on PostgreSQL (2 members), cluster cp1", "done control plane started",
                     "done gemma-3-270m-q4_k_m is serving"):
            assert line in r.stdout, f"missing {line!r} in:\n{r.stdout}"
        cfg = load_server_config(Paths(first).server_config)
        assert cfg.store.url.startswith("postgresql+psycopg://llmgw:")
        assert cfg.cluster.patroni == [f"http://127.0.0.1:{ports[0] + 2576}", f"http://127.0.0.2:{ports[1] + 2576}"]
        # Issue 19, item 6: this machine's node names every control plane, as add-node's do.
        agent_cfg = load_agent_config(Paths(first).agent_config)
        assert agent_cfg.control_planes == [f"https://127.0.0.1:{agent_port}", f"https://127.0.0.2:{agent_port}"]
        gateway = re.search(r"curl -s (http://127\.0\.0\.1:\d+)/v1/chat/completions", r.stdout)
        assert gateway, r.stdout
        print(f"HA init of the first control plane took {took:.1f} s")
        # Every secret is its owner's alone (ha.yaml and patroni.yml hold the database passwords).
        assert exposed(first) == []
        assert stat.S_IMODE((Paths(first).etc / "ha.yaml").stat().st_mode) == 0o600

        bundle = first / "bundle-cp2"
        r = llmgw(first, "server", "add-control-plane", "cp2", "--address", "127.0.0.2", "--out", str(bundle))
        assert r.returncode == 0, r.stdout + r.stderr

        # A machine already in another cluster refuses it, before writing anything of it.
        Paths(foreign).pki.mkdir(parents=True)
        CA.create().write(Paths(foreign).pki)
        r = llmgw(foreign, "server", "init", "--join", str(bundle), "--patroni-venv", str(patroni_venv))
        assert r.returncode != 0
        assert "refusing to join: this machine already has another cluster's CA" in r.stdout + r.stderr
        assert not (Paths(foreign).etc / "ha.yaml").exists()

        # Issue 19, item 7: a taken member port refuses the join before any file of the bundle is
        # copied (the CA key and the database passwords are in it), naming no flag --join refuses.
        with socket.create_server(("127.0.0.2", ports[1])):
            r = llmgw(standby, "server", "init", "--join", str(bundle), "--patroni-venv", str(patroni_venv),
                      *standby_listen)
        assert r.returncode != 0
        assert f"PostgreSQL port 127.0.0.2:{ports[1]} is already in use" in r.stdout + r.stderr
        assert "--control-plane" not in r.stdout + r.stderr
        assert not (Paths(standby).pki / "ca-key.pem").exists()
        assert not (Paths(standby).etc / "ha.yaml").exists()

        t0 = time.monotonic()
        r = llmgw(standby, "server", "init", "--join", str(bundle), "--patroni-venv", str(patroni_venv),
                  *standby_listen)
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stdout + r.stderr
        for line in ("done database member cp2 is the replica", "done control plane started"):
            assert line in r.stdout, f"missing {line!r} in:\n{r.stdout}"
        print(f"--join took {took:.1f} s")
        roles = {m["name"]: m["role"] for m in PatroniRest(f"http://127.0.0.1:{ports[0] + 2576}").cluster()["members"]}
        assert roles["cp1"] == "leader"
        assert roles["cp2"] in ("replica", "sync_standby")  # sync once Patroni's next loop (2 s) picks it
        assert PatroniRest(f"http://127.0.0.2:{ports[1] + 2576}").is_streaming()
        # The standby's control plane reads the catalog the first one wrote, from the shared database.
        models = llmgw(standby, "ctl", "models", timeout=60)
        assert models.returncode == 0, models.stderr
        assert "gemma-3-270m-q4_k_m" in models.stdout

        # A second --join keeps everything.
        r = llmgw(standby, "server", "init", "--join", str(bundle), "--patroni-venv", str(patroni_venv),
                  *standby_listen)
        assert r.returncode == 0, r.stdout + r.stderr
        assert not [ln for ln in r.stdout.splitlines() if ln.startswith("  done")], r.stdout

        # The first control plane down, its node's agent restarted: it registers with cp2 (before,
        # it knew only cp1 and was lost until cp1 came back).
        assert llmgw(first, "service", "stop", "server").returncode == 0
        r = llmgw(first, "service", "restart", "agent")
        assert r.returncode == 0, r.stdout + r.stderr
        deadline = time.monotonic() + 60
        logs = ""
        while time.monotonic() < deadline:
            logs = llmgw(first, "service", "logs", "agent", "-n", "200").stdout
            if f"registered with https://127.0.0.2:{agent_port} as node e2e-node" in logs:
                break
            time.sleep(1)
        else:
            raise AssertionError(f"the agent did not register with cp2:\n{logs}")

        # A second init on the first control plane keeps everything; an agent.yaml from before
        # (the first control plane alone) gets the others added, with a backup.
        conf = Paths(first).agent_config
        old = "\n".join(ln for ln in conf.read_text().splitlines()
                        if "servers:" not in ln and "127.0.0.2" not in ln and "other control planes" not in ln)
        conf.write_text(old + "\n")
        r = llmgw(first, *args)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "kept database role llmgw" in r.stdout
        assert "kept server.yaml's store" in r.stdout
        assert f"updated {conf}: servers += https://127.0.0.2:{agent_port}" in r.stdout, r.stdout
        assert load_agent_config(conf).control_planes == agent_cfg.control_planes
        assert [p.read_text() for p in conf.parent.glob("agent.yaml.bak-*")] == [old + "\n"]
    finally:
        stop_installs(standby, first)
