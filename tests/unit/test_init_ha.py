"""HA ``server init`` without starting Patroni: member specs, the plan, ``patroni.yml``, the store
URL, the Patroni unit, the standby's bundle (``server add-control-plane``) and ``--join``'s checks,
on temporary roots with real files and real certificates. Bad flags: a clear error, nothing written.
Patroni itself runs in tests/e2e/test_init_ha.py."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import socket
import ssl
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.config import load_agent_config, load_server_config
from llmgw.errors import ConfigError, PkiError, ServiceError, UnreachableError
from llmgw.paths import Paths
from llmgw.serverinit import agentconf, files
from llmgw.serverinit.onboard import add_node
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.patroni import HaPlan, Member, ensure_venv, patroni_yml
from llmgw.serverinit.standby import Bundle, add_control_plane, check_bundle, check_cluster_ca, install_bundle
from llmgw.serverinit.steps import database, ha, pki, serveryaml
from llmgw.serverinit.steps.context import InitContext
from llmgw.serverinit.steps.node import own_advertise
from llmgw.service.haunits import patroni_unit
from llmgw.service.manager import SupervisorManager
from llmgw.service.unitfile import parse_unit
from llmgw.service.units import check_service
from llmgw.tlsconf import CA, cert_hosts, server_context
from tests.conftest import skip_or_fail
from tests.helpers.init import init_cli, written
from tests.helpers.net import free_port
from tests.helpers.processes import llmgw

SPECS = ["cp1=10.0.0.1", "cp2=10.0.0.2", "cp3=10.0.0.3:6432"]


def plan(**kw: Any) -> HaPlan:
    return HaPlan(members=[Member.parse(s) for s in SPECS], **kw)


# --- members and the plan ---------------------------------------------------------------------


def test_a_member_spec_gives_the_three_ports_from_postgresql_s() -> None:
    m = Member.parse("cp3=10.0.0.3:6432")
    assert (m.name, m.host, m.pg_port, m.rest_port, m.raft_port) == ("cp3", "10.0.0.3", 6432, 9008, 6011)
    assert Member.parse("cp1=db1.example").pg_port == 5432
    assert Member.parse("cp1=db1.example").rest_url == "http://db1.example:8008"
    v6 = Member.parse("cp2=[fd00::2]:5433")
    assert (v6.host, v6.pg_port, v6.rest_url) == ("fd00::2", 5433, "http://[fd00::2]:8009")
    assert v6.spec == "cp2=[fd00::2]:5433"


@pytest.mark.parametrize(("spec", "says"), [
    ("10.0.0.1", "is not NAME=HOST[:PORT]"),
    ("CP1=10.0.0.1", "control plane name"),
    ("cp1=10.0.0.1:x", "the port 'x' is not a number"),
    ("cp1=fd00::1", "an IPv6 address goes in brackets"),
    ("cp1=10.0.0.1:80", "the PostgreSQL port is 80, outside 1024-65535"),
    ("cp1=10.0.0.1:64000", "the REST API port is 66576"),
])
def test_a_bad_member_spec_says_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        Member.parse(spec)
    assert says in str(e.value)


def test_a_plan_refuses_a_name_or_a_port_used_twice_and_a_bad_etcd_url() -> None:
    with pytest.raises(ConfigError, match="'cp1' is given twice"):
        HaPlan(members=[Member.parse("cp1=a"), Member.parse("cp1=b")])
    with pytest.raises(ConfigError, match=r"cp2 and cp1 would both use 127\.0\.0\.1:8008"):
        HaPlan(members=[Member.parse("cp1=127.0.0.1:5432"), Member.parse("cp2=127.0.0.1:8008")])
    HaPlan(members=[Member.parse("cp1=127.0.0.1:5432"), Member.parse("cp2=127.0.0.1:5433")])  # 1 apart is fine
    with pytest.raises(ConfigError, match="not an etcd v3 client URL"):
        plan(etcd=["10.0.0.1:2379"])
    with pytest.raises(ConfigError, match="needs its control planes"):
        HaPlan(members=[])


def test_the_store_url_is_libpq_multi_host_over_every_member() -> None:
    p = plan()
    pw = p.passwords["llmgw"]
    assert p.store_url() == (
        f"postgresql+psycopg://llmgw:{pw}@/llmgw?host=10.0.0.1:5432&host=10.0.0.2:5432&host=10.0.0.3:6432"
        "&target_session_attrs=read-write&connect_timeout=2"
    )
    assert p.rest_urls() == ["http://10.0.0.1:8008", "http://10.0.0.2:8008", "http://10.0.0.3:9008"]
    assert set(p.passwords) == {"superuser", "replication", "rewind", "llmgw", "restapi", "raft"}
    assert len(set(p.passwords.values())) == 6


def test_the_plan_round_trips_through_ha_yaml(tmp_path: Path) -> None:
    p = plan(etcd=["http://10.0.0.9:2379"])
    (tmp_path / "ha.yaml").write_text(p.to_yaml())
    back = HaPlan.load(tmp_path / "ha.yaml")
    assert back.to_doc() == p.to_doc()
    assert back.same_cluster(p) == []
    other = HaPlan(members=[Member.parse("cp1=10.0.0.1")])
    assert back.same_cluster(other)[0].startswith("control planes cp1=10.0.0.1:5432, cp2=")


def old_ha_yaml(path: Path) -> HaPlan:
    """An ha.yaml as init wrote it before raft had a password."""
    p = plan()
    doc = p.to_doc()
    del doc["passwords"]["raft"]
    path.write_text(yaml.safe_dump(doc))
    return p


def test_an_old_ha_yaml_without_a_raft_password_loads_with_one_made_and_named(tmp_path: Path) -> None:
    old_ha_yaml(tmp_path / "ha.yaml")
    got = HaPlan.load(tmp_path / "ha.yaml")
    assert got.generated == ["raft"]
    assert len(got.passwords["raft"]) >= 32
    assert HaPlan.load(tmp_path / "ha.yaml").passwords["raft"] != got.passwords["raft"]  # not kept yet
    old = (tmp_path / "ha.yaml").read_text()
    backup = database.add_passwords(tmp_path / "ha.yaml", got)  # what the first control plane's init does
    assert backup.read_text() == old
    assert stat.S_IMODE(backup.stat().st_mode) == stat.S_IMODE((tmp_path / "ha.yaml").stat().st_mode) == 0o600
    again = HaPlan.load(tmp_path / "ha.yaml")
    assert again.generated == []
    assert again.passwords == got.passwords


def test_add_control_plane_refuses_an_ha_yaml_without_a_raft_password(tmp_path: Path) -> None:
    paths = first_control_plane(tmp_path / "cp1")
    old_ha_yaml(paths.etc / "ha.yaml")
    with pytest.raises(ConfigError, match=r"no password for Patroni's raft .* run 'llmgw server init' here again"):
        add_control_plane(paths, "cp2", tmp_path / "bundle", address="10.0.0.2")
    assert not (tmp_path / "bundle").exists()


def test_a_standby_s_old_ha_yaml_is_replaced_by_a_bundle_that_adds_raft_s_password(tmp_path: Path) -> None:
    first = first_control_plane(tmp_path / "cp1")
    add_control_plane(first, "cp2", tmp_path / "bundle", address="10.0.0.2")
    standby = Paths(tmp_path / "cp2")
    b = check_bundle(tmp_path / "bundle", standby)
    install_bundle(b, standby)
    doc = yaml.safe_load((standby.etc / "ha.yaml").read_text())
    del doc["passwords"]["raft"]
    (standby.etc / "ha.yaml").write_text(yaml.safe_dump(doc))
    old = (standby.etc / "ha.yaml").read_text()
    tags = {p.name: t for t, p in install_bundle(check_bundle(tmp_path / "bundle", standby), standby)}
    assert tags["ha.yaml"] == "updated"
    assert HaPlan.load(standby.etc / "ha.yaml").passwords["raft"] == b.plan.passwords["raft"]
    assert [p.read_text() for p in standby.etc.glob("ha.yaml.bak-*")] == [old]


# --- patroni.yml and the unit -------------------------------------------------------------------


def test_patroni_yml_has_ha_md_s_settings_and_raft_partners() -> None:
    p = plan()
    first = yaml.safe_load(patroni_yml(p, p.members[0]))
    second = yaml.safe_load(patroni_yml(p, p.members[1]))
    dcs = first["bootstrap"]["dcs"]
    assert (dcs["ttl"], dcs["loop_wait"], dcs["retry_timeout"], dcs["synchronous_mode"]) == (20, 2, 4, True)
    assert dcs["postgresql"]["use_pg_rewind"] is True
    assert dcs["postgresql"]["parameters"]["tcp_keepalives_idle"] == 5
    assert (first["name"], first["scope"]) == ("cp1", "llmgw")
    assert first["restapi"] == {"listen": "10.0.0.1:8008", "connect_address": "10.0.0.1:8008",
                                "authentication": {"username": "llmgw", "password": p.passwords["restapi"]}}
    assert first["postgresql"]["listen"] == "10.0.0.1:5432"
    assert first["postgresql"]["bin_dir"] == "/usr/lib/postgresql/15/bin"
    assert first["postgresql"]["authentication"]["superuser"]["password"] == p.passwords["superuser"]
    assert first["postgresql"]["basebackup"] == [{"checkpoint": "fast"}]
    # The first member's raft leads alone; the others join it.
    assert first["raft"]["partner_addrs"] == []
    # Raft binds the member's address and takes only members that know its password (issue 19,
    # item 7: pysyncobj bound every interface and took anyone's messages).
    assert second["raft"] == {"data_dir": "/var/lib/llmgw-patroni/raft", "self_addr": "10.0.0.2:5011",
                              "bind_addr": "10.0.0.2:5011", "password": p.passwords["raft"],
                              "partner_addrs": ["10.0.0.1:5011", "10.0.0.3:6011"]}
    named = yaml.safe_load(patroni_yml(p, Member.parse("cp2=db2.example")))
    assert named["raft"]["bind_addr"] == "0.0.0.0:5011"  # a name may not be this machine's own address
    assert named["raft"]["password"] == p.passwords["raft"]
    assert "etcd3" not in first
    assert first["watchdog"] == {"mode": "off"}


def test_patroni_yml_with_etcd_names_its_hosts_and_no_raft() -> None:
    p = plan(etcd=["http://10.0.0.9:2379", "http://10.0.0.8:2379"])
    doc = yaml.safe_load(patroni_yml(p, Member.parse("cp2=db2.example")))
    assert doc["etcd3"] == {"hosts": ["10.0.0.9:2379", "10.0.0.8:2379"], "protocol": "http"}
    assert "raft" not in doc
    assert doc["postgresql"]["listen"] == "0.0.0.0:5432"  # a name: bind every interface
    assert doc["postgresql"]["connect_address"] == "db2.example:5432"


def test_the_patroni_unit_runs_patroni_as_postgres() -> None:
    body = patroni_unit(Paths(Path("/")), Path("/opt/llmgw/patroni-4.1.5"), Path("/var/lib/llmgw-patroni/patroni.yml"))
    spec = parse_unit(body)
    assert spec.argv == ["/opt/llmgw/patroni-4.1.5/bin/patroni", "/var/lib/llmgw-patroni/patroni.yml"]
    assert (spec.user, spec.group, spec.restart, spec.restart_sec, spec.stop_timeout) == (
        "postgres", "postgres", "on-failure", 2.0, 60.0)
    check_service("patroni")  # a service the manager and 'llmgw service' take by name


# --- bad flags -----------------------------------------------------------------------------------


def test_a_bad_control_plane_flag_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "root"
    code, out = init_cli(root, "--control-plane", "cp1=10.0.0.1", "--control-plane", "cp1=10.0.0.2")
    assert code == 2
    assert "the control plane name 'cp1' is given twice" in out
    assert written(root) == []


def test_join_with_no_bundle_says_what_to_copy(tmp_path: Path) -> None:
    root = tmp_path / "root"
    code, out = init_cli(root, "--join", str(tmp_path / "nope"))
    assert code == 2
    assert "no such directory; copy there what 'llmgw server add-control-plane' wrote" in out
    assert written(root) == []


# --- the bundle and --join -----------------------------------------------------------------------


def first_control_plane(root: Path) -> Paths:
    """A first control plane's files as HA init leaves them (no services)."""
    paths = Paths(root)
    ctx = InitContext(paths, InitOptions(hosts=["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
                      SupervisorManager(paths), out=io.StringIO())
    pki.run(ctx)
    serveryaml.run(ctx)
    p = plan()
    (paths.etc / "ha.yaml").write_text(p.to_yaml())
    with paths.server_config.open("a") as f:
        f.write(database.server_yaml_block(p, p.members[0], "https://10.0.0.1:7443"))
    return paths


def test_add_control_plane_writes_a_private_bundle_for_the_standby(tmp_path: Path) -> None:
    paths = first_control_plane(tmp_path / "cp1")
    assert load_server_config(paths.server_config).cluster.name == "cp1"
    out = tmp_path / "bundle"
    files = add_control_plane(paths, "cp2", out, address="10.0.0.2")
    assert [f.name for f in files] == ["ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "admin-token",
                                       "client-keys", "ha.yaml", "ha-me", "server.yaml"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}
    assert {"10.0.0.1", "10.0.0.2", "10.0.0.3"} <= set(cert_hosts(out / "server.pem"))
    cert = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "10.0.0.2"
    assert (out / "ha-me").read_text() == "cp2\n"
    assert (out / "admin-token").read_bytes() == paths.admin_token.read_bytes()
    doc = yaml.safe_load((out / "server.yaml").read_text())
    assert doc["cluster"]["name"] == "cp2"
    assert doc["cluster"]["agent_url"].startswith("https://10.0.0.2:")
    assert doc["store"]["url"] == HaPlan.load(paths.etc / "ha.yaml").store_url()
    assert doc["tls"]["ca"] == "/etc/llmgw/pki/ca.pem"

    with pytest.raises(ConfigError, match="is not empty"):
        add_control_plane(paths, "cp2", out, address="10.0.0.2")
    with pytest.raises(ConfigError, match=r"cp3 is at 10\.0\.0\.3 .* not 10\.9\.9\.9"):
        add_control_plane(paths, "cp3", tmp_path / "b3", address="10.9.9.9")
    with pytest.raises(ConfigError, match="no control plane 'cp9'"):
        add_control_plane(paths, "cp9", tmp_path / "b9", address="10.0.0.9")
    with pytest.raises(ConfigError, match="the first control plane itself"):
        add_control_plane(paths, "cp1", tmp_path / "b1", address="10.0.0.1")


def test_add_node_on_an_ha_cluster_names_every_control_plane(tmp_path: Path) -> None:
    """A node added on an HA cluster can reach any control plane before its first reply: agent.yaml's
    ``server`` is this one, ``servers`` the others (the agent rotates through them)."""
    paths = first_control_plane(tmp_path / "cp1")
    add_node(paths, "gpu-1", tmp_path / "node", address="10.0.0.7")
    cfg = load_agent_config(tmp_path / "node" / "agent.yaml")
    port = cfg.server.rsplit(":", 1)[1]
    assert cfg.server == f"https://10.0.0.1:{port}"
    assert cfg.servers == [f"https://10.0.0.2:{port}", f"https://10.0.0.3:{port}"]
    assert cfg.control_planes == [cfg.server, *cfg.servers]


def test_add_node_names_a_standby_at_the_agent_url_it_wrote_itself(tmp_path: Path) -> None:
    """A new user's cp3 joined with its own --agent-listen port; add-node listed it at this control
    plane's port, where nothing listens. The URLs the control planes wrote (``GET /api/v1/cluster``,
    asked by the CLI) win; a member without a row yet keeps the guess."""
    paths = first_control_plane(tmp_path / "cp1")
    add_node(paths, "gpu-1", tmp_path / "node", address="10.0.0.7", known={"cp3": "https://10.0.0.3:21643"})
    cfg = load_agent_config(tmp_path / "node" / "agent.yaml")
    port = cfg.server.rsplit(":", 1)[1]
    assert cfg.servers == [f"https://10.0.0.2:{port}", "https://10.0.0.3:21643"]


def test_add_node_on_a_single_machine_install_names_one_control_plane(tmp_path: Path) -> None:
    paths = first_control_plane(tmp_path / "cp1")
    (paths.etc / "ha.yaml").unlink()
    add_node(paths, "cpu-1", tmp_path / "node", address="10.0.0.7")
    assert load_agent_config(tmp_path / "node" / "agent.yaml").servers == []


CPS = ["https://10.0.0.1:7443", "https://10.0.0.2:7443", "https://10.0.0.3:7443"]


def init_agent_yaml(tmp_path: Path, servers: list[str] | None = None, hosts: tuple[str, ...] = ("10.0.0.1",)) -> Path:
    """agent.yaml as init's node step writes it (its advertise address from ``own_advertise``)."""
    conf = tmp_path / "agent.yaml"
    conf.write_text(files.agent_yaml(
        server=CPS[0], node_id="cp1", etc=tmp_path, label_key="llmgw.control-plane", label_value="true",
        llama_server=Path("/opt/llama-server"), servers=servers, advertise=own_advertise(list(hosts), servers or [])))
    return conf


def test_the_agent_yaml_init_writes_on_an_ha_control_plane_names_every_control_plane(tmp_path: Path) -> None:
    """Issue 19, item 6: init's own node named only ``server``; restarted while that control plane
    was down it was marked lost though the others were up. Now ``servers`` are the others."""
    cfg = load_agent_config(init_agent_yaml(tmp_path, CPS[1:]))
    assert cfg.control_planes == CPS
    assert cfg.engines.llamacpp.binary == Path("/opt/llama-server")
    (tmp_path / "single").mkdir()
    assert load_agent_config(init_agent_yaml(tmp_path / "single")).control_planes == CPS[:1]


def test_init_s_own_node_on_an_ha_cluster_advertises_its_member_address_not_loopback(tmp_path: Path) -> None:
    """A new user's HA node advertised 127.0.0.1 (engines bound loopback): the other control planes'
    gateways, on other machines, would dial their own loopback for its replicas. On one machine
    loopback stays (nothing else calls the engines)."""
    assert own_advertise(["10.0.0.1", "cp1.example"], CPS[1:]) == "10.0.0.1"
    assert own_advertise(["[fd00::1]"], CPS[1:]) == "fd00::1"
    assert own_advertise(["10.0.0.1"], []) == "127.0.0.1"
    conf = init_agent_yaml(tmp_path, CPS[1:])
    assert load_agent_config(conf).advertise_address == "10.0.0.1"
    assert "every control plane's gateway calls them here" in conf.read_text()
    (tmp_path / "single").mkdir()
    assert load_agent_config(init_agent_yaml(tmp_path / "single")).advertise_address == "127.0.0.1"


def test_a_rerun_adds_the_missing_control_planes_keeping_the_rest_and_a_backup(tmp_path: Path) -> None:
    conf = init_agent_yaml(tmp_path)  # as init wrote it before: the first control plane alone
    old = conf.read_text()
    conf.write_text(old + "# the operator's note\n")
    old = conf.read_text()
    got = agentconf.add_servers(conf, CPS, now=0)
    assert got.added == CPS[1:]
    assert got.backup is not None
    assert got.backup.read_text() == old
    assert got.backup.name.startswith("agent.yaml.bak-")
    text = conf.read_text()
    assert text.startswith(old)  # comments, the engine and the note kept
    cfg = load_agent_config(conf)
    assert cfg.control_planes == CPS
    assert cfg.engines.llamacpp.binary == Path("/opt/llama-server")
    again = agentconf.add_servers(conf, CPS)
    assert again.added == []
    assert again.backup is None
    assert conf.read_text() == text


@pytest.mark.parametrize("servers", [
    "servers:\n  - https://10.0.0.9:7443  # added by hand\n  - https://10.0.0.2:7443\n\n# tail\nlabels: {}\n",
    "servers: [https://10.0.0.9:7443, https://10.0.0.2:7443]\nlabels: {}\n",
    "servers:\n- https://10.0.0.9:7443\n- https://10.0.0.2:7443\nlabels: {}\n",
])
def test_servers_already_there_stay_first_and_in_their_order(tmp_path: Path, servers: str) -> None:
    conf = tmp_path / "agent.yaml"
    conf.write_text(f"server: {CPS[0]}\nnode_id: n1\n{servers}"
                    "tls: {ca: /x/ca.pem, cert: /x/agent.pem, key: /x/agent-key.pem}\n")
    got = agentconf.add_servers(conf, CPS)
    assert got.added == [CPS[2]]
    cfg = load_agent_config(conf)
    assert cfg.servers == ["https://10.0.0.9:7443", CPS[1], CPS[2]]
    assert cfg.node_id == "n1"
    assert cfg.labels == {}


def test_an_agent_yaml_that_does_not_load_is_left_as_it_is_with_a_clear_error(tmp_path: Path) -> None:
    conf = tmp_path / "agent.yaml"
    conf.write_text("server: [unclosed\n")
    with pytest.raises(ConfigError) as err:
        agentconf.add_servers(conf, CPS)
    assert str(conf) in str(err.value)
    assert "is left as it is" in str(err.value)
    assert "run init again" in str(err.value)
    assert conf.read_text() == "server: [unclosed\n"
    assert [p.name for p in tmp_path.iterdir()] == ["agent.yaml"]


def test_join_installs_the_bundle_with_this_machine_s_paths_then_keeps_it(tmp_path: Path) -> None:
    first = first_control_plane(tmp_path / "cp1")
    add_control_plane(first, "cp2", tmp_path / "bundle", address="10.0.0.2")
    standby = Paths(tmp_path / "cp2")
    b = check_bundle(tmp_path / "bundle", standby)
    assert (b.me.name, len(b.plan.members)) == ("cp2", 3)
    tags = install_bundle(b, standby)
    assert {t for t, _ in tags} == {"done"}
    cfg = load_server_config(standby.server_config)
    assert cfg.tls.ca == standby.pki / "ca.pem"
    assert cfg.cluster.name == "cp2"
    assert (standby.pki / "ca.pem").read_bytes() == (first.pki / "ca.pem").read_bytes()
    assert stat.S_IMODE((standby.pki / "ca-key.pem").stat().st_mode) == 0o600
    again = install_bundle(check_bundle(tmp_path / "bundle", standby), standby)
    assert {t for t, _ in again} == {"kept"}


def test_join_refuses_a_bundle_from_another_cluster_s_ca(tmp_path: Path) -> None:
    first = first_control_plane(tmp_path / "cp1")
    add_control_plane(first, "cp2", tmp_path / "bundle", address="10.0.0.2")
    other = first_control_plane(tmp_path / "elsewhere")  # a machine already in another cluster
    with pytest.raises(PkiError, match="this machine already has another cluster's CA"):
        check_bundle(tmp_path / "bundle", other)
    assert not (other.etc / "ha-me").exists()


def test_join_on_a_member_of_the_same_cluster_says_where_to_run_it_not_to_remove_anything(tmp_path: Path) -> None:
    """A new user ran cp2's bundle on cp1 (the primary, the leader) and was told to remove its
    server.pem "(or /etc/llmgw)": that advice destroys a live member. Now: which member this machine
    is, where the bundle belongs, and that nothing needs removing."""
    first = first_control_plane(tmp_path / "cp1")
    (first.etc / "ha-me").write_text("cp1\n")
    add_control_plane(first, "cp2", tmp_path / "bundle", address="10.0.0.2")
    before = written(tmp_path / "cp1")
    with pytest.raises(ConfigError) as e:
        check_bundle(tmp_path / "bundle", first)
    assert str(e.value).startswith("this machine is already control plane cp1 of a cluster")
    assert "this bundle is for cp2 at 10.0.0.2: run 'llmgw server init --join DIR' on that machine" in str(e.value)
    assert "nothing here needs removing" in str(e.value)
    assert written(tmp_path / "cp1") == before


def test_join_refuses_a_bundle_whose_certificate_another_ca_signed(tmp_path: Path) -> None:
    first = first_control_plane(tmp_path / "cp1")
    bundle = tmp_path / "bundle"
    add_control_plane(first, "cp2", bundle, address="10.0.0.2")
    CA.create().issue_server(["10.0.0.2"]).write(bundle, "server")
    with pytest.raises(PkiError, match=r"was not signed by .*ca\.pem"):
        check_bundle(bundle, Paths(tmp_path / "cp2"))
    code, out = init_cli(tmp_path / "cp2", "--join", str(bundle))
    assert code != 0
    assert "refusing to join" in out
    assert written(tmp_path / "cp2") == []


@contextlib.contextmanager
def tls_server(ca: CA, tmp: Path) -> Iterator[int]:
    """A TLS listener on 127.0.0.1 presenting a server certificate of ``ca`` (as a control plane's
    agent API does); yields its port. Handshakes until the block ends."""
    tmp.mkdir(parents=True)
    cert, key = ca.issue_server(["127.0.0.1"]).write(tmp, "server")
    ca.write(tmp / "pki")
    ctx = server_context(tmp / "pki" / "ca.pem", cert, key)
    ctx.verify_mode = ssl.CERT_NONE  # the agent API wants client certs; the join check sends none
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with contextlib.suppress(OSError), ctx.wrap_socket(conn, server_side=True):
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        done.set()
        t.join()
        srv.close()


def loopback_bundle(tmp: Path, ca: CA, agent_port: int) -> Bundle:
    """A standby bundle for cp2 of a cluster whose first control plane is on 127.0.0.1:``agent_port``."""
    d = tmp / "bundle"
    d.mkdir(parents=True)
    ca.write(d / "x")
    (d / "ca.pem").write_bytes((d / "x" / "ca.pem").read_bytes())
    ca.issue_server(["127.0.0.1"]).write(d, "server")
    (d / "server.yaml").write_text(yaml.safe_dump({
        "agent_listen": f"127.0.0.1:{agent_port}",
        "tls": {"ca": str(d / "ca.pem"), "cert": str(d / "server.pem"), "key": str(d / "server-key.pem")},
    }))
    p = HaPlan(members=[Member.parse("cp1=127.0.0.1:5432"), Member.parse("cp2=127.0.0.2:5432")])
    return Bundle(d, p, p.members[1])


def test_join_asks_the_first_control_plane_whether_the_bundle_is_its_cluster_s(tmp_path: Path) -> None:
    """A bundle whose four PKI files all come from another CA is consistent in itself (a new
    operator's bundle joined and started a control plane the cluster's CA does not accept): the
    first control plane's agent API must verify with the bundle's CA, over real TLS."""
    cluster = CA.create()
    with tls_server(cluster, tmp_path / "cp1") as port:
        ours = loopback_bundle(tmp_path / "ours", cluster, port)
        assert check_cluster_ca(ours) == f"127.0.0.1:{port}"
        foreign = loopback_bundle(tmp_path / "foreign", CA.create(), port)
        with pytest.raises(PkiError, match=r"refusing to join: the first control plane cp1 at 127\.0\.0\.1:\d+ "
                                           r"presents a certificate that .* does not accept"):
            check_cluster_ca(foreign)
    with pytest.raises(UnreachableError, match=r"the first control plane cp1 does not answer .* start it"):
        check_cluster_ca(ours, timeout_s=1.0)


JOIN_FLAGS = {"--join", "--admin-listen", "--agent-listen", "--gateway-listen"}
"""What ``init --join`` takes beyond the places of Patroni and PostgreSQL: the listen flags replace
the first control plane's in the standby's server.yaml (steps/join.py); ``--control-plane`` is
refused with it, the mirror's are not used."""


def _free_pg_port() -> int:
    """A PostgreSQL port whose REST API (+2576) and raft (-421) ports are free on 127.0.0.1 too."""
    for _ in range(200):
        port = free_port()
        if 1500 < port < 60000 and all(_bindable(p) for p in (port + 2576, port - 421)):
            return port
    raise AssertionError("no free PostgreSQL port with free REST and raft ports")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_join_checks_its_ports_before_it_copies_anything_and_names_only_flags_join_takes(tmp_path: Path) -> None:
    """Issue 19, item 7, through the real CLI in a child process: a standby whose gateway port and
    PostgreSQL port are taken (real listening sockets). Before, --join copied the bundle (the CA key,
    ha.yaml with the database passwords) into /etc/llmgw, then refused on the port, suggesting
    --control-plane, which --join refuses. Now each refusal comes before any file is written, and
    following its advice (the listen flag it names) gets past it to the next one."""
    cluster_root = tmp_path / "cp1"
    first = Paths(cluster_root)
    pg = [_free_pg_port(), _free_pg_port()]
    taken_gateway = free_port()
    ctx = InitContext(first, InitOptions(hosts=["127.0.0.1"], gateway_listen=f"127.0.0.1:{taken_gateway}"),
                      SupervisorManager(first), out=io.StringIO())
    pki.run(ctx)
    standby = Path(tempfile.mkdtemp(prefix="llmgw-join-"))  # postgres must reach its patroni dir
    standby.chmod(0o755)
    try:
        with tls_server(CA.load(first.pki), tmp_path / "tls") as agent_port:  # the first's agent API answers
            ctx.opts.agent_listen = f"127.0.0.1:{agent_port}"
            serveryaml.run(ctx)
            p = HaPlan(members=[Member.parse(f"cp1=127.0.0.1:{pg[0]}"), Member.parse(f"cp2=127.0.0.1:{pg[1]}")])
            (first.etc / "ha.yaml").write_text(p.to_yaml())
            with first.server_config.open("a") as f:
                f.write(database.server_yaml_block(p, p.members[0], f"https://127.0.0.1:{agent_port}"))
            bundle = tmp_path / "bundle"
            add_control_plane(first, "cp2", bundle, address="127.0.0.1")
            said: list[str] = []
            given = ["--admin-listen", f"127.0.0.1:{free_port()}"]
            with socket.create_server(("127.0.0.1", taken_gateway)), socket.create_server(("127.0.0.1", pg[1])):
                # Each refusal's advice, followed, gets past it to the next; none copies anything. The
                # listeners' taken ports come in one refusal (a new user learned of them in three runs).
                for refusal, advice in (
                    (f"ports {agent_port} (agent-listen, 127.0.0.1:{agent_port}), {taken_gateway} (gateway-listen, "
                     f"127.0.0.1:{taken_gateway}) are already taken", ["--agent-listen", "--gateway-listen"]),
                    (f"control plane cp2: PostgreSQL port 127.0.0.1:{pg[1]} is already in use", []),
                ):
                    r = llmgw(standby, "server", "init", "--join", str(bundle), *given, timeout=60)
                    out = r.stdout + r.stderr
                    said.append(out)
                    assert r.returncode != 0, out
                    assert refusal in out, out
                    assert written(standby) == [], out
                    if advice:
                        assert f"other addresses with {' '.join(advice)}; nothing of the bundle was copied" in out
                        for flag in advice:
                            given += [flag, f"127.0.0.1:{free_port()}"]
                    else:
                        assert "Stop it and run init --join again" in out
            flags = {f for text in said for f in re.findall(r"(?<![\w-])--[a-z][a-z-]+", text)}
            assert flags <= JOIN_FLAGS, flags
    finally:
        shutil.rmtree(standby, ignore_errors=True)


def test_add_control_plane_cli_on_a_machine_without_ha_says_what_to_run(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["--root", str(tmp_path), "server", "add-control-plane", "cp2",
                                 "--address", "10.0.0.2", "--out", str(tmp_path / "b")])
    assert r.exit_code != 0
    assert "not the first control plane of an HA cluster" in r.output


def test_missing_postgresql_binaries_are_named_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "root"
    code, out = init_cli(root, "--control-plane", "cp1=10.0.0.1", "--pg-bin-dir", str(tmp_path / "nopg"))
    assert code == 2
    assert f"PostgreSQL 15 is not in {tmp_path / 'nopg'}: apt-get install postgresql-15, or give --pg-bin-dir" in out
    assert written(root) == []


def test_offline_without_a_patroni_venv_says_to_carry_one_in(tmp_path: Path) -> None:
    root = tmp_path / "root"
    if not (Path("/usr/lib/postgresql/15/bin/postgres")).exists():
        skip_or_fail("needs the PostgreSQL 15 binaries (/usr/lib/postgresql/15/bin) to get past their check")
    code, out = init_cli(root, "--control-plane", "cp1=10.0.0.1", "--patroni-venv", str(tmp_path / "novenv"))
    assert code == 2
    assert f"--offline and no Patroni at {tmp_path / 'novenv'}/bin/patroni" in out
    assert written(root) == []


def test_ha_prepare_names_every_control_plane_and_opens_the_mirror_to_them(tmp_path: Path) -> None:
    """What HA changes in the other steps: certificate names, the mirror's API and its allow list,
    two judges. Runs only the checks (no file is written)."""
    if not (Path("/usr/lib/postgresql/15/bin/postgres")).exists():
        skip_or_fail("needs the PostgreSQL 15 binaries (/usr/lib/postgresql/15/bin) to get past their check")
    paths = Paths(tmp_path)
    opts = InitOptions(control_planes=SPECS, hosts=["cp1.example"], patroni_venv=Path("/nonexistent"),
                       patroni_dir=Path("/nonexistent/patroni"))
    ctx = InitContext(paths, opts, SupervisorManager(paths), out=io.StringIO())
    me = ha.prepare(ctx)
    assert me.name == "cp1"
    assert opts.hosts == ["10.0.0.1", "cp1.example", "10.0.0.2", "10.0.0.3"]
    assert (opts.mirror_api_listen, ctx.local_mirror_api()) == (":8082", "http://10.0.0.1:8082")
    assert ctx.mirror_allow == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert opts.judge_replicas == 2
    assert list(tmp_path.iterdir()) == []


def test_a_venv_that_pip_cannot_make_is_removed_and_pip_s_words_shown(tmp_path: Path) -> None:
    """pip's failure is simulated (no network is needed to show what init says about it)."""
    venv = tmp_path / "patroni"
    calls: list[list[str]] = []

    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        if argv[1:3] == ["-m", "venv"]:
            venv.joinpath("bin").mkdir(parents=True)
            return subprocess.CompletedProcess(argv, 0, "", "")
        return subprocess.CompletedProcess(argv, 1, "", "ERROR: No matching distribution found for patroni")

    with pytest.raises(ServiceError, match="No matching distribution found for patroni"):
        ensure_venv(venv, run=run)
    assert calls[1] == [str(venv / "bin" / "pip"), "install", "-q", "patroni[psycopg3,raft,etcd3]==4.1.5"]
    assert not venv.exists()
    with pytest.raises(ServiceError, match="under /root, which the postgres user cannot read"):
        ensure_venv(Path("/root/patroni"), run=run)
    with pytest.raises(ServiceError, match="--offline"):
        ensure_venv(venv, offline=True, run=run)


def test_a_patroni_dir_the_postgres_user_cannot_reach_is_refused(tmp_path: Path) -> None:
    if not (Path("/usr/lib/postgresql/15/bin/postgres")).exists():
        skip_or_fail("needs the PostgreSQL 15 binaries (/usr/lib/postgresql/15/bin) to get past their check")
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "patroni").write_text("#!/bin/sh\n")
    (venv / "bin" / "patroni").chmod(0o755)
    root = tmp_path / "root"
    code, out = init_cli(root, "--control-plane", "cp1=10.0.0.1", "--patroni-venv", str(venv),
                         "--patroni-dir", str(closed / "patroni"))
    assert code == 2
    assert f"the postgres user cannot reach {closed / 'patroni'}" in out
    assert "is not searchable by others" in out
    assert written(root) == []


def test_a_new_password_never_reads_as_a_command_line_option() -> None:
    """``syncobj_admin -pass PW`` (and any CLI) takes a leading ``-`` for an option: token_urlsafe's
    passwords began with one 1 time in 64 (in 1,000 draws: all but certain)."""
    from llmgw.serverinit.patroni import _new_password  # noqa: PLC0415

    drawn = [_new_password() for _ in range(1000)]
    assert not [p for p in drawn if p.startswith("-")]
    assert all(len(p) == 48 and p.isalnum() for p in drawn)
