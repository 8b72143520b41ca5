"""``llmgw server add-node``: another machine's identity from the cluster CA, and its agent.yaml."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from llmgw.config import load_agent_config
from llmgw.errors import ConfigError, PkiError
from llmgw.paths import Paths
from llmgw.serverinit import files
from llmgw.serverinit.onboard import add_node
from llmgw.tlsconf import CA


@pytest.fixture
def cluster(tmp_path: Path) -> Paths:
    paths = Paths(tmp_path / "root")
    ca = CA.create()
    ca.write(paths.pki)
    ca.issue_server(["cp.example", "10.0.0.1"]).write(paths.pki, "server")
    files.write_atomic(paths.server_config, files.server_yaml(
        admin_listen="127.0.0.1:9090", agent_listen=":7443", gateway_listen=":8080", pki=paths.pki,
        keys_file=paths.client_keys))
    return paths


def test_a_node_gets_a_certificate_from_the_ca_and_an_agent_yaml(cluster: Paths, tmp_path: Path) -> None:
    out = tmp_path / "node-b"
    written = add_node(cluster, "node-b", out, address="10.0.0.7", labels={"zone": "a"},
                       llama_server=Path("/opt/llama/llama-server"))
    assert sorted(p.name for p in written.files) == ["agent-key.pem", "agent.pem", "agent.yaml", "ca.pem"]
    assert written.server == "https://cp.example:7443"
    cert = x509.load_pem_x509_certificate((out / "agent.pem").read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node-b"
    assert (out / "agent-key.pem").stat().st_mode & 0o777 == 0o600
    # Signed by the cluster CA: a context trusting only the CA accepts it.
    ctx = ssl.create_default_context(cafile=str(out / "ca.pem"))
    ctx.load_cert_chain(str(out / "agent.pem"), str(out / "agent-key.pem"))
    cfg = load_agent_config(out / "agent.yaml")
    assert cfg.server == "https://cp.example:7443"  # the certificate's CN: init's first --host
    assert (cfg.node_id, cfg.advertise_address, cfg.labels) == ("node-b", "10.0.0.7", {"zone": "a"})
    assert cfg.tls.cert == out / "agent.pem"  # named beside agent.yaml (was /etc/llmgw/agent.pem)
    assert "cert: agent.pem" in (out / "agent.yaml").read_text()
    assert cfg.engines.llamacpp.binary == Path("/opt/llama/llama-server")


def test_nothing_is_overwritten_and_bad_ids_are_named(cluster: Paths, tmp_path: Path) -> None:
    out = tmp_path / "n"
    add_node(cluster, "n1", out, address="10.0.0.8")
    with pytest.raises(ConfigError, match=r"n is not empty \(agent-key\.pem, agent\.pem, agent\.yaml, \.\.\.\)"):
        add_node(cluster, "n1", out, address="10.0.0.8")
    with pytest.raises(ConfigError, match="is not a valid node id: 1-63 characters"):
        add_node(cluster, "bad id!", tmp_path / "x", address="10.0.0.8")
    # a new user's findings: a directory of other files was taken (and told to copy all of it to
    # /etc/llmgw), and the label init pins the starter and the judges with could be given to a node
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"busy is not empty \(notes.txt\); give an empty directory with --out"):
        add_node(cluster, "n2", busy, address="10.0.0.9")
    with pytest.raises(ConfigError, match=r"--label llmgw\.control-plane is llmgw's own"):
        add_node(cluster, "n3", tmp_path / "n3", address="10.0.0.9", labels={"llmgw.control-plane": "true"})
    assert not (tmp_path / "n3").exists()
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]


def test_without_the_ca_key_it_says_so(cluster: Paths, tmp_path: Path) -> None:
    (cluster.pki / "ca-key.pem").unlink()
    with pytest.raises(PkiError, match=r"the CA key .* is missing"):
        add_node(cluster, "n2", tmp_path / "y", address="10.0.0.9")
    assert not (tmp_path / "y").exists()


@pytest.mark.parametrize("address", ["not an address!!", "http://10.0.0.8", "10.0.0.8:7000", "", "a" * 64])
def test_an_address_that_is_not_one_is_refused_and_nothing_written(
    cluster: Paths, tmp_path: Path, address: str
) -> None:
    """A new user's ``--address 'not an address!!'`` went into agent.yaml as it was (2026-12-04)."""
    with pytest.raises(ConfigError, match="is not an IP address or a host name; give the node's address"):
        add_node(cluster, "n3", tmp_path / "z", address=address)
    assert not (tmp_path / "z").exists()


@pytest.mark.parametrize("address", ["10.0.0.8", "fe80::1", "[fe80::1]", "gpu-1.lan", "gpu_1", "node-b."])
def test_addresses_and_host_names_are_taken(cluster: Paths, tmp_path: Path, address: str) -> None:
    add_node(cluster, "n4", tmp_path / "w", address=address)
    # [fe80::1] is written fe80::1: engines bind it, and host_port brackets it ([[fe80::1]]:P before)
    assert load_agent_config(tmp_path / "w" / "agent.yaml").advertise_address == address.strip("[]")


def test_the_cli_says_when_agent_yaml_names_a_loopback_control_plane(tmp_path: Path) -> None:
    """After a quickstart (``--host 127.0.0.1``) add-node wrote ``server: https://127.0.0.1:7443`` for a
    remote node and said only "copy it to /etc/llmgw" (a new user's report): now a ``!!`` line says a
    loopback address reaches only this machine, and what to pass."""
    from typer.testing import CliRunner  # noqa: PLC0415

    from llmgw.cli.main import app  # noqa: PLC0415

    paths = Paths(tmp_path / "root")
    ca = CA.create()
    ca.write(paths.pki)
    ca.issue_server(["127.0.0.1"]).write(paths.pki, "server")
    files.write_atomic(paths.server_config, files.server_yaml(
        admin_listen="127.0.0.1:9090", agent_listen=":7443", gateway_listen=":8080", pki=paths.pki,
        keys_file=paths.client_keys))
    runner = CliRunner()
    args = ["server", "add-node", "n5", "--out", str(tmp_path / "n5"), "--address", "10.0.0.5"]
    r = runner.invoke(app, args, env={"LLMGW_ROOT": str(paths.root)})
    assert r.exit_code == 0, r.output
    assert "!! agent.yaml names the control plane as https://127.0.0.1:7443, a loopback address" in r.output
    other = ["server", "add-node", "n6", "--out", str(tmp_path / "n6"), "--address", "10.0.0.6",
             "--server", "https://cp.lan:7443"]
    r = runner.invoke(app, other, env={"LLMGW_ROOT": str(paths.root)})
    assert r.exit_code == 0, r.output
    assert "!!" not in r.output


def test_add_node_says_when_the_id_is_a_node_the_cluster_has(tmp_path: Path) -> None:
    """``server add-node vm`` for a live node ``vm`` issued a second certificate without a word (a new
    user's report, 2026-12-04). A real control plane (``serve`` in a thread, SQLite) knows ``node-a``
    from a heartbeat; add-node for it says so, for ``node-b`` it does not; with the control plane down
    it issues without asking."""
    from typer.testing import CliRunner  # noqa: PLC0415

    from llmgw.cli.main import app  # noqa: PLC0415
    from llmgw.control.store import default_url, open_store  # noqa: PLC0415
    from llmgw.protocol import Heartbeat, Inventory  # noqa: PLC0415
    from tests.helpers.control import make_install  # noqa: PLC0415
    from tests.unit.test_ctl_model_rm import ThreadedControlPlane  # noqa: PLC0415

    inst = make_install(tmp_path / "root")
    store = open_store(default_url("", inst.paths.database))
    inv = Inventory(cores=2, memory_total_bytes=4 << 30, memory_available_bytes=4 << 30)
    store.upsert_node_heartbeat("node-a", Heartbeat(inventory=inv), 1e12)

    def add(node: str) -> str:
        r = CliRunner().invoke(app, ["--root", str(inst.root), "server", "add-node", node, "--out",
                                     str(tmp_path / node), "--address", "10.0.0.5"])
        assert r.exit_code == 0, r.output
        return r.output

    with ThreadedControlPlane(inst):
        said = add("node-a")
        assert "!! node 'node-a' is already in the cluster (state ready): this is a second identity" in said
        assert "run 'llmgw ctl node rm node-a' first" in said
        assert "already in the cluster" not in add("node-b")
    assert "already in the cluster" not in add("node-c")  # nobody to ask: issued, nothing said
    assert (tmp_path / "node-c" / "agent.pem").exists()


async def test_the_copied_bundle_runs_an_agent_under_another_root(tmp_path: Path) -> None:
    """``server add-node node-b --out DIR``, ``cp DIR/* $RB/etc/llmgw/`` and ``LLMGW_ROOT=$RB llmgw
    agent`` failed: agent.yaml named ``/etc/llmgw/ca.pem``, outside the node's root (a new operator's
    report). agent.yaml now names its files relative to itself, so the documented copy works under any
    root: the agent, started from the copied files only, registers with a real control plane."""
    import asyncio  # noqa: PLC0415
    import os  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    import yaml  # noqa: PLC0415
    from typer.testing import CliRunner  # noqa: PLC0415

    from llmgw.adminclient import AdminClient  # noqa: PLC0415
    from llmgw.agent.loop.loop import run_agent  # noqa: PLC0415
    from llmgw.cli.main import app  # noqa: PLC0415
    from tests.helpers.control import TOKEN, make_install, serving  # noqa: PLC0415
    from tests.helpers.waits import until  # noqa: PLC0415

    inst = make_install(tmp_path / "cp")
    bundle = tmp_path / "bundle"
    rb = Paths(tmp_path / "rb")
    async with serving(inst):
        r = await asyncio.to_thread(CliRunner().invoke, app, [
            "--root", str(inst.root), "server", "add-node", "node-b", "--address", "127.0.0.1", "--out", str(bundle)])
        assert r.exit_code == 0, r.output
        rb.etc.mkdir(parents=True)
        for f in bundle.iterdir():  # cp DIR/* $RB/etc/llmgw/
            shutil.copy(f, rb.etc / f.name)
        shutil.rmtree(bundle)  # nothing left where add-node wrote it
        # The test's own additions (a declared inventory, a fast beat); tls stays as add-node wrote it.
        doc = yaml.safe_load(rb.agent_config.read_text())
        inventory = tmp_path / "inventory.yaml"
        inventory.write_text(yaml.safe_dump({"cores": 2, "memory_total_bytes": 4 << 30,
                                             "memory_available_bytes": 4 << 30}))
        doc.update(discovery={"inventory_file": str(inventory)}, heartbeat_interval_s=0.2)
        rb.agent_config.write_text(yaml.safe_dump(doc))
        cfg = load_agent_config(rb.agent_config)
        stop = asyncio.Event()
        agent = asyncio.create_task(run_agent(cfg, rb, stop=stop))
        admin = AdminClient(inst.admin, TOKEN)

        async def registered() -> list[str]:
            assert not agent.done(), agent.exception()
            nodes = await asyncio.to_thread(admin.nodes)
            return [f"{n.id} {n.state}" for n in nodes]

        try:
            assert await until("node-b registered", registered, within_s=30) == ["node-b ready"]
        finally:
            stop.set()
            await asyncio.wait_for(agent, 20)
    assert doc["tls"] == {"ca": "ca.pem", "cert": "agent.pem", "key": "agent-key.pem"}
    assert (cfg.tls.ca, cfg.tls.cert, cfg.tls.key) == (
        rb.etc / "ca.pem", rb.etc / "agent.pem", rb.etc / "agent-key.pem")
    assert os.stat(rb.agent_state).st_mode & 0o777 == 0o700


def test_relative_tls_paths_in_agent_yaml_are_relative_to_its_directory(tmp_path: Path) -> None:
    """What add-node writes (``ca.pem``) is taken beside agent.yaml; an absolute path stays as it is."""
    conf = tmp_path / "etc" / "agent.yaml"
    conf.parent.mkdir()
    conf.write_text("server: https://cp:7443\nnode_id: n\ntls: {ca: ca.pem, cert: sub/agent.pem, key: /k/key.pem}\n")
    tls = load_agent_config(conf).tls
    assert (tls.ca, tls.cert, tls.key) == (conf.parent / "ca.pem", conf.parent / "sub/agent.pem", Path("/k/key.pem"))


async def test_an_agent_without_its_certificate_is_told_to_run_add_node(tmp_path: Path) -> None:
    """The advice named 'llmgw server init', which issues only the control plane's own node; a node's
    certificate comes from 'server add-node NODE' on the control plane."""
    from llmgw.agent.loop.loop import run_agent  # noqa: PLC0415

    conf = tmp_path / "agent.yaml"
    conf.write_text("server: https://cp:7443\nnode_id: node-b\n"
                    "tls: {ca: ca.pem, cert: agent.pem, key: agent-key.pem}\n")
    with pytest.raises(PkiError) as got:
        await run_agent(load_agent_config(conf), Paths(tmp_path / "root"))
    named = (f"tls.ca {tmp_path / 'ca.pem'} and tls.cert {tmp_path / 'agent.pem'} "
             f"and tls.key {tmp_path / 'agent-key.pem'}")
    assert str(got.value).startswith(f"agent.yaml: {named} do not exist; fix the path in agent.yaml, or "), got.value
    assert str(got.value).endswith(
        "issue this node a certificate with 'llmgw server add-node node-b --address ADDR --out DIR' on the control "
        "plane and copy DIR's files beside agent.yaml")


def test_add_node_says_when_it_could_not_ask_whether_the_id_is_live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new operator's ``add-node node-a`` for the control plane's own live node succeeded without a
    word (LLMGW_ROOT, listeners on other ports): the check of the previous report swallowed every error
    of the admin API (a refused token, a 5xx, a timeout, an answer it could not read) as 'not a node'.
    Now a check that could not be made says so and why: here the admin token file no longer holds the
    token the control plane started with (a 401), and an admin address that accepts and never answers
    (a timeout, after ASK_TIMEOUT_S: 0.5 s here, 5 s in use); a control plane that is down is still
    nobody to ask."""
    from typer.testing import CliRunner  # noqa: PLC0415

    from llmgw.cli.main import app  # noqa: PLC0415
    from tests.helpers.control import make_install  # noqa: PLC0415
    from tests.unit.test_ctl_model_rm import ThreadedControlPlane  # noqa: PLC0415

    inst = make_install(tmp_path / "root")  # its listeners on free ports, not the defaults
    monkeypatch.setattr("llmgw.adminclient.ASK_TIMEOUT_S", 0.5)  # the CLI imports it when it runs

    def add(node: str) -> str:
        r = CliRunner().invoke(app, ["server", "add-node", node, "--out", str(tmp_path / node), "--address",
                                     "10.0.0.5"], env={"LLMGW_ROOT": str(inst.root)})
        assert r.exit_code == 0, r.output
        assert (tmp_path / node / "agent.pem").exists()
        return r.output

    with ThreadedControlPlane(inst):
        inst.paths.admin_token.write_text("not-the-token\n")
        said = add("node-a")
    assert "!! could not check whether node 'node-a' is already in the cluster (GET /api/v1/nodes: 401 " in said
    assert ("if it is, this is a second identity for it: see 'llmgw ctl nodes', and 'llmgw ctl node rm node-a' "
            "before moving the id to a new machine") in said
    assert "!! could not check" not in add("node-c")  # the control plane is down: nobody to ask, as before
    with socket.create_server(("127.0.0.1", 0)) as mute:  # listens, never answers: a control plane too busy
        port = mute.getsockname()[1]
        inst.write(admin_listen=f"127.0.0.1:{port}")
        said = add("node-d")
    assert ("!! could not check whether node 'node-d' is already in the cluster (the control plane's admin API at "
            f"http://127.0.0.1:{port} does not answer (ReadTimeout: ") in said
