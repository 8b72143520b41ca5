"""The leader's reconcile loop: node liveness, replica placement, restarts, and placement's explanations.

Exactly one control plane is the leader and runs this loop (:mod:`llmgw.control.reconcile.election`:
with SQLite the process that owns the file; with PostgreSQL the holder of a session advisory lock
and its term). The control plane runs it on a store fenced by that term, so a pass still running
after leadership moved cannot write, and cancels it on step-down.

Passes run off the event loop, on the store's thread pool (:class:`~llmgw.control.store.offloop.OffLoop`),
so placement over every node and the explanations never stall heartbeats or the gateway. A wake
(an admin write, a heartbeat that changed something) starts a pass after :data:`COALESCE_S`, at
most one pass starts per :data:`MIN_GAP_S`, and wakes that arrive while a pass runs collapse into
one more pass: adding 50 models in a burst, and the 100 heartbeats that report their replicas
ready, cost a handful of passes, not 150.

After each pass, off the loop, GGUF headers of the models it saw whose profiles give no ``min_memory_gb``
are read from the mirror (:mod:`llmgw.control.placement.estimate`) and stored (a failed source retried after
:data:`.facts.FACTS_RETRY_S`); a header read wakes a pass to count it (read before each pass instead, a new
model's waited for the pass after next: ``ctl model add`` waited 2-3 s). Before each pass every ``ready``
replica whose node is silent (no heartbeat for ``node_lost_after_s``, or already ``lost``) has its engine
probed as the gateway would reach it (:mod:`llmgw.control.reconcile.probe`, on the loop). The pass itself
never does network I/O.

Each pass (:meth:`Leader.reconcile_once`), in this order (a *dirty* pass, what the loop runs
between full ones, reads only what changed and visits only the models that may need work:
:mod:`.view` says how, how each also reads a part of the view's rows again, and why a full pass
comes every :data:`~.view.RESYNC_S`):

1. **Nodes**: a ``ready`` node whose last heartbeat is older than ``node_lost_after_s`` becomes
   ``lost`` (silence counts from this leader's first pass at the earliest, so a control plane
   restarted after an outage loses no node whose agent reports within ``node_lost_after_s``).
   First, so that the rest of the pass does not count or place on a dead node.
2. **Orphans**: replicas of models no longer in the catalog, and replicas on ``lost`` nodes or on
   nodes never seen, are deleted; the agents stop what is no longer desired at their next heartbeat
   (a lost node that comes back is told to run none of them, so its agent stops those engines).
   Except: a replica of a silent node whose engine answered this pass's probe is kept, and stays
   routable. A silent agent (restarted, paused, cut off from the control plane but not from the
   gateway) says nothing about its engines; killing and replacing a serving engine turned a 30 s
   agent pause into ~20 s of 503s. When the agent reports again, it keeps (or adopts)
   the very same engine; when the probe fails too, the replica is lost and replaced.
   Before placement, so the capacity they held is free again.
3. **Stale and failed replicas**: a replica whose profile, source or version changed since it was
   placed (``spec_hash``) is replaced: a ready one drains (as a scale-down's: :mod:`.drainer`) while
   its replacement is placed, one not yet ready is deleted; a ``failed`` one is deleted once its
   backoff has passed (10 s doubling to 5 min by crashes so far, forgiven after ``backoff_reset_s``
   ready; an operator's restart is no crash: :mod:`llmgw.control.reconcile.restarts`), and the
   replica placed in its stead carries ``restarts + 1`` and its error as ``last_error``.
4. **Models**, by name: the newest replicas above the wanted count drain, then stop
   (:mod:`.drainer`: autoscaling's scale-down and ``ctl model scale`` alike); place new ones until the wanted count
   (``scaling.min``, or the autoscaler's last decision: :func:`.autoscale.wanted_replicas`) with one
   :class:`~llmgw.control.placement.placer.Placer` for the whole pass (each placement sees the reservations of
   every one before it, of any model, so replicas spread and two never get one GPU); store the
   :class:`~llmgw.views.ExplainView` for every model, placed or not, so ``explain-placement`` always answers
   from the last pass. An explanation equal to the one this leader last stored for the model (``evaluated_at``
   aside) is not written again: a steady cluster's passes write nothing, and ``evaluated_at`` is the pass that
   first reached the current verdict.

A profile without ``min_memory_gb`` reserves its GGUF's estimate once the header is known, nothing before
(:mod:`llmgw.control.placement.inputs`). Every write is optimistic (revision checked); a row that changed
under the pass is left for the next pass. A new replica is ``pending`` with a fresh id (``<model>-<6 hex>``)
and key until its node reports it.

What it does not guarantee: a node that flaps past ``node_lost_after_s`` while its engines do not answer the
probe loses its replicas and gets new ones (new ids and keys, so engines restart); an engine kept by the probe
is watched by nobody but that probe until its agent returns (a crash shows as a failed probe, one pass later);
replicas are not moved to a better node once placed; a profile or version change replaces every replica of
the model at once, not one by one.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import KW_ONLY, dataclass, field, replace

import aiohttp

from llmgw.catalog import Model
from llmgw.control.placement import checks
from llmgw.control.placement import estimate as est
from llmgw.control.placement import placer as placement
from llmgw.control.placement.explain import explain_view
from llmgw.control.placement.inputs import effective_model, parse_facts
from llmgw.control.reconcile import drainer, facts, groups, restarts
from llmgw.control.reconcile import probe as probing
from llmgw.control.reconcile.autoscale import FRESH_S, wanted_replicas
from llmgw.control.reconcile.probe import EngineProbe, probe_engine
from llmgw.control.reconcile.restarts import BACKOFF_RESET_S, Carry
from llmgw.control.reconcile.specs import new_replica_id, spec_hash, spec_hashes
from llmgw.control.reconcile.view import RESYNC_S, Roll, View
from llmgw.control.store import ModelRow, NodeRow, ReplicaRow, Store
from llmgw.control.store.offloop import OffLoop, run_off
from llmgw.control.store.rows import DecisionRow, DirtyRead, GatewayLoadRow
from llmgw.errors import Conflict
from llmgw.protocol import ReplicaState
from llmgw.views import ExplainView

log = logging.getLogger(__name__)

#: Seconds between the starts of passes when nothing wakes the loop (at least :data:`MIN_GAP_S` between one's
#: end and the next's start); an admin change or a heartbeat that changed something wakes it at once.
DEFAULT_INTERVAL_S = 2.0

#: How long a wake waits before its pass starts (seconds), so that a burst of admin writes or
#: heartbeats is reconciled by one pass; small next to the seconds an engine takes to start.
COALESCE_S = 0.2

#: The shortest time between the starts of two passes when wakes keep coming (seconds). A pass over
#: 200 nodes and 50 models is ~0.1-0.2 s of CPU on 2 cores; one a second leaves the rest to
#: heartbeats and the gateway while replicas start, and still places a new model within a second.
MIN_GAP_S = 1.0


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    """True when called from ``loop``'s own thread, inside it."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


@dataclass
class PassResult:
    """What one pass did (for logs and tests)."""

    lost: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    explanations: dict[str, ExplainView] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)  # replicas of silent nodes whose engine answered
    drained: list[str] = field(default_factory=list)  # replicas that began (or stopped) draining

    @property
    def changed(self) -> bool:
        """True when nodes or replicas changed (draining included: the routing table leaves them out)."""
        return bool(self.lost or self.created or self.removed or self.drained)


@dataclass(eq=False, repr=False)
class Leader:
    """Runs :meth:`reconcile_once` every ``interval_s`` or when :meth:`wake` is called.

    Args:
        store: the state store.
        node_lost_after_s: ``ServerConfig.node_lost_after_s``.
        clock: unix seconds (injected so tests need not sleep).
        interval_s: seconds between passes when nothing wakes the loop.
        on_change: called after a pass that created, removed or lost something (the routing
            table refreshes on it). With :meth:`run` it is called on a store thread.
        read_facts: reads a GGUF header from a source URL (a seam; default: HTTP Range request).
        backoff_reset_s: ``ServerConfig.backoff_reset_s``: ready this long, a replica's crashes
            are forgiven.
        probe: probes an engine of a silent node (a seam; default :func:`probe_engine`).
        db: the pool :meth:`run` runs passes on (default: the loop's default executor).
        coalesce_s: :data:`COALESCE_S`.
        min_gap_s: :data:`MIN_GAP_S`.
        resync_s: seconds between full passes when the loop runs (:data:`~.view.RESYNC_S`); the dirty
            passes between read the view's rows again in parts (:class:`~.view.Roll`).
    """

    store: Store
    _: KW_ONLY
    node_lost_after_s: float
    clock: Callable[[], float] = time.time
    interval_s: float = DEFAULT_INTERVAL_S
    on_change: Callable[[], None] | None = None
    read_facts: facts.FactsReader = est.read_facts
    backoff_reset_s: float = BACKOFF_RESET_S
    probe: EngineProbe | None = None
    db: OffLoop | None = None
    coalesce_s: float = COALESCE_S
    min_gap_s: float = MIN_GAP_S
    resync_s: float = RESYNC_S
    # The pass's own state (not constructor arguments):
    #: the cluster as of the last pass (view.py); None: the next pass is full.
    _view: View | None = field(default=None, init=False)
    #: (at, the ids silent_nodes gave then).
    _silent: tuple[float, list[str]] = field(default_factory=lambda: (-1.0, []), init=False)
    #: which of the view's rows each dirty pass reads again (view.py, "Rolling re-reads").
    _roll: Roll = field(default_factory=Roll, init=False)
    #: nodes whose rows changed under the last pass: read them again.
    _reread: set[str] = field(default_factory=set, init=False)
    #: suspects() read for a full pass.
    _prefetched: tuple[float, DirtyRead, View] | None = field(default=None, init=False)
    #: this pass's new replicas and explanations, written at its end.
    _new: list[ReplicaRow] = field(default_factory=list, init=False)
    _views: list[ExplainView] = field(default_factory=list, init=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False)
    _created: dict[str, float] = field(default_factory=dict, init=False)
    _first_pass: float | None = field(default=None, init=False)
    #: kept by the probe at the last pass (to log changes once).
    _vouched: set[str] = field(default_factory=set, init=False)
    #: model -> (its created_at, its last stored explanation without evaluated_at).
    _explained: dict[str, tuple[float, str]] = field(default_factory=dict, init=False)
    #: model -> (its newest replica placed, the placement's summary) (explain-placement).
    _placed: dict[str, tuple[str, str]] = field(default_factory=dict, init=False)
    #: each model's last autoscaling decision, read each pass.
    _decisions: dict[str, DecisionRow] = field(default_factory=dict, init=False)
    #: the gateways' fresh load rows, read each pass (draining).
    _load: list[GatewayLoadRow] = field(default_factory=list, init=False)

    def wake(self) -> None:
        """Ask for a pass now (an admin change, a heartbeat that changed a node). Callable from any
        thread once :meth:`run` has started (a judge fetched by the mirror wakes it from one)."""
        loop = self._loop
        if loop is not None and not _on(loop):
            loop.call_soon_threadsafe(self._wake.set)
        else:
            self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Reconcile until ``stop`` is set, each pass on a store thread (engine probes on the
        loop). A failed pass is logged and the next one runs."""
        self._loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as session:
            if self.probe is None:
                self.probe = lambda endpoint, key: probe_engine(session, endpoint, key)
            await self._passes(stop)

    async def _passes(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._wake.clear()
            started = time.monotonic()
            try:
                await self.pass_once(self.clock(), dirty=True)
                if await run_off(self.db, self.refresh_facts, self.clock()):  # a pass counts what was read
                    self._wake.set()
            except Exception:
                log.exception("reconcile pass failed; the next pass retries")
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
            try:
                await asyncio.wait(waiters, timeout=self.until_next(started), return_when=asyncio.FIRST_COMPLETED)
            finally:  # cancelled too (a shutdown): a waiter left pending was "destroyed but pending" at exit
                for w in waiters:
                    w.cancel()
            if self._wake.is_set() and not stop.is_set():
                # Let the rest of a burst arrive, and keep passes at least min_gap_s apart.
                await asyncio.sleep(max(self.coalesce_s, self.min_gap_s - (time.monotonic() - started)))

    def until_next(self, started: float) -> float:
        """Seconds until the next timed pass: ``interval_s`` after the last one *started* (so a node
        gone silent is marked at most ``interval_s`` plus the mark's own write after its silence
        passed ``node_lost_after_s``, however long the passes take), but at least ``min_gap_s``
        after it ended (a pass longer than the interval does not make them back to back)."""
        return max(self.min_gap_s, self.interval_s - (time.monotonic() - started))

    def refresh_facts(self, now: float) -> list[str]:
        """Read the GGUF headers that are missing (:func:`.facts.refresh`), after a pass; returns the
        sources read. From the view when the next pass is a dirty one (no store trip unless one is read)."""
        return facts.refresh(self.store, None if self._full_due(now) else self._view, self.read_facts, now)

    def _full_due(self, now: float) -> bool:
        """Whether the next dirty pass must be a full one: no view yet (a new leader, a failed
        pass), or the last full read is :attr:`resync_s` old."""
        return self._view is None or now - self._view.full_at >= self.resync_s

    def silent(self, node: NodeRow, now: float) -> bool:
        """Whether ``node`` counts as silent at ``now`` (:func:`~llmgw.control.reconcile.probe.silent`,
        counted from this leader's first pass at the earliest)."""
        return probing.silent(node, now, lost_after_s=self.node_lost_after_s, since=self._first_pass)

    def _silent_ids(self, now: float) -> list[str]:
        """The ``ready`` nodes silent at ``now``, asked of the store (one query, kept for ``now``)."""
        cutoff = now - self.node_lost_after_s
        if self._first_pass is None or self._first_pass >= cutoff:
            return []  # silence counts from this leader's first pass
        if self._silent[0] != now:
            self._silent = (now, self.store.silent_nodes(before=cutoff))
        return self._silent[1]

    def suspects(self, now: float, *, dirty: bool = False) -> list[ReplicaRow]:
        """The ``ready`` replicas whose node is silent, lost or gone at ``now``. Before a full pass
        from the rows it then reuses (:meth:`_read_full`); before a dirty one from the view and
        the silent nodes' ids."""
        view = self._view
        if not dirty or view is None or self._full_due(now):
            got, view = self.store.read_dirty(), View.read(self.store, now)  # marks first (_read_full)
            self._prefetched = (now, got, view)
            silent = {k for k, n in view.nodes.items() if self.silent(n, now)}
        else:
            silent = set(self._silent_ids(now)) | {k for k, n in view.nodes.items() if n.state != "ready"}
            if not silent:  # the common case: no replica scanned (a removed node's replicas went with it)
                return []
        return [r for r in view.replicas.values()
                if r.state == ReplicaState.READY and r.endpoint and (r.node in silent or r.node not in view.nodes)]

    def _read_full(self, now: float) -> tuple[DirtyRead, View]:
        """The marks, then every row: what :meth:`suspects` read for this ``now``, else read now.
        Marks first, so a change committed between the two reads keeps its mark for the next pass."""
        pre, self._prefetched = self._prefetched, None
        if pre is not None and pre[0] == now:
            return pre[1], pre[2]
        return self.store.read_dirty(), View.read(self.store, now)

    async def probe_silent(self, now: float, *, dirty: bool = False) -> set[str]:
        """Probe the engine of every ``ready`` replica whose node is silent (or gone), all at
        once; returns the ids of those whose engine answered
        (:data:`~llmgw.control.reconcile.probe.PROBE_TIMEOUT_S` at most)."""
        if self.probe is None:
            return set()
        suspects = await run_off(self.db, self.suspects, now, dirty=dirty)
        return await probing.answering(self.probe, suspects)

    async def pass_once(self, now: float, *, dirty: bool = False) -> PassResult:
        """Probe the engines of silent nodes (:meth:`probe_silent`, on the loop), then
        :meth:`reconcile_once` off it."""
        answering = await self.probe_silent(now, dirty=dirty)
        return await run_off(self.db, self.reconcile_once, now, answering=answering, dirty=dirty)

    def reconcile_once(self, now: float, *, answering: Collection[str] = (), dirty: bool = False) -> PassResult:
        """One pass, as the module docstring describes; returns what it did.

        ``answering``: ids of replicas on silent nodes whose engine answered its probe this pass
        (:meth:`probe_silent`); they are kept. Without it, a silent node's replicas go.
        ``dirty``: a dirty pass (:mod:`.view`) unless a full one is due; else a full pass.
        """
        try:
            return self._reconcile(now, set(answering), dirty=dirty and not self._full_due(now))
        except BaseException:
            self._view = None  # the view may be half-applied: the next pass reads everything
            self._explained = {}  # and writes every explanation again
            raise

    def _reconcile(self, now: float, answering: set[str], *, dirty: bool) -> PassResult:
        result, reread, self._reread = PassResult(), self._reread, set()
        self._new, self._views = [], []
        if self._first_pass is None:
            self._first_pass = now
        if dirty and self._view is not None:
            view = self._view
            roll_nodes, roll_models = self._roll.due(view, now)
            got = self.store.read_dirty(nodes=[*self._silent_ids(now), *reread, *roll_nodes], models=roll_models)
            view.apply(got)
            checked = [n for n in (got.nodes[k] for k in sorted(got.nodes)) if n is not None]
            for name in (k for k, v in got.models.items() if v is None):
                self.store.delete_explanation(name)
        else:
            got, view = self._read_full(now)
            self._view = view
            self._roll.start(now)
            checked = [view.nodes[k] for k in sorted(view.nodes)]
            for stale in set(self.store.explanation_summaries()) - set(view.models):
                self.store.delete_explanation(stale)
        for node in self._mark_lost(now, checked, result):
            view.nodes[node.id] = node
            view.pending_nodes.add(node.id)
        rows = view.models
        facts = parse_facts(view.facts)  # once per pass, not once per model
        models = {k: effective_model(v.model, facts) for k, v in rows.items()}
        live = {n.id for n in view.nodes.values() if n.state == "ready"}
        before = dict(view.replicas)
        replicas = self._remove_orphans(rows, live, answering, list(before.values()), result)
        replicas, carry = self._replace_stale_and_failed(rows, replicas, now, result,
                                                         changed=set(got.models) if dirty else None)
        replicas = restarts.forgive(self.store, replicas, now, self.backoff_reset_s)
        view.replicas = {r.id: r for r in replicas}
        autoscaled = any(m.model.scaling.autoscaled for m in rows.values())
        if autoscaled:
            self._decisions = self.store.last_decisions()
        if autoscaled or any(r.draining_since is not None for r in replicas):
            self._load = self.store.read_gateway_load(since=now - FRESH_S)  # what draining replicas still serve
        running = Counter(r.model for r in replicas if r.draining_since is None)  # before a first decision
        wanted = {k: wanted_replicas(m, self._decisions, running[k]) for k, m in models.items()}
        removed = [before[k] for k in result.removed if k in before]
        visit = view.visits(models, wanted, got.models, removed) if dirty else set(models)
        self._explained = {k: v for k, v in self._explained.items() if k in rows and v[0] == rows[k].created_at}
        self._placed = {k: v for k, v in self._placed.items() if k in rows}
        self._created = {k: v.created_at for k, v in rows.items()}
        by_model: dict[str, list[ReplicaRow]] = {}
        for r in replicas:
            by_model.setdefault(r.model, []).append(r)
        placer = view.placer_for(models) if visit else None  # built or caught up only when needed
        for name in sorted(visit):
            by_model[name] = self._reconcile_model(
                models[name], raw=rows[name].model, placer=placer, mine=by_model.get(name, []),  # type: ignore[arg-type]
                carry=carry.get(name, []), wanted=wanted[name], now=now, result=result, view=view,
            )
        view.replicas = {r.id: r for ms in by_model.values() for r in ms}
        self.store.add_replicas(self._new)
        self.store.set_explanations(self._views, now=now)
        self.store.forget_changes(got.change_ids)
        if result.changed and self.on_change is not None:
            self.on_change()
        return result

    def _store_explanation(self, view: ExplainView, now: float) -> None:
        """Write ``view`` unless it is what this leader last stored for the model (same row)."""
        created = self._created.get(view.model, 0.0)
        body = view.model_copy(update={"evaluated_at": None}).model_dump_json()
        if self._explained.get(view.model) == (created, body):
            return
        self._views.append(view)  # written with the pass's others (store.set_explanations)
        self._explained[view.model] = (created, body)

    def _mark_lost(self, now: float, nodes: list[NodeRow], result: PassResult) -> list[NodeRow]:
        """Mark the silent ones of ``nodes`` lost; returns them as now stored."""
        out = []
        for node in nodes:
            # Silence counts from this leader's first pass at the earliest: a control plane that was
            # down (restart, upgrade) heard no heartbeats and must not stop every engine of every
            # node at its first pass; agents get node_lost_after_s to report again.
            if node.state == "ready" and self.silent(node, now):
                try:
                    lost = self.store.update_node(node, state="lost")
                except Conflict:
                    self._reread.add(node.id)  # a heartbeat arrived meanwhile: it is alive
                    continue
                result.lost.append(node.id)
                log.warning("node %s lost: no heartbeat for %.1f s", node.id, now - node.last_seen)
                out.append(lost)
        return out

    def _remove_orphans(
        self, models: dict[str, ModelRow], live: set[str], answering: set[str], replicas: list[ReplicaRow],
        result: PassResult,
    ) -> list[ReplicaRow]:
        kept = []
        vouched = set()
        for r in replicas:
            if r.model in models and r.node in live:
                kept.append(groups.check_members(self.store, r, live) if r.members else r)
                continue
            if r.model in models and r.id in answering and r.state == ReplicaState.READY:
                # The node is silent but its engine serves: keep it routable (module docstring, 2).
                if r.id not in self._vouched:
                    log.warning(
                        "replica %s: node %s is silent, but its engine answers its health probe; "
                        "kept (routable) until the agent reports or the probe fails", r.id, r.node
                    )
                vouched.add(r.id)
                result.kept.append(r.id)
                kept.append(r)
                continue
            if r.id in self._vouched:
                log.warning("replica %s: node %s is silent and its engine no longer answers; replacing it",
                            r.id, r.node)
            if self.store.delete_replica(r.id, revision=r.revision):
                result.removed.append(r.id)
            else:
                kept.append(r)  # changed under us; the next pass sees it fresh
                self._reread.add(r.node)
        self._vouched = vouched
        return kept

    def _drain(self, model: Model, mine: list[ReplicaRow], wanted: int, now: float,
               result: PassResult, *, raw: Model) -> list[ReplicaRow]:
        """Above the wanted count the newest drain, drained ones go, draining ones are called back when
        more are wanted (:mod:`.drainer`; not one from a spec ``raw`` no longer has); returns them as stored."""
        active = [r for r in mine if r.draining_since is None]
        leaving = sorted((r for r in mine if r.draining_since is not None), key=lambda r: (r.created_at, r.id))
        current = [r for r in leaving if not r.spec_hash or r.spec_hash in spec_hashes(raw, r.profile)]
        back = current[:max(wanted - len(active), 0)]
        now_rows: dict[str, ReplicaRow | None] = {}
        for r in drainer.to_drain(active, wanted):
            now_rows[r.id] = self._write(r, now)
            log.info("replica %s of %s: draining (%d wanted)", r.id, model.name, wanted)
        for r in reversed(back):
            now_rows[r.id] = self._write(r, None)
            log.info("replica %s of %s: serving again (%d wanted)", r.id, model.name, wanted)
        for r in (x for x in leaving if x not in back):
            if drainer.drained(r, self._load, now) and self.store.delete_replica(r.id, revision=r.revision):
                log.info("replica %s of %s: drained; stopping it", r.id, model.name)
                result.removed.append(r.id)
                now_rows[r.id] = None
        if not now_rows:
            return mine
        result.drained.extend(k for k, v in now_rows.items() if v is not None)
        return [x for x in (now_rows.get(r.id, r) for r in mine) if x is not None]

    def _write(self, r: ReplicaRow, draining_since: float | None) -> ReplicaRow:
        """``r`` with ``draining_since`` written (revision-checked); ``r`` unchanged when it changed
        under the pass (the next pass sees it fresh)."""
        try:
            return self.store.update_replica(replace(r, draining_since=draining_since))
        except Conflict:
            return r

    def _replace_stale_and_failed(
        self, rows: dict[str, ModelRow], replicas: list[ReplicaRow], now: float, result: PassResult,
        changed: set[str] | None,
    ) -> tuple[list[ReplicaRow], dict[str, list[Carry]]]:
        """Step 3; ``changed``: the models whose spec may have changed (None: any)."""
        kept: list[ReplicaRow] = []
        carry: dict[str, list[Carry]] = {}
        hashes: dict[tuple[str, str], set[str]] = {}  # (model, profile) -> spec_hashes, once per pass
        for r in replicas:
            if changed is not None and r.state != ReplicaState.FAILED and r.model not in changed:
                kept.append(r)  # a dirty pass: neither failed nor of a model that changed
                continue
            if r.model not in rows:  # its model is gone and its delete lost a race: _remove_orphans
                kept.append(r)  # deletes it at the next pass
                continue
            model = rows[r.model].model
            if (r.model, r.profile) not in hashes:
                hashes[r.model, r.profile] = spec_hashes(model, r.profile)
            stale = bool(r.spec_hash) and r.spec_hash not in hashes[r.model, r.profile]
            failed_for = now - r.updated_at
            crashes = restarts.crashes(r, self.backoff_reset_s)
            if not (stale or restarts.due(r, now, self.backoff_reset_s)):
                kept.append(r)
                continue
            if stale and r.state == ReplicaState.READY:  # not stopped under its requests
                kept.append(self._drain_stale(r, now, carry, result))
                continue
            if not self.store.delete_replica(r.id, revision=r.revision):
                kept.append(r)
                self._reread.add(r.node)
                continue
            result.removed.append(r.id)
            if stale:
                log.info("replica %s: its profile or source changed; replacing it", r.id)
                carry.setdefault(r.model, []).append(Carry(r.restarts, r.last_error))
            else:
                log.info(
                    "replica %s: failed %.0f s ago (restart %d); replacing it", r.id, failed_for, crashes + 1
                )
                carry.setdefault(r.model, []).append(Carry(crashes + 1, r.err))
        return kept, carry

    def _drain_stale(self, r: ReplicaRow, now: float, carry: dict[str, list[Carry]], result: PassResult) -> ReplicaRow:
        """``r`` (ready, its profile, source or version changed) marked draining, once: routed no more,
        stopped once its requests end (at most :data:`.drainer.DRAIN_BOUND_S`), while its replacement is
        placed; returns it as now stored (unchanged when it changed under the pass)."""
        if r.draining_since is not None:
            return r
        drained = self._write(r, now)
        if drained is r:  # changed under the pass: the next one sees it fresh
            self._reread.add(r.node)
            return r
        log.info("replica %s: its profile or source changed; draining it while a replacement is placed", r.id)
        result.drained.append(r.id)  # the routing tables leave it out
        carry.setdefault(r.model, []).append(Carry(r.restarts, r.last_error))
        return drained

    def _reconcile_model(
        self,
        model: Model,
        *,
        raw: Model,
        placer: placement.Placer,
        mine: list[ReplicaRow],
        carry: list[Carry],
        wanted: int,
        now: float,
        result: PassResult,
        view: View,
    ) -> list[ReplicaRow]:
        """Step 4 for one model: drain or remove what is above its count, place what is missing,
        store its explanation; returns its replicas as now stored."""
        # Above the wanted count the newest drain, then stop (the oldest are the likeliest to be ready).
        mine = self._drain(model, mine, wanted, now, result, raw=raw)
        decision: checks.Decision | None = None
        while len([r for r in mine if r.draining_since is None]) < wanted:
            decision = placer.place(model)
            if decision.node is None or decision.profile is None:
                break
            before = carry.pop(0) if carry else Carry(0, "")
            new = ReplicaRow(
                id=new_replica_id(model.name),
                model=model.name,
                node=decision.node,
                profile=decision.profile.name,
                key=secrets.token_urlsafe(24),
                created_at=now,
                updated_at=now,
                restarts=before.restarts,
                last_error=before.last_error,
                gpu_indexes=decision.gpu_indexes,
                spec_hash=spec_hash(raw, decision.profile.name),
                members=decision.members,
            )
            self._new.append(new)  # written with the pass's others (store.add_replicas)
            view.placed(new.id, placer.reserve_members(model, decision, new.id))
            group = f" with workers on {', '.join(m.node for m in new.members[1:])}" if new.members else ""
            self._placed[model.name] = (new.id, decision.summary)
            log.info("replica %s: %s%s", new.id, decision.summary, group)
            result.created.append(new.id)
            mine = [*mine, new]
        if decision is None:
            # A dry run of one more replica, the model's own replicas not counted against it, so the
            # explanation always lists every node's verdict (Placer.without shares the pass's indexes:
            # a few ms at 5,000 nodes where a fresh placer took ~150 ms per model). The place() before
            # it builds the model's profile indexes on the pass's placer (it reserves nothing), so
            # every dry run copies them instead of building its own over every node.
            placer.place(model)
            dry = placer.without(model.name)
            placer_for_view, decision = dry, dry.place(model)
        else:
            placer_for_view = placer
        explained = explain_view(model, decision=decision, placer=placer_for_view, now=now, wanted=wanted,
                                 replicas=[(r.id, groups.where(r)) for r in mine if r.draining_since is None],
                                 newest=self._placed.get(model.name),
                                 draining=[r.id for r in mine if r.draining_since is not None])
        self._store_explanation(explained, now)
        result.explanations[model.name] = explained
        return mine
