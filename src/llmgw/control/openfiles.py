"""The control plane's limit on open files: one connection per node stays open between beats.

The agent API keeps each agent's connection for ``protocol.KEEPALIVE_S`` (a beat reuses it instead
of a new mTLS handshake), so a cluster of N nodes holds about N sockets open; a soft limit of 1,024
(systemd's default for services, many shells') would refuse connections past ~1,000 nodes.
"""

from __future__ import annotations

import resource

MIN_OPEN_FILES = 8192
"""Below this limit on open files the control plane warns at start (a connection per node is kept)."""


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (at most 1,048,576) and return
    it: the agent API keeps one connection per node open between beats (``protocol.KEEPALIVE_S``),
    and a soft limit of 1,024 (systemd's default) would refuse connections past ~1,000 nodes. A
    limit that cannot be raised is left as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1_048_576
    want = min(want, 1_048_576)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            return soft
        return want
    return soft
