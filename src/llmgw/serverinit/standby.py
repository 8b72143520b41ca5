"""A standby control plane: the bundle the first control plane writes for it, and the checks and
copies ``server init --join DIR`` makes of it.

``llmgw server add-control-plane NAME --address ADDR --out DIR`` (on the machine holding the CA
key and ``/etc/llmgw/ha.yaml``) writes into DIR (made 0700, every file 0600):

| file | what |
| --- | --- |
| ``ca.pem``, ``ca-key.pem`` | the cluster CA (the standby issues agents' certificates too) |
| ``server.pem``, ``server-key.pem`` | the standby's server certificate: ADDR first, then every control plane |
| ``admin-token``, ``client-keys`` | the cluster's admin token and gateway keys (every control plane takes the same) |
| ``ha.yaml``, ``ha-me`` | the HA plan (with the database passwords) and which member the standby is |
| ``server.yaml`` | the standby's server.yaml (paths as under ``/etc/llmgw``; ``--join`` rewrites them to its own) |

NAME must be one of the control planes init was given (``--control-plane NAME=HOST[:PORT]``),
at the same address: Patroni's members are fixed at the first init.

:func:`check_bundle` refuses a bundle whose server certificate the bundle's CA did not sign,
whose key does not match its certificate, or whose CA is not the one this machine already has
(a machine of another cluster), each saying why; nothing is written before it passes.
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from llmgw.atomicfile import write_atomic
from llmgw.config import ServerConfig, load_server_config, parse_listen
from llmgw.errors import ConfigError, PkiError, UnreachableError
from llmgw.paths import Paths
from llmgw.serverinit.patroni import HaPlan, Member
from llmgw.tlsconf import CA

BUNDLE_FILES = (
    "ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "admin-token", "client-keys",
    "ha.yaml", "ha-me", "server.yaml",
)
"""The files of a standby's bundle, in the order they are written."""

PKI_FILES = ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem")
"""Bundle files that go into ``/etc/llmgw/pki``; the others go into ``/etc/llmgw``."""


def agent_url(host: str, agent_listen: str) -> str:
    """``https://HOST:PORT`` of a control plane's agent API, PORT from ``agent_listen``."""
    _h, port = parse_listen(agent_listen)
    return f"https://{'[' + host + ']' if ':' in host else host}:{port}"


def standby_server_yaml(
    first: ServerConfig, plan: HaPlan, me: Member, etc: Path, listen: dict[str, str] | None = None,
) -> str:
    """The standby's server.yaml: the first control plane's, with this member's cluster name and
    agent URL, and every path under ``etc``. ``listen`` replaces listen addresses (keys
    ``admin_listen``, ``agent_listen``, ``gateway_listen``: init's flags, when given on the standby)."""
    doc: dict[str, Any] = first.model_dump(mode="json", exclude_defaults=True)
    listen = listen or {}
    for key in ("admin_listen", "agent_listen"):
        if listen.get(key):
            doc[key] = listen[key]
    doc["tls"] = {"ca": str(etc / "pki" / "ca.pem"), "cert": str(etc / "pki" / "server.pem"),
                  "key": str(etc / "pki" / "server-key.pem")}
    doc.pop("admin_token_file", None)
    gateway = doc.setdefault("gateway", {})
    gateway["keys_file"] = str(etc / "client-keys")
    if listen.get("gateway_listen"):
        gateway["listen"] = listen["gateway_listen"]
    # A standby serves clients from elsewhere: each needs a key.
    gateway["allow_loopback_without_key"] = False
    doc["store"] = {"url": plan.store_url()}
    cluster = doc.setdefault("cluster", {})
    cluster.update(name=me.name, agent_url=agent_url(me.host, doc.get("agent_listen") or first.agent_listen),
                   patroni=plan.rest_urls())
    head = (f"# Standby control plane {me.name} of an llmgw HA cluster, written by "
            "'llmgw server add-control-plane'.\n# Edit it freely; 'llmgw server init --join' writes it once.\n")
    body = head + yaml.safe_dump(doc, sort_keys=False)
    ServerConfig.model_validate(yaml.safe_load(body))
    return body


def add_control_plane(paths: Paths, name: str, out: Path, *, address: str) -> list[Path]:
    """Write standby ``name``'s bundle into ``out``; return the files written.

    Args:
        name: one of the plan's control planes.
        address: its address; must be the plan's host for it (``HOST`` or ``HOST:PORT``).

    Raises:
        ConfigError: no HA plan here (this is not an HA first control plane), ``name`` is not in
            it or ``address`` differs from it, or ``out`` is not empty.
        PkiError: the CA key is not on this machine.
    """
    plan_path = paths.etc / "ha.yaml"
    if not plan_path.exists():
        raise ConfigError(f"{plan_path} is missing: this is not the first control plane of an HA cluster; "
                          "run 'llmgw server init --control-plane NAME=HOST …' first")
    plan = HaPlan.load(plan_path)
    if plan.generated:
        raise ConfigError(f"{plan_path} has no password for Patroni's raft (it was written by an older llmgw), so "
                          "the bundle would carry none the first control plane uses: run 'llmgw server init' "
                          "here again with the same flags (it adds one), then add-control-plane")
    me = plan.member(name)
    host = address.rsplit(":", 1)[0].strip("[]") if address.count(":") == 1 or address.startswith("[") else address
    if host != me.host:
        raise ConfigError(f"{name} is at {me.host} in {plan_path}, not {address}; the members are fixed at the "
                          "first init: give --address " + me.host)
    if me == plan.members[0]:
        raise ConfigError(f"{name} is the first control plane itself; name a standby "
                          f"({', '.join(m.name for m in plan.members[1:])})")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty; give an empty (or new) directory with --out")
    ca = CA.load(paths.pki)
    first = load_server_config(paths.server_config)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    out.chmod(0o700)
    leaf = ca.issue_server(list(dict.fromkeys([me.host, *(m.host for m in plan.members)])))
    body = {
        "ca.pem": ca.cert_pem,
        "ca-key.pem": (paths.pki / "ca-key.pem").read_bytes(),
        "server.pem": leaf.cert_pem,
        "server-key.pem": leaf.key_pem,
        "admin-token": paths.admin_token.read_bytes(),
        "client-keys": paths.client_keys.read_bytes(),
        "ha.yaml": plan.to_yaml().encode(),
        "ha-me": (me.name + "\n").encode(),
        "server.yaml": standby_server_yaml(first, plan, me, Path("/etc/llmgw")).encode(),
    }
    written = []
    for f in BUNDLE_FILES:
        write_atomic(out / f, body[f], 0o600)
        written.append(out / f)
    return written


@dataclass(frozen=True)
class Bundle:
    """A checked standby bundle: its directory, plan and member."""

    dir: Path
    plan: HaPlan
    me: Member


def check_bundle(bundle: Path, paths: Paths) -> Bundle:
    """Check ``bundle`` before anything is copied from it.

    Raises:
        ConfigError: a file is missing, or ha.yaml/ha-me do not load.
        PkiError: the server certificate was not signed by the bundle's CA, its key is not its
            certificate's, or this machine already belongs to a cluster with another CA.
    """
    if not bundle.is_dir():
        raise ConfigError(f"--join {bundle}: no such directory; copy there what 'llmgw server add-control-plane' wrote")
    missing = [f for f in BUNDLE_FILES if not (bundle / f).is_file()]
    if missing:
        raise ConfigError(f"--join {bundle} lacks {', '.join(missing)}; write it again with "
                          "'llmgw server add-control-plane NAME --address ADDR --out DIR'")
    try:
        ca = x509.load_pem_x509_certificate((bundle / "ca.pem").read_bytes())
        cert = x509.load_pem_x509_certificate((bundle / "server.pem").read_bytes())
        key = serialization.load_pem_private_key((bundle / "server-key.pem").read_bytes(), password=None)
    except ValueError as e:
        raise PkiError(f"--join {bundle}: a certificate or key does not parse: {e}") from e
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as e:
        raise PkiError(
            f"refusing to join: {bundle / 'server.pem'} was not signed by {bundle / 'ca.pem'} "
            f"({ca.subject.rfc4514_string()}); the bundle mixes two clusters: write it again on the first "
            "control plane with 'llmgw server add-control-plane'"
        ) from e
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.PEM, pub) != cert.public_key().public_bytes(
            serialization.Encoding.PEM, pub):
        raise PkiError(f"refusing to join: {bundle / 'server-key.pem'} is not the key of {bundle / 'server.pem'}")
    mine = paths.pki / "ca.pem"
    if mine.exists() and mine.read_bytes().strip() != (bundle / "ca.pem").read_bytes().strip():
        have = x509.load_pem_x509_certificate(mine.read_bytes())
        raise PkiError(
            f"refusing to join: this machine already has another cluster's CA in {mine} "
            f"(serial {have.serial_number:x}, the bundle's is {ca.serial_number:x}); it was set up for "
            "another cluster. Remove /etc/llmgw and /var/lib/llmgw here to start over, or write the "
            "bundle from this machine's own cluster"
        )
    plan = HaPlan.load(bundle / "ha.yaml")
    me = plan.member((bundle / "ha-me").read_text().strip())
    here = paths.etc / "ha-me"  # which member this machine is, when it is one already
    name = here.read_text().strip() if here.is_file() else ""
    if name and name != me.name:
        raise ConfigError(
            f"this machine is already control plane {name} of a cluster ({here}); this bundle is for {me.name} "
            f"at {me.host}: run 'llmgw server init --join DIR' on that machine instead. Nothing of the bundle "
            "was copied, and nothing here needs removing"
        )
    load_bundle_yaml(bundle / "server.yaml")
    return Bundle(bundle, plan, me)


def check_cluster_ca(b: Bundle, *, timeout_s: float = 3.0) -> str:
    """Ask the first control plane whether the bundle is its cluster's: a TLS handshake with its
    agent API (the bundle server.yaml's ``agent_listen`` port, on the plan's first member's host)
    that must verify with the bundle's CA, the host name included. A bundle whose four PKI files
    all come from another CA is consistent in itself; only the running cluster can tell. Returns
    ``HOST:PORT`` as checked.

    Raises:
        PkiError: the first control plane presents a certificate the bundle's CA did not sign (the
            bundle is another cluster's), or one that does not name its host.
        UnreachableError: it does not answer within ``timeout_s`` (start it first: the standby's
            database member replicates from the cluster anyway).
    """
    first = b.plan.members[0]
    _h, port = parse_listen(load_bundle_yaml(b.dir / "server.yaml").agent_listen)
    where = f"{first.url_host}:{port}"
    ctx = ssl.create_default_context(cafile=str(b.dir / "ca.pem"))
    try:
        with socket.create_connection((first.host.strip("[]"), port), timeout=timeout_s) as sock, \
                ctx.wrap_socket(sock, server_hostname=first.host.strip("[]")):
            pass
    except ssl.SSLCertVerificationError as e:
        raise PkiError(
            f"refusing to join: the first control plane {first.name} at {where} presents a certificate that "
            f"{b.dir / 'ca.pem'} does not accept ({e.verify_message}); the bundle is from another cluster. "
            "Write it again on the first control plane with 'llmgw server add-control-plane'"
        ) from e
    except (OSError, ssl.SSLError) as e:
        raise UnreachableError(
            f"--join: the first control plane {first.name} does not answer at {where} ({e}); start it "
            "(llmgw service start server, on it) and check this machine can reach it, then join again"
        ) from e
    return where


def load_bundle_yaml(path: Path) -> ServerConfig:
    """The bundle's server.yaml. Raises ConfigError when it does not load."""
    try:
        return ServerConfig.model_validate(yaml.safe_load(path.read_text()))
    except (yaml.YAMLError, ValueError) as e:
        raise ConfigError(f"{path} does not load: {e}") from e


def _adds_passwords(have_path: Path, bundle: HaPlan) -> bool:
    """True when the ha.yaml here is the bundle's but for passwords an older init did not make
    (raft's): the bundle then brings them, and replaces it."""
    try:
        have = HaPlan.load(have_path)
    except ConfigError:
        return False
    if not have.generated or have.same_cluster(bundle):
        return False
    return all(have.passwords[k] == bundle.passwords.get(k) for k in have.passwords if k not in have.generated)


def install_bundle(b: Bundle, paths: Paths, listen: dict[str, str] | None = None) -> list[tuple[str, Path]]:
    """Copy the bundle into ``paths.etc`` (``pki/`` for the certificates; server.yaml with this
    machine's paths and ``listen`` addresses, see :func:`standby_server_yaml`). A file already
    there with the same content is kept; server.yaml, once written, is kept; an ha.yaml from an older
    init that lacks raft's password is replaced by the bundle's when all else is the same (the old
    one kept as ``ha.yaml.bak-YYYYmmdd-HHMMSS``). Returns ``(tag, path)`` for each: ``done``,
    ``kept`` or ``updated``.

    Raises:
        ConfigError: a file there differs from the bundle's (another cluster's, or an older bundle).
    """
    paths.pki.mkdir(mode=0o700, parents=True, exist_ok=True)
    result: list[tuple[str, Path]] = []
    for f in BUNDLE_FILES:
        if f == "server.yaml":
            continue
        dst = (paths.pki if f in PKI_FILES else paths.etc) / f
        data = (b.dir / f).read_bytes()
        if f == "ha.yaml" and dst.exists() and _adds_passwords(dst, b.plan):
            backup = dst.with_name(f"{dst.name}.bak-{time.strftime('%Y%m%d-%H%M%S')}")
            write_atomic(backup, dst.read_bytes(), 0o600)
            write_atomic(dst, data, 0o600)
            result.append(("updated", dst))
            continue
        if dst.exists():
            if dst.read_bytes() != data:
                raise ConfigError(f"{dst} is there and differs from {b.dir / f}; this machine was set up "
                                  "otherwise (an older bundle, or another setup): if it is no member you still "
                                  "use, remove it (or /etc/llmgw) to join with this bundle")
            result.append(("kept", dst))
            continue
        write_atomic(dst, data, 0o644 if f in ("ca.pem", "server.pem") else 0o600)
        result.append(("done", dst))
    yml = paths.server_config
    if yml.exists():
        result.append(("kept", yml))
    else:
        first = load_bundle_yaml(b.dir / "server.yaml")
        write_atomic(yml, standby_server_yaml(first, b.plan, b.me, paths.etc, listen), 0o640)
        result.append(("done", yml))
    return result

