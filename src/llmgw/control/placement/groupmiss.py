"""Why a group profile (``nodes`` above 1) found no set of nodes (:class:`GroupMiss`), and the
number words its sentences use (GB rounded the safe way, ordinals, node counts).

Split from :mod:`llmgw.control.placement.checks` (which still offers :class:`GroupMiss`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def gb_up(gb: float) -> str:
    """GB to one decimal, rounded up: a need shown must be enough (4.045 is "4.1", never "4.0")."""
    return f"{math.ceil(gb * 10 - 1e-6) / 10:.1f}"


def gb_down(gb: float) -> str:
    """GB to one decimal, rounded down: free memory shown is never more than there is."""
    return f"{math.floor(gb * 10 + 1e-6) / 10:.1f}"


ORDINALS = (
    "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth",
    "ninth", "tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth",
)  # fmt: skip


def ordinal(n: int) -> str:
    """``3`` -> ``third`` (1 to 16, a group's largest size), else ``#17``."""
    return ORDINALS[n - 1] if 1 <= n <= len(ORDINALS) else f"#{n}"


def count_nodes(n: int) -> str:
    """``1 node``, ``2 nodes``."""
    return f"{n} node" if n == 1 else f"{n} nodes"


@dataclass(frozen=True)
class GroupMiss:
    """Why a group profile (``nodes`` above 1) found no set of nodes, with its numbers.

    Attributes:
        profile: the profile's name.
        size: the nodes one replica spans (``Profile.nodes``).
        cluster: the nodes known (all of them, lost ones included).
        found: the candidates: nodes that passed every member check.
        need_gb: the group's memory (``min_memory_gb``; CPU groups, else 0).
        last_need_gb: when there are enough candidates but not enough memory: what is left for the
            last member once the others, the candidates with the most free memory, hold all of
            theirs (``the third needs 14.2 GB``).
        best_free_gb: then the most free memory of a candidate not used yet (``best remaining node
            has 9.8 GB free``).
        others: the nodes that are not candidates, counted by reason (``1 node cordoned``), or "".
    """

    profile: str
    size: int
    cluster: int
    found: int
    need_gb: float = 0.0
    last_need_gb: float | None = None
    best_free_gb: float | None = None
    others: str = ""
    found_free_gb: float | None = None  # too few candidates: the memory free on those found (GB)

    @property
    def short_gb(self) -> float:
        """What one of the best candidates would have to free for the group to fit (GB)."""
        if self.last_need_gb is None or self.best_free_gb is None:
            return 0.0
        return max(self.last_need_gb - self.best_free_gb, 0.0)

    def clause(self, *, others: bool = True) -> str:
        """``2 of 3 nodes found: the third needs 14.2 GB, best remaining node has 9.8 GB free`` (not
        enough memory over the best candidates), or ``2 of 3 nodes found: 1 more is needed`` (too few
        candidates), then ``; the others: <counted reasons>`` and, when the cluster is smaller than
        the group, ``; the cluster has 2 nodes``."""
        if self.last_need_gb is not None and self.best_free_gb is not None:
            text = (
                f"{self.size - 1} of {self.size} nodes found: the {ordinal(self.size)} needs "
                f"{gb_up(self.last_need_gb)} GB, best remaining node has {gb_down(self.best_free_gb)} GB free"
            )
        else:
            more = self.size - self.found
            text = f"{self.found} of {self.size} nodes found: {more} more {'is' if more == 1 else 'are'} needed"
            if self.need_gb > 0 and self.found_free_gb is not None and self.found and self.need_gb > self.found_free_gb:
                # Short of memory too: say by how much, or "add a node" reads as if one would do.
                text += (f" and {gb_up(self.need_gb - self.found_free_gb)} GB more memory (the group needs "
                         f"{gb_up(self.need_gb)} GB, the {count_nodes(self.found)} found "
                         f"{'has' if self.found == 1 else 'have'} {gb_down(self.found_free_gb)} GB free)")
        if others and self.others:
            text += f"; {'the others' if self.found else 'the nodes'}: {self.others}"
        if others and self.cluster < self.size:
            text += f"; the cluster has {count_nodes(self.cluster)}"
        return text
