"""The rules server init decides by: cpu_plan, judge_for (llmgw.guard.sizing), starter_model, guard_model."""

from __future__ import annotations

import pytest

from llmgw.catalog import Role
from llmgw.guard import sizing
from llmgw.serverinit import plan


@pytest.mark.parametrize(
    ("cpus", "judges", "want"),
    [
        (1, 0, (0, 1)), (1, 1, (0, 0)), (1, 3, (0, 0)),
        (2, 0, (2, 2)), (2, 1, (2, 0)), (2, 2, (1, 0)), (2, 3, (1, 0)),
        (4, 1, (4, 0)), (4, 2, (2, 0)), (4, 3, (1, 1)),
        (5, 3, (1, 2)), (6, 3, (2, 0)),
        (8, 0, (2, 8)), (8, 1, (4, 4)), (8, 2, (2, 4)),
        (16, 0, (2, 8)), (16, 1, (4, 8)), (16, 3, (2, 8)),
    ],
)
def test_cpu_plan_table(cpus: int, judges: int, want: tuple[int, int]) -> None:
    split = sizing.cpu_plan(cpus=cpus, judges=judges)
    assert (split.judge, split.starter) == want


@pytest.mark.parametrize("cpus", range(1, 17))
@pytest.mark.parametrize("judges", range(4))
def test_cpu_plan_never_reserves_more_than_the_machine(cpus: int, judges: int) -> None:
    split = sizing.cpu_plan(cpus=cpus, judges=judges)
    assert split.starter <= 8
    if cpus < 2:  # the judges reserve none; the starter alone has the core
        assert (split.judge, split.starter) == (0, 0 if judges else cpus)
        return
    # Judges get at least one core each; the starter only what is left.
    assert split.judge >= 1
    assert judges * split.judge + split.starter <= max(cpus, judges)
    if judges == 1:
        assert split.judge == min(cpus, sizing.JUDGE_CORES_ALONE)


def test_cpu_plan_without_a_node_reserves_two_a_judge_and_no_starter() -> None:
    assert sizing.cpu_plan(cpus=32, judges=2, no_node=True) == sizing.CpuSplit(judge=2, starter=0)


@pytest.mark.parametrize(
    ("no_node", "standbys", "flag", "want"),
    [
        (False, False, None, 1), (True, False, None, 2), (False, True, None, 2),
        (False, False, 3, 3), (True, False, 0, 0),
    ],
)
def test_judge_for(no_node: bool, standbys: bool, flag: int | None, want: int) -> None:
    assert sizing.judge_for(no_node=no_node, standbys=standbys, replicas_flag=flag) == want


def test_starter_entry() -> None:
    spec = plan.starter_spec(plan.STARTER_SOURCE)
    m = plan.starter_model(spec, 4096, 6, "http://m:8081/x/starter/q.gguf", ["h100-80gb", "l4-24gb"], pinned=True)
    assert m.name == "qwen2.5-0.5b-instruct"
    assert m.aliases == ["qwen-0.5b"]
    assert (m.scaling.min, m.scaling.max) == (1, 1)
    assert m.context_length == 4096
    assert m.max_output == 1024
    assert m.routing_profile == "chat"
    assert [(p.name, p.priority, p.gpu_class) for p in m.profiles] == [
        ("gpu-h100-80gb", 200, "h100-80gb"), ("gpu-l4-24gb", 200, "l4-24gb"), ("cpu", 100, ""),
    ]
    gpu, cpu = m.profiles[0], m.profiles[-1]
    assert gpu.args == ["--ctx-size", "32768"]
    assert cpu.args == ["--ctx-size", "16384"]
    assert cpu.cpu_cores == 6
    assert gpu.cpu_cores == 0
    for p in m.profiles:
        assert p.node_selector == {"llmgw.control-plane": "true"}
        assert p.min_memory_gb == 2
    # Tried GPU first.
    assert [p.name for p in m.profiles_by_priority()][-1] == "cpu"


def test_starter_context_grows_past_the_floor() -> None:
    spec = plan.starter_spec(plan.STARTER_SOURCE)
    m = plan.starter_model(spec, 16384, 2, "u/q.gguf", ["a10-24gb"], pinned=False)
    assert m.profiles[0].args == ["--ctx-size", "65536"]
    assert m.profiles[1].args == ["--ctx-size", "65536"]
    assert all(p.node_selector == {} for p in m.profiles)


def test_starter_from_a_carried_in_file_is_named_after_it() -> None:
    spec = plan.starter_spec("file:/models/Gemma-3-270M-Q4_K_M.gguf", size_bytes=253_000_000)
    assert spec.name == "gemma-3-270m-q4_k_m"
    assert spec.alias == ""
    assert spec.min_memory_gb() == 2
    named = plan.starter_spec("file:/m/x.gguf", name="tiny", alias="t")
    assert (named.name, named.alias) == ("tiny", "t")


def test_guard_entry() -> None:
    g = plan.guard_model("http://m/g.gguf", 1, 4)
    assert g.name == "qwen3guard-0.6b"
    assert g.role is Role.GUARD
    assert g.guard is not None
    assert g.guard.format == "qwen3guard"
    assert (g.scaling.min, g.scaling.max) == (1, 1)
    (p,) = g.profiles
    assert (p.name, p.gpu_class, p.min_memory_gb, p.cpu_cores) == ("cpu", "", 2, 4)
    assert p.args == ["--ctx-size", "8192", "--cache-ram", "0"]
