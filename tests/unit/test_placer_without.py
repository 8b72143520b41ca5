"""A dry-run placer (:meth:`Placer.without`) leaves out every replica of its model, found from the
placer's own records of who holds what (its add log, and the nodes it does not know) rather than a
walk over every node's usage: on known nodes, on nodes gone from the cluster, held or released
after the placer was built."""

from __future__ import annotations

from llmgw.control.placement.checks import NodeInfo, Reservation
from llmgw.control.placement.placer import Placer
from llmgw.protocol import Inventory

INV = Inventory(cores=8, memory_total_bytes=32 * 10**9, memory_available_bytes=32 * 10**9)


def test_without_leaves_out_the_model_on_known_and_unknown_nodes_and_later_holds() -> None:
    nodes = [NodeInfo(f"n{i}", "ready", INV) for i in range(5)]
    placer = Placer(nodes, [
        Reservation("n1", "m", 2.0, 1, replica="r1"),
        Reservation("n1", "other", 2.0, 1, replica="o1"),
        Reservation("gone", "m", 2.0, 1, replica="r2"),  # a node no longer in the cluster
    ])
    placer.hold([Reservation("n3", "m", 2.0, 1, replica="r3"), Reservation("away", "m", 2.0, 1, replica="r4")])
    placer.release([("n1", "o1")])
    dry = placer.without("m")
    for node in ("n1", "n3", "gone", "away"):
        assert dry.usage[node].by_model["m"] == 0, node
        assert placer.usage[node].by_model["m"] == 1, node  # the placer itself keeps them
    assert dry.usage["n1"].cpu_cores == 0
    assert placer.usage["n1"].cpu_cores == 1
    assert dry.usage["n2"] is placer.usage["n2"]  # untouched nodes are shared, not copied
    other = placer.without("other")
    assert other.usage["n1"] is placer.usage["n1"]  # released: nothing of "other" left to leave out
    assert dry.usage["n3"].memory_gb == 0
