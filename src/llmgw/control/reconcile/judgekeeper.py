"""The judge keeper: on the leader, fetch and serve each judge llmgw
knows that a policy names and the catalog does not have.

Naming ``qwen3guard-4b`` in a policy is all it takes to have one, and a judge removed by mistake
comes back. A judge it does not know is left to ``llmgw ctl guard judge enable --repo``, said in
``guard judge status``.

Each pass (:meth:`JudgeKeeper.check`), in this order:

1. Only the leader acts; with guardrails off (no policy) nothing is done.
2. A grace of :data:`JUDGE_GRACE` (10 minutes) after the keeper's first look: init adds its own
   judge just after the control plane starts, sized and placed as the install says, and one the
   leader added first was what init then kept (found on a fresh HA install: a second judge ran off
   the judge machine).
3. For each judge the policies name (sorted): skipped when the catalog has it, when it is not a
   known judge, when a serve job for it is running, or when it was asked for less than
   :data:`JUDGE_RETRY` (10 minutes) ago. A CPU judge gets 2 replicas on init's cores
   (:func:`refit_cores`); a GPU judge the roomiest GPU class, and without GPUs a warning naming the
   default judge instead. The request is ``if_absent``: init, or an operator, may add it while this
   fetches, and theirs stays.

Not guaranteed: that a judge asked for is ever served (the mirror may not reach its source; the
job's failure is logged and retried every 10 minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from llmgw.catalog import Model
from llmgw.guard.config import GuardConfig
from llmgw.guard.judges import DEFAULT_JUDGE, ServeRequest, known_judge
from llmgw.guard.sizing import JUDGE_CORES, JUDGE_CORES_ALONE

log = logging.getLogger(__name__)

#: How long a judge whose serving failed waits before it is asked for again (seconds).
JUDGE_RETRY = 10 * 60.0
#: The keeper's grace on a control plane just started (seconds).
JUDGE_GRACE = 10 * 60.0


@dataclass(frozen=True)
class ServeJob:
    """A serve job: ``model`` is the catalog name it adds; ``running`` until it ends."""

    id: str
    model: str
    request: ServeRequest
    running: bool


class Serve(Protocol):
    """Starts serve jobs (fetch into the mirror, add to the catalog) and lists them."""

    def start(self, request: ServeRequest) -> ServeJob:
        """Start one; raises :class:`~llmgw.errors.LlmgwError` when it cannot start."""
        ...

    def jobs(self) -> list[ServeJob]:
        """Every job this process started, running or ended."""
        ...


@dataclass(frozen=True)
class ClassUse:
    """A GPU class in the cluster and its free memory (GB) across nodes."""

    gpu_class: str
    free_gb: float


def roomiest_gpu_class(classes: list[ClassUse]) -> str:
    """The GPU class with the most free memory; "" when there is none (ties: by name)."""
    if not classes:
        return ""
    return sorted(classes, key=lambda c: (-c.free_gb, c.gpu_class))[0].gpu_class


def refit_cores(replicas: int, cpus: list[int]) -> int:
    """A judge replica's cores by init's rule: up to four for the one judge of a cluster, two each
    where there are more, fewer where the smallest node cannot hold them all (``cpus``: each node's)."""
    smallest = 0
    for c in cpus:
        if c > 0 and (smallest == 0 or c < smallest):
            smallest = c
    if replicas <= 1:
        return JUDGE_CORES if smallest == 0 else min(smallest, JUDGE_CORES_ALONE)
    cores = JUDGE_CORES
    if len(cpus) == 1 and smallest > 0 and replicas * cores > smallest:
        cores = max(1, smallest // replicas)
    return cores


@dataclass(kw_only=True, eq=False)
class JudgeKeeper:
    """See the module docstring. Every dependency is a callable, so tests drive each branch.

    Args:
        library: the guard configuration in force.
        models: the catalog's models.
        serve: starts serve jobs.
        leader: whether this process is the leader (None: always).
        gpus: the cluster's GPU classes and their free memory.
        now: wall-clock seconds (injected).
        grace: seconds after the first look during which no judge is served (0 waits for nothing).
        node_cpus: each ready node's cores, for a CPU judge's :func:`refit_cores` (None: none known).
    """

    library: Callable[[], GuardConfig]
    models: Callable[[], list[Model]]
    serve: Serve
    leader: Callable[[], bool] | None = None
    gpus: Callable[[], list[ClassUse]] = list
    now: Callable[[], float] = time.time
    grace: float = JUDGE_GRACE
    node_cpus: Callable[[], list[int]] | None = None
    #: When each judge was last asked for, so one that cannot be fetched is not asked every look.
    tried: dict[str, float] = field(default_factory=dict, init=False)
    first: float | None = field(default=None, init=False)

    async def run(self, stop: asyncio.Event, every_s: float = 30.0) -> None:
        """:meth:`check` every ``every_s`` until ``stop`` is set, on a worker thread (its store calls
        must not stall the event loop); a failing pass is logged, not fatal."""
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.check)
            except Exception:
                log.exception("judge keeper pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)

    def check(self) -> None:
        """One pass (see the module docstring)."""
        if self.leader is not None and not self.leader():
            return
        lib = self.library()
        if not lib.on():
            return
        have = {m.name for m in self.models()}
        now = self.now()
        if self.first is None:
            self.first = now
        if now - self.first < self.grace:
            return
        busy = set()
        for j in self.serve.jobs():
            if j.running:
                busy.add(j.model)
                busy.add(j.request.name)
        for name in lib.judge_names():
            kj = known_judge(name)
            if name in have or kj is None or name in busy:
                continue
            at = self.tried.get(name)
            if at is not None and now - at < JUDGE_RETRY:
                continue
            self.tried[name] = now
            if kj.gpu:
                klass = roomiest_gpu_class(self.gpus())
                if not klass:
                    log.warning(
                        "a policy names a judge that runs on a GPU, and this cluster has none: judge=%s instead=%s",
                        name, DEFAULT_JUDGE,
                    )
                    continue
                req = kj.serve_request(gpu_class=klass)
            else:
                # The cores init would give the same number of judges.
                cpus = self.node_cpus() if self.node_cpus is not None else []
                req = kj.serve_request(replicas=2, cores=refit_cores(2, cpus))
            # init, or an operator, may add it while this fetches: theirs stays.
            req = replace(req, by="llmgw (a guard policy names it)", if_absent=True)
            try:
                job = self.serve.start(req)
            except Exception as e:
                log.error("could not start serving a judge a policy names: judge=%s err=%s", name, e)  # noqa: TRY400
                continue
            log.info(
                "serving a judge a policy names, which the catalog did not have: judge=%s repo=%s file=%s job=%s",
                name, kj.repo, kj.file, job.id,
            )
