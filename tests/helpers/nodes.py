"""Nodes as placement and discovery see them: a ``NodeInfo`` builder, GPUs, and discovery's seams
(a recorded ``nvidia-smi``, no NVML, an agent.yaml)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from llmgw.agent.node.discovery import SMI_QUERY, SmiRunner
from llmgw.config import AgentConfig
from llmgw.control.placement import checks
from llmgw.protocol import GPU, EngineStatus, Inventory, ProvisionState

GB = 1_000_000_000
LLAMA = EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1", features=["rpc"])
"""llama.cpp installed with its rpc-server, as a node reports it."""


def node(
    id: str = "n1",
    *,
    state: str = "ready",
    cordoned: bool = False,
    labels: dict[str, str] | None = None,
    engines: list[EngineStatus] | None = None,
    mem_gb: float = 8,
    avail_gb: float | None = None,
    cores: int = 4,
    gpus: list[GPU] | None = None,
    cached: frozenset[str] = frozenset(),
) -> checks.NodeInfo:
    """A node as placement sees it: 4 cores, 8 GB, llama.cpp installed, unless told otherwise."""
    inv = Inventory(
        cores=cores,
        memory_total_bytes=int(mem_gb * GB),
        memory_available_bytes=int((mem_gb if avail_gb is None else avail_gb) * GB),
        gpus=gpus or [],
    )
    engs = [LLAMA] if engines is None else engines
    return checks.NodeInfo(id, state, inv, cordoned, labels or {}, {e.engine: e for e in engs}, cached)


def h100(mem_gb: float = 80, index: int = 0, used_gb: float = 0) -> GPU:
    """An H100 80 GB card as discovery reports it (``used_gb`` in use)."""
    return GPU(
        index=index,
        name="H100",
        klass="h100-80gb",
        memory_total_bytes=int(mem_gb * GB),
        memory_used_bytes=int(used_gb * GB),
    )


def smi(stdout: str = "", returncode: int = 0, stderr: str = "") -> SmiRunner:
    """An smi runner that answers with a recorded output and checks it was asked the right query."""

    def run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        assert list(argv) == SMI_QUERY
        return subprocess.CompletedProcess(list(argv), returncode, stdout, stderr)

    return run


def no_nvml() -> list[GPU] | None:
    """An NVML probe on a machine without NVML."""
    return None


def agent_cfg(tmp_path: Path, **extra: object) -> AgentConfig:
    """An agent.yaml for node ``n1`` with TLS files under ``tmp_path`` (not written), plus ``extra``."""
    return AgentConfig.model_validate(
        {
            "server": "https://cp:7443",
            "node_id": "n1",
            "tls": {"ca": tmp_path / "ca.pem", "cert": tmp_path / "a.pem", "key": tmp_path / "k.pem"},
            **extra,
        }
    )


def declared_node(tmp_path: Path, cores: int = 4) -> tuple[Path, Path]:
    """``(inventory_file, llama_server)`` under ``tmp_path``: a declared inventory of ``cores`` cores
    and 8 GB (6 available), and a stand-in llama-server that only prints its version (4242): an agent
    built on them probes nothing of this machine and starts no engine."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"cores: {cores}\nmemory_total_bytes: 8000000000\nmemory_available_bytes: 6000000000\n")
    fake = tmp_path / "llama-server"
    fake.write_text('#!/bin/sh\necho "version: 4242 (feedbee)"\n')
    fake.chmod(0o755)
    return inv, fake
