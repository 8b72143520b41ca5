"""Gang placement: a profile with ``nodes`` above 1 is one replica over several nodes, placed whole
or not at all, its memory split as the engine will (by free memory for llama.cpp RPC, evenly per
pipeline stage on GPUs), and its explanation speaks of the set of nodes, word for word."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from llmgw.catalog import Model, Profile, Scaling
from llmgw.control.placement import checks
from llmgw.control.placement import placer as pl
from llmgw.control.placement.explain import would_fit_if
from llmgw.control.placement.inputs import reservations
from llmgw.control.placement.resources import resources_view
from llmgw.control.store import NodeRow, ReplicaRow
from llmgw.protocol import GroupMember
from tests.helpers.nodes import h100, node

GPU_CLASS = "h100-80gb"


def group(n: int = 3, need: float = 14.0, **kw: object) -> Profile:
    return Profile.model_validate({"name": "cpu", "nodes": n, "min_memory_gb": need, **kw})


def model(*profiles: Profile, name: str = "big") -> Model:
    return Model(name=name, source="file:/m.gguf", profiles=list(profiles), scaling=Scaling(min=1, max=4))


def shares(d: checks.Decision) -> list[tuple[str, int, float, list[int]]]:
    return [(m.node, m.rank, m.memory_gb, m.gpu_indexes) for m in d.members]


def test_placed_over_three_nodes_with_shares_by_free_memory() -> None:
    nodes = [node("a", mem_gb=8), node("b", mem_gb=16), node("c", mem_gb=4), node("d", mem_gb=2)]
    placer = pl.Placer(nodes, [])
    m = model(group(3, 14.0))
    d = placer.place(m)
    assert d.placed
    # b, a and c have the most free memory (16 + 8 + 4 = 28 GB): 14 GB split 16:8:4, b the head
    assert shares(d) == [("b", 0, 8.0, []), ("a", 1, 4.0, []), ("c", 2, 2.0, [])]
    assert (d.node, d.gpu_indexes, d.verdicts) == ("b", (), [])
    assert d.summary == "placed as a group of 3 on b (head), a, c (profile cpu)"
    head = placer.reserve(m, d, "big-1")
    assert head == checks.Reservation("b", "big", 8.0, 0, replica="big-1")
    assert {k: (u.memory_gb, u.by_model["big"]) for k, u in placer.usage.items()} == {
        "a": (4.0, 1),
        "b": (8.0, 1),
        "c": (2.0, 1),
        "d": (0.0, 0),
    }


def test_a_group_that_does_not_fit_reserves_nothing_and_says_why_word_for_word() -> None:
    nodes = [
        node("a", mem_gb=12),
        node("b", mem_gb=11),
        node("c", mem_gb=9.8),
        node("d", mem_gb=64, cordoned=True),
    ]
    placer = pl.Placer(nodes, [])
    m = model(group(3, 37.2))
    d = placer.place(m)
    assert not d.placed
    assert d.members == ()
    assert d.summary == (
        "0/4 nodes can run it as a group of 3: 2 of 3 nodes found: the third needs 14.2 GB, "
        "best remaining node has 9.8 GB free; the others: 1 node cordoned"
    )
    clause = "2 of 3 nodes found: the third needs 14.2 GB, best remaining node has 9.8 GB free"
    but = f"but the group of 3 does not fit: {clause}"
    assert [(r.node, r.kind, r.code, r.reason) for r in d.rejections] == [
        ("d", "filtered", "node_cordoned", "node is cordoned"),
        ("a", "exhausted", checks.GROUP_CODE, f"could be a member (12.0 GB free), {but}"),
        ("b", "exhausted", checks.GROUP_CODE, f"could be a member (11.0 GB free), {but}"),
        ("c", "exhausted", checks.GROUP_CODE, f"could be a member (9.8 GB free), {but}"),
    ]
    assert would_fit_if(d, placer, m) == [
        "a node with at least 14.2 GB free joins (or one of the candidates frees 4.4 GB)",
        "uncordon d ('llmgw ctl node uncordon d')",
    ]
    with pytest.raises(ValueError, match="only a placed decision"):
        placer.reserve(m, d)
    assert all(u.memory_gb == 0 and not u.held for u in placer.usage.values())


def test_a_cluster_smaller_than_the_group() -> None:
    placer = pl.Placer([node("a"), node("b")], [])
    m = model(group(3, 6.0))
    d = placer.place(m)
    assert d.summary == (
        "0/2 nodes can run it as a group of 3: 2 of 3 nodes found: 1 more is needed; the cluster has 2 nodes"
    )
    assert would_fit_if(d, placer, m) == ["1 more node joins (the cluster has 2; this profile needs 3)"]


def test_too_few_candidates_names_the_others() -> None:
    nodes = [node("a"), node("b", state="lost"), node("c", cores=1), node("d")]
    placer = pl.Placer(nodes, [])
    m = model(group(3, 6.0, cpu_cores=2))
    d = placer.place(m)
    assert d.summary == (
        "0/4 nodes can run it as a group of 3: 2 of 3 nodes found: 1 more is needed; "
        "the others: 1 node lost, 1 node with too few cores"
    )
    assert would_fit_if(d, placer, m) == [
        "bring b back: its agent is not reporting",
        "c is too small (1 core in all, needs 2): add a node with at least 2 cores",
    ]


def test_cordoned_unready_and_filtered_nodes_are_never_members() -> None:
    nodes = [
        node("a", mem_gb=64, cordoned=True),
        node("b", mem_gb=64, state="lost"),
        node("c", mem_gb=64, engines=[], labels={"pool": "big"}),
        node("d", mem_gb=64, labels={"pool": "other"}),
        node("e", mem_gb=8, labels={"pool": "big"}),
        node("f", mem_gb=8, labels={"pool": "big"}),
    ]
    m = model(group(2, 10.0, node_selector={"pool": "big"}))
    d = pl.Placer(nodes, []).place(m)
    assert shares(d) == [("e", 0, 5.0, []), ("f", 1, 5.0, [])]
    assert [(r.node, r.code) for r in d.rejections] == [
        ("a", "node_cordoned"),
        ("b", "node_not_ready"),
        ("c", "engine_not_installed"),
        ("d", "selector_mismatch"),
    ]


def test_a_node_without_free_memory_is_not_a_member() -> None:
    nodes = [node("a", mem_gb=8, avail_gb=0.05), node("b"), node("c")]
    d = pl.Placer(nodes, []).place(model(group(2, 4.0)))
    assert [m.node for m in d.members] == ["b", "c"]
    assert d.rejections[0].reason == (
        "needs at least 0.1 GB free for a share of the group, 0.1 of 8.0 GB free (8.0 GB used outside llmgw)"
    )


def test_two_groups_of_one_model_spread_and_cached_weights_count() -> None:
    nodes = [node(i, mem_gb=8, cached=frozenset({"big/1"}) if i in "ef" else frozenset()) for i in "abcdef"]
    placer = pl.Placer(nodes, [])
    m = model(group(3, 12.0))
    first = placer.place(m)
    # equal nodes: the ones holding the weights first, then by id
    assert [x.node for x in first.members] == ["a", "e", "f"]
    placer.reserve(m, first, "big-1")
    second = placer.place(m)
    assert [x.node for x in second.members] == ["b", "c", "d"]
    assert [x.memory_gb for x in second.members] == [4.0, 4.0, 4.0]


def test_the_richest_set_when_the_spread_one_lacks_memory() -> None:
    nodes = [node("x", mem_gb=16), node("y", mem_gb=4), node("z", mem_gb=4)]
    held = [checks.Reservation("x", "big", 0.0, 0, replica="big-0")]
    d = pl.Placer(nodes, held).place(model(group(2, 10.0)))
    # y and z (no replica of big yet) hold 8 GB together, too little: x and y hold 20
    assert shares(d) == [("x", 0, 8.0, []), ("y", 1, 2.0, [])]


def test_gpu_group_gets_cards_on_every_member() -> None:
    nodes = [
        node("g1", mem_gb=64, gpus=[h100(index=0, used_gb=40), h100(index=1), h100(index=2)]),
        node("g2", mem_gb=64, gpus=[h100(index=i) for i in range(4)]),
        node("g3", mem_gb=64, gpus=[h100(index=i) for i in range(3)]),
        node("cpu", mem_gb=64),
    ]
    held = [checks.Reservation("g3", "other", 60, 0, GPU_CLASS, (0, 1), "other-1")]
    placer = pl.Placer(nodes, held)
    # 200 GB over 2 nodes x 2 cards: 50 GB a card
    m = model(group(2, 200.0, gpu_class=GPU_CLASS, gpu_count=2))
    d = placer.place(m)
    assert shares(d) == [("g1", 0, 100.0, [1, 2]), ("g2", 1, 100.0, [0, 1])]
    assert (d.node, d.gpu_indexes) == ("g1", (1, 2))
    assert [(r.node, r.code) for r in d.rejections] == [("cpu", "gpu_class_mismatch"), ("g3", "gpu_exhausted")]
    placer.reserve(m, d, "big-1")
    assert {k: dict(u.gpus_taken) for k, u in placer.usage.items() if k != "cpu"} == {
        "g1": {1: "big-1", 2: "big-1"},
        "g2": {0: "big-1", 1: "big-1"},
        "g3": {0: "other-1", 1: "other-1"},
    }
    again = placer.place(m)
    assert again.summary == (
        "0/4 nodes can run it as a group of 2: 1 of 2 nodes found: 1 more is needed; "
        "the others: 1 node without a GPU of class h100-80gb, 2 no free GPU"
    )
    assert [(r.node, r.code, r.reason) for r in again.rejections][-1] == (
        "g2",
        checks.GROUP_CODE,
        "could be a member (cards 2, 3 free), but the group of 2 does not fit: 1 of 2 nodes found: 1 more is needed",
    )


def test_gpu_group_member_share_decides_card_size() -> None:
    """A card smaller than the whole model still serves a member's stage."""
    nodes = [node("g1", gpus=[h100(mem_gb=24)]), node("g2", gpus=[h100(mem_gb=24)])]
    one = model(Profile(name="gpu", gpu_class=GPU_CLASS, min_memory_gb=40))
    assert pl.Placer(nodes, []).place(one).summary == "0/2 nodes can run it: 2 nodes with a GPU too small"
    two = model(group(2, 40.0, gpu_class=GPU_CLASS))
    assert shares(pl.Placer(nodes, []).place(two)) == [("g1", 0, 20.0, [0]), ("g2", 1, 20.0, [0])]


def test_a_group_profile_among_one_node_profiles() -> None:
    gpu = Profile(name="gpu", gpu_class=GPU_CLASS, priority=200, min_memory_gb=40)
    m = model(gpu, group(3, 30.0))
    d = pl.Placer([node("a"), node("b"), node("c")], []).place(m)
    assert d.summary == (
        "0/3 nodes can run it: 3 nodes without a GPU of class h100-80gb; as a group of 3 (profile cpu): "
        "2 of 3 nodes found: the third needs 14.0 GB, best remaining node has 8.0 GB free"
    )
    assert would_fit_if(d, pl.Placer([node("a"), node("b"), node("c")], []), m)[:2] == [
        "a node with at least 14.0 GB free joins (or one of the candidates frees 6.0 GB)",
        "add a node with GPU class h100-80gb",
    ]


def test_placer_cache_agrees_with_fresh_placement_for_groups() -> None:
    nodes = [node(i, mem_gb=4 + 2 * k) for k, i in enumerate("abcdefg")]
    m = model(group(3, 9.0))
    placer = pl.Placer(nodes, [])
    done: list[checks.Reservation] = []
    placed = []
    for i in range(8):
        d = placer.place(m)
        placed.append(d.placed)
        fresh = pl.place(m, nodes, done)
        assert (d.members, d.summary) == (fresh.members, fresh.summary)
        if d.placed:
            done += placer.reserve_members(m, d, f"big-{i}")
    assert placed == [True] * 7 + [False]  # 70 GB in all, 63 of them taken by 7 groups
    assert len(done) == 21


def test_reservations_of_a_stored_group_are_per_member() -> None:
    members = (
        GroupMember(node="b", rank=0, memory_gb=8.0),
        GroupMember(node="a", rank=1, memory_gb=4.0),
        GroupMember(node="c", rank=2, memory_gb=2.0),
    )
    row = ReplicaRow(id="big-1", model="big", node="b", profile="cpu", key="k", members=members)
    m = model(group(3, 14.0, cpu_cores=2))
    assert reservations([row], {"big": m}) == [
        checks.Reservation("b", "big", 8.0, 2, replica="big-1"),
        checks.Reservation("a", "big", 4.0, 2, replica="big-1"),
        checks.Reservation("c", "big", 2.0, 2, replica="big-1"),
    ]
    # the profile grew since: the same proportions of the new need
    bigger = model(group(3, 28.0, cpu_cores=2))
    assert [r.memory_gb for r in reservations([row], {"big": bigger})] == [16.0, 8.0, 4.0]
    gpu_row = ReplicaRow(
        id="g-1",
        model="big",
        node="g1",
        profile="cpu",
        key="k",
        members=(GroupMember(node="g1", rank=0, gpu_indexes=[1]), GroupMember(node="g2", rank=1, gpu_indexes=[0])),
    )
    gm = model(group(2, 40.0, gpu_class=GPU_CLASS))
    assert reservations([gpu_row], {"big": gm}) == [
        checks.Reservation("g1", "big", 20.0, 0, GPU_CLASS, (1,), "g-1"),
        checks.Reservation("g2", "big", 20.0, 0, GPU_CLASS, (0,), "g-1"),
    ]
    assert reservations([gpu_row], {}) == [
        checks.Reservation("g1", "big", 0.0, 0, replica="g-1"),
        checks.Reservation("g2", "big", 0.0, 0, replica="g-1"),
    ]


def test_nodes_zero_is_refused_by_the_catalog() -> None:
    with pytest.raises(ValidationError, match="nodes"):
        Profile(name="cpu", nodes=0)
    with pytest.raises(ValidationError, match="nodes"):
        Profile(name="cpu", nodes=17)


def _row(n: checks.NodeInfo) -> NodeRow:
    return NodeRow(n.id, 1, n.state, n.cordoned, n.labels, n.inventory, list(n.engines.values()), [], 0.0, 0.0)


def test_resources_say_where_a_group_would_go() -> None:
    nodes = [_row(node("a", mem_gb=8)), _row(node("b", mem_gb=4)), _row(node("c", cordoned=True))]
    m = model(group(2, 6.0))
    view = resources_view(m, nodes=nodes, replicas=[], models={"big": m}, stored_facts={})
    p = view.profiles[0]
    assert (p.group_size, p.group) == (2, "fits on a (head), b")
    assert [(f.node, f.fits, f.reason) for f in p.nodes] == [
        ("a", True, ""),
        ("b", True, ""),
        ("c", False, "node is cordoned"),
    ]
    m3 = model(group(3, 6.0))
    p3 = resources_view(m3, nodes=nodes, replicas=[], models={"big": m3}, stored_facts={}).profiles[0]
    assert p3.group == "2 of 3 nodes found: 1 more is needed; the others: 1 node cordoned"


def test_a_node_without_rpc_server_is_no_group_member() -> None:
    """A node whose llama.cpp has no rpc-server (its agent reports no "rpc" feature) cannot be a member."""
    from llmgw.protocol import EngineStatus, ProvisionState  # noqa: PLC0415

    bare = EngineStatus(engine="llamacpp", state=ProvisionState.INSTALLED, version="b1")
    model = Model(name="g", source="http://m/g.gguf", profiles=[Profile(name="rpc", nodes=2, min_memory_gb=4)])
    d = pl.place(model, [node("a"), node("b", engines=[bare]), node("c")], [])
    assert {m.node for m in d.members} == {"a", "c"}
    d = pl.place(model, [node("a"), node("b", engines=[bare])], [])
    assert not d.placed
    (why,) = [v.rejection for v in d.verdicts if v.rejection.node == "b"]
    assert (why.code, why.reason) == (
        "group_engine_missing", "llama.cpp here has no rpc-server beside llama-server (build it with -DGGML_RPC=ON)"
    )


def test_too_few_nodes_and_too_little_memory_says_both() -> None:
    model = Model(name="g", source="http://m/g.gguf", profiles=[Profile(name="rpc", nodes=2, min_memory_gb=120)])
    d = pl.place(model, [node("a", mem_gb=24, avail_gb=23.3)], [])
    assert d.summary == (
        "0/1 nodes can run it as a group of 2: 1 of 2 nodes found: 1 more is needed and 96.7 GB more memory "
        "(the group needs 120.0 GB, the 1 node found has 23.3 GB free); the cluster has 1 node"
    )
