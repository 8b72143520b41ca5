"""Who may use a mirror's management API, and what a mirror run as root may publish.

``llmgw mirror serve`` runs as a real child process (as root when the suite does, as a mirror did
when ``server init`` fell back to root), with an import directory that holds a model (0644) and,
beside it, an ssh key only its owner may read (0600), as a home directory would. The management API
and the bytes port are reached over real HTTP on loopback, as any local user reaches them.

Before: the management API answered every local user with no token (a fetch of the key was
imported and then served to anyone on the bytes port; a DELETE removed a served model's weights).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from llmgw.paths import Paths

MODEL = b"GGUF" + os.urandom(4000)
KEY = b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    api: str
    files: str
    token: str
    home: pathlib.Path
    token_file: pathlib.Path


@pytest.fixture
def served(tmp_path: pathlib.Path) -> Iterator[Served]:
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)  # noqa: S103 (a home others may enter, where the key's own mode is what protects it)
    (home / "model.gguf").write_bytes(MODEL)
    os.chmod(home / "model.gguf", 0o644)
    (home / "id_ed25519").write_bytes(KEY)
    os.chmod(home / "id_ed25519", 0o600)
    api, files = _free_port(), _free_port()
    root = tmp_path / "root"
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "mirror", "serve", "--dir", str(tmp_path / "store"),
         "--listen", f"127.0.0.1:{files}", "--api-listen", f"127.0.0.1:{api}",
         "--base", f"http://127.0.0.1:{files}", "--import-dir", str(home)],
        env={**os.environ, "LLMGW_ROOT": str(root)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{api}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/api/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "mirror serve never answered"
            time.sleep(0.1)
        # mirror serve made its token (no llmgw install under LLMGW_ROOT): only its user may read it.
        token_file = Paths.from_env(root).etc / "mirror-token"
        token = token_file.read_text().strip() if token_file.exists() else ""
        yield Served(url, f"http://127.0.0.1:{files}", token, home, token_file)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


class Admin:
    """The token holder (root's CLI, the control plane), over plain HTTP."""

    def __init__(self, s: Served) -> None:
        self.s = s
        self.auth = {"Authorization": f"Bearer {s.token}"} if s.token else {}

    def fetch(self, source: str, model: str) -> httpx.Response:
        body = {"source": source, "model": model, "version": "1"}
        return httpx.post(f"{self.s.api}/api/v1/fetch", json=body, headers=self.auth, timeout=10)

    def state(self, model: str) -> str:
        for _ in range(300):
            st = httpx.get(f"{self.s.api}/api/v1/status/{model}/1", headers=self.auth, timeout=10).json()
            if st.get("state") != "fetching":
                return str(st.get("state"))
            time.sleep(0.05)
        return "fetching"


def test_the_management_api_needs_its_token_and_a_local_user_cannot_delete_served_weights(served: Served) -> None:
    s = served
    admin = Admin(s)
    assert admin.fetch(f"file:{s.home}/model.gguf", "m").status_code in (200, 202)
    assert admin.state("m") == "present"
    served_url = f"{s.files}/m/1/model.gguf"
    assert httpx.get(served_url, timeout=10).content == MODEL

    # Any local user, on loopback, without the token (or with a wrong one): 401, and nothing happens.
    for headers in ({}, {"Authorization": "Bearer guess"}, {"Authorization": f"Basic {s.token}"}):
        r = httpx.delete(f"{s.api}/api/v1/files/m/1", headers=headers, timeout=10)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "unauthorized"
        assert "token" in r.json()["error"]["message"]
        body = {"source": f"file:{s.home}/model.gguf", "model": "x", "version": "1"}
        assert httpx.post(f"{s.api}/api/v1/fetch", json=body, headers=headers, timeout=10).status_code == 401
        assert httpx.get(f"{s.api}/api/v1/files", headers=headers, timeout=10).status_code == 401
        assert httpx.get(f"{s.api}/api/v1/status/m/1", headers=headers, timeout=10).status_code == 401
    r = httpx.delete(f"{s.api}/api/v1/files/m/1", headers=[(b"authorization", b"Bearer \xff\xfe")], timeout=10)
    assert r.status_code == 401, r.text  # bytes that are not UTF-8: a wrong token, not a 500
    assert httpx.get(served_url, timeout=10).content == MODEL
    assert hashlib.sha256(httpx.get(served_url, timeout=10).content).hexdigest() == hashlib.sha256(MODEL).hexdigest()

    # The token holder (root's CLI, the control plane) may delete.
    r = httpx.delete(f"{s.api}/api/v1/files/m/1", headers=admin.auth, timeout=10)
    assert r.status_code == 200, r.text
    assert (s.token_file.stat().st_mode & 0o777) == 0o600
    assert httpx.get(served_url, timeout=10).status_code == 404


def test_the_mirror_never_imports_a_file_other_users_could_not_read(served: Served) -> None:
    """Even asked with the token, and running as root: a 0600 key beside the model is refused, and
    so is anything under a directory closed to others; the bytes port serves neither."""
    s = served
    admin = Admin(s)
    r = admin.fetch(f"file:{s.home}/id_ed25519", "k")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "source_refused"
    assert "is readable only by its owner and group (mode 0600)" in err["message"]
    assert f"chmod 644 {s.home}/id_ed25519" in err["message"]
    assert "sudo" not in err["message"]  # it once advised 'sudo llmgw mirror add', which copied it anyway
    time.sleep(0.5)
    assert httpx.get(f"{s.files}/k/1/id_ed25519", timeout=10).status_code == 404

    private = s.home / "private"
    private.mkdir()
    os.chmod(private, 0o700)
    (private / "w.gguf").write_bytes(MODEL)
    os.chmod(private / "w.gguf", 0o644)
    r = admin.fetch(f"file:{private}/w.gguf", "p")
    assert r.status_code == 400, r.text
    assert f"the directory {private} is closed to other users (mode 0700)" in r.json()["error"]["message"]
    assert httpx.get(f"{s.api}/api/v1/files", headers=admin.auth, timeout=10).json() == []
