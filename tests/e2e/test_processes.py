"""The long-running commands as real processes: ``llmgw server run`` answers and exits 0 on SIGTERM,
and re-reads its gateway keys on SIGHUP; ``llmgw mirror serve`` answers and exits 0 on SIGTERM."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time

import httpx
import pytest

from llmgw.errors import UnreachableError
from llmgw.mirror.client import MirrorClient
from tests.helpers.control import make_install, make_keyed_install, server_run, wait_admin_health
from tests.helpers.net import free_port

pytestmark = pytest.mark.e2e

ALICE = "sk-alice-0123456789"
BOB = "sk-bob-0123456789"


def test_server_run_process_serves_and_stops_on_sigterm(tmp_path: pathlib.Path) -> None:
    install = make_install(tmp_path)
    with server_run(install) as process:
        wait_admin_health(install, process)
        assert install.paths.database.exists()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0


def test_sighup_rereads_the_keys_file_in_a_running_server(tmp_path: pathlib.Path) -> None:
    keyed = make_keyed_install(tmp_path, ALICE, BOB)
    with server_run(keyed) as process:
        url = f"http://127.0.0.1:{keyed.ports['gateway']}/v1/models"
        auth = {"Authorization": f"Bearer {ALICE}"}
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url, headers=auth, timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.communicate()[0].decode()
            assert time.monotonic() < deadline, "server run did not answer in 30 s"
            time.sleep(0.1)
        (keyed.paths.etc / "gateway-keys").write_text(f"{BOB}\n")
        process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while httpx.get(url, headers=auth, timeout=5).status_code != 401:
            assert process.poll() is None, "SIGHUP stopped the server: " + process.communicate()[0].decode()
            assert time.monotonic() < deadline, "alice's removed key still works 10 s after SIGHUP"
            time.sleep(0.05)
        assert httpx.get(url, headers={"Authorization": f"Bearer {BOB}"}, timeout=5).status_code == 200
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=15)[0].decode()
        assert process.returncode == 0, output
        assert "reloaded (SIGHUP): 1 keys" in output


def test_mirror_serve_process_answers_and_exits_cleanly_on_sigterm(tmp_path: pathlib.Path) -> None:
    api = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "mirror", "serve", "--dir", str(tmp_path / "store"),
         "--listen", f"127.0.0.1:{free_port()}", "--api-listen", f"127.0.0.1:{api}", "--base", "http://x:8081"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        with MirrorClient(f"http://127.0.0.1:{api}", timeout=1) as c:
            for _ in range(100):
                try:
                    c.health()
                    break
                except UnreachableError:
                    time.sleep(0.1)
            else:
                raise AssertionError("mirror serve never answered")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out.decode()
