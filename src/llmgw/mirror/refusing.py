"""An aiohttp connector that never connects to an address a rule refuses, checked at connect time.

A check of a source's host before its download (resolve it, look at the addresses) leaves two ways
around it: a DNS answer that changes between the check and the connection (DNS rebinding), and a
redirect to a refused address. This connector closes both: its resolver drops the refused addresses
from every name it resolves (none left: refused), and its socket factory refuses a literal one (a
URL or a redirect naming an address). The refusal is a
:class:`~llmgw.mirror.download.RefusedConnection`, which :func:`~llmgw.mirror.download.download`
reports at once and does not retry.

Used by the mirror (:meth:`llmgw.mirror.policy.SourcePolicy.connector`: private addresses unless
allowed) and the agent (link-local addresses, :func:`llmgw.sourcecheck.link_local`).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from llmgw.mirror.download import RefusedConnection
from llmgw.sourcecheck import Address, carried_ipv4

#: ``refusal(ip)``: why a connection to ``ip`` is refused (``"a link-local address"``), ``""`` when allowed.
Refusal = Callable[[Address], str]
#: ``message(host, ip, why)``: the error text for a refused connection (``host`` is a name or ``ip`` itself).
Message = Callable[[str, Address, str], str]


def _address(text: str) -> Address:
    """``text`` (a resolver's or a socket's address, maybe with an IPv6 zone) as an address, one that
    carries an IPv4 address as that (:func:`~llmgw.sourcecheck.carried_ipv4`)."""
    return carried_ipv4(ipaddress.ip_address(text.split("%", 1)[0]))


def refusing_connector(refusal: Refusal, message: Message, **options: Any) -> aiohttp.TCPConnector:
    """A ``TCPConnector`` (``options`` as it takes them) that connects to no address ``refusal``
    refuses: see the module docstring. No DNS cache: each connection resolves, and is checked, again."""

    def make_socket(addr_info: tuple[int, int, int, str, tuple[Any, ...]]) -> socket.socket:
        family, type_, proto, _, sockaddr = addr_info
        ip = _address(str(sockaddr[0]))
        if why := refusal(ip):
            raise RefusedConnection(errno.EACCES, message(str(ip), ip, why))
        return socket.socket(family=family, type=type_, proto=proto)

    return aiohttp.TCPConnector(
        resolver=_FilteringResolver(refusal, message), socket_factory=make_socket, use_dns_cache=False, **options
    )


class _FilteringResolver(AbstractResolver):
    """aiohttp's resolver, less the addresses ``refusal`` refuses (none left: :class:`RefusedConnection`)."""

    def __init__(self, refusal: Refusal, message: Message) -> None:
        self._refusal = refusal
        self._message = message
        self._inner = ThreadedResolver()  # holds nothing to close: the connector does not close a resolver it was given

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        kept, first = [], None
        for r in found:
            ip = _address(r["host"])
            if reason := self._refusal(ip):
                first = first or (ip, reason)
            else:
                kept.append(r)
        if not kept:
            ip, reason = first if first else (ipaddress.ip_address("0.0.0.0"), "no address")
            raise RefusedConnection(errno.EACCES, self._message(host, ip, reason))
        return kept

    async def close(self) -> None:
        await self._inner.close()
