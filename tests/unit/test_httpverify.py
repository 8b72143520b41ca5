"""The HTTP clients llmgw makes per request load the CA bundle once per process
(llmgw.httpverify.verify_context), not once per request (20 ms of CPU each). Against a real local
HTTP server; the bundle loads are counted where Python's ssl module does them."""

from __future__ import annotations

import http.server
import ssl
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from llmgw.adminclient import AdminClient
from llmgw.control.placement.estimate import read_facts
from llmgw.errors import EstimateError
from llmgw.httpverify import verify_context


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.startswith("/api/v1/health"):
            body = b'{"pid": 4242}'
            self.send_response(200)
        else:
            body = b'{"error": {"code": "not_found", "message": "no such thing"}}'
            self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def bundle_loads(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every CA bundle loaded from now on (``SSLContext.load_verify_locations``/``load_default_certs``)."""
    loads: list[object] = []
    for name in ("load_verify_locations", "load_default_certs"):
        original = getattr(ssl.SSLContext, name)

        def counted(self: ssl.SSLContext, *a: Any, _original: Any = original, **kw: Any) -> Any:
            loads.append(a or kw)
            return _original(self, *a, **kw)

        monkeypatch.setattr(ssl.SSLContext, name, counted)
    return loads


def test_one_context_per_process() -> None:
    assert verify_context() is verify_context()
    assert verify_context().verify_mode == ssl.CERT_REQUIRED
    assert verify_context().check_hostname


def test_admin_requests_load_no_bundle_each(server: str, bundle_loads: list[object]) -> None:
    verify_context()  # the process's one load, made here if no test made it before
    bundle_loads.clear()
    client = AdminClient(server, "token")
    assert client.health()
    assert client.health_pid() == 4242
    with pytest.raises(Exception, match="404 no such thing"):
        client.get("/api/v1/models")
    assert bundle_loads == []


def test_the_leaders_header_reads_load_no_bundle_each(server: str, bundle_loads: list[object]) -> None:
    verify_context()
    bundle_loads.clear()
    for name in ("a", "b", "c"):
        with pytest.raises(EstimateError, match="answered 404 to a Range request"):
            read_facts(f"{server}/absent/{name}.gguf")
    assert bundle_loads == []
