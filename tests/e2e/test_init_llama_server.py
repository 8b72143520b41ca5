"""``--llama-server`` through real inits, on real processes as in test_init.py:
a shell script that is not llama-server is refused before anything is written; an init with the
real llama-server (behind a wrapper script) serves; a later init given the binary's own path
updates the value init wrote into agent.yaml (``updated …``, ``agent.yaml.bak``), restarts the agent,
and the node is ready and answering again.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw.config import load_agent_config
from tests.conftest import Assets
from tests.helpers.processes import llmgw, offline_init

pytestmark = pytest.mark.e2e


@pytest.fixture
def install(tmp_path: Path, assets: Assets) -> Iterator[tuple[Path, list[str]]]:
    with offline_init(tmp_path, assets) as got:
        yield got


def _with_llama_server(args: list[str], binary: Path) -> list[str]:
    i = args.index("--llama-server")
    return [*args[:i], "--llama-server", str(binary), *args[i + 2 :]]


def test_a_wrong_llama_server_is_refused_and_a_later_one_replaces_what_init_wrote(
    install: tuple[Path, list[str]], tmp_path: Path, assets: Assets
) -> None:
    root, args = install
    fake = tmp_path / "fake" / "llama-server"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'this is not llama-server'\n")
    fake.chmod(0o755)
    r = llmgw(root, *_with_llama_server(args, fake), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--llama-server {fake} is not a working llama-server" in r.stderr
    assert not (root / "etc/llmgw/agent.yaml").exists()
    assert not (root / "etc/llmgw/server.yaml").exists()

    # The same llama-server under another path (init resolves links, so a wrapper, not a link).
    first_path = tmp_path / "first" / "llama-server"
    first_path.parent.mkdir()
    first_path.write_text(f'#!/bin/sh\nexec {assets.llama_server} "$@"\n')
    first_path.chmod(0o755)
    first = llmgw(root, *_with_llama_server(args, first_path))
    assert first.returncode == 0, first.stdout + first.stderr
    conf = root / "etc/llmgw/agent.yaml"
    assert load_agent_config(conf).engines.llamacpp.binary == first_path

    second = llmgw(root, *args)  # the fixture's --llama-server: the real binary's own path
    assert second.returncode == 0, second.stdout + second.stderr
    out = second.stdout
    assert f"updated {conf}: engines.llamacpp.binary {first_path} -> {assets.llama_server}" in out
    assert "done llmgw-agent restarted: agent.yaml changed" in out
    assert "done node e2e-node is ready" in out
    assert load_agent_config(conf).engines.llamacpp.binary == assets.llama_server
    assert load_agent_config(conf.with_name("agent.yaml.bak")).engines.llamacpp.binary == first_path

    # The node serves again, through the gateway.
    keys = (root / "etc/llmgw/client-keys").read_text().split()
    i = args.index("--gateway-listen")
    gateway = f"http://{args[i + 1]}"
    r2 = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": "gemma", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8},
        headers={"Authorization": f"Bearer {keys[0]}"}, timeout=180,
    )
    assert r2.status_code == 200, r2.text


def test_init_with_the_real_llama_server_after_a_failed_replica_serves(
    install: tuple[Path, list[str]], tmp_path: Path, assets: Assets
) -> None:
    """A new user's report on item 23: after an install whose replica failed with a bad
    llama-server (one that passes ``--version`` but serves nothing), init with the real one
    updated agent.yaml, restarted the agent, and at once stopped on the replica's failure from
    before (exit 1). That failure is from before this run: init waits for the restarted agent's first
    heartbeat, the replica starts again on the real llama-server and serves, and ``ctl replicas``
    shows no error on the ready replica."""
    root, args = install
    bad = tmp_path / "bad" / "llama-server"
    bad.parent.mkdir()
    bad.write_text(
        '#!/bin/sh\nif [ "$1" = "--version" ]; then echo "version: 1 (abc)" >&2; exit 0; fi\n'
        'echo "error: this llama-server cannot load models" >&2\nexit 1\n'
    )
    bad.chmod(0o755)
    first = llmgw(root, *_with_llama_server(args, bad))
    assert first.returncode == 1, first.stdout + first.stderr
    assert "failed to start" in first.stderr

    second = llmgw(root, *args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "done llmgw-agent restarted: agent.yaml changed" in second.stdout
    # The restarted agent's first heartbeat says what runs now (init waits for it): it starts the
    # replica again with the real llama-server, so the old failure is never taken as final.
    assert "done gemma-3-270m-q4_k_m is serving (profile cpu)" in second.stdout

    reps = llmgw(root, "ctl", "replicas", "--json", timeout=60)
    assert reps.returncode == 0, reps.stderr
    ready = [r for r in json.loads(reps.stdout) if r["state"] == "ready"]
    assert len(ready) == 1, reps.stdout
    assert (ready[0]["err"], ready[0]["last_error"]) == ("", "")
