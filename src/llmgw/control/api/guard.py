"""The admin API's guard routes, the judge keeper's serve jobs, and the keeper's wiring.

Routes (behind the admin token, like every admin route):

- ``GET /api/v1/guard/status``: each policy (checks, fail, Controversial, budget) and each judge it
  names: in the catalog or not, its format, replicas ready, replicas failed for a wrong template,
  p50/p95 judge time, whether llmgw knows how to fetch it, and what to do when it is missing; plus
  the guard's counters (verdicts, blocked, unjudged, refused, errors).
- ``POST /api/v1/guard/test`` ``{"text", "direction": "in"|"out", "prompt"?, "policy"?}``: judge a
  text with a policy's judges, as the gateway would: ``{"verdict", "categories", "judge", "ms",
  "engine_ms", "decision"}`` or ``{"error", "kind"}`` (the judge's raw text included: this is the
  operator's API).
- ``POST /api/v1/guard/judges/{name}/enable`` ``{"repo"?, "file"?, "format"?}``: serve a judge
  (fetched into the mirror, added to the catalog if absent) as the keeper would; a judge llmgw does
  not know needs ``repo`` and ``file``. 202 with the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any

from aiohttp import web

from llmgw import jsonbody
from llmgw.control.gateway.guard import GuardInspector
from llmgw.control.reconcile.judgekeeper import ClassUse, JudgeKeeper, ServeJob
from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.errors import ConfigError, JudgeError, LlmgwError, MirrorError, SourceError, WaitTimeout
from llmgw.guard.config import Controversial, Direction, GuardConfig
from llmgw.guard.formats import FORMATS, Safety
from llmgw.guard.judges import DEFAULT_JUDGE, ServeRequest, known_judge
from llmgw.httperrors import error_json
from llmgw.mirror.client import MirrorClient
from llmgw.protocol import ReplicaState
from llmgw.sourcecheck import to_download

log = logging.getLogger(__name__)


@dataclass(eq=False)
class MirrorServe:
    """Serve jobs: fetch a judge into the mirror, wait until it is there, add it to the catalog.

    Each job runs in a daemon thread (the mirror client is synchronous). ``if_absent``: a model of
    that name added meanwhile is kept, and nothing is added. ``on_added`` runs after an addition
    (the control plane refreshes its routing table and wakes the leader).
    """

    store: Store
    mirror_api: str
    _: KW_ONLY
    on_added: Callable[[], None] = lambda: None
    mirror_token: str = ""  # the management API's (llmgw.mirror.client); "" sends none
    wait_s: float = 30 * 60
    poll_s: float = 2.0
    _jobs: dict[str, ServeJob] = field(default_factory=dict, init=False)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1), init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def start(self, request: ServeRequest) -> ServeJob:
        """Start fetching and adding ``request``; raises ConfigError without a mirror."""
        if not self.mirror_api:
            raise ConfigError("server.yaml has no mirror.api, so a judge cannot be fetched; run 'llmgw server init'")
        job = ServeJob(f"serve-{next(self._ids)}", request.name, request, True)
        with self._lock:
            self._jobs[job.id] = job
        threading.Thread(target=self._run, args=(job,), daemon=True, name=job.id).start()
        return job

    def jobs(self) -> list[ServeJob]:
        """Every job started by this process."""
        with self._lock:
            return list(self._jobs.values())

    def _fetch(self, req: ServeRequest) -> tuple[str, str]:
        """Fetch into the mirror and wait: the mirror's URL and sha256.

        Raises:
            MirrorError: the mirror could not fetch it.
            WaitTimeout: it did not arrive within ``wait_s``.
            ApiError, UnreachableError: the mirror refused the request or does not answer.
        """
        mirror = MirrorClient(self.mirror_api, timeout=15.0, token=self.mirror_token or None)
        st = mirror.fetch(req.source, req.name, "guard")
        deadline = time.monotonic() + self.wait_s
        while st.state != "present":
            if st.state == "failed":
                raise MirrorError(f"the mirror could not fetch {req.source}: {st.err}")
            if time.monotonic() > deadline:
                raise WaitTimeout(f"{req.source} did not arrive in the mirror within {self.wait_s:g} s")
            time.sleep(self.poll_s)
            st = mirror.status(req.name, "guard")
        return st.url, st.sha256

    def _run(self, job: ServeJob) -> None:
        req = job.request
        try:
            url, sha256 = self._fetch(req)
            if req.if_absent and self.store.get_model(req.name) is not None:
                log.info("a judge was added meanwhile; kept it: judge=%s job=%s", req.name, job.id)
            else:
                self.store.add_model(req.model(url, sha256), now=time.time())
                log.info("judge in the catalog: judge=%s by=%s job=%s", req.name, req.by, job.id)
                self.on_added()
        except Exception as e:
            log.error("serving judge %s failed: %s (job %s)", req.name, e, job.id)  # noqa: TRY400
        finally:
            with self._lock:
                self._jobs[job.id] = ServeJob(job.id, job.model, req, False)


def cluster_gpus(store: Store) -> list[ClassUse]:
    """Each GPU class in the cluster's ready nodes with its free memory (GB), for the keeper."""
    free: dict[str, float] = {}
    for n in store.list_nodes():
        if n.state != "ready":
            continue
        for g in n.inventory.gpus:
            free[g.klass] = free.get(g.klass, 0.0) + (g.memory_total_bytes - g.memory_used_bytes) / 1e9
    return [ClassUse(k, v) for k, v in sorted(free.items())]


def node_cpus(store: Store) -> list[int]:
    """Each ready node's cores, for the keeper's :func:`~llmgw.control.reconcile.judgekeeper.refit_cores`."""
    return [n.inventory.cores for n in store.list_nodes() if n.state == "ready"]


def build_keeper(store: Store, guard: Callable[[], GuardConfig], serve: MirrorServe) -> JudgeKeeper:
    """The judge keeper over the store: the catalog's models, the ready nodes' GPUs and cores."""
    return JudgeKeeper(
        library=guard,
        models=lambda: [r.model for r in store.list_models()],
        serve=serve,
        gpus=lambda: cluster_gpus(store),
        node_cpus=lambda: node_cpus(store),
    )


def guard_status(inspector: GuardInspector | None, config: GuardConfig, store: Store) -> dict[str, Any]:
    """What ``GET /api/v1/guard/status`` answers (see the module docstring)."""
    models = {r.model.name: r.model for r in store.list_models()}
    aliases = {a: m for m in models.values() for a in m.aliases}
    replicas = store.list_replicas()
    failed = inspector.client.template_failed if inspector else {}
    policies = []
    for p in config.policies:
        judges = []
        for name in p.judges():
            m = models.get(name) or aliases.get(name)
            mine = [r for r in replicas if m is not None and r.model == m.name]
            ready = [r for r in mine if r.state == ReplicaState.READY]
            pct = inspector.stats.percentiles(name) if inspector else None
            hint = ""
            if m is not None and m.guard is None:  # a new user named the starter: told to enable it with --repo
                role = m.role.value
                called = f"an alias of the {role} model '{m.name}'" if m.name != name else f"a {role} model"
                hint = f"'{name}' is {called}, not a guard model: name one in the policy (llmgw ctl guard judge enable)"
            elif m is None:
                hint = (
                    f"llmgw ctl guard judge enable {name}" if known_judge(name)
                    else f"llmgw ctl guard judge enable {name} --repo ORG/REPO --file FILE.gguf"
                )
            elif not ready:
                hint = f"llmgw ctl explain-placement {m.name}"
            judges.append({
                "name": name,
                "in_catalog": m is not None,
                "known": known_judge(name) is not None,
                "format": (m.guard.format if m and m.guard else ""),
                "replicas_ready": len(ready),
                "replicas": len(mine),
                "template_failed": sorted(i for i in failed if any(r.id == i for r in mine)),
                "p50_ms": pct[0] if pct else None,
                "p95_ms": pct[1] if pct else None,
                "queue": q.snapshot() if inspector and (q := inspector.client.queues.get(name)) else None,
                "hint": hint,
            })
        policies.append({
            "name": p.name, "check": [d.value for d in p.check], "fail": p.fail.value,
            "controversial": p.controversial.value, "budget_s": p.budget_s, "models": p.models,
            "keys": p.keys, "key_names": p.key_names, "judges": judges,
        })
    return {
        "on": config.on(),
        "policies": policies,
        "stats": inspector.stats.as_dict() if inspector else {},
    }


@dataclass(frozen=True)
class GuardContext:
    """What the guard handlers share, kept on the admin app under :data:`GUARD` by
    :func:`add_guard_routes` (see its arguments)."""

    inspector: GuardInspector | None
    config: GuardConfig
    store: Store
    serve: MirrorServe | None
    db: OffLoop


#: Where the admin app keeps its :class:`GuardContext`.
GUARD: web.AppKey[GuardContext] = web.AppKey("guard", GuardContext)


async def status(request: web.Request) -> web.Response:
    """``GET /api/v1/guard/status``: :func:`guard_status`, built on a store thread."""
    ctx = request.app[GUARD]
    inspector, config, store, db = ctx.inspector, ctx.config, ctx.store, ctx.db
    return web.json_response(await db.read(guard_status, inspector, config, store))


async def test(request: web.Request) -> web.Response:
    """``POST /api/v1/guard/test``: judge a text with a policy's judges, as the gateway would."""
    ctx = request.app[GUARD]
    inspector, config = ctx.inspector, ctx.config
    try:
        body = await jsonbody.read_json(request)
        text = str(body["text"])
        direction = Direction(body.get("direction", "in"))
    except (ValueError, KeyError, TypeError):
        return error_json(400, "invalid_request", 'send {"text": "...", "direction": "in"|"out"}')
    if inspector is None or not config.on():
        return error_json(409, "guard_off", "no guard policy in server.yaml: guardrails are off")
    name = body.get("policy")
    policy = next((p for p in config.policies if p.name == name), None) if name else config.policies[0]
    if policy is None:
        return error_json(404, "policy_not_found", f"no policy '{name}' in server.yaml")
    prompt = str(body.get("prompt", "")) if direction is Direction.OUT else text
    answer = text if direction is Direction.OUT else ""
    t0 = time.perf_counter()
    try:
        j = await inspector.judge(policy, direction, prompt, answer, whole=True)
    except JudgeError as e:
        return web.json_response({
            "policy": policy.name, "direction": direction.value, "error": str(e), "kind": e.kind,
            "raw": e.raw, "ms": (time.perf_counter() - t0) * 1000, "decision": f"fail {policy.fail.value}",
        })
    v = j.verdict
    block = v.safety is Safety.UNSAFE or (
        v.safety is Safety.CONTROVERSIAL and policy.controversial is Controversial.BLOCK
    )
    return web.json_response({
        "policy": policy.name, "direction": direction.value, "verdict": v.safety.value,
        "categories": list(v.categories), "refusal": v.refusal, "judge": j.judge, "ms": j.ms,
        "engine_ms": j.engine_ms, "cached_tokens": j.cached_tokens, "raw": j.raw,
        "decision": "block" if block else "allow",
    })


async def enable(request: web.Request) -> web.Response:  # noqa: PLR0911 - one return per refusal
    """``POST /api/v1/guard/judges/{name}/enable``: serve a judge as the keeper would; 202 with the job."""
    ctx = request.app[GUARD]
    store, serve, db = ctx.store, ctx.serve, ctx.db
    name = request.match_info["name"]
    body: dict[str, Any] = {}
    if request.can_read_body:
        with contextlib.suppress(ValueError):
            body = await jsonbody.read_json(request)
    if serve is None:
        return error_json(409, "no_mirror", "this control plane has no mirror.api to fetch a judge with")
    if await db.read(store.get_model, name) is not None:
        return error_json(
            409, "model_exists", f"'{name}' is already in the catalog; see llmgw ctl guard judge status"
        )
    kj = known_judge(name)
    repo, file = body.get("repo"), body.get("file")
    fmt = body.get("format") or "qwen3guard"
    if fmt not in FORMATS:
        return error_json(400, "invalid_format", f"format '{fmt}': use one of {', '.join(FORMATS)}")
    if repo and file:
        req = ServeRequest(name=name, repo=str(repo), file=str(file), format=fmt, replicas=1, cores=2)
    elif kj is not None:
        if kj.gpu:
            from llmgw.control.reconcile.judgekeeper import roomiest_gpu_class  # noqa: PLC0415

            klass = roomiest_gpu_class(await db.read(cluster_gpus, store))
            if not klass:
                return error_json(
                    409, "no_gpu", f"{name} runs on a GPU and this cluster has none; use {DEFAULT_JUDGE}"
                )
            req = kj.serve_request(gpu_class=klass)
        else:
            req = kj.serve_request(replicas=1, cores=2)
    else:
        return error_json(
            400, "unknown_judge", f"llmgw does not know '{name}': give --repo ORG/REPO and --file FILE.gguf"
        )
    try:  # a source the mirror refuses at once (hf:../../etc/passwd) is a 400 now, not a job that fails unseen
        to_download(req.source, env={})
    except SourceError as e:
        return error_json(400, "invalid_source", f"{e}; give --repo ORG/REPO and --file FILE.gguf")
    try:
        job = await asyncio.to_thread(
            serve.start, replace(req, by="llmgw ctl guard judge enable", if_absent=True)
        )
    except LlmgwError as e:
        return error_json(409, "cannot_serve", str(e))
    return web.json_response({"job": job.id, "judge": name, "source": req.source}, status=202)


#: The guard routes.
ROUTES = [
    web.get("/api/v1/guard/status", status),
    web.post("/api/v1/guard/test", test),
    web.post("/api/v1/guard/judges/{name}/enable", enable),
]


def add_guard_routes(
    app: web.Application, *, inspector: GuardInspector | None, config: GuardConfig, store: Store,
    serve: MirrorServe | None, db: OffLoop,
) -> None:
    """Register the guard routes on the admin app (before it starts).

    Their store calls go through ``db``, the admin API's own off-loop pool (the loop also serves
    heartbeats and the gateway): past its deadline, or with no database, a call raises
    :class:`~llmgw.errors.StoreUnavailable`, which the admin app's middleware answers 503
    ``store_unavailable`` as for every other route. Asking the mirror to fetch a judge is an HTTP
    call, not a store call: it runs on a plain worker thread.
    """
    app[GUARD] = GuardContext(inspector=inspector, config=config, store=store, serve=serve, db=db)
    app.add_routes(ROUTES)
