"""Secrets a client sends in a header (``Authorization: Bearer …``, ``x-api-key``), as bytes.

aiohttp decodes header bytes as UTF-8 with ``surrogateescape``: bytes that are not UTF-8 (``\\xff``)
arrive as lone surrogates, which ``str.encode()`` refuses. A request with such a key or token got a
500 and an ERROR traceback in the log from the gateway, the admin API and the metrics page (a new
user's finding); :func:`sent_bytes` gives back the bytes as sent, so such a key is merely wrong (401).
"""

from __future__ import annotations

import hmac


def sent_bytes(text: str) -> bytes:
    """``text`` (a header's value, or part of one) as the bytes the client sent (UTF-8, with the bytes
    aiohttp could not decode restored)."""
    return text.encode("utf-8", "surrogateescape")


def bearer_is(header: str, token: str) -> bool:
    """Whether ``header`` (an ``Authorization`` value) is ``Bearer <token>``: the scheme in any case,
    spaces around the token ignored, the token compared in constant time. False for an empty token."""
    scheme, _, given = header.strip().partition(" ")
    return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(sent_bytes(given.strip()), token.encode())
