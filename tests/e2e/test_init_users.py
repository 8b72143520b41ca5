"""``server init`` as root, where the ``llmgw`` user can run llmgw: the
control plane and the mirror run as ``llmgw`` under llmgw's own supervisor (their live processes'
real uid, read with psutil), the agent stays root, the gateway still answers (so the control
plane, as ``llmgw``, read its config, token, keys and server key and wrote its store), and no
secret in the tree is readable by anyone else.

This install's own Python usually lives under ``/root`` (pyenv), which ``llmgw`` cannot enter: the
test makes a venv from the system's ``/usr/bin/python3`` in a ``/tmp`` directory others may enter,
pointing at this checkout and its packages (same CPython minor version), and copies the model
there, as an operator installing llmgw system-wide would have it.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

import llmgw
from llmgw.paths import Paths
from llmgw.service.manager import SupervisorManager
from tests.conftest import Assets
from tests.helpers.processes import ENGINE_CORES, exposed, listen_args, stop_install

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="switching to the llmgw user needs root; CI runs as root"),
]

SYSTEM_PYTHON = Path("/usr/bin/python3")


@pytest.fixture
def system_install(assets: Assets) -> Iterator[Path]:
    """A directory (0755, in /tmp) with ``venv/bin/llmgw`` on the system Python and the model."""
    probe = subprocess.run([str(SYSTEM_PYTHON), "-c", "import sys; print(sys.version_info[:2])"],
                           capture_output=True, text=True, check=False) if SYSTEM_PYTHON.exists() else None
    if probe is None or probe.stdout.strip() != str(sys.version_info[:2]):
        pytest.skip(f"needs {SYSTEM_PYTHON} of Python {sys.version_info[0]}.{sys.version_info[1]}, as this venv")
    base = Path(tempfile.mkdtemp(prefix="llmgw-users-", dir="/tmp"))
    try:
        base.chmod(0o755)
        venv = base / "venv"
        subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(venv)], check=True)
        site = Path(subprocess.run(
            [str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True).stdout.strip())
        here = [sysconfig.get_paths()["purelib"], str(Path(llmgw.__file__).resolve().parents[1])]
        (site / "llmgw-checkout.pth").write_text("\n".join(here) + "\n")
        script = venv / "bin/llmgw"
        script.write_text(f"#!{venv}/bin/python\nimport sys\nfrom llmgw.cli.main import main\nsys.exit(main())\n")
        script.chmod(0o755)
        (base / "models").mkdir(mode=0o755)
        shutil.copyfile(assets.model, base / "models/starter.gguf")
        (base / "models/starter.gguf").chmod(0o644)
        yield base
    finally:
        stop_install(base / "root")
        shutil.rmtree(base, ignore_errors=True)


def test_init_runs_the_control_plane_and_mirror_as_llmgw(system_install: Path, assets: Assets) -> None:
    root = system_install / "root"
    argv = [
        str(system_install / "venv/bin/llmgw"), "server", "init", "--offline", "--host", "127.0.0.1",
        "--node-id", "users-node", "--no-guard-model",
        "--starter-source", f"file:{system_install / 'models/starter.gguf'}", "--starter-alias", "gemma",
        "--llama-server", str(assets.llama_server), "--cpus", str(ENGINE_CORES), *listen_args(),
    ]
    env = {**os.environ, "LLMGW_ROOT": str(root)}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "run as root, not as llmgw" not in done.stdout, done.stdout
    # which user they run as is said, whether the user was made now or before (a new user's report)
    assert re.search(r"^\s*(done|kept) system user llmgw: the control plane and the mirror run as it$",
                     done.stdout, re.M), done.stdout

    paths = Paths(root)
    for name in ("server", "mirror"):
        assert "\nUser=llmgw\nGroup=llmgw\n" in paths.unit(name).read_text()
    llmgw_user = pwd.getpwnam("llmgw")
    manager = SupervisorManager(paths)
    uids = {}
    for name in ("server", "mirror", "agent"):
        st = manager.status(name)
        assert st.state == "running", (name, st)
        assert st.pid is not None
        proc = psutil.Process(st.pid)
        uids[name] = (proc.uids().real, proc.uids().effective, proc.gids().real)
    assert uids["server"] == (llmgw_user.pw_uid, llmgw_user.pw_uid, llmgw_user.pw_gid)
    assert uids["mirror"] == (llmgw_user.pw_uid, llmgw_user.pw_uid, llmgw_user.pw_gid)
    assert uids["agent"][:2] == (0, 0)  # root, for its engines

    # The control plane, as llmgw, serves: it read its files and writes its store.
    gateway = re.search(r"curl -s (http://127\.0\.0\.1:\d+)/v1/chat/completions", done.stdout)
    assert gateway, done.stdout
    r = httpx.post(f"{gateway.group(1)}/v1/chat/completions", timeout=120,
                   json={"model": "gemma", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert paths.database.stat().st_uid == llmgw_user.pw_uid
    # The mirror, as llmgw, wrote the starter into its store.
    stored = list(paths.mirror_store.rglob("*.gguf"))
    assert stored
    assert all(p.stat().st_uid == llmgw_user.pw_uid for p in stored)
    assert exposed(root) == []

    # A restart checks the config as llmgw would read it: a server.yaml only root can read is refused.
    paths.server_config.chmod(0o600)
    os.chown(paths.server_config, 0, 0)
    refused = subprocess.run([str(system_install / "venv/bin/llmgw"), "service", "restart", "server"], env=env,
                             capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode != 0, refused.stdout
    assert "was not restarted" in refused.stderr
    assert "Permission denied" in refused.stderr or "cannot be read" in refused.stderr, refused.stderr
    assert manager.status("server").state == "running"
