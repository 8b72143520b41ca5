"""``decide()``, the KPA rule of :mod:`llmgw.control.reconcile.autoscale`, table-driven on synthetic
load samples (pure logic: no store, no loop), and the catalog's autoscaling fields (bad values are
a validation error naming the field)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from llmgw.catalog import Model, Scaling, scale_to, scaling_target
from llmgw.control.reconcile.autoscale import Sample, ScaleState, decide, wanted_replicas
from llmgw.control.store.rows import DecisionRow

T0 = 1_000_000.0


def _steady(load: float, start: float, end: float, every: float = 0.5) -> list[Sample]:
    return [Sample(start + i * every, load) for i in range(int((end - start) / every) + 1)]


def _run(scaling: Scaling, target: float, loads: list[tuple[float, float]], *, ready_follows: bool = True,
         wanted: int | None = None, every: float = 0.5) -> list[tuple[float, int, str]]:
    """Drive decide() every ``every`` s over ``loads`` ([(until_t, load)]), ready = wanted when
    ``ready_follows``; returns [(t, wanted, reason)] for each change."""
    state = ScaleState(wanted=scaling.min if wanted is None else wanted, last_load_at=T0)
    samples: list[Sample] = []
    t, out = T0, []
    for until, load in loads:
        while t < T0 + until:
            samples.append(Sample(t, load))
            samples = [s for s in samples if s.at > t - scaling.stable_window_s]
            v = decide(scaling, target, samples, state.wanted if ready_follows else 0, state, t)
            if v.reason:
                out.append((t - T0, v.state.wanted, v.reason))
            state = v.state
            t += every
    return out


def test_stable_load_settles_on_ceil_of_load_over_target() -> None:
    s = Scaling(min=1, max=10, target=2.0)
    # 5 in flight with 1 replica ready: 2.5x capacity -> panic at once, ceil(5/2) = 3
    changes = _run(s, 2.0, [(120, 5.0)])
    assert changes[0][:2] == (0.0, 3)
    assert changes[0][2] == "scaled 1 → 3: 5.0 in flight or queued per replica over 6 s, target 2, panic"
    assert len(changes) == 1  # then steady: no flapping


def test_below_panic_threshold_scales_on_the_stable_average() -> None:
    s = Scaling(min=1, max=10, target=4.0)
    # 3 replicas ready, load 14 (< 2 x 12): no panic; the stable average rises toward 14 -> 4 replicas
    changes = _run(s, 4.0, [(90, 14.0)], wanted=3)
    assert [c[1] for c in changes] == [4]
    assert "panic" not in changes[0][2]
    assert changes[0][2].endswith("over 60 s, target 4")
    # the stable average of 14 over a filling window: 4 is wanted once it passes 12 (first sample)
    assert changes[0][0] == 0.0


def test_panic_decides_from_the_newest_sample_within_one_tick() -> None:
    s = Scaling(min=1, max=10, target=2.0)
    state = ScaleState(wanted=1, last_load_at=T0)
    idle = _steady(0.0, T0, T0 + 30)
    step = [*idle, Sample(T0 + 30.5, 8.0)]
    v = decide(s, 2.0, step, 1, state, T0 + 30.5)
    # the panic window's average is 8/13 = 0.6; the newest sample (8 >= 2 x 2) decides: ceil(8/2) = 4
    assert (v.state.wanted, v.panic) == (4, True)
    assert v.reason == "scaled 1 → 4: 8.0 in flight or queued per replica over 6 s, target 2, panic"


def test_no_scale_down_in_panic_nor_before_scale_down_after_s() -> None:
    s = Scaling(min=1, max=10, target=2.0, scale_down_after_s=120.0)
    changes = _run(s, 2.0, [(10, 8.0), (400, 1.0)])
    assert changes[0][:2] == (0.0, 4)  # the burst, 1 ready: panic
    # panic lasts a stable window (60 s) after the last panicking sample (t=0: 4 ready from then
    # on, 8 < 2 x 8); at t=60 the stable average (2.1) wants 2, and 120 s later it goes to 2; the
    # next quiet period (the average of 1.0 wants 1) ends 120 s after that
    assert [(t, n) for t, n, _ in changes[1:]] == [(180.0, 2), (300.5, 1)]
    assert changes[1][2] == "scaled 4 → 2: 0.2 in flight or queued per replica over 60 s, target 2, lower for 120 s"


def test_scale_down_goes_to_the_highest_desire_of_the_quiet_period() -> None:
    s = Scaling(min=1, max=10, target=1.0, scale_down_after_s=60.0, stable_window_s=10.0, panic_window_s=2.0)
    changes = _run(s, 1.0, [(5, 6.0), (40, 3.0), (200, 1.0)], wanted=6)
    # the step to 3 at t=5: the 10 s average falls through 5 first, so 60 s after t=7 the count
    # goes to 5, the highest desire of that quiet period, not to 3; the next period ends at 1
    assert [(t, n) for t, n, _ in changes] == [(67.0, 5), (127.5, 1)]


def _to_zero(s: Scaling, until: float) -> tuple[float, str]:
    """One replica under a load of 2 in flight until t=5, then none until ``until``: the one change
    the run makes (to zero), as (when, its reason)."""
    changes = _run(s, 2.0, [(5, 2.0), (until, 0.0)], wanted=1)
    assert [c[1] for c in changes] == [0]
    t, _, reason = changes[0]
    return t, reason


def test_to_zero_only_after_scale_to_zero_after_s_without_load() -> None:
    s = Scaling(min=0, max=3, target=2.0, scale_down_after_s=30.0, scale_to_zero_after_s=120.0)
    t, reason = _to_zero(s, 400)
    assert 124 <= t <= 126, t  # the last load at t=4.5
    assert reason.startswith("scaled 1 → 0: no request for 12")


def test_from_zero_any_load_scales_to_one_at_once() -> None:
    s = Scaling(min=0, max=3, target=4.0)
    v = decide(s, 4.0, [Sample(T0, 1.0)], 0, ScaleState(wanted=0), T0)
    assert (v.state.wanted, v.panic) == (1, True)
    assert v.reason == "scaled 0 → 1: 1.0 in flight or queued per replica over 6 s, target 4, panic"


@pytest.mark.parametrize(
    ("scaling", "load", "wanted", "expect", "why"),
    [
        (Scaling(min=2, max=5), 100.0, 1, 2, "scaled 1 → 2: scaling.min is 2"),
        (Scaling(min=1, max=3), 0.0, 5, 3, "scaled 5 → 3: scaling.max is 3"),
        (Scaling(min=1, max=3, target=1.0), 100.0, 1, 3, "scaled 1 → 3: 100.0 in flight or queued per replica"),
    ],
)
def test_clamped_to_min_and_max(scaling: Scaling, load: float, wanted: int, expect: int, why: str) -> None:
    v = decide(scaling, scaling_target_or(scaling), [Sample(T0, load)], wanted, ScaleState(wanted=wanted), T0)
    assert v.state.wanted == expect
    assert v.reason.startswith(why)


def scaling_target_or(s: Scaling) -> float:
    return s.target if s.target is not None else 4.0


def test_wanted_replicas_is_min_unless_autoscaled() -> None:
    m = _model({"min": 2, "max": 2})
    last = {"m": DecisionRow("m", T0, 2, 5, "x")}
    assert wanted_replicas(m, last) == 2
    m = _model({"min": 1, "max": 4})
    assert wanted_replicas(m, {}) == 1
    assert wanted_replicas(m, last) == 4  # clamped to max
    m = _model({"min": 1, "max": 6})
    assert wanted_replicas(m, last) == 5


def _model(scaling: dict[str, object], args: list[str] | None = None) -> Model:
    return Model.model_validate({
        "name": "m", "source": "https://h/x.gguf", "version": "1", "scaling": scaling,
        "profiles": [{"name": "cpu", "args": args or []}],
    })


def test_target_defaults_to_the_engine_slots() -> None:
    assert scaling_target(_model({})) == 4.0
    assert scaling_target(_model({}, ["--parallel", "8"])) == 8.0
    assert scaling_target(_model({}, ["-np", "2"])) == 2.0
    assert scaling_target(_model({"target": 1.5})) == 1.5


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("target", 0, "greater than 0"),
        ("target", -1.0, "greater than 0"),
        ("target", math.inf, "finite"),
        ("target", math.nan, "finite"),
        ("target", "2", "valid number"),
        ("stable_window_s", 1e9, "less than or equal to 86400"),
        ("panic_window_s", 0.0, "greater than or equal to 1"),
        ("scale_down_after_s", True, "valid number"),
        ("scale_to_zero_after_s", 1e9, "less than or equal to 86400"),
    ],
)
def test_bad_fields_name_the_field(field: str, value: object, says: str) -> None:
    with pytest.raises(ValidationError) as e:
        Scaling.model_validate({"min": 0, "max": 3, field: value})
    err = e.value.errors()[0]
    assert err["loc"] == (field,)
    assert says in err["msg"]


def test_panic_window_longer_than_stable_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"scaling\.panic_window_s 90 is longer than scaling\.stable_window_s 60"):
        Scaling(panic_window_s=90.0)


@pytest.mark.parametrize(
    ("n", "cur", "patch"),
    [
        (1, (2, 2), {"min": 1, "max": 1}),  # fixed stays fixed: scaling down a fixed model
        (3, (2, 2), {"min": 3, "max": 3}),
        (0, (1, 4), {"min": 0, "max": 4}),  # autoscaled keeps its max
        (5, (1, 4), {"min": 5, "max": 5}),  # ... raised to n when below
    ],
)
def test_scale_to_keeps_a_fixed_model_fixed(n: int, cur: tuple[int, int], patch: dict[str, int]) -> None:
    assert scale_to(n, cur_min=cur[0], cur_max=cur[1]) == patch


def test_the_last_replica_goes_after_scale_to_zero_after_s_even_below_scale_down_after_s() -> None:
    """``scale_to_zero_after_s`` 20 with the default ``scale_down_after_s`` 300: the model stayed at one
    replica for 300 s of quiet (found checking this stop's changes); the last replica goes 20 s
    after the last request, as the docs say."""
    s = Scaling(min=0, max=3, target=2.0, scale_to_zero_after_s=20.0, stable_window_s=6.0)
    assert s.scale_down_after_s > 20
    t, reason = _to_zero(s, 100)
    assert 24 <= t <= 26, t  # the last load at t=4.5
    assert reason.startswith("scaled 1 → 0: no request for 2")


def test_a_stable_window_longer_than_scale_to_zero_after_s_is_named_as_what_held_the_replica() -> None:
    """``scale_to_zero_after_s`` 5 under a 60 s ``stable_window_s``: the replica goes once the window
    holds no load, ~60 s after the request; the reason named only the 5 s (an operator's finding)."""
    s = Scaling(min=0, max=3, target=2.0, scale_to_zero_after_s=5.0, stable_window_s=60.0)
    t, reason = _to_zero(s, 200)
    assert t >= 60, t
    assert reason.startswith("scaled 1 → 0: no request for ")
    assert reason.endswith("(scale_to_zero_after_s 5, and stable_window_s 60 without load)"), reason
