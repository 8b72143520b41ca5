"""A group head's llama-server flags: the layers split by the members' shares
(agent/engines/llamacpp_group.py); a vLLM group's Ray count and flags (agent/engines/vllm_group.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.agent.engines.llamacpp_group import gguf_layers, head_args, layer_split, rpc_binary
from llmgw.agent.engines.vllm_group import active_nodes, vllm_group_args
from llmgw.errors import GroupError
from llmgw.protocol import GroupMember
from tests.conftest import Assets


def _members(*gb: float) -> list[GroupMember]:
    return [GroupMember(node=f"n{i}", rank=i, memory_gb=g) for i, g in enumerate(gb)]


def test_layers_follow_the_shares() -> None:
    # gemma-3-270m has 18 blocks; placement split 1.0 GB as 0.545 / 0.455 over a head and one worker.
    assert layer_split(18, _members(0.545, 0.455)) == (8, [1.0])
    # Three even shares: the head keeps 6, the two workers get 6 each.
    assert layer_split(18, _members(0.4, 0.4, 0.4)) == (12, [0.5, 0.5])
    # Workers split in proportion to their shares; no estimate (0) counts as equal.
    assert layer_split(30, _members(1, 2, 1)) == (22, [0.6667, 0.3333])
    assert layer_split(10, _members(0, 0)) == (5, [1.0])
    # At least one block goes to the workers, however small their share.
    assert layer_split(4, _members(100, 0.1))[0] == 1


def test_head_args() -> None:
    assert head_args(18, _members(0.4, 0.4, 0.4), "127.0.0.1:1,127.0.0.1:2") == [
        "--rpc", "127.0.0.1:1,127.0.0.1:2", "--n-gpu-layers", "12", "--tensor-split", "0.5,0.5",
    ]


def test_a_build_without_rpc_server_is_named(tmp_path: Path) -> None:
    server = tmp_path / "llama-server"
    server.write_text("")
    with pytest.raises(GroupError, match=r"has no rpc-server beside it: .* -DGGML_RPC=ON"):
        rpc_binary(server)
    (tmp_path / "rpc-server").write_text("")
    assert rpc_binary(server) == tmp_path / "rpc-server"


def test_the_block_count_of_the_real_gguf(assets: Assets) -> None:
    """The test asset, gemma-3-270m (the assets fixture fails under LLMGW_REQUIRE_ASSETS=1)."""
    assert gguf_layers(assets.model) == 18


def test_ray_status_counts_the_active_nodes() -> None:
    status = """======== Autoscaler status: 2026-12-02 11:00:00 ========
Node status
---------------------------------------------------------------
Active:
 1 node_6f0a...c1
 1 node_8b2e...d4
Pending:
 (no pending nodes)
Recent failures:
 (no failures)
"""
    assert active_nodes(status) == 2
    assert active_nodes("Active:\n (no active nodes)\nPending:\n") == 0
    assert vllm_group_args(3, 2) == ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "3",
                                     "--distributed-executor-backend", "ray"]
