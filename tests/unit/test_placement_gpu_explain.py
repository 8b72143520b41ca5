"""GPU explanations: the card that is short is named by index with its
free memory, a card or node too small is called too small (never "free a negative amount"), and a
GPU reported with 0 GB memory is a discovery problem on the node, in the explanation and the nodes
view.

GPUs cannot run here: every node is a declared inventory (agent.yaml ``discovery.inventory_file``,
read by the agent's own loader), which is what a node with those cards would report.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from llmgw.agent.node.discovery import load_inventory_file
from llmgw.catalog import Model, Profile, Scaling
from llmgw.control.api.admin import build_admin_app
from llmgw.control.placement import checks
from llmgw.control.placement import placer as pl
from llmgw.control.placement.explain import would_fit_if
from llmgw.control.reconcile.leader import Leader
from llmgw.control.store import Store
from llmgw.protocol import Heartbeat, Inventory
from tests.helpers.control import ctl_on_admin_app
from tests.helpers.nodes import LLAMA

GB = 1_000_000_000
TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def declared(tmp_path: Path, gpus: list[dict[str, Any]], *, mem_gb: int = 64) -> Inventory:
    """An inventory as agent.yaml's discovery.inventory_file declares it (GPU classes derived)."""
    path = tmp_path / f"inventory-{len(list(tmp_path.glob('inventory-*')))}.yaml"
    path.write_text(yaml.safe_dump({
        "hostname": "gpu-a", "cores": 16, "memory_total_bytes": mem_gb * GB,
        "memory_available_bytes": mem_gb * GB, "gpus": gpus,
    }))
    return load_inventory_file(path)


def rtx4090(index: int, used_gb: float = 0, total_mib: int = 24564) -> dict[str, Any]:
    """An RTX 4090 as NVML reports it: 24564 MiB (class rtx-4090-24gb)."""
    return {"index": index, "name": "NVIDIA GeForce RTX 4090", "memory_total_bytes": total_mib << 20,
            "memory_used_bytes": int(used_gb * GB)}


def gpu_node(inv: Inventory, node_id: str = "gpu-a") -> checks.NodeInfo:
    return checks.NodeInfo(node_id, "ready", inv, engines={"llamacpp": LLAMA})


def model(*profiles: Profile) -> Model:
    return Model(name="big", source="file:/m.gguf", profiles=list(profiles), scaling=Scaling(min=1, max=1))


def explain(m: Model, nodes: list[checks.NodeInfo]) -> tuple[checks.Decision, list[str]]:
    placer = pl.Placer(nodes, [])
    d = placer.place(m)
    return d, would_fit_if(d, placer, m)


def test_a_split_short_on_one_card_names_that_card_not_the_best_one(tmp_path: Path) -> None:
    """Two 4090s, card 0 with 18 GB used by another program; a 40 GB model split over both needs
    20 GB a card. Card 1 has room; card 0 is the one short, and 14 GB freed there makes it fit."""
    inv = declared(tmp_path, [rtx4090(0, used_gb=18), rtx4090(1)])
    split = Profile(name="gpu2", gpu_class="rtx-4090-24gb", min_memory_gb=40, gpu_count=2)
    d, fix = explain(model(split), [gpu_node(inv)])
    (rej,) = d.rejections
    assert rej.code == "gpu_exhausted"
    assert rej.reason == (
        "card 0 has 7.8 of 25.8 GB free, needs 20.0 (18.0 GB used outside llmgw); "
        "the profile takes 2 rtx-4090-24gb cards"
    )
    assert (rej.gpu_index, rej.need, rej.free) == (0, 20.0, 7.757)
    assert d.summary == "0/1 nodes can run it: 1 not enough GPU memory"
    assert fix == ["free 12.2 GB on card 0 of gpu-a (18.0 GB there is used outside llmgw)"]


def test_the_short_card_is_named_with_its_free_memory_on_24_gb_cards(tmp_path: Path) -> None:
    """The issue's own figures: 24.0 GB cards, card 0 has 6.0 free, 20.0 needed."""
    cards = [rtx4090(0, used_gb=18, total_mib=22888), rtx4090(1, total_mib=22888)]  # 24.0 GB (10^9) each
    inv = declared(tmp_path, cards)
    split = Profile(name="gpu2", gpu_class=inv.gpus[0].klass, min_memory_gb=40, gpu_count=2)
    d, fix = explain(model(split), [gpu_node(inv)])
    (rej,) = d.rejections
    assert rej.reason.startswith("card 0 has 6.0 of 24.0 GB free, needs 20.0")
    assert "best card" not in rej.reason
    assert fix == ["free 14.0 GB on card 0 of gpu-a (18.0 GB there is used outside llmgw)"]


def test_a_card_smaller_than_its_share_is_too_small_not_something_to_free(tmp_path: Path) -> None:
    """A 60 GB model over two 4090s needs 30 GB a card: no amount of freeing makes a 25.8 GB card
    hold it. Before, the line asked to free a negative amount of memory on "a card"."""
    inv = declared(tmp_path, [rtx4090(0), rtx4090(1)])
    split = Profile(name="gpu2", gpu_class="rtx-4090-24gb", min_memory_gb=60, gpu_count=2)
    d, fix = explain(model(split), [gpu_node(inv)])
    (rej,) = d.rejections
    assert (rej.code, rej.kind) == ("gpu_too_small", "filtered")
    assert rej.reason == (
        "cards 0, 1 have 25.8 GB in all, need 30.0 each: too small "
        "(0 of the 2 rtx-4090-24gb cards the profile needs are big enough)"
    )
    assert d.summary == "0/1 nodes can run it: 1 node with a GPU too small"
    assert fix == [
        "card 0 of gpu-a is too small (25.8 GB, needs 30.0): no amount of freeing helps; add a node with "
        "bigger cards, or raise the profile's gpu_count to split the model over more cards"
    ]
    assert not any(line.startswith("free") for line in fix)


def test_one_small_card_beside_a_big_one_is_named(tmp_path: Path) -> None:
    """Mixed cards of one class (a declared inventory may say so): the small one is the reason."""
    inv = declared(tmp_path, [rtx4090(0, total_mib=16384), rtx4090(1)])
    for g in inv.gpus:
        g.klass = "rtx-4090"
    split = Profile(name="gpu2", gpu_class="rtx-4090", min_memory_gb=40, gpu_count=2)
    d, _ = explain(model(split), [gpu_node(inv)])
    (rej,) = d.rejections
    assert rej.reason == (
        "card 0 has 17.2 GB in all, needs 20.0: too small (1 of the 2 rtx-4090 cards the profile needs are big enough)"
    )


def test_no_line_ever_asks_to_free_a_negative_amount(tmp_path: Path) -> None:
    """Every mix of used memory on two cards, for one- and two-card profiles: each "free N GB"
    suggestion has N > 0, and frees it on a card that is named."""
    for used0 in (0, 6, 12, 18, 24):
        for used1 in (0, 6, 12, 18, 24):
            inv = declared(tmp_path, [rtx4090(0, used_gb=used0), rtx4090(1, used_gb=used1)])
            for p in (
                Profile(name="one", gpu_class="rtx-4090-24gb", min_memory_gb=20),
                Profile(name="two", gpu_class="rtx-4090-24gb", min_memory_gb=40, gpu_count=2),
            ):
                d, fix = explain(model(p), [gpu_node(inv)])
                for line in fix:
                    assert line.startswith("free "), line
                    amount = float(line.split()[1])
                    assert amount > 0, (used0, used1, p.name, line)
                    assert " on card " in line, line
                if not d.placed:
                    assert fix, (used0, used1, p.name)


def test_a_cpu_node_smaller_than_the_model_is_too_small() -> None:
    inv = Inventory(cores=4, memory_total_bytes=8 * GB, memory_available_bytes=8 * GB)
    d, fix = explain(model(Profile(name="cpu", min_memory_gb=12)), [gpu_node(inv, "small")])
    (rej,) = d.rejections
    assert (rej.code, rej.reason) == ("memory_too_small", "needs 12.0 GB memory, the node has 8.0 GB in all: too small")
    assert fix == ["small is too small (8.0 GB memory in all, needs 12.0): add a node with at least 12.0 GB"]


@pytest.mark.parametrize(
    ("card", "klass"),
    [
        # The class loses its memory part: before, "no GPU of class rtx-4090-24gb (has: rtx-4090)".
        ({"index": 0, "name": "NVIDIA GeForce RTX 4090", "memory_total_bytes": 0}, "rtx-4090-24gb"),
        # The name carries the memory, the class survives: before, "0.0 of 0.0 GB free".
        ({"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 0}, "h100-80gb-hbm3"),
    ],
)
def test_a_gpu_with_memory_0_is_a_discovery_problem(tmp_path: Path, card: dict[str, Any], klass: str) -> None:
    inv = declared(tmp_path, [card])
    p = Profile(name="gpu", gpu_class=klass, min_memory_gb=8)
    d, fix = explain(model(p), [gpu_node(inv)])
    (rej,) = d.rejections
    assert (rej.code, rej.kind, rej.gpu_index) == ("gpu_discovery_problem", "filtered", 0)
    assert rej.reason.startswith(f"GPU 0 ({card['name']}) reports 0 GB of memory: a GPU discovery problem on this node")
    for what in ("nvidia-smi", "NVML", "/dev/nvidia*", "llmgw service restart agent"):
        assert what in rej.reason
    assert "0.0 of 0.0" not in rej.reason
    assert d.summary == "0/1 nodes can run it: 1 GPU discovery problem"
    assert fix[0].startswith("fix GPU discovery on gpu-a: GPU 0")


def test_a_measured_card_still_serves_beside_an_unmeasured_one(tmp_path: Path) -> None:
    inv = declared(tmp_path, [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 0},
                              {"index": 1, "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 81559 << 20}])
    d, _ = explain(model(Profile(name="gpu", gpu_class="h100-80gb-hbm3", min_memory_gb=8)), [gpu_node(inv)])
    assert (d.node, d.gpu_indexes) == ("gpu-a", (1,))


@pytest.fixture
async def client(store: Store) -> AsyncIterator[TestClient[Any, Any]]:
    app = build_admin_app(store, token=TOKEN, on_change=lambda: None, clock=lambda: 1000.0)
    async with TestClient(TestServer(app)) as c:
        yield c


async def test_the_nodes_view_and_the_explanation_report_the_discovery_problem(
    client: TestClient[Any, Any], store: Store, tmp_path: Path
) -> None:
    """Through the admin API: ``GET /api/v1/nodes`` carries the problem with what to check, and the
    stored explanation names it rather than a lack of memory."""
    inv = declared(tmp_path, [{"index": 0, "name": "NVIDIA GeForce RTX 4090", "memory_total_bytes": 0}])
    store.upsert_node_heartbeat("gpu-a", Heartbeat(inventory=inv, engines=[LLAMA]), 999.0)
    store.upsert_node_heartbeat(
        "cpu-a", Heartbeat(inventory=Inventory(cores=4, memory_total_bytes=8 * GB, memory_available_bytes=8 * GB),
                           engines=[LLAMA]), 999.0)
    body = model(Profile(name="gpu", gpu_class="rtx-4090-24gb", min_memory_gb=8)).model_dump(mode="json")
    body["source"] = "http://mirror:8081/big/1/big.gguf"  # the API takes only sources nodes can download
    assert (await client.post("/api/v1/models", json=body, headers=AUTH)).status == 201
    Leader(store, node_lost_after_s=30).reconcile_once(1000.0)

    nodes = {n["id"]: n for n in await (await client.get("/api/v1/nodes", headers=AUTH)).json()}
    (problem,) = nodes["gpu-a"]["problems"]
    assert problem.startswith("GPU 0 (NVIDIA GeForce RTX 4090) reports 0 GB of memory: a GPU discovery problem")
    assert "nvidia-smi" in problem
    assert nodes["cpu-a"]["problems"] == []

    ex = await (await client.get("/api/v1/explain-placement?model=big", headers=AUTH)).json()
    assert ex["summary"] == "0/2 nodes can run it: 1 GPU discovery problem, 1 node without a GPU of class rtx-4090-24gb"
    by_node = {r["node"]: r for r in ex["rejections"]}
    assert by_node["gpu-a"]["code"] == "gpu_discovery_problem"
    assert "not enough GPU memory" not in str(ex)


def test_the_agent_logs_an_unmeasured_gpu_with_what_to_check(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """nvidia-smi's answer on a card whose memory it could not read (``[N/A]``), through the
    agent's discovery: the card is still reported, and the agent's log says what to check."""
    from llmgw.agent.node.discovery import discover_inventory  # noqa: PLC0415
    from tests.helpers.nodes import agent_cfg, no_nvml, smi  # noqa: PLC0415

    csv = "0, GPU-1, NVIDIA GeForce RTX 4090, [N/A], [N/A]\n"
    with caplog.at_level("WARNING", logger="llmgw.agent.node.discovery"):
        inv = discover_inventory(agent_cfg(tmp_path), nvml=no_nvml, smi=smi(stdout=csv))
    (gpu,) = inv.gpus
    assert (gpu.klass, gpu.memory_total_bytes) == ("rtx-4090", 0)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("GPU 0 (NVIDIA GeForce RTX 4090) reports 0 GB of memory: a GPU discovery problem")
    assert "nvidia-smi" in line


def test_ctl_nodes_prints_the_discovery_problem(tmp_path: Path, store: Store) -> None:
    """``llmgw ctl nodes`` against the real admin API on a loopback port (in a thread): the node's
    problem line follows the table."""
    inv = declared(tmp_path, [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 0}])
    store.upsert_node_heartbeat("gpu-a", Heartbeat(inventory=inv, engines=[LLAMA]), 999.0)
    output = ctl_on_admin_app(store, "nodes", token=TOKEN)
    assert "gpu-a: GPU 0 (NVIDIA H100 80GB HBM3) reports 0 GB of memory: a GPU discovery problem" in output


def test_an_unmeasured_card_of_another_product_is_not_the_reason(tmp_path: Path) -> None:
    inv = declared(tmp_path, [{"index": 0, "name": "NVIDIA A10", "memory_total_bytes": 0}])
    d, _ = explain(model(Profile(name="gpu", gpu_class="h100-80gb-hbm3", min_memory_gb=8)), [gpu_node(inv)])
    (rej,) = d.rejections
    assert (rej.code, rej.reason) == ("gpu_class_mismatch", "no GPU of class h100-80gb-hbm3 (has: a10)")
