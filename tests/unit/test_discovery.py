"""Discovery: GPU class rule, nvidia-smi parsing and fallbacks, inventory file, PCI probe.

The nvidia-smi outputs below stand for recorded ones (``--query-gpu=index,uuid,name,memory.total,
memory.used --format=csv,noheader,nounits``): the product names and MiB totals are what those cards
report (H100 SXM 81559, RTX 4090 24564, RTX 3060 12288; GB10 prints ``[N/A]`` for memory, and a
machine without a loaded driver prints the "couldn't communicate" line and exits 9); the UUIDs are
made up. No GPU machine was available to capture them, so they were written in nvidia-smi's exact
format; replace them with a capture when one is. They reach the parser through the injectable smi
runner; NVML is replaced by a reader that says "not available".
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from llmgw.agent.node.discovery import (
    MIB,
    discover_gpus,
    discover_inventory,
    gpu_class,
    gpus_from_smi_csv,
    has_nvidia_device,
)
from llmgw.errors import ConfigError
from llmgw.protocol import GPU
from tests.helpers.nodes import agent_cfg, no_nvml, smi

H100_NODE = """\
0, GPU-5a3c1f0e-8b2d-4c7e-9f10-2b3d4e5f6a7b, NVIDIA H100 80GB HBM3, 81559, 4
1, GPU-7d9e2a1b-3c4d-4e5f-8a6b-7c8d9e0f1a2b, NVIDIA H100 80GB HBM3, 81559, 71234
"""
WORKSTATION = """\
0, GPU-0a1b2c3d-4e5f-6a7b-8c9d-0e1f2a3b4c5d, NVIDIA GeForce RTX 4090, 24564, 1093
1, GPU-1b2c3d4e-5f6a-7b8c-9d0e-1f2a3b4c5d6e, NVIDIA GeForce RTX 3060, 12288, 5
"""
GB10 = "0, GPU-9f8e7d6c-5b4a-3c2d-1e0f-a9b8c7d6e5f4, NVIDIA GB10, [N/A], [N/A]\n"
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)


@pytest.mark.parametrize(
    ("name", "mib", "klass"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "h100-80gb-hbm3"),
        ("NVIDIA GeForce RTX 4090", 24564, "rtx-4090-24gb"),
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-sxm4-80gb"),
        ("NVIDIA A100-PCIE-40GB", 40960, "a100-pcie-40gb"),
        ("NVIDIA H200", 143771, "h200-141gb"),
        ("NVIDIA H100 NVL", 95830, "h100-nvl-94gb"),
        ("NVIDIA B200", 183359, "b200-180gb"),
        ("Tesla T4", 15360, "t4-16gb"),
        ("NVIDIA L4", 23034, "l4-24gb"),
        ("NVIDIA L40S", 46068, "l40s-48gb"),
        ("NVIDIA RTX A6000", 49140, "rtx-a6000-48gb"),
        ("Quadro RTX 8000", 48601, "rtx-8000-48gb"),
        ("NVIDIA GeForce GTX 1080 Ti", 11264, "gtx-1080-ti-11gb"),
        ("NVIDIA GeForce RTX 3060", 12288, "rtx-3060-12gb"),
        ("NVIDIA GB10", 0, "gb10"),  # memory unknown: no suffix rather than a wrong one
    ],
)
def test_gpu_class(name: str, mib: int, klass: str) -> None:
    assert gpu_class(name, mib * MIB) == klass


def test_smi_h100_node() -> None:
    gpus = discover_gpus(nvml=no_nvml, smi=smi(H100_NODE))
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].klass == "h100-80gb-hbm3"
    assert gpus[0].uuid == "GPU-5a3c1f0e-8b2d-4c7e-9f10-2b3d4e5f6a7b"
    assert gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert gpus[0].memory_total_bytes == 81559 * MIB
    assert gpus[1].memory_used_bytes == 71234 * MIB


def test_smi_workstation_classes() -> None:
    gpus = discover_gpus(nvml=no_nvml, smi=smi(WORKSTATION))
    assert [g.klass for g in gpus] == ["rtx-4090-24gb", "rtx-3060-12gb"]


def test_smi_not_available_fields() -> None:
    (gpu,) = gpus_from_smi_csv(GB10)
    assert gpu.memory_total_bytes == 0
    assert gpu.memory_used_bytes == 0
    assert gpu.klass == "gb10"


def test_smi_garbage_lines_are_skipped() -> None:
    text = "\n" + "nonsense\n" + "x, GPU-1, NVIDIA L4, 23034, 0\n" + "0, GPU-2, NVIDIA L4, 23034, 0\n"
    assert [g.uuid for g in gpus_from_smi_csv(text)] == ["GPU-2"]


def test_no_driver_is_no_gpus() -> None:
    assert discover_gpus(nvml=no_nvml, smi=smi(stdout=NO_DRIVER, returncode=9)) == []


def test_no_nvidia_smi_is_no_gpus() -> None:
    def missing(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")

    assert discover_gpus(nvml=no_nvml, smi=missing) == []


def test_nvml_answer_wins_over_smi() -> None:
    gpu = GPU(index=0, name="NVIDIA L4", klass="l4-24gb", memory_total_bytes=23034 * MIB)

    def never(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        raise AssertionError("nvidia-smi must not be asked when NVML answered")

    assert discover_gpus(nvml=lambda: [gpu], smi=never) == [gpu]


def test_discover_inventory_probes_this_machine(tmp_path: Path) -> None:
    inv = discover_inventory(agent_cfg(tmp_path), nvml=no_nvml, smi=smi(WORKSTATION))
    assert inv.cores >= 1
    assert 0 < inv.memory_available_bytes <= inv.memory_total_bytes
    assert inv.hostname
    assert [g.klass for g in inv.gpus] == ["rtx-4090-24gb", "rtx-3060-12gb"]


def test_inventory_file_overrides_discovery(tmp_path: Path) -> None:
    f = tmp_path / "inv.yaml"
    f.write_text(
        "cores: 64\nmemory_total_bytes: 1000\nmemory_available_bytes: 900\n"
        "gpus:\n  - {index: 0, name: NVIDIA H100 80GB HBM3, memory_total_bytes: 85520809984}\n"
    )
    cfg = agent_cfg(tmp_path, discovery={"inventory_file": str(f)})

    def never(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        raise AssertionError("a declared inventory probes nothing")

    inv = discover_inventory(cfg, nvml=no_nvml, smi=never)
    assert inv.cores == 64
    assert inv.gpus[0].klass == "h100-80gb-hbm3"


def test_inventory_file_errors_name_the_file(tmp_path: Path) -> None:
    f = tmp_path / "inv.json"
    f.write_text('{"cores": "many"}')
    with pytest.raises(ConfigError, match=r"inv\.json"):
        discover_inventory(agent_cfg(tmp_path, discovery={"inventory_file": str(f)}))
    with pytest.raises(ConfigError, match="inventory_file"):
        discover_inventory(agent_cfg(tmp_path, discovery={"inventory_file": str(tmp_path / "none.yaml")}))


def pci(root: Path, slot: str, vendor: str, klass: str) -> None:
    d = root / "bus" / "pci" / "devices" / slot
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "class").write_text(klass + "\n")


def test_has_nvidia_device(tmp_path: Path) -> None:
    assert not has_nvidia_device(tmp_path)
    pci(tmp_path, "0000:00:01.0", "0x8086", "0x030000")  # an Intel display controller
    pci(tmp_path, "0000:00:02.0", "0x10de", "0x068000")  # an NVIDIA bridge (NVSwitch)
    assert not has_nvidia_device(tmp_path)
    pci(tmp_path, "0000:17:00.0", "0x10de", "0x030200")  # an NVIDIA 3D controller
    assert has_nvidia_device(tmp_path)
