"""The judge keeper, branch by branch, with an injected clock and a recording serve."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from llmgw.catalog import Model
from llmgw.control.reconcile.judgekeeper import (
    JUDGE_GRACE,
    JUDGE_RETRY,
    ClassUse,
    JudgeKeeper,
    ServeJob,
    refit_cores,
    roomiest_gpu_class,
)
from llmgw.guard.config import GuardConfig, Policy
from llmgw.guard.judges import ServeRequest
from llmgw.serverinit import plan


@dataclass
class FakeServe:
    started: list[ServeRequest] = field(default_factory=list)
    running: list[ServeJob] = field(default_factory=list)
    fail: bool = False

    def start(self, request: ServeRequest) -> ServeJob:
        if self.fail:
            raise RuntimeError("mirror unreachable")
        self.started.append(request)
        return ServeJob(f"job-{len(self.started)}", request.name, request, True)

    def jobs(self) -> list[ServeJob]:
        return list(self.running)


@dataclass
class Clock:
    t: float = 1000.0

    def __call__(self) -> float:
        return self.t


def lib(*judges: str) -> GuardConfig:
    return GuardConfig(policies=[Policy(name="p", judge=list(judges))] if judges else [])


def keeper(
    judges: tuple[str, ...] = ("qwen3guard-0.6b",), models: list[Model] | None = None, **kw: object
) -> tuple[JudgeKeeper, FakeServe, Clock]:
    serve, clock = FakeServe(), Clock()
    k = JudgeKeeper(
        library=lambda: lib(*judges), models=lambda: list(models or []), serve=serve, now=clock,
        **kw,  # type: ignore[arg-type]
    )
    return k, serve, clock


def past_grace(k: JudgeKeeper, clock: Clock) -> None:
    k.check()
    clock.t += JUDGE_GRACE


def test_not_the_leader_does_nothing() -> None:
    k, serve, _clock = keeper(leader=lambda: False, grace=0)
    k.check()
    assert serve.started == []


def test_guardrails_off_does_nothing() -> None:
    k, serve, _ = keeper(judges=(), grace=0)
    k.check()
    assert serve.started == []
    assert k.first is None


def test_grace_after_start() -> None:
    k, serve, clock = keeper()
    k.check()
    clock.t += JUDGE_GRACE - 1
    k.check()
    assert serve.started == []
    clock.t += 1
    k.check()
    assert [r.name for r in serve.started] == ["qwen3guard-0.6b"]


def test_cpu_judge_is_served_if_absent_on_inits_cores() -> None:
    k, serve, _clock = keeper(node_cpus=lambda: [2], grace=0)
    k.check()
    (req,) = serve.started
    assert (req.replicas, req.cores, req.gpu_class) == (2, 1, "")
    assert req.if_absent is True
    assert req.by == "llmgw (a guard policy names it)"
    assert req.source == plan.GUARD_MODEL_SOURCE


def test_in_catalog_unknown_or_busy_is_skipped() -> None:
    judge = plan.guard_model("http://m/q.gguf", 1, 4)
    k, serve, _ = keeper(judges=("qwen3guard-0.6b", "my-own-judge", "qwen3guard-4b"), models=[judge], grace=0,
                         gpus=lambda: [ClassUse("l4-24gb", 20)])
    serve.running.append(ServeJob("j", "qwen3guard-4b", ServeRequest("qwen3guard-4b", "r", "f"), True))
    k.check()
    assert serve.started == []


def test_retry_after_ten_minutes() -> None:
    k, serve, clock = keeper(grace=0)
    k.check()
    k.check()
    assert len(serve.started) == 1
    clock.t += JUDGE_RETRY - 1
    k.check()
    assert len(serve.started) == 1
    clock.t += 1
    k.check()
    assert len(serve.started) == 2


def test_gpu_judge_on_the_roomiest_class() -> None:
    k, serve, _ = keeper(judges=("qwen3guard-8b",), grace=0,
                         gpus=lambda: [ClassUse("l4-24gb", 20), ClassUse("h100-80gb", 70)])
    k.check()
    (req,) = serve.started
    assert (req.gpu_class, req.replicas, req.cores) == ("h100-80gb", 1, 0)
    assert req.model("http://m/x.gguf").profiles[0].gpu_class == "h100-80gb"


def test_gpu_judge_without_gpus_is_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    k, serve, _ = keeper(judges=("qwen3guard-4b",), grace=0)
    with caplog.at_level(logging.WARNING):
        k.check()
        k.check()
    assert serve.started == []
    warned = [r for r in caplog.records if "runs on a GPU" in r.getMessage()]
    assert len(warned) == 1  # not again until the retry
    assert "qwen3guard-0.6b" in warned[0].getMessage()


def test_a_serve_that_cannot_start_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    k, serve, _ = keeper(grace=0)
    serve.fail = True
    with caplog.at_level(logging.ERROR):
        k.check()
    assert "could not start serving" in caplog.text


@pytest.mark.parametrize(
    ("replicas", "cpus", "want"),
    [(1, [], 2), (1, [2], 2), (1, [16, 3], 3), (1, [16], 4), (2, [], 2), (2, [2], 1), (2, [3], 1),
     (2, [8], 2), (2, [2, 2], 2), (3, [4], 1)],
)
def test_refit_cores(replicas: int, cpus: list[int], want: int) -> None:
    assert refit_cores(replicas, cpus) == want


def test_roomiest_gpu_class() -> None:
    assert roomiest_gpu_class([]) == ""
    assert roomiest_gpu_class([ClassUse("b", 10), ClassUse("a", 10), ClassUse("c", 5)]) == "a"
