"""Autoscaling: how many replicas a model wants, decided by the leader from the gateways' load.

**The signal.** Every control plane's gateway counts, per model, requests in flight and queued
(:data:`~llmgw.control.gateway.load.LoadSource`); :class:`~llmgw.control.gateway.load.LoadReporter`
writes them to the store every second (one transaction: its rows replaced), on every control
plane, leader or not (HA: every control plane serves traffic).

**The decision** (:class:`Autoscaler`, run by the leader beside its reconcile loop): every
:data:`TICK_S` it reads the rows written within :data:`FRESH_S`, sums them per model into one
sample (``in_flight + queued``), and asks :func:`decide` for the wanted count of every model with
``scaling.max > scaling.min`` (the others keep exactly ``scaling.min``, as before autoscaling).
A changed count is stored with its reason (``autoscale_decisions``) and wakes the leader, whose pass
places replicas up to it, or marks the newest above it as draining (:mod:`.drainer`).

:func:`decide` is Knative's KPA rule (``knative.dev/serving``, pkg/autoscaler):

* ``desired = ceil(stable average / target)``, the stable average over ``stable_window_s`` (60 s);
* **panic** when the load is at least twice the ready capacity (``ready x target``), or any load
  with no replica ready: scale up at once to ``ceil(panic load / target)``, and do not scale down
  while in panic (for ``stable_window_s`` after the last panicking sample);
* scale down only after ``scale_down_after_s`` (300 s) of lower desire, to the highest desire seen
  in that time; the last replica goes (``min: 0``) only after ``scale_to_zero_after_s`` (600 s)
  without any load;
* always within ``[scaling.min, scaling.max]``.

One departure from the KPA, for reaction time: the panic load is the larger of the panic window's
average and the newest sample (each control plane's reading of the last second). A window average
lags a step by half its length (3 s of a 6 s window); the issue asks for a decision within 2 s of a
load step, which only the newest reading gives. The cost is that a one-second spike of twice the
capacity starts a replica (kept ``scale_down_after_s``); a burst that short is rare next to the
seconds an LLM answer takes, and starting a replica early is the cheap mistake.

**Continuation.** A new leader (failover, restart) reads each model's last decision and starts from
its count, and from its panic (still in panic until ``at + stable_window_s``). Its sample history
starts empty, and it counts lower desire from its own start: it may keep replicas longer than the
old leader would have, never fewer, so a failover does not flap a model down and up.

What it does not guarantee: samples are taken every :data:`TICK_S` when the leader's pool is free;
a control plane whose writes stop (down, cut off) leaves the sum within :data:`FRESH_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from llmgw.catalog import Model, Scaling, scaling_target
from llmgw.control.store import ReplicaRow, Store
from llmgw.control.store.offloop import OffLoop, run_off
from llmgw.control.store.rows import DecisionRow, GatewayLoadRow, HistoryRow
from llmgw.errors import Conflict
from llmgw.protocol import ReplicaState

log = logging.getLogger(__name__)

#: Seconds between two decisions; with the gateways' writes every second
#: (:data:`~llmgw.control.gateway.load.REPORT_EVERY_S`) a load step is seen within ~1.5 s.
TICK_S = 0.5
#: A load row older than this (s) is not counted: three missed writes, its control plane is gone.
FRESH_S = 3.0
#: The newest sample counts as "now" for panic while it is this recent (s).
NEWEST_S = 2.0
#: Decisions kept per model in the store.
KEEP_DECISIONS = 100
#: Seconds between two points of the dashboard's plot (wanted, ready, load); kept :data:`HISTORY_S`.
HISTORY_EVERY_S = 15.0
HISTORY_S = 3600.0


@dataclass(frozen=True)
class Sample:
    """The cluster's load of one model at ``at`` (unix seconds): requests in flight plus queued,
    summed over the control planes' fresh rows, and the requests that arrived since each control
    plane's previous reading (``arrived``: a request too short to be seen in flight still counts
    as a request for scale to zero)."""

    at: float
    load: float
    arrived: int = 0


@dataclass(frozen=True)
class ScaleState:
    """What :func:`decide` remembers between calls for one model.

    Attributes:
        wanted: the replicas wanted now (the last decision's count, or ``scaling.min``).
        panic_until: unix seconds until which the model is in panic (no scale-down); 0: not.
        lower_since: since when the desire has been below ``wanted`` (None: it is not).
        lower_peak: the highest desire seen since ``lower_since``.
        last_load_at: when any load was last seen (unix seconds), for scale to zero.
    """

    wanted: int
    panic_until: float = 0.0
    lower_since: float | None = None
    lower_peak: int = 0
    last_load_at: float = 0.0


@dataclass(frozen=True)
class Verdict:
    """:func:`decide`'s answer: the new ``state`` (its ``wanted`` is the count), ``reason`` ("" when
    the count did not change) and whether the model is in ``panic``."""

    state: ScaleState
    reason: str = ""
    panic: bool = False


def _mean(samples: Sequence[Sample], since: float) -> tuple[float, int]:
    """Mean load of the samples after ``since``, and how many there were (0.0, 0 for none)."""
    loads = [s.load for s in samples if s.at > since]
    return (sum(loads) / len(loads), len(loads)) if loads else (0.0, 0)


def _ceil(x: float) -> int:
    """``ceil`` that does not turn 4.000000001 (float sums) into 5."""
    return math.ceil(round(x, 6))


def decide(
    scaling: Scaling, target: float, samples: Sequence[Sample], ready: int, state: ScaleState, now: float
) -> Verdict:
    """The wanted replicas of one model (module docstring: the KPA rule).

    Args:
        scaling: the model's ``scaling`` (``min``, ``max``, the windows).
        target: requests in flight per replica (:func:`~llmgw.catalog.scaling_target`), > 0.
        samples: the model's load samples, oldest first (older than the stable window are ignored).
        ready: replicas ready and not draining now.
        state: what the last call returned (:class:`ScaleState`; a first call: ``ScaleState(min)``).
        now: unix seconds.

    Returns:
        the :class:`Verdict`; its ``reason`` names the load per replica, the window, the target and
        ``panic`` (``scaled 1 → 3: 7.4 in flight or queued per replica over 6 s, target 2, panic``).
    """
    stable, _ = _mean(samples, now - scaling.stable_window_s)
    panic_avg, _ = _mean(samples, now - scaling.panic_window_s)
    fresh = samples[-1] if samples and samples[-1].at > now - NEWEST_S else None
    newest = fresh.load if fresh is not None else 0.0
    burst = max(panic_avg, newest)
    asked = newest > 0 or (fresh is not None and fresh.arrived > 0)  # in flight, queued, or come and gone
    last_load_at = now if asked else state.last_load_at
    capacity = ready * target
    panicking = burst > 0 and (ready == 0 or burst >= 2 * capacity)
    panic_until = now + scaling.stable_window_s if panicking else state.panic_until
    in_panic = now < panic_until
    if in_panic:
        desired = max(state.wanted, _ceil(burst / target), _ceil(stable / target))
        load, window = burst, scaling.panic_window_s
    else:
        desired = _ceil(stable / target)
        load, window = stable, scaling.stable_window_s
    desired = min(max(desired, scaling.min), scaling.max)
    st = replace(state, panic_until=panic_until, last_load_at=last_load_at)
    per = f"{load / max(ready, 1):.1f} in flight or queued per replica over {window:g} s, target {target:g}"
    wanted = min(max(state.wanted, scaling.min), scaling.max)
    if wanted != state.wanted:  # the operator moved min or max past the count
        which = "min" if wanted == scaling.min and state.wanted < wanted else "max"
        return _changed(st, state.wanted, wanted, f"scaling.{which} is {wanted}", in_panic)
    if desired > wanted:
        return _changed(st, wanted, desired, per + (", panic" if in_panic else ""), in_panic)
    if desired == wanted:
        return Verdict(replace(st, lower_since=None, lower_peak=0), panic=in_panic)
    since = state.lower_since if state.lower_since is not None else now
    peak = max(state.lower_peak, desired) if state.lower_since is not None else desired
    st = replace(st, lower_since=since, lower_peak=peak)
    quiet = now - last_load_at
    # The last replica goes after scale_to_zero_after_s without a request, even when scale_down_after_s
    # is longer (with the default 300 s, scale_to_zero_after_s 20 did nothing: found checking this stop)
    last_idle = wanted == 1 and peak == 0 and quiet >= scaling.scale_to_zero_after_s
    if now - since < scaling.scale_down_after_s and not last_idle:
        return Verdict(st, panic=in_panic)
    to = peak
    if to == 0 and quiet < scaling.scale_to_zero_after_s:
        to = 1  # the last replica waits for scale_to_zero_after_s without any request
    if to >= wanted:
        return Verdict(st, panic=in_panic)
    zero = f"scale_to_zero_after_s {scaling.scale_to_zero_after_s:g}"
    if scaling.stable_window_s > scaling.scale_to_zero_after_s:  # the load it averages reaches 0 only then
        zero += f", and stable_window_s {scaling.stable_window_s:g} without load"
    why = f"no request for {quiet:.0f} s ({zero})" if to == 0 else f"{per}, lower for {now - since:.0f} s"
    # A new quiet period starts (the peak of the next one is measured afresh), except toward zero:
    # a count floored at 1 goes to 0 as soon as scale_to_zero_after_s without a request is reached.
    after = replace(st, lower_peak=desired) if to == 1 and desired == 0 else replace(st, lower_since=None, lower_peak=0)
    return _changed(after, wanted, to, why, in_panic)


def _changed(st: ScaleState, old: int, new: int, why: str, panic: bool) -> Verdict:
    if new > old:
        st = replace(st, lower_since=None, lower_peak=0)
    return Verdict(replace(st, wanted=new), f"scaled {old} → {new}: {why}", panic)


def floor_closed_judges(store: Store, closed: Mapping[str, str], now: float) -> list[str]:
    """Raise ``scaling.min`` from 0 to 1 for each judge a ``fail: closed`` guard policy names
    (``closed``: ``{judge model name or alias: policy}``), logged with the reason; returns their
    names. The admin API refuses ``min: 0`` for them; this catches an entry stored before its policy
    failed closed (server.yaml changed), since every request the policy guards would be refused while
    its judge starts from zero. A row that changed meanwhile is left for the next leader term."""
    raised = []
    for row in store.list_models():
        m = row.model
        policy = next((closed[n] for n in (m.name, *m.aliases) if n in closed), None)
        if policy is None or m.scaling.min > 0:
            continue
        scaling = m.scaling.model_copy(update={"min": 1, "max": max(m.scaling.max, 1)})
        try:
            store.update_model(m.model_copy(update={"scaling": scaling}), revision=row.revision, now=now)
        except Conflict:
            continue
        log.warning("model %s: scaling.min 0 raised to 1: it judges the guard policy '%s', which fails closed "
                    "(a judge at zero replicas would refuse every request it guards)", m.name, policy)
        raised.append(m.name)
    return raised


def wanted_replicas(model: Model, last: Mapping[str, DecisionRow], current: int = 0) -> int:
    """How many replicas the leader places for ``model``: ``scaling.min`` unless it autoscales
    (``max > min``), else its last decision's count, within ``[min, max]``. Before its first decision,
    the ``current`` replicas (not draining) within ``[min, max]``: a model made autoscaled (``min`` set
    to 0 on a running one) keeps what runs until the autoscaler decides, which it does from there
    (:meth:`Autoscaler.tick_once`); it was cut to ``min`` at once, without a decision or
    ``scale_to_zero_after_s`` (a new user's finding)."""
    s = model.scaling
    if not s.autoscaled:
        return s.min
    count = last[model.name].to_n if model.name in last else current
    return min(max(count, s.min), s.max)


def serving(r: ReplicaRow) -> bool:
    """A replica ready and not draining: what counts as ready capacity."""
    return r.state == ReplicaState.READY and r.draining_since is None


def sum_load(rows: Sequence[GatewayLoadRow]) -> dict[str, float]:
    """``{model: in flight + queued}`` over every control plane's rows."""
    out: dict[str, float] = {}
    for r in rows:
        out[r.model] = out.get(r.model, 0.0) + r.in_flight + r.queued
    return out


def sum_arrived(rows: Sequence[GatewayLoadRow]) -> dict[str, int]:
    """``{model: requests arrived}`` over every control plane's rows (each its last reading's)."""
    out: dict[str, int] = {}
    for r in rows:
        if r.arrived:
            out[r.model] = out.get(r.model, 0) + r.arrived
    return out


class Autoscaler:
    """The leader's autoscaling loop (module docstring).

    Args:
        store: the store, fenced by the leader's term.
        wake: called (on a store thread) after a pass that changed a wanted count: the leader's
            :meth:`~llmgw.control.reconcile.leader.Leader.wake`.
        db: the pool passes run on (default: the loop's default executor).
        clock: unix seconds.
        tick_s: :data:`TICK_S`.
        on_decision: called with each decision recorded (metrics); on a store thread.
        closed_judges: ``{judge model: policy}`` of the ``fail: closed`` guard policies: never at zero
            (:func:`floor_closed_judges`, when a term starts).
    """

    def __init__(
        self,
        store: Store,
        *,
        wake: Callable[[], None] = lambda: None,
        db: OffLoop | None = None,
        clock: Callable[[], float] = time.time,
        tick_s: float = TICK_S,
        on_decision: Callable[[DecisionRow], None] | None = None,
        closed_judges: Mapping[str, str] | None = None,
    ) -> None:
        self.store, self.wake, self.db, self.clock, self.tick_s = store, wake, db, clock, tick_s
        self.closed_judges = dict(closed_judges or {})
        self.on_decision = on_decision
        self.states: dict[str, ScaleState] | None = None  # None: not yet read from the store
        self.samples: dict[str, deque[Sample]] = {}
        self._plotted: dict[str, float] = {}  # model -> when its last history point was written

    def resume(self, now: float, models: Sequence[Model]) -> None:
        """Start from each model's last recorded decision (module docstring: continuation); first,
        :func:`floor_closed_judges`."""
        if self.closed_judges and floor_closed_judges(self.store, self.closed_judges, now):
            models = [r.model for r in self.store.list_models()]
            self.wake()
        last = self.store.last_decisions()
        self.states = {}
        for m in models:
            d = last.get(m.name)
            if d is None:
                continue
            if not m.scaling.autoscaled:
                self.store.forget_decisions(m.name)
                continue
            panic_until = d.at + m.scaling.stable_window_s if d.panic else 0.0
            self.states[m.name] = ScaleState(wanted=d.to_n, panic_until=panic_until, last_load_at=now)

    def tick_once(self, now: float) -> list[DecisionRow]:
        """Read the load and the replicas, decide every autoscaled model, record the changes."""
        models = [r.model for r in self.store.list_models()]
        if self.states is None:
            self.resume(now, models)
            models = [r.model for r in self.store.list_models()]
        states = self.states if self.states is not None else {}
        rows = self.store.read_gateway_load(since=now - FRESH_S)
        load, arrived = sum_load(rows), sum_arrived(rows)
        ready: dict[str, int] = {}
        placed: dict[str, int] = {}  # not draining: the count a model made autoscaled starts from
        for r in self.store.list_replicas():
            if serving(r):
                ready[r.model] = ready.get(r.model, 0) + 1
            if r.draining_since is None:
                placed[r.model] = placed.get(r.model, 0) + 1
        made = []
        names = {m.name for m in models}
        for gone in [k for k in states if k not in names]:
            states.pop(gone)
            self.samples.pop(gone, None)
        for m in models:
            if not m.scaling.autoscaled:
                if states.pop(m.name, None) is not None:
                    # Autoscaled no more: its count is scaling.min from now on, and a later return to
                    # autoscaling starts from there, not from a stale decision.
                    self.store.forget_decisions(m.name)
                self.samples.pop(m.name, None)
                continue
            q = self.samples.setdefault(m.name, deque())
            q.append(Sample(now, load.get(m.name, 0.0), arrived.get(m.name, 0)))
            while q and q[0].at <= now - m.scaling.stable_window_s:
                q.popleft()
            state = states.get(m.name) or ScaleState(wanted=wanted_replicas(m, {}, placed.get(m.name, 0)),
                                                     last_load_at=now)
            states[m.name] = state  # known from now on (even before its first decision)
            verdict = decide(m.scaling, scaling_target(m), q, ready.get(m.name, 0), state, now)
            states[m.name] = verdict.state
            if verdict.reason:
                row = DecisionRow(m.name, now, state.wanted, verdict.state.wanted, verdict.reason, verdict.panic)
                self.store.add_decision(row, keep=KEEP_DECISIONS)
                log.info("model %s: %s", m.name, verdict.reason)
                made.append(row)
                if self.on_decision is not None:
                    self.on_decision(row)
        due = [name for name in sorted(states) if now - self._plotted.get(name, 0.0) >= HISTORY_EVERY_S]
        if due:  # a point per model every HISTORY_EVERY_S, the first as soon as it autoscales
            self._plotted = {name: self._plotted.get(name, 0.0) for name in states} | dict.fromkeys(due, now)
            points = [HistoryRow(n, now, states[n].wanted, ready.get(n, 0), load.get(n, 0.0)) for n in due]
            self.store.add_history(points, before=now - HISTORY_S)
        if made:
            self.wake()
        return made

    async def run(self, stop: asyncio.Event) -> None:
        """:meth:`tick_once` every ``tick_s`` until ``stop`` is set; a failed tick is logged."""
        while not stop.is_set():
            try:
                await run_off(self.db, self.tick_once, self.clock())
            except Exception:
                log.exception("autoscaling pass failed; the next one retries")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.tick_s)

