"""Step 1: the PKI. The cluster CA, the server certificate (every ``--host``, the primary
address, the hostname), the admin token and a gateway key; each kept when it is there, and a
server certificate that lacks a name re-issued with it added.
"""

from __future__ import annotations

import socket

import psutil

from llmgw.errors import PkiError
from llmgw.serverinit import files
from llmgw.serverinit.steps.context import InitContext
from llmgw.tlsconf import CA, cert_hosts


def primary_address() -> str:
    """This machine's first non-loopback IPv4 address, or ``""`` when it has none."""
    for _name, addrs in sorted(psutil.net_if_addrs().items()):
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return ""


def reachable_addr(hosts: list[str]) -> str:
    """The address other machines use for this one: the first ``--host`` (``hosts``), else its
    first address, else its hostname. It is in the server certificate either way."""
    if hosts:
        return hosts[0]
    return primary_address() or socket.gethostname()


def cert_names(hosts: list[str]) -> list[str]:
    """Names the server certificate must carry: every ``--host``, the primary address, the hostname."""
    names = [*hosts, primary_address(), socket.gethostname()]
    return list(dict.fromkeys(n for n in names if n))


def run(ctx: InitContext) -> None:
    """The CA, the server certificate, the admin token and a gateway key; each kept when there.

    Raises:
        PkiError: the CA key is there without its certificate, or a certificate must be issued
            and the CA key is not on this machine.
    """
    paths = ctx.paths
    pki = paths.pki
    ca_cert, ca_key = pki / "ca.pem", pki / "ca-key.pem"
    ca: CA | None = None
    if ca_cert.exists():
        if ca_key.exists():
            ca = CA.load(pki)
        ctx.say("kept", f"cluster CA in {pki}")
    elif ca_key.exists():
        raise PkiError(f"{ca_key} is there but {ca_cert} is not; restore ca.pem from a backup")
    else:
        ca = CA.create()
        ca.write(pki)
        ctx.say("done", f"cluster CA in {pki}")

    server_cert = pki / "server.pem"
    want = cert_names(ctx.opts.hosts)
    if server_cert.exists():
        missing = [n for n in want if n not in cert_hosts(server_cert)]
        if not missing:
            ctx.say("kept", f"server certificate for {', '.join(want)}")
        else:
            if ca is None:
                raise PkiError(
                    f"the server certificate lacks {', '.join(missing)} and the CA key {ca_key} is "
                    "missing, so init cannot issue a new one; run init where the CA key is"
                )
            names = list(dict.fromkeys([*want, *cert_hosts(server_cert)]))
            ca.issue_server(names).write(pki, "server")
            ctx.say("done", f"server certificate now also for {', '.join(missing)}")
    else:
        if ca is None:
            raise PkiError(
                f"the CA key {ca_key} is missing, so init cannot issue the server certificate; "
                "restore it from a backup, or run init where the CA is"
            )
        ca.issue_server(want).write(pki, "server")
        ctx.say("done", f"server certificate for {', '.join(want)}")

    if paths.admin_token.exists():
        ctx.say("kept", f"admin token {paths.admin_token}")
    else:
        files.write_atomic(paths.admin_token, files.new_secret() + "\n", 0o600)
        ctx.say("done", f"admin token {paths.admin_token}")
    if paths.client_keys.exists():
        ctx.say("kept", f"gateway API key in {paths.client_keys}")
    else:
        files.write_atomic(paths.client_keys, files.new_secret("sk-llmgw-") + "\n", 0o600)
        ctx.say("done", f"gateway API key in {paths.client_keys}")
