"""The cluster's own PKI: a CA, the control plane's server certificate, agents' client certificates.

* The CA (``ca.pem``, ``ca-key.pem`` 0600) signs everything; agents trust only it.
* The server certificate names every ``--host``, the primary address and ``localhost``/``127.0.0.1``,
  so agents reach the agent API by any of them.
* An agent's client certificate has CN = node id: the agent API takes the node id from it, never
  from a field the agent claims.

Keys are EC P-256 (small, fast handshakes), written 0600. Certificates last 10 years (CA) and
5 years (leaves): a self-hosted cluster should not stop on an expiry nobody scheduled.
"""

from __future__ import annotations

import asyncio.sslproto
import datetime as dt
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.atomicfile import write_atomic
from llmgw.errors import PkiError

CA_DAYS = 3650
LEAF_DAYS = 1825
BACKDATE = dt.timedelta(minutes=5)
"""How far before its issue a certificate's ``notBefore`` is set (a node whose clock is a little
behind still accepts it); :func:`issued_at` adds it back."""


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass
class Leaf:
    """An issued certificate and its key (PEM bytes)."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: Path, stem: str) -> tuple[Path, Path]:
        """Write ``<stem>.pem`` (0644) and ``<stem>-key.pem`` (0600) into ``directory``; return both paths."""
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = directory / f"{stem}.pem", directory / f"{stem}-key.pem"
        write_atomic(key, self.key_pem, 0o600)
        write_atomic(cert, self.cert_pem, 0o644)
        return cert, key


@dataclass
class CA:
    """The cluster CA: its certificate and private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, name: str = "llmgw cluster CA") -> CA:
        """A new self-signed CA (EC P-256, valid ``CA_DAYS`` days)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                    key_encipherment=False, data_encipherment=False, key_agreement=False,
                    encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load(cls, pki_dir: Path) -> CA:
        """Load ``ca.pem`` and ``ca-key.pem`` from ``pki_dir``.

        Raises:
            PkiError: a file is missing or not a CA certificate/key.
        """
        cert_path, key_path = pki_dir / "ca.pem", pki_dir / "ca-key.pem"
        if not key_path.exists():
            raise PkiError(
                f"the CA key {key_path} is missing, so this machine cannot issue certificates; "
                "run this where the CA is, or restore the key from a backup"
            )
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except (OSError, ValueError) as e:
            raise PkiError(f"cannot read the cluster CA in {pki_dir}: {e}") from e
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise PkiError(f"{key_path} is not an EC private key")
        return cls(cert, key)

    def write(self, pki_dir: Path) -> None:
        """Write ``ca.pem`` (0644) and ``ca-key.pem`` (0600) into ``pki_dir``."""
        pki_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(pki_dir / "ca-key.pem", _key_pem(self.key), 0o600)
        write_atomic(pki_dir / "ca.pem", self.cert.public_bytes(serialization.Encoding.PEM), 0o644)

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate, PEM."""
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def _issue(self, cn: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]) -> Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return Leaf(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def issue_server(self, hosts: list[str]) -> Leaf:
        """A server certificate for every name/address in ``hosts`` plus ``localhost``/``127.0.0.1``/``::1``."""
        names = list(dict.fromkeys([*hosts, "localhost", "127.0.0.1", "::1"]))
        sans: list[x509.GeneralName] = []
        for h in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        return self._issue(names[0], ExtendedKeyUsageOID.SERVER_AUTH, sans)

    def issue_client(self, node_id: str) -> Leaf:
        """An agent's client certificate with CN = ``node_id``."""
        if not node_id:
            raise PkiError("a node id is needed to issue an agent certificate")
        return self._issue(node_id, ExtendedKeyUsageOID.CLIENT_AUTH, [])


def cert_hosts(cert_path: Path) -> list[str]:
    """The DNS names and IP addresses a certificate's SAN names, as strings."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    out: list[str] = [str(v) for v in san.get_values_for_type(x509.DNSName)]
    out += [str(v) for v in san.get_values_for_type(x509.IPAddress)]
    return out


TLS_READ_BUFFER = 16 * 1024
"""Bytes of plaintext asyncio's TLS transport reads at once: one TLS record's most (RFC 8446 §5.1).
asyncio's default, ``SSLProtocol.max_size`` = 256 KiB, is also a buffer every TLS connection
allocates and fills with zeros when it opens (CPython 3.11 ``asyncio/sslproto.py``), whether the
protocol reads into it or not (aiohttp's does not): measured on this machine with 1,000 kept
aiohttp TLS connections, a server's resident memory grew 287 KiB per connection with the default
and 47 KiB with 16 KiB. A control plane keeps one connection per node: at 5,000 nodes, 1.4 GiB
against 0.23 GiB. Reads are no smaller for it: OpenSSL hands over one record (at most 16 KiB) per
read, and the transport reads until none is left."""


def small_read_buffers() -> None:
    """Make every TLS connection this process opens or accepts from now on read through a
    :data:`TLS_READ_BUFFER` buffer instead of asyncio's 256 KiB one (process-wide: it sets the
    class attribute asyncio reads for each new connection; idempotent). Servers that hold many
    connections call it before they listen."""
    asyncio.sslproto.SSLProtocol.max_size = TLS_READ_BUFFER


def missing_files(files: dict[str, Path]) -> str:
    """Which of ``files`` (``{"tls.cert": path, …}``, the names a config gives them) do not exist, as
    ``tls.cert /etc/llmgw/agnt.pem does not exist``; ``""`` when all do. Said before loading them:
    ``ssl`` names neither the file nor which of three it could not open ("[Errno 2] No such file
    or directory", a new user's finding)."""
    gone = [f"{name} {path}" for name, path in files.items() if not path.exists()]
    if not gone:
        return ""
    return f"{' and '.join(gone)} {'does' if len(gone) == 1 else 'do'} not exist"


def server_context(ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
    """The agent API's TLS context: our certificate, and client certificates required from ``ca``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca))
    ctx.load_cert_chain(str(cert), str(key))
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def web_server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A TLS listener for browsers (the dashboard's ``ui.listen``): our certificate, no client
    certificate asked for; TLS 1.2 at least."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """An agent's TLS context: trust only ``ca``, present ``cert``/``key`` when given."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    if cert is not None and key is not None:
        ctx.load_cert_chain(str(cert), str(key))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def issued_at(peercert: dict[str, object] | None) -> float | None:
    """When a verified peer certificate (``getpeercert()``) was issued, in unix seconds: its
    ``notBefore`` (whole seconds, so at most 1 s before the issue) plus :data:`BACKDATE`, as every
    certificate llmgw issues is backdated; None when the session has no certificate."""
    raw = peercert.get("notBefore") if peercert else None
    if not raw:
        return None
    try:
        return ssl.cert_time_to_seconds(str(raw)) + BACKDATE.total_seconds()
    except ValueError:
        return None


def peer_common_name(peercert: dict[str, object] | None) -> str | None:
    """The CN of a verified peer certificate as ``ssl`` returns it (``getpeercert()``), or None."""
    if not peercert:
        return None
    for rdn in peercert.get("subject", ()):  # type: ignore[attr-defined]
        for k, v in rdn:
            if k == "commonName":
                return str(v)
    return None
