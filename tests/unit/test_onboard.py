"""``llmgw server add-node``: another machine's identity from the cluster CA, and its agent.yaml."""

from __future__ import annotations

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
    assert sorted(p.name for p in written) == ["agent-key.pem", "agent.pem", "agent.yaml", "ca.pem"]
    cert = x509.load_pem_x509_certificate((out / "agent.pem").read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node-b"
    assert (out / "agent-key.pem").stat().st_mode & 0o777 == 0o600
    # Signed by the cluster CA: a context trusting only the CA accepts it.
    ctx = ssl.create_default_context(cafile=str(out / "ca.pem"))
    ctx.load_cert_chain(str(out / "agent.pem"), str(out / "agent-key.pem"))
    cfg = load_agent_config(out / "agent.yaml")
    assert cfg.server == "https://cp.example:7443"  # the certificate's CN: init's first --host
    assert (cfg.node_id, cfg.advertise_address, cfg.labels) == ("node-b", "10.0.0.7", {"zone": "a"})
    assert cfg.tls.cert == Path("/etc/llmgw/agent.pem")
    assert cfg.engines.llamacpp.binary == Path("/opt/llama/llama-server")


def test_nothing_is_overwritten_and_bad_ids_are_named(cluster: Paths, tmp_path: Path) -> None:
    out = tmp_path / "n"
    add_node(cluster, "n1", out, address="10.0.0.8")
    with pytest.raises(ConfigError, match="already exists; give an empty directory"):
        add_node(cluster, "n1", out, address="10.0.0.8")
    with pytest.raises(ConfigError, match="is not a valid node id: 1-63 characters"):
        add_node(cluster, "bad id!", tmp_path / "x", address="10.0.0.8")


def test_without_the_ca_key_it_says_so(cluster: Paths, tmp_path: Path) -> None:
    (cluster.pki / "ca-key.pem").unlink()
    with pytest.raises(PkiError, match=r"the CA key .* is missing"):
        add_node(cluster, "n2", tmp_path / "y", address="10.0.0.9")
    assert not (tmp_path / "y").exists()
