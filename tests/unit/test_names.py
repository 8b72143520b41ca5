"""One rule for names (llmgw.names) at every entry point, and duplicate YAML keys
refused in every file llmgw reads.

Entry points: the admin API (real HTTP), model.yaml through ``ctl model add -f`` (the real CLI
against a real admin API), ``server add-node``, agent.yaml, heartbeat labels and the certificate's
CN at the agent API (real mTLS).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from aiohttp import web
from typer.testing import CliRunner

from llmgw import tlsconf, yamlsafe
from llmgw.agent.node.discovery import load_inventory_file
from llmgw.cli.ctl import app as ctl_app
from llmgw.config import load_agent_config, load_server_config
from llmgw.control.api.admin import build_admin_app
from llmgw.control.api.agent import build_agent_app
from llmgw.control.store import Store
from llmgw.errors import ConfigError
from llmgw.names import check_label_key, check_labels, check_name
from llmgw.paths import Paths
from llmgw.serverinit import files
from llmgw.serverinit.onboard import add_node
from tests.helpers.gateway import ServerThread

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

GOOD_NAMES = ["gemma-3-270m", "qwen2.5-0.5b-instruct", "q4_k_m", "1", "a" * 63, "node-1.example.com"]
BAD_NAMES = ["", "Gemma", "bad name", "../etc", ".hidden", "-x", "a/b", "a" * 64, "é", "x\n", "a;b"]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_good_names(name: str) -> None:
    assert check_name(name, "model name") == name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_say_the_rule(name: str) -> None:
    with pytest.raises(ValueError, match="1-63 characters: lowercase letters, digits"):
        check_name(name, "model name")


@pytest.mark.parametrize("key", ["gpu.vendor", "example.com/zone", "llmgw.control-plane", "zone", "a_b"])
def test_good_label_keys(key: str) -> None:
    assert check_label_key(key) == key


@pytest.mark.parametrize("key", ["", "Zone", "bad key", "/x", "a/", "example.com/", "a/b/c", "x=y", "a" * 64])
def test_bad_label_keys(key: str) -> None:
    with pytest.raises(ValueError, match="is not a valid label key"):
        check_label_key(key)


@pytest.mark.parametrize("value", ["", "true", "x", "A1", "a.b_c-d", "a" * 63])
def test_good_label_values(value: str) -> None:
    assert check_labels({"zone": value}) == {"zone": value}


@pytest.mark.parametrize("value", ["x\ny", "x\n", "-a", "a.", "has space", "a" * 64, "é", "a/b"])
def test_bad_label_values(value: str) -> None:
    """A new user's report: ``{"k": "x\ny"}`` was accepted as a label value."""
    with pytest.raises(ValueError, match="is not a valid label value"):
        check_labels({"zone": value})


# --- the admin API and ctl ---------------------------------------------------------------------


@dataclass
class Admin:
    url: str
    store: Store


@pytest.fixture
def admin(store: Store) -> Iterator[Admin]:
    servers = ServerThread()
    port = servers.serve(build_admin_app(store, token=TOKEN))
    yield Admin(f"http://127.0.0.1:{port}", store)
    servers.close()


def model(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": "chat", "source": "http://m/chat.gguf", "profiles": [{"name": "cpu"}]}
    doc.update(over)
    return doc


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"name": "Bad Name"}, "name"),
        ({"aliases": ["Default"]}, "aliases"),
        ({"aliases": ["ok", "has space"]}, "aliases"),
        ({"version": "../../etc"}, "version"),
        ({"version": "Q4_K_M"}, "version"),
        ({"version": "a" * 64}, "version"),
        ({"profiles": [{"name": "cpu", "node_selector": {"Bad Key": "x"}}]}, "node_selector"),
        ({"profiles": [{"name": "cpu", "node_selector": {"k": "x\ny"}}]}, "node_selector"),
    ],
)
def test_admin_api_refuses_bad_names(admin: Admin, over: dict[str, Any], field: str) -> None:
    r = httpx.post(admin.url + "/api/v1/models", json=model(**over), headers=AUTH)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert field in msg
    assert "1-63 characters" in msg or "label key" in msg or "label value" in msg
    assert admin.store.list_models() == []


def test_admin_api_refuses_bad_names_on_patch_too(admin: Admin) -> None:
    assert httpx.post(admin.url + "/api/v1/models", json=model(), headers=AUTH).status_code == 201
    r = httpx.patch(admin.url + "/api/v1/models/chat", json={"aliases": ["A B"]}, headers=AUTH)
    assert r.status_code == 400
    assert "'A B' is not a valid alias" in r.json()["error"]["message"]


def test_ctl_model_add_refuses_bad_names_and_duplicate_keys(admin: Admin, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: chat\nsource: http://m/chat.gguf\nversion: ../up\nprofiles: [{name: cpu}]\n")
    out = CliRunner().invoke(ctl_app, ["model", "add", "-f", str(bad), "--server", admin.url, "--token", TOKEN])
    assert out.exit_code != 0
    assert "'../up' is not a valid version" in out.output

    dup = tmp_path / "dup.yaml"
    dup.write_text(
        "name: chat\nsource: http://m/chat.gguf\nprofiles:\n  - name: cpu\n    min_memory_gb: 1\n"
        "    min_memory_gb: 100\n"
    )
    out = CliRunner().invoke(ctl_app, ["model", "add", "-f", str(dup), "--server", admin.url, "--token", TOKEN])
    assert out.exit_code == 2, out.output
    assert "key 'min_memory_gb' appears twice (lines 5 and 6)" in out.output
    assert admin.store.list_models() == []


def test_ctl_model_add_with_a_field_missing_points_at_model_yaml_s_fields(admin: Admin, tmp_path: Path) -> None:
    """A model.yaml without ``source``: the error names the field and where model.yaml's fields are
    written down (it named the field only: a reviewer's finding); a refusal that is not about the
    file's fields (a name already taken) does not."""
    f = tmp_path / "m.yaml"
    f.write_text("name: chat\nprofiles: [{name: cpu}]\n")
    argv = ["model", "add", "-f", str(f), "--server", admin.url, "--token", TOKEN]
    out = CliRunner().invoke(ctl_app, argv)
    assert out.exit_code == 1, out.output
    assert "source: Field required" in out.output
    assert "docs/operating.md, 'Adding a model'" in out.output
    assert admin.store.list_models() == []
    f.write_text("name: chat\nsource: http://m/chat.gguf\nprofiles: [{name: cpu, min_memory_gb: 1}]\n")
    assert CliRunner().invoke(ctl_app, argv).exit_code == 0
    out = CliRunner().invoke(ctl_app, argv)
    assert out.exit_code == 1, out.output
    assert "already" in out.output
    assert "docs/operating.md" not in out.output


# --- nodes: add-node, agent.yaml, heartbeats, certificates ---------------------------------------


@pytest.fixture
def cluster(tmp_path: Path) -> Paths:
    paths = Paths(tmp_path / "root")
    ca = tlsconf.CA.create()
    ca.write(paths.pki)
    ca.issue_server(["cp.example"]).write(paths.pki, "server")
    files.write_atomic(paths.server_config, files.server_yaml(
        admin_listen="127.0.0.1:9090", agent_listen=":7443", gateway_listen=":8080", pki=paths.pki,
        keys_file=paths.client_keys))
    return paths


@pytest.mark.parametrize("node", ["Node-1", "node 1", "../x", "n" * 64])
def test_add_node_refuses_a_bad_id(cluster: Paths, tmp_path: Path, node: str) -> None:
    with pytest.raises(ConfigError, match="is not a valid node id"):
        add_node(cluster, node, tmp_path / "out", address="10.0.0.2")
    assert not (tmp_path / "out").exists()


def test_add_node_refuses_a_bad_label_key(cluster: Paths, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'Zone' is not a valid label key"):
        add_node(cluster, "node-2", tmp_path / "out", address="10.0.0.2", labels={"Zone": "a"})


AGENT_YAML = """\
server: https://cp:7443
node_id: {node}
tls: {{ca: /a, cert: /b, key: /c}}
labels: {{{labels}}}
"""


@pytest.mark.parametrize(
    ("node", "labels", "says"),
    [
        ("Node_A", "", "node_id: Value error, 'Node_A' is not a valid node id"),
        ("node-a", "'bad key': x", "labels: Value error, 'bad key' is not a valid label key"),
    ],
)
def test_agent_yaml_checks_node_id_and_labels(tmp_path: Path, node: str, labels: str, says: str) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(AGENT_YAML.format(node=node, labels=labels))
    with pytest.raises(ConfigError, match=says):
        load_agent_config(path)


@dataclass
class Agent:
    url: str
    ca: tlsconf.CA
    dir: Path


@pytest.fixture
def agent_api(store: Store, tmp_path: Path) -> Iterator[Agent]:
    ca = tlsconf.CA.create()
    ca.write(tmp_path)
    cert, key = ca.issue_server(["127.0.0.1"]).write(tmp_path, "server")
    servers = ServerThread()

    async def start() -> int:
        runner = web.AppRunner(build_agent_app(store))
        await runner.setup()
        ctx = tlsconf.server_context(tmp_path / "ca.pem", cert, key)
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx).start()
        servers._runners.append(runner)
        port: int = runner.addresses[-1][1]
        return port

    port = servers.run(start())
    yield Agent(f"https://127.0.0.1:{port}", ca, tmp_path)
    servers.close()
    assert [n.id for n in store.list_nodes()] in ([], ["node-ok"])


def _beat(agent: Agent, cn: str, labels: dict[str, str]) -> httpx.Response:
    cert, key = agent.ca.issue_client(cn).write(agent.dir, "client")
    ctx = tlsconf.client_context(agent.dir / "ca.pem", cert, key)
    body = json.dumps({"inventory": {"cores": 1, "memory_total_bytes": 1, "memory_available_bytes": 1},
                       "labels": labels})
    with httpx.Client(verify=ctx, timeout=30) as c:
        return c.post(agent.url + "/agent/v1/heartbeat", content=body)


def test_heartbeat_labels_follow_the_rule(agent_api: Agent) -> None:
    r = _beat(agent_api, "node-ok", {"Bad Key": "x"})
    assert r.status_code == 400, r.text
    assert "'Bad Key' is not a valid label key" in r.json()["error"]["message"]
    assert _beat(agent_api, "node-ok", {"example.com/zone": "a"}).status_code == 200


@pytest.mark.parametrize("cn", ["Node-Upper", "bad cn", "x" * 64])
def test_a_certificate_whose_cn_is_not_a_node_id_is_refused(agent_api: Agent, cn: str) -> None:
    r = _beat(agent_api, cn, {})
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "invalid_node_id"


# --- duplicate YAML keys -------------------------------------------------------------------------


def test_yamlsafe_refuses_duplicates_at_any_depth_and_keeps_merges() -> None:
    with pytest.raises(yamlsafe.DuplicateKeyError, match=r"key 'a' appears twice \(lines 1 and 2\)"):
        yamlsafe.load("a: 1\na: 2\n")
    with pytest.raises(yamlsafe.DuplicateKeyError, match=r"key 'y' appears twice \(lines 3 and 4\)"):
        yamlsafe.load("x:\n  - z: 1\n    y: 1\n    y: 2\n")
    assert yamlsafe.load("base: &b {k: 1}\nother:\n  <<: *b\n  j: 2\n") == {
        "base": {"k": 1}, "other": {"k": 1, "j": 2}}


def test_server_yaml_duplicate_keys_name_the_key_and_lines(cluster: Paths) -> None:
    text = cluster.server_config.read_text()
    cluster.server_config.write_text(text + "admin_listen: 0.0.0.0:9090\n")
    with pytest.raises(ConfigError, match="key 'admin_listen' appears twice"):
        load_server_config(cluster.server_config)


def test_guard_block_duplicate_keys_are_refused(cluster: Paths) -> None:
    text = cluster.server_config.read_text()
    guard = "guard:\n  policies:\n    - name: p\n      name: q\n"
    cluster.server_config.write_text(text + guard)
    with pytest.raises(ConfigError, match="key 'name' appears twice"):
        load_server_config(cluster.server_config)


def test_agent_yaml_duplicate_keys_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(AGENT_YAML.format(node="n1", labels="") + "node_id: n2\n")
    with pytest.raises(ConfigError, match=r"key 'node_id' appears twice \(lines 2 and 5\)"):
        load_agent_config(path)


def test_inventory_file_duplicate_keys_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text("cores: 4\ncores: 400\nmemory_total_bytes: 1\nmemory_available_bytes: 1\n")
    with pytest.raises(ConfigError, match="key 'cores' appears twice"):
        load_inventory_file(path)


def test_a_row_stored_before_the_rule_still_loads_and_a_write_must_fix_it(admin: Admin) -> None:
    spec = model(version="Q4_K_M", aliases=["Old Alias"])
    spec["profiles"] = [{"name": "cpu", "node_selector": {"Zone": "a"}}]
    with admin.store.engine.begin() as conn:  # type: ignore[attr-defined]  # by hand, as an older llmgw wrote it
        conn.execute(sa.text("INSERT INTO models VALUES ('chat', 1, :spec, 1.0, 1.0)"), {"spec": json.dumps(spec)})
    (row,) = admin.store.list_models()
    assert (row.model.version, row.model.aliases) == ("Q4_K_M", ["Old Alias"])
    r = httpx.patch(admin.url + "/api/v1/models/chat", json={"scaling": {"min": 0}}, headers=AUTH)
    assert r.status_code == 400
    assert "'Old Alias' is not a valid alias" in r.json()["error"]["message"]
    r = httpx.patch(admin.url + "/api/v1/models/chat", headers=AUTH, json={
        "version": "q4_k_m", "aliases": ["old-alias"], "profiles": [{"name": "cpu", "node_selector": {"zone": "a"}}]})
    assert r.status_code == 200, r.text


def test_init_does_not_append_a_second_block_of_a_key_already_there(cluster: Paths) -> None:
    before = cluster.server_config.read_text() + "guard: {policies: []}\n"
    cluster.server_config.write_text(before)
    with pytest.raises(ConfigError, match="key 'guard' appears twice"):
        files.append_block(cluster.server_config, files.guard_block("judge"))
    assert cluster.server_config.read_text() == before
