"""`llmgw agent`: the command runs the agent, logs with timestamps, stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.tlsconf import CA


def write_config(tmp_path: Path) -> Path:
    ca = CA.create()
    ca.write(tmp_path / "pki")
    cert, key = ca.issue_client("node-1").write(tmp_path, "agent")
    inv = tmp_path / "inventory.json"
    inv.write_text(json.dumps({"cores": 2, "memory_total_bytes": 4, "memory_available_bytes": 2}))
    # A stand-in llama-server: with no binary configured the agent would fetch llama.cpp's release
    # from GitHub (it failed at once here, with no DNS; elsewhere it would really try).
    fake = tmp_path / "llama-server"
    fake.write_text('#!/bin/sh\necho "version: 4242 (feedbee)"\n')
    fake.chmod(0o755)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        "server: https://127.0.0.1:9\n"  # nothing listens there
        "node_id: node-1\n"
        f"tls: {{ca: {tmp_path}/pki/ca.pem, cert: {cert}, key: {key}}}\n"
        f"discovery: {{inventory_file: {inv}}}\n"
        f"engines: {{llamacpp: {{binary: {fake}}}}}\n"
        "heartbeat_interval_s: 0.2\n"
    )
    return cfg


def test_inventory_command(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["--root", str(tmp_path), "agent", "inventory", "--config", str(write_config(tmp_path))]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["cores"] == 2


def test_missing_config_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["--root", str(tmp_path), "agent"])
    assert result.exit_code == 2
    assert "agent.yaml does not exist" in result.output


def test_agent_runs_until_sigterm(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "--root", str(tmp_path / "root"), "agent", "--config", str(cfg)],
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    trying = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "does not answer" in line:
                trying.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # SIGTERM once the agent is in its loop (it logged its first failed beat), not after a fixed
        # sleep: on a loaded machine the interpreter had not installed its handlers after 2.5 s.
        assert trying.wait(60), "".join(lines)
        assert proc.poll() is None  # an unreachable control plane is retried, not fatal
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        reader.join(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()
    err = "".join(lines)
    assert proc.returncode == 0, err
    assert "does not answer" in err
    assert "agent stopped" in err
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", err, re.MULTILINE)  # timestamps
