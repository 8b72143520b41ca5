"""CPU pinning: each replica that reserves cores gets its own, and its engine runs on them only.

The control plane reserves ``cpu_cores`` per replica on a node (placement never over-commits); the
agent turns the count into concrete cores with a :class:`CoreAllocator` (lowest free cores first,
never two replicas on one core), records them in the replica's record so a restarted agent claims
the same ones for the engines it adopts, and pins the engine with :func:`pin_process`:
``sched_setaffinity`` on every thread of the engine right after it starts (threads created later
inherit it). That works for any engine (llama-server, vLLM) and covers llama-server's HTTP threads
too, which its own ``--cpu-range`` does not; ``--threads`` is set to the number of pinned cores.

Why pin at all (bench/pinning.py, this 2-core machine): two CPU engines left to the scheduler each
spin their ggml threadpool (``--poll 50`` by default) across both cores and slow each other down;
pinned to one core each they do not meet.

A replica with ``cpu_cores == 0`` reserves nothing and is not pinned (it shares the node). When
fewer cores are free than asked (a node whose cores changed, records from an older agent), the
replica runs unpinned and the reason is logged: a slower replica is better than none. The agent
pins it once enough cores are free (``ReplicaRunner.pin_if_free``, at every beat): a profile change
starts the new replica before the old one has stopped, and the new one ran unpinned for its life.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable

log = logging.getLogger(__name__)


def usable_cpus() -> list[int]:
    """The cores this agent may use (its own affinity mask: cgroup cpusets and ``taskset`` narrow it)."""
    return sorted(os.sched_getaffinity(0))


class CoreAllocator:
    """Hands out disjoint core sets to replicas of one node.

    Args:
        cpus: the node's usable cores (default: :func:`usable_cpus`).
    """

    def __init__(self, cpus: Iterable[int] | None = None) -> None:
        self.cpus = sorted(set(cpus if cpus is not None else usable_cpus()))
        self._held: dict[str, list[int]] = {}

    def held(self) -> dict[str, list[int]]:
        """Replica id → its cores (a copy)."""
        return {k: list(v) for k, v in self._held.items()}

    def free(self) -> list[int]:
        """Cores no replica holds, lowest first."""
        taken = {c for cs in self._held.values() for c in cs}
        return [c for c in self.cpus if c not in taken]

    def allocate(self, replica_id: str, count: int) -> list[int]:
        """``count`` free cores for ``replica_id`` (the ones it holds already, if the same count).

        Returns ``[]`` (run unpinned) when ``count`` is 0 or fewer than ``count`` cores are free.
        """
        have = self._held.get(replica_id)
        if have is not None and len(have) == count:
            return list(have)
        self.release(replica_id)
        free = self.free()
        if count <= 0:
            return []
        if len(free) < count:
            log.warning(
                "replica %s asks for %d cores, %d of %s are free; it runs unpinned",
                replica_id,
                count,
                len(free),
                self.cpus,
            )
            return []
        got = free[:count]
        self._held[replica_id] = got
        return list(got)

    def claim(self, replica_id: str, cpus: Iterable[int]) -> list[int]:
        """Take exactly ``cpus`` for an adopted engine; cores another replica holds are left out."""
        taken = {c for rid, cs in self._held.items() if rid != replica_id for c in cs}
        got = [c for c in cpus if c in self.cpus and c not in taken]
        if got:
            self._held[replica_id] = got
        return got

    def release(self, replica_id: str) -> None:
        """Give a replica's cores back (it stopped or failed)."""
        self._held.pop(replica_id, None)


def pin_process(pid: int, cpus: Iterable[int]) -> int:
    """Set the affinity of every thread of ``pid`` to ``cpus``; returns how many threads were pinned.

    Threads are listed from ``/proc/<pid>/task`` twice, so one created during the first sweep (by a
    thread not yet pinned) is caught by the second; threads created afterwards inherit the mask
    from their (pinned) creator. A thread that ends meanwhile is skipped.

    Raises:
        OSError: ``pid`` is gone, or the mask is refused (a core outside this cgroup's cpuset).
    """
    mask = set(cpus)
    os.sched_setaffinity(pid, mask)
    done: set[int] = {pid}
    for _ in range(2):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except FileNotFoundError as e:
            raise ProcessLookupError(f"process {pid} is gone") from e
        for tid in tids:
            if tid in done:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, mask)
                done.add(tid)
    return len(done)


def format_cpus(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"`` (the cpuset list format, for logs and ``--cpu-range``-like text)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
