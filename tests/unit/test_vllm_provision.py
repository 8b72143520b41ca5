"""vLLM provisioning decisions (no GPU and no vLLM here: nothing is installed by these tests)."""

from __future__ import annotations

import threading
from pathlib import Path

from llmgw.agent.engines.vllm import NO_GPU, NOT_INSTALLING, VllmProvisioner
from llmgw.protocol import ProvisionState


def test_cpu_only_nodes_are_unsupported(tmp_path: Path) -> None:
    status, server = VllmProvisioner(tmp_path).status(has_nvidia=False)
    assert (status.state, status.detail, server) == (ProvisionState.UNSUPPORTED, NO_GPU, None)


def test_declared_gpus_start_no_download(tmp_path: Path) -> None:
    """A node whose GPUs come from discovery.inventory_file (tests, odd hardware) must not start a
    multi-GB pip install in the background: it leaked pip processes from the cluster tests."""
    before = {t.name for t in threading.enumerate()}
    prov = VllmProvisioner(tmp_path)
    status, server = prov.status(has_nvidia=True, install=False)
    assert (status.state, status.detail, server) == (ProvisionState.UNSUPPORTED, NOT_INSTALLING, None)
    assert "vllm-provision" not in {t.name for t in threading.enumerate()} - before
    assert not (tmp_path / "engines").exists()
