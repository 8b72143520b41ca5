"""GPUs that discovery saw but could not measure: a problem on the node, not a lack of memory.

A card reported with 0 bytes of memory (NVML's memory query failed, nvidia-smi printed
``[N/A]``, a driver/library mismatch, an agent not allowed to open ``/dev/nvidia*``) loses the
``-<n>gb`` part of its class and has no free memory to offer. Left alone, placement would call it
"no GPU of class …" or "0.0 of 0.0 GB free", which sends the operator looking for memory to free.
The agent logs these lines at discovery; the nodes view (``ctl nodes``) and placement's
explanation name them with what to check.

Shared by the agent and the control plane, so it depends on :mod:`llmgw.protocol` alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.protocol import GPU

WHAT_TO_CHECK = (
    "check the NVIDIA driver on the node ('nvidia-smi' must list the card with its memory; a driver "
    "and library of different versions fail there), that the agent may use NVML (it must be able to "
    "open /dev/nvidia*), then restart the agent ('llmgw service restart agent'); a unified-memory "
    "part (GB10, Grace) has no card memory to report: declare it in agent.yaml discovery.inventory_file"
)
"""What an operator checks when a card's memory is unknown, most common cause first."""


def unmeasured(gpus: Sequence[GPU]) -> list[GPU]:
    """The cards reported with no memory (``memory_total_bytes`` 0 or less), by index."""
    return sorted((g for g in gpus if g.memory_total_bytes <= 0), key=lambda g: g.index)


def describe(gpus: Sequence[GPU]) -> str:
    """``GPU 0 (NVIDIA H100) reports 0 GB of memory`` or ``GPUs 0, 1 (…) report 0 GB of memory``.

    Raises:
        ValueError: ``gpus`` is empty.
    """
    if not gpus:
        raise ValueError("describe() needs at least one GPU")
    names = ", ".join(dict.fromkeys(g.name or "unnamed" for g in gpus))
    if len(gpus) == 1:
        return f"GPU {gpus[0].index} ({names}) reports 0 GB of memory"
    return f"GPUs {', '.join(str(g.index) for g in gpus)} ({names}) report 0 GB of memory"


def discovery_problems(gpus: Sequence[GPU]) -> list[str]:
    """One line per node-level GPU discovery problem (empty when every card was measured):
    ``GPU 0 (…) reports 0 GB of memory: a GPU discovery problem, placement cannot use it; check …``."""
    bad = unmeasured(gpus)
    if not bad:
        return []
    return [f"{describe(bad)}: a GPU discovery problem, placement cannot use it; {WHAT_TO_CHECK}"]
