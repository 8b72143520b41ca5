"""Another machine as a node: its identity from the cluster CA, and an agent.yaml naming the
control plane — what ``server init`` does for its own machine, packed into a directory to carry.

``llmgw server add-node NODE --out DIR`` (on the machine holding the CA key) writes
``DIR/ca.pem``, ``DIR/agent.pem`` (CN = NODE), ``DIR/agent-key.pem`` (0600) and ``DIR/agent.yaml``,
which names the other three by file name alone: :func:`~llmgw.config.load_agent_config` takes them
beside agent.yaml. On the node: copy DIR's files to ``/etc/llmgw`` (``$LLMGW_ROOT/etc/llmgw`` for an
agent run under ``--root``) and run ``llmgw agent`` (or install the agent unit); absolute
``/etc/llmgw/...`` paths, written before, failed under a root. Nothing is written when the CA
key is missing, the node id is not a valid name, or DIR already holds an identity.
"""

from __future__ import annotations

import ipaddress
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from llmgw.atomicfile import write_atomic
from llmgw.config import AgentConfig, load_server_config, parse_listen
from llmgw.errors import ConfigError, PkiError
from llmgw.names import check_labels, check_name
from llmgw.paths import Paths
from llmgw.serverinit.patroni import HaPlan
from llmgw.serverinit.plan import LOCAL_LABEL_KEY
from llmgw.serverinit.standby import agent_url
from llmgw.tlsconf import CA


@dataclass(frozen=True)
class Onboarded:
    """What :func:`add_node` wrote: ``files`` (CA, certificate, key, agent.yaml) and ``server``, the
    agent API URL agent.yaml names (given, or derived from the server certificate)."""

    files: list[Path]
    server: str


def add_node(paths: Paths, node_id: str, out: Path, *, address: str, server: str = "",
             labels: dict[str, str] | None = None, llama_server: Path | None = None,
             known: Mapping[str, str] | None = None) -> Onboarded:
    """Write a node's identity and agent.yaml into ``out``; return the files written and the agent
    API URL agent.yaml names.

    Args:
        node_id: the node's id, the CN of its certificate (:mod:`llmgw.names`: lowercase letters,
            digits, ``.``, ``_``, ``-``, at most 63).
        address: the node's address that the gateway dials its engines on (``advertise_address``).
        server: the agent API URL the node dials; default the server certificate's common name
            (init's first ``--host``, the address nodes use) and ``agent_listen``'s port.
        llama_server: the llama-server binary on the node (``engines.llamacpp.binary``); without
            it the node finds one on PATH or downloads the pinned release.
        labels: the node's labels (placement's ``node_selector`` matches them).
        known: the control planes' own agent URLs by name, for ``servers`` (:func:`ha_servers`).

    Raises:
        ConfigError: a bad node id or label, or ``out`` is not empty (an identity there is never
            overwritten; other files would be copied to the node with the bundle).
        PkiError: the CA key is not on this machine.
    """
    try:
        check_name(node_id, "node id")
        check_labels(labels or {})
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if LOCAL_LABEL_KEY in (labels or {}):  # a node given it could take them (a new user's finding)
        raise ConfigError(f"--label {LOCAL_LABEL_KEY} is llmgw's own: init pins the starter and the judges to the "
                          "control plane's machine with it; give the node another label")
    check_address(address)
    if out.is_dir() and (others := sorted(p.name for p in out.iterdir())):  # the bundle is copied whole (dir/*)
        raise ConfigError(f"{out} is not empty ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); "
                          "give an empty directory with --out: the node's files are copied from it whole")
    ca = CA.load(paths.pki)
    cfg = load_server_config(paths.server_config) if paths.server_config.exists() else None
    if not server:
        if cfg is None:
            raise ConfigError(f"{paths.server_config} does not exist; run 'llmgw server init' or pass --server")
        _h, port = parse_listen(cfg.agent_listen)
        server_cert = x509.load_pem_x509_certificate((paths.pki / "server.pem").read_bytes())
        cns = server_cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        host = str(cns[0].value) if cns else ""
        if not host:
            raise PkiError(f"{paths.pki / 'server.pem'} names no host; pass --server https://HOST:PORT")
        server = f"https://{'[' + host + ']' if ':' in host else host}:{port}"
    out.mkdir(parents=True, exist_ok=True)
    cert, key = ca.issue_client(node_id).write(out, "agent")
    shutil.copyfile(paths.pki / "ca.pem", out / "ca.pem")
    doc = {
        "server": server,
        "node_id": node_id,
        "tls": {"ca": "ca.pem", "cert": "agent.pem", "key": "agent-key.pem"},  # beside agent.yaml
        "labels": dict(sorted((labels or {}).items())),
        "advertise_address": address.strip("[]"),  # an address, not a URL host: engines bind it
    }
    others = ha_servers(paths, cfg.agent_listen if cfg else "", server, known)
    if others:
        doc["servers"] = others
    if llama_server is not None:
        doc["engines"] = {"llamacpp": {"binary": str(llama_server)}}
    body = "# A node of the llmgw cluster, written by 'llmgw server add-node'. Copy this directory's files to\n"
    body += "# /etc/llmgw on the node (or $LLMGW_ROOT/etc/llmgw), then run 'llmgw agent'. The tls files are\n"
    body += "# named relative to this file's directory.\n" + yaml.safe_dump(doc, sort_keys=False)
    AgentConfig.model_validate(doc)
    write_atomic(out / "agent.yaml", body, 0o644)
    return Onboarded([out / "ca.pem", cert, key, out / "agent.yaml"], server)


_LABEL = r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}\.?$){_LABEL}(\.{_LABEL})*\.?")
"""A host name (RFC 1123: labels of letters, digits and inner hyphens, 1-63 each, 253 in all; `_` let in
as well, as /etc/hosts and many resolvers take it)."""


def check_address(address: str) -> None:
    """``--address``: an IP address or a host name, which the gateway dials as ``ADDRESS:PORT``.

    Raises:
        ConfigError: anything else (a URL, a port, spaces), with what to give instead. A new user's
            ``--address 'not an address!!'`` was written into agent.yaml as it was.
    """
    try:
        ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        is_ip = False
    else:
        is_ip = True
    if not is_ip and not _HOSTNAME.fullmatch(address):
        raise ConfigError(
            f"--address {address!r} is not an IP address or a host name; give the node's address as the "
            "gateway reaches it, without a scheme or port (10.0.0.7, gpu-1.lan)"
        )


def ha_servers(paths: Paths, agent_listen: str, server: str, known: Mapping[str, str] | None = None) -> list[str]:
    """The agent-API URLs of an HA cluster's other control planes (``agent.yaml``'s ``servers``),
    from ``/etc/llmgw/ha.yaml`` (:class:`~llmgw.serverinit.patroni.HaPlan`) with ``agent_listen``'s
    port; [] on a single-machine install (no ha.yaml) or without ``agent_listen``. ``known``: control
    plane name -> the agent URL it wrote itself (``GET /api/v1/cluster``), used where there is one (a
    standby joined with another ``--agent-listen`` port was listed at this one's port, where nothing
    listens). The agent also learns the members from its heartbeat replies; these are the ones it can
    try before any reply.

    Raises:
        ConfigError: ha.yaml is there but does not parse.
    """
    plan_path = paths.etc / "ha.yaml"
    if not agent_listen or not plan_path.exists():
        return []
    urls = [(known or {}).get(m.name) or agent_url(m.host, agent_listen) for m in HaPlan.load(plan_path).members]
    return [u for u in dict.fromkeys(urls) if u != server]
