"""How long ``llmgw server init`` takes from nothing to the first answer, with the assets cached.

Runs ``llmgw server init --offline`` under a fresh temp ``LLMGW_ROOT`` (control plane, mirror,
agent, a real llama-server with gemma-3-270m), then asks the gateway one question; prints the
time of each phase, then stops everything. Target: init to first answer <= 60 s on a
2-core machine. Prints its figures last, one ``name: value unit`` per line.

    python bench/init.py
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assets() -> tuple[str, str]:
    out = subprocess.run(
        [str(Path(__file__).resolve().parent.parent / "scripts" / "assets")],
        capture_output=True, text=True, check=True,
    ).stdout
    vals = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return vals["LLAMA_SERVER"], vals["MODEL"]


def main() -> None:
    server, model = assets()
    root = Path(tempfile.mkdtemp(prefix="llmgw-bench-init-"))
    env = {**os.environ, "LLMGW_ROOT": str(root)}
    llmgw = [sys.executable, "-m", "llmgw"]
    ports = {k: free_port() for k in ("admin", "agent", "gateway", "mirror", "mapi")}
    args = [
        "server", "init", "--offline", "--host", "127.0.0.1", "--starter-source", f"file:{model}",
        "--llama-server", server, "--admin-listen", f"127.0.0.1:{ports['admin']}",
        "--agent-listen", f"127.0.0.1:{ports['agent']}", "--gateway-listen", f"127.0.0.1:{ports['gateway']}",
        "--mirror-listen", f"127.0.0.1:{ports['mirror']}", "--mirror-api-listen", f"127.0.0.1:{ports['mapi']}",
    ]
    marks: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen([*llmgw, *args], env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"{time.monotonic() - t0:6.1f}s {line}", end="")
            for key, pat in (("control_plane", "control plane started"), ("mirror", "model mirror in"),
                             ("node_ready", "is ready"), ("starter_in_mirror", "in the mirror"),
                             ("starter_serving", "is serving")):
                if pat in line and key not in marks:
                    marks[key] = time.monotonic() - t0
        if proc.wait() != 0:
            sys.exit(f"init failed with exit code {proc.returncode}")
        init_done = time.monotonic() - t0
        r = httpx.post(
            f"http://127.0.0.1:{ports['gateway']}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "What is the capital of France?"}],
                  "model": Path(model).stem.lower(), "max_tokens": 32},
            timeout=120,
        )
        r.raise_for_status()
        answer = r.json()["choices"][0]["message"]["content"]
        first_answer = time.monotonic() - t0
        print(f"\nanswer: {answer.strip()[:200]!r}\n")
    finally:
        subprocess.run([*llmgw, "service", "stop", "--engines"], env=env, check=False, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    for key, value in marks.items():
        print(f"{key}_s: {value:.1f} s")
    print(f"init_s: {init_done:.1f} s")
    print(f"init_to_first_answer_s: {first_answer:.1f} s")


if __name__ == "__main__":
    main()
