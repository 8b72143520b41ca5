"""What this node has: logical cores, memory, hostname and NVIDIA GPUs, as an :class:`Inventory`.

Mechanism, in order:

1. ``discovery.inventory_file`` in agent.yaml, when set, *is* the inventory (YAML or JSON of the
   :class:`~llmgw.protocol.Inventory` fields; a GPU without ``klass`` gets one from the rule below).
   Tests and odd hardware use it; nothing is probed then.
2. Cores are psutil's *logical* count (what ``--threads`` counts), memory is psutil's total and
   available, in bytes.
3. GPUs come from NVML (``nvidia-ml-py``, module ``pynvml``). When NVML cannot start (no driver,
   no library) the ``nvidia-smi`` CSV query is the fallback; when that is missing or fails too,
   the node has no GPU. None is an answer, not an error: the node then serves on CPU.
   :func:`has_nvidia_device` tells "no card" from "a card the driver does not show".
4. A card reported with 0 GB memory is logged as a discovery problem with what to check
   (:mod:`llmgw.gpuhealth`); it is still reported, so the nodes view and placement name it too.

The GPU class (:func:`gpu_class`) is what placement matches ``gpu_class`` profiles against: the
product name without vendor words plus the memory *as marketed*, never the raw MiB (81559 and
81920 MiB are the same card under different drivers and ECC settings).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import yaml
from pydantic import ValidationError

from llmgw import gpuhealth, yamlsafe
from llmgw.config import AgentConfig, describe_validation_error
from llmgw.errors import ConfigError
from llmgw.protocol import GPU, Inventory

log = logging.getLogger(__name__)

MIB = 1 << 20
GIB = 1 << 30

SMI_QUERY = [
    "nvidia-smi",
    "--query-gpu=index,uuid,name,memory.total,memory.used",
    "--format=csv,noheader,nounits",
]
"""The fallback query; memory comes in MiB (``nounits``), a field may be ``[N/A]``."""

SMI_TIMEOUT_S = 15.0
"""nvidia-smi answers in well under a second on a healthy driver; a wedged one must not hang us."""

MARKETED_GB = (2, 3, 4, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96, 128, 141, 180, 192, 288)
"""Memory sizes GPUs are sold with (GB). A card's total is rounded to the nearest of these:
an RTX 4090 reports 24564 MiB (23.99 GiB) → 24, an L4 23034 MiB → 24, an H200 143771 MiB → 141."""

_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro"}
_GB_TOKEN = re.compile(r"^\d+gb$")

SmiRunner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]
"""Runs an nvidia-smi argv and returns its completed process; raises OSError when it is missing."""

NvmlReader = Callable[[], "list[GPU] | None"]
"""Reads the GPUs through NVML; None when NVML cannot start (then nvidia-smi is asked)."""


def run_smi(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """The real nvidia-smi runner: text output, a timeout, never raises for a non-zero exit."""
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False)


def marketed_gb(memory_total_bytes: int) -> int:
    """The marketed size (GB) nearest to ``memory_total_bytes``; 0 when the total is unknown."""
    if memory_total_bytes <= 0:
        return 0
    gib = memory_total_bytes / GIB
    nearest = min(MARKETED_GB, key=lambda size: abs(size - gib))
    # A size far from every usual one (a new product) is named by itself, not forced onto a neighbour.
    return nearest if abs(nearest - gib) <= 0.1 * nearest else round(gib)


def gpu_class(name: str, memory_total_bytes: int) -> str:
    """The GPU class of a card: product slug plus marketed memory (``rtx-4090-24gb``).

    Vendor words (NVIDIA, GeForce, Tesla, Quadro) are dropped, the rest lowercased with runs of
    non-alphanumerics turned into ``-``; ``-<n>gb`` is appended unless the name already carries a
    ``<n>GB`` token, or the memory is unknown.

    >>> gpu_class("NVIDIA H100 80GB HBM3", 81559 * MIB)
    'h100-80gb-hbm3'
    >>> gpu_class("NVIDIA GeForce RTX 4090", 24564 * MIB)
    'rtx-4090-24gb'
    """
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in _VENDOR_WORDS]
    if not words:
        words = ["gpu"]
    if not any(_GB_TOKEN.match(w) for w in words):
        gb = marketed_gb(memory_total_bytes)
        if gb:
            words.append(f"{gb}gb")
    return "-".join(words)


def _smi_int(field: str) -> int | None:
    """An nvidia-smi number, or None for ``[N/A]``, ``[Not Supported]`` and other non-numbers."""
    try:
        return int(float(field))
    except ValueError:
        return None


def gpus_from_smi_csv(text: str) -> list[GPU]:
    """Parse the output of :data:`SMI_QUERY` (``index, uuid, name, memory.total, memory.used``, MiB).

    Lines that do not have five fields, or whose index is not a number, are skipped with a log
    line; a memory field that is ``[N/A]`` (unified-memory parts) counts as 0.
    """
    gpus: list[GPU] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 5:
            log.warning("nvidia-smi line not understood, skipped: %r", line)
            continue
        # A name with a comma would split in two: the memory fields are always the last two.
        index, uuid, total, used = fields[0], fields[1], fields[-2], fields[-1]
        name = ", ".join(fields[2:-2])
        idx = _smi_int(index)
        if idx is None:
            log.warning("nvidia-smi line without a GPU index, skipped: %r", line)
            continue
        total_b = (_smi_int(total) or 0) * MIB
        gpus.append(
            GPU(
                index=idx,
                uuid="" if uuid.startswith("[") else uuid,
                name=name,
                klass=gpu_class(name, total_b),
                memory_total_bytes=total_b,
                memory_used_bytes=(_smi_int(used) or 0) * MIB,
            )
        )
    return gpus


def gpus_from_smi(runner: SmiRunner = run_smi) -> list[GPU]:
    """The GPUs nvidia-smi lists; [] when it is missing, fails (no driver) or times out."""
    try:
        done = runner(SMI_QUERY)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("nvidia-smi not usable: %s", e)
        return []
    if done.returncode != 0:
        first = (done.stderr or done.stdout or "").strip().splitlines()[:1]
        log.info("nvidia-smi exited %d: %s", done.returncode, first[0] if first else "")
        return []
    return gpus_from_smi_csv(done.stdout)


def gpus_from_nvml() -> list[GPU] | None:
    """The GPUs NVML sees, or None when NVML cannot start (no driver, no ``libnvidia-ml.so.1``)."""
    try:
        import pynvml  # noqa: PLC0415 - only nodes with a driver get further than this
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        log.debug("NVML not available: %s", e)
        return None
    gpus = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                total, used = int(mem.total), int(mem.used)
            except pynvml.NVMLError:  # unified-memory parts (GB10/Grace) report no memory
                total, used = 0, 0
            gpus.append(
                GPU(
                    index=i,
                    uuid=uuid,
                    name=name,
                    klass=gpu_class(name, total),
                    memory_total_bytes=total,
                    memory_used_bytes=used,
                )
            )
    except pynvml.NVMLError as e:
        log.warning("NVML failed while listing GPUs, asking nvidia-smi instead: %s", e)
        return None
    else:
        return gpus
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def discover_gpus(*, nvml: NvmlReader = gpus_from_nvml, smi: SmiRunner = run_smi) -> list[GPU]:
    """NVML's GPUs, else nvidia-smi's, else none."""
    gpus = nvml()
    if gpus is not None:
        return gpus
    return gpus_from_smi(smi)


def load_inventory_file(path: Path) -> Inventory:
    """Read an inventory declared in YAML or JSON; GPUs without ``klass`` get one from :func:`gpu_class`.

    Raises:
        ConfigError: the file is missing, unreadable, not YAML/JSON, or a field is wrong (named).
    """
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(
            f"agent.yaml: discovery.inventory_file '{path}' cannot be read: {e.strerror}; "
            "fix the path or remove the setting to discover the hardware"
        ) from e
    try:
        data: Any = json.loads(text) if path.suffix == ".json" else yamlsafe.load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid YAML/JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of Inventory fields")
    for g in data.get("gpus") or []:
        if isinstance(g, dict) and "klass" not in g:
            g["klass"] = gpu_class(str(g.get("name", "")), int(g.get("memory_total_bytes", 0) or 0))
    try:
        return Inventory.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe_validation_error(path, e)) from e


def discover_inventory(
    cfg: AgentConfig,
    *,
    nvml: NvmlReader = gpus_from_nvml,
    smi: SmiRunner = run_smi,
) -> Inventory:
    """This node's inventory: the declared file when agent.yaml names one, else probed.

    Raises:
        ConfigError: ``discovery.inventory_file`` is set but unusable.
    """
    if cfg.discovery.inventory_file is not None:
        inv = load_inventory_file(cfg.discovery.inventory_file)
    else:
        mem = psutil.virtual_memory()
        inv = Inventory(
            hostname=socket.gethostname(),
            cores=psutil.cpu_count(logical=True) or 1,
            memory_total_bytes=int(mem.total),
            memory_available_bytes=int(mem.available),
            gpus=discover_gpus(nvml=nvml, smi=smi),
        )
    for problem in gpuhealth.discovery_problems(inv.gpus):
        log.warning("%s", problem)
    return inv


def has_nvidia_device(sys_root: Path = Path("/sys")) -> bool:
    """Whether an NVIDIA display or 3D controller is on the PCI bus, driver or not.

    So a machine whose GPU is invisible for want of a driver can say so instead of quietly
    serving on CPU. Vendor ``0x10de`` is NVIDIA; class ``0x03xxxx`` is a display/3D controller
    (NVIDIA also makes bridges, which do not count).
    """
    for vendor in sorted((sys_root / "bus" / "pci" / "devices").glob("*/vendor")):
        try:
            if vendor.read_text().strip() != "0x10de":
                continue
            klass = (vendor.parent / "class").read_text().strip()
        except OSError:
            continue
        if klass.startswith("0x03"):
            return True
    return False
