"""Judge sizing, one home: how many judge replicas init serves, the cores and memory each one
reserves, and how a machine's cores are split between the judges and the starter.

Both the installer (:mod:`llmgw.serverinit.plan`, which writes the judge's catalog entry) and the
control plane (:mod:`llmgw.control.reconcile.judgekeeper`, which re-fits a judge's cores when the
nodes change) size judges by these rules, so they live here, below both: the runtime never imports
the installer. Pure functions, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

# JUDGE_CORES and JUDGE_MEMORY_GB are what a judge replica needs: two cores for a judgment within its
# budget, and 2 GB for its 1.6 with no prompt cache. JUDGE_CORES_ALONE is what the one judge of a
# single machine takes, past which a model this small hardly gets faster.
JUDGE_CORES = 2
JUDGE_CORES_ALONE = 4
JUDGE_MEMORY_GB = 2


def judge_for(*, no_node: bool, standbys: bool = False, replicas_flag: int | None = None) -> int:
    """How many judge replicas init serves.

    One machine runs one judge, on up to four cores: a second judge replica on the same machine
    shares its cores and is lost with it, so it bought nothing but half the speed of each. On a
    4-core, 8 GB single-machine install, one judge on four cores passed 20 of 20 requests at about
    3.5 s each, judged in and out; two judges on two cores each had passed 19 of 20. Two, on two
    cores each, where there will be other nodes (HA setups, or a control plane that is not a node).
    ``--judge-replicas`` still chooses.
    """
    if replicas_flag is not None:
        return replicas_flag
    return 2 if (no_node or standbys) else 1


@dataclass(frozen=True)
class CpuSplit:
    """The cores init's models reserve: each judge replica's, and the starter's on CPU."""

    judge: int
    starter: int


def cpu_plan(*, cpus: int, judges: int, no_node: bool = False) -> CpuSplit:
    """Divide the CPUs between the judges and the starter.

    Without it, two judge replicas and the starter on one 4-core control plane all ran on all
    four: under load most judgments missed their budget and the requests were refused. A judge
    needs cores: a judgment of about 280 tokens took 8.0 s on one, 4.2 s on two and 2.3 s on four,
    against a 5 s budget. On one machine its one replica gets up to four; where there are two, two
    each (one each only where two would not fit both). The starter has what is left, up to 8, or
    no reservation at all (0) when nothing is, rather than a starter that fits nowhere. A machine
    that is not the node reserves two a judge on whichever node takes it, and the starter, on a
    node not known yet, none. With fewer than two cores the judges reserve none; the starter
    alone there has the one core (``--cpus 1`` on a bigger machine: one engine thread, not all the
    machine's: with no reservation the engine runs a thread per core of the node).

    Args:
        cpus: this machine's cores (``--cpus`` or the count the OS gives).
        judges: judge replicas init serves (0 with ``--no-guard-model``).
        no_node: this machine is not a node (``--no-node``).
    """
    if no_node:
        return CpuSplit(judge=JUDGE_CORES, starter=0)
    if cpus < 2:
        return CpuSplit(judge=0, starter=0 if judges else cpus)
    judge = JUDGE_CORES
    if judges == 1:
        judge = min(cpus, JUDGE_CORES_ALONE)
    elif judges > 0 and judges * judge > cpus:
        judge = max(1, cpus // judges)
    left = max(cpus - judges * judge, 0)
    return CpuSplit(judge=judge, starter=min(left, 8))
