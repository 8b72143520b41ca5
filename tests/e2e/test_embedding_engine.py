"""An embedding model's engine as the agent launches it (the real argv builder, the real llama-server
and gemma-3-270m): an input longer than llama-server's default micro-batch (512 tokens) is embedded.

Before, the agent started an embedding engine with ``--embeddings --pooling mean`` alone, and any
input past 512 tokens was a 500 "input (602 tokens) is too large to process. increase the physical
batch size" (a new user's finding): ``build_argv`` now gives an embedding engine a batch and a
micro-batch of one slot's context.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from llmgw.agent.engines.llamacpp import LlamaServer, build_argv, parse_help_flags, run_probe
from llmgw.protocol import ReplicaSpec
from tests.conftest import Assets
from tests.helpers.net import free_port
from tests.helpers.processes import ENGINE_CORES, stop_process
from tests.helpers.waits import wait_for

pytestmark = pytest.mark.e2e


def test_an_input_past_the_default_micro_batch_is_embedded(assets: Assets, tmp_path: Path) -> None:
    helped = run_probe([str(assets.llama_server), "--help"])
    server = LlamaServer(assets.llama_server, flags=parse_help_flags(helped.stdout + helped.stderr))
    spec = ReplicaSpec.model_validate({
        "id": "e1", "model": "embed", "version": "1", "profile": "cpu", "engine": "llamacpp",
        "source_url": "http://mirror/embed/1/g.gguf", "file_name": "g.gguf", "key": "k-embed",
        "args": ["-c", "2048", "-np", "1", "--embeddings", "--pooling", "mean"],  # as role_args gives them
    })
    port = free_port()
    argv = build_argv(server, spec, model_path=assets.model, host="127.0.0.1", port=port, node_cores=ENGINE_CORES,
                      node_has_gpus=False, key="k-embed")
    assert argv[argv.index("--ubatch-size") + 1] == argv[argv.index("--batch-size") + 1] == "2048"
    log = tmp_path / "engine.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=out)
    try:
        url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer k-embed"}

        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()[-2000:]
            return httpx.get(f"{url}/health", timeout=2).status_code == 200

        wait_for("llama-server healthy", healthy, 60, 0.1)
        r = httpx.post(f"{url}/v1/embeddings", headers=auth, timeout=60,
                       json={"model": "embed", "input": "hello world " * 300})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] > 512, body["usage"]
        assert len(body["data"][0]["embedding"]) == 640  # gemma-3-270m's embedding length
    finally:
        stop_process(proc)
