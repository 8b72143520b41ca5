"""The TLS context the HTTP clients of one process verify servers with, built once.

httpx builds a new ``ssl.SSLContext`` for every client (``httpx.Client()``, and ``httpx.get``/``post``
make one per call), loading the whole CA bundle into it: 20 ms of CPU here (2026-12-06, httpx 0.29;
a request on a kept client costs 1.2 ms). The clients that llmgw makes per request (the admin API's,
the leader's GGUF header reads) pass :func:`verify_context` instead.
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def verify_context() -> ssl.SSLContext:
    """httpx's default verification context (certifi's CA bundle, or ``SSL_CERT_FILE``/``SSL_CERT_DIR``
    where set when first asked), shared by the clients of this process (an SSLContext may be used by
    several connections and threads at once; nothing here changes it)."""
    return httpx.create_ssl_context()
