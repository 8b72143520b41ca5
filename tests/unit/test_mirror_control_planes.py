"""The mirror's management API serving several control planes (HA), each from its own address.

A real MirrorServer in a thread; the control planes are real httpx clients (MirrorClient) bound to
their own source addresses on loopback (127.0.0.2, .3, .4: the mirror treats only 127.0.0.1 and ::1
as loopback, so these stand for three machines).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from llmgw.errors import ApiError, UnreachableError
from llmgw.mirror.client import CONNECT_TIMEOUT_S, MirrorClient
from tests.helpers.mirrors import ThreadedMirror

DATA = os.urandom(50_000)


def client_from(source: str, api: str) -> MirrorClient:
    """A MirrorClient whose connections come from ``source`` (as a control plane on that machine)."""
    return MirrorClient(api, timeout=5.0, transport=httpx.HTTPTransport(local_address=source))


@pytest.fixture
def mirror(tmp_path: pathlib.Path) -> Iterator[ThreadedMirror]:
    m = ThreadedMirror(tmp_path / "store")
    m.server.api_allow = ("127.0.0.2", "127.0.0.3")  # --api-allow, once per control plane
    with m:
        yield m


def test_every_allowed_control_plane_is_answered_and_sees_the_same_files(
    mirror: ThreadedMirror, tmp_path: pathlib.Path
) -> None:
    src = tmp_path / "w.gguf"
    src.write_bytes(DATA)
    with client_from("127.0.0.2", mirror.api) as first, client_from("127.0.0.3", mirror.api) as second:
        first.health()
        second.health()
        first.fetch(f"file:{src}", "m", "1")  # the leader asks...
        deadline = time.monotonic() + 10
        while (st := second.status("m", "1")).state == "fetching" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert st.state == "present"  # ...and another control plane sees the result
        assert st.sha256 == hashlib.sha256(DATA).hexdigest()
        assert [f.model for f in first.files()] == ["m"]


def test_a_control_plane_not_allowed_is_refused_naming_the_flag(mirror: ThreadedMirror) -> None:
    with client_from("127.0.0.4", mirror.api) as stranger:
        with pytest.raises(ApiError) as e:
            stranger.files()
        assert e.value.status == 403
        assert e.value.code == "forbidden"
        assert "start the mirror with --api-allow 127.0.0.4" in str(e.value)
        with pytest.raises(UnreachableError, match="not healthy"):
            stranger.health()


def test_a_mirror_that_does_not_accept_connections_costs_the_connect_timeout_not_the_request_timeout() -> None:
    # A listening socket whose backlog is full: the kernel drops further SYNs, so connecting hangs
    # as it does to a remote machine that went away.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        time.sleep(0.1)
        t0 = time.monotonic()
        with MirrorClient(f"http://127.0.0.1:{port}", timeout=15.0) as c, pytest.raises(UnreachableError) as e:
            c.health()
        took = time.monotonic() - t0
    finally:
        for s in fillers:
            s.close()
        srv.close()
    assert "does not answer" in str(e.value)
    assert CONNECT_TIMEOUT_S - 0.1 <= took <= CONNECT_TIMEOUT_S + 1.5, took
