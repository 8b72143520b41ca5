"""Why the agent's TLS connection to the control plane failed, in words an operator can act on.

aiohttp reports a refused client certificate as ``Server disconnected`` or ``Connection reset by
peer``, never as what happened: Python's asyncio TLS server drops the connection on a failed
handshake without flushing the TLS alert it made (``sslproto._fatal_error`` force-closes the
transport), and with TLS 1.3 the client has finished its side of the handshake before the server
checks the client's certificate. An agent with a certificate from another CA therefore retried
forever, logging "control plane does not answer: Server disconnected", and
nobody could tell why.

So when a heartbeat fails that way (:func:`may_be_tls`), :func:`diagnose` looks for itself (it
blocks; run it in a thread): one handshake of its own with the agent's TLS files and a tiny HTTP
request, then

- the agent does not trust the server's certificate (a verify error on our side): says so, with
  what to copy, or which host to use when the certificate does not name it;
- a TLS alert from the server (a server that sends one: a proxy, another TLS stack): names it;
- the server closes the connection during or right after the handshake without answering: it
  refused this agent's certificate. What is wrong with it is then checked locally
  (:func:`certificate_problem`): not issued by the CA in ``tls.ca`` (the cluster's: the server's
  certificate verified against it) is "unknown CA"; expired, not yet valid, not for client auth;
- an HTTP answer: TLS is fine and the failure was something else (None: keep the original text).

Every message ends with what to do: ``llmgw server add-node NODE`` on the control plane and copy
the new files, or copy the cluster's ``ca.pem``.
"""

from __future__ import annotations

import datetime as dt
import socket
import ssl
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID

from llmgw.tlsconf import client_context

#: How long the diagnostic connection may take (connect, handshake, first answer), seconds.
DIAGNOSE_TIMEOUT_S = 5.0

_ALERT_PREFIXES = ("TLSV13_ALERT_", "TLSV1_ALERT_", "SSLV3_ALERT_")


def may_be_tls(cause: BaseException | None) -> bool:
    """Whether an aiohttp failure can hide a TLS refusal: a TLS error, a disconnect or a reset
    after connecting. A refused connection or an unknown host cannot (nothing listens there)."""
    if isinstance(cause, aiohttp.ClientSSLError | aiohttp.ServerDisconnectedError):
        return True
    if isinstance(cause, aiohttp.ClientConnectorError):
        return False
    return isinstance(cause, aiohttp.ClientOSError | ConnectionResetError | ssl.SSLError)


def alert_name(reason: str | None) -> str:
    """``TLSV1_ALERT_UNKNOWN_CA`` → ``unknown CA``; ``""`` when ``reason`` is not a TLS alert."""
    if not reason:
        return ""
    for prefix in _ALERT_PREFIXES:
        if reason.startswith(prefix):
            words = reason.removeprefix(prefix).lower().replace("_", " ")
            return words.replace(" ca", " CA")
    return ""


def _load_certs(path: Path) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(path.read_bytes())
    except (OSError, ValueError):
        return []


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def certificate_problem(cert_path: Path, ca_path: Path, *, now: dt.datetime | None = None) -> tuple[str, str]:
    """What is wrong with the agent's certificate, checked locally: ``(short, explanation)``,
    e.g. ``("unknown CA", "it was not issued by this cluster's CA (...)")``; ``("", "")`` when
    nothing is (the server refused it for a reason only it knows)."""
    certs, cas = _load_certs(cert_path), _load_certs(ca_path)
    if not certs:
        return "", ""
    cert = certs[0]
    if cas and not any(_issued_by(cert, ca) for ca in cas):
        return "unknown CA", (
            f"it was not issued by this cluster's CA ({cert_path} was issued by "
            f"'{cert.issuer.rfc4514_string()}'; the cluster's CA in {ca_path} is '{cas[0].subject.rfc4514_string()}')"
        )
    now = now or dt.datetime.now(dt.UTC)
    if cert.not_valid_after_utc < now:
        return "certificate expired", f"{cert_path} expired on {cert.not_valid_after_utc:%Y-%m-%d}"
    if cert.not_valid_before_utc > now:
        return "certificate not yet valid", (
            f"{cert_path} is valid only from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (is this clock right?)"
        )
    try:
        usages = list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]  # no restriction
    if ExtendedKeyUsageOID.CLIENT_AUTH not in usages:
        return "unsupported certificate", f"{cert_path} is not a client certificate (no clientAuth usage)"
    return "", ""


def refused_message(node_id: str, cert_path: Path, ca_path: Path, alert: str = "") -> str:
    """The control plane refused this agent's certificate: why (``alert`` from the server, else
    the local check) and what to do."""
    short, why = certificate_problem(cert_path, ca_path)
    cause = alert or short
    head = "the control plane rejected this agent's certificate" + (f" ({cause})" if cause else "")
    if not why:
        why = (
            f"the control plane closed the connection during the TLS handshake: it does not accept "
            f"{cert_path} (its tls.ca is not the CA that issued it)"
            if not alert
            else f"it does not accept {cert_path}"
        )
    return (
        f"{head}: {why}; run 'llmgw server add-node {node_id or 'NODE'} --address ADDR --out DIR' on the "
        "control plane and copy the new files (ca.pem, agent.pem, agent-key.pem) to this node's /etc/llmgw"
    )


def untrusted_server_message(server: str, ca_path: Path, verify_message: str) -> str:
    """The agent does not trust the server's certificate: why and what to do."""
    if "mismatch" in verify_message.lower():
        return (
            f"this agent does not trust the control plane's certificate at {server} ({verify_message}): "
            "the certificate does not name that host; set 'server' in agent.yaml to a name or address the "
            "control plane's certificate carries (init's --host), or re-run 'llmgw server init --host NAME'"
        )
    return (
        f"this agent does not trust the control plane's certificate at {server} ({verify_message}): "
        f"it is not signed by the CA in {ca_path}; copy the cluster's CA (/etc/llmgw/pki/ca.pem on the "
        f"control plane) to {ca_path}, or run 'llmgw server add-node' there and copy the new files"
    )


def diagnose(
    server: str, node_id: str, ca: Path, cert: Path, key: Path, *, timeout_s: float = DIAGNOSE_TIMEOUT_S
) -> str | None:
    """Connect to ``server`` (``https://HOST:PORT``) with the agent's TLS files and say why TLS
    fails, or None when it does not (or the host cannot be reached at all). Blocks up to
    ``timeout_s``."""
    url = urlsplit(server)
    host, port = url.hostname or "", url.port or 443
    try:
        ctx = client_context(ca, cert, key)
    except (OSError, ssl.SSLError):
        return None  # run_agent checked these files at start; nothing more to say here
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            ctx.wrap_socket(raw, server_hostname=host) as tls,
        ):
            tls.sendall(b"GET /agent/v1/health HTTP/1.1\r\nHost: " + host.encode() + b"\r\nConnection: close\r\n\r\n")
            answer = tls.recv(64)
    except ssl.SSLCertVerificationError as e:
        return untrusted_server_message(server, ca, str(e.verify_message or e.reason or e))
    except ssl.SSLError as e:
        alert = alert_name(e.reason)
        if alert or isinstance(e, ssl.SSLEOFError) or e.reason == "UNEXPECTED_EOF_WHILE_READING":
            return refused_message(node_id, cert, ca, alert)
        return None
    except (ConnectionResetError, BrokenPipeError):
        answer = b""
    except OSError:
        return None  # cannot connect at all: the caller's own message says so
    return None if answer else refused_message(node_id, cert, ca)
