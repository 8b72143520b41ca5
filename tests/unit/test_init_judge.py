"""init's judge parts: the judge's name, engine args and catalog entry, the policy block it appends."""

from __future__ import annotations

from pathlib import Path

import yaml

from llmgw.catalog import Role
from llmgw.guard import sizing
from llmgw.guard.config import FailMode, GuardConfig
from llmgw.serverinit import files, plan


def test_judge_name() -> None:
    assert plan.judge_name(plan.GUARD_MODEL_SOURCE, "") == "qwen3guard-0.6b"
    assert plan.judge_name("file:/x/Qwen3Guard-Gen-0.6B.Q8_0.gguf", "qwen3guard") == "qwen3guard-0.6b"
    assert plan.judge_name("file:/m/gemma-3-270m-q4_k_m.gguf", "prompted") == "judge-gemma-3-270m-q4_k_m"


def test_guard_model_entry() -> None:
    m = plan.guard_model("http://mirror/q.gguf", 1, 4)
    assert m.name == "qwen3guard-0.6b"
    assert m.role is Role.GUARD
    assert m.guard is not None
    assert m.guard.format == "qwen3guard"
    assert (m.scaling.min, m.scaling.max) == (1, 1)
    (p,) = m.profiles
    assert (p.name, p.engine, p.gpu_class, p.min_memory_gb, p.cpu_cores) == ("cpu", "llamacpp", "", 2, 4)
    assert p.args == ["--ctx-size", "8192", "--cache-ram", "0"]
    g = plan.guard_model("http://mirror/g.gguf", 2, 2, fmt="prompted", name="judge-g")
    assert g.profiles[0].args[-1] == "--swa-full"
    assert g.guard is not None
    assert g.guard.format == "prompted"


def test_judge_for_and_cpu_plan() -> None:
    assert sizing.judge_for(no_node=False) == 1
    assert sizing.judge_for(no_node=True) == 2
    assert sizing.judge_for(no_node=False, replicas_flag=3) == 3
    assert sizing.cpu_plan(cpus=2, judges=1) == sizing.CpuSplit(judge=2, starter=0)
    assert sizing.cpu_plan(cpus=8, judges=1) == sizing.CpuSplit(judge=4, starter=4)
    assert sizing.cpu_plan(cpus=2, judges=0) == sizing.CpuSplit(judge=2, starter=2)


def test_guard_block_is_a_valid_closed_policy(tmp_path: Path) -> None:
    conf = tmp_path / "server.yaml"
    conf.write_text("admin_listen: 127.0.0.1:9090\n")
    backup = files.append_block(conf, files.guard_block("qwen3guard-0.6b"))
    assert backup.read_text() == "admin_listen: 127.0.0.1:9090\n"
    g = GuardConfig.model_validate(yaml.safe_load(conf.read_text())["guard"])
    assert g.on()
    (p,) = g.policies
    assert p.judges() == ["qwen3guard-0.6b"]
    assert p.fail is FailMode.CLOSED
    assert [d.value for d in p.check] == ["in", "out"]
