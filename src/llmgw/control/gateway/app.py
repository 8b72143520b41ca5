"""The OpenAI-compatible gateway (docs/architecture.md, "A gateway request"): an aiohttp app the control plane mounts.

Routes: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/chat/completions``, ``GET /healthz``.
Every other path or method is an OpenAI-shaped 404/405 (a 405 with ``Allow``), so clients never parse an HTML page.

A chat request goes, in order (cheap checks first, nothing awaited before the body):

1. **key**: ``Authorization: Bearer <key>`` with a key from ``keys`` (compared by SHA-256 digest, so
   the lookup takes the same time for every wrong key; a keys file is re-read when it changes,
   :mod:`llmgw.control.gateway.keys`). When ``allow_loopback_without_key``, a client whose TCP peer
   is 127.0.0.0/8 or ::1 may send *no* key (or an empty one); a key it does send must be valid like
   anyone else's, so a revoked key is refused from loopback too (an ``openai`` client, which insists
   on some key, is given a real one). The peer address is the socket's, never
   ``X-Forwarded-For``; a reverse proxy on this machine would make every client loopback, so don't
   combine the two.
2. **body**: JSON object with a string ``model`` and a list ``messages`` (``prompt``: one prompt;
   ``input``), every string valid Unicode (no lone surrogate), else 400 ``invalid_request_error``
   naming the field; a chat request's ``messages``/``tools``/``tool_choice`` shapes are checked with
   the fields (:func:`~llmgw.control.gateway.request.check_chat`).
3. **model**: ``router.resolve`` (name or alias); unknown → 404 ``model_not_found`` naming the known models and
   their aliases; no ready replica → 503 ``model_unavailable`` with ``Route.unavailable`` as the reason. Then the
   body is cut to what an engine may see (:mod:`llmgw.control.gateway.request`: OpenAI fields only, ``max_tokens``
   held to the model's ``max_output``); dropped fields are named in the ``x-llmgw-dropped`` header.
4. **guard in** (optional :class:`~llmgw.control.gateway.inspect.Inspector`), then the replica
   (:mod:`llmgw.control.gateway.upstream`: a free slot chosen by the model's policy,
   :mod:`llmgw.control.gateway.balancer`; another replica on a refused connection; byte relay for
   streams), then **guard out**.

A client that disconnects cancels its request: the control plane serves this app with aiohttp's
``handler_cancellation=True``, so the handler is cancelled, which closes the upstream connection,
and llama-server stops generating for a connection that is gone (it looks about once a second) and
frees the slot. Without it, an abandoned non-streamed request held its slot until the answer was
complete (four abandoned requests blocked every later one for 60 s). Serve the app the
same way elsewhere (tests, benchmarks) to keep that.

Every response to a chat request carries ``x-llmgw-replica`` (the replica's id, not its address)
and, once a replica was asked, ``x-llmgw-overhead-ms``: the time spent in the gateway excluding the
wait on the replica, from the handler's start to the response being ready (for streams: to the
first byte). ``observe`` receives the same figures per request, for metrics and usage, on the loop's
next turn (``call_soon``): after the answer is written, before any later event (cProfile, 2,000 requests:
metrics, usage and the access-log line were 379 of the handler's own 757 µs); tokens spent count at once.

What the gateway costs a request (``bench/gateway_overhead.py``: added p50, requests/s against
LiteLLM, CPU per request and where it goes) is measured in docs/install.md ("Gateway overhead").
No body ever names a replica's address or key: the router's reasons are phrased for clients, and a
replica's own error body is scrubbed before it is passed through.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from aiohttp import web

from llmgw import jsonbody
from llmgw.control.gateway.balancer import Balancer, RoutingMetrics
from llmgw.control.gateway.body import abandoned_usage, blocked_usage, prompt_chars, reserved_tokens
from llmgw.control.gateway.body import parse_body as _parse
from llmgw.control.gateway.callers import LOOPBACK_CALLER, STALE_RETRY_AFTER_S, Caller, Callers, presented_key_id
from llmgw.control.gateway.inspect import Call, Exchange, Inspector, current_call
from llmgw.control.gateway.keys import GatewayKeys
from llmgw.control.gateway.limits import Limiter
from llmgw.control.gateway.load import LOAD, LOAD_KICK, LoadCounter, combined
from llmgw.control.gateway.request import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    Endpoint,
    dropped_header,
    echo_text,
    upstream_body,
    with_stream_usage,
)
from llmgw.control.gateway.requestid import request_id, send_request_id
from llmgw.control.gateway.sse import StreamTally
from llmgw.control.gateway.starting import Answered, Starting, hold_request, unavailable_error
from llmgw.control.gateway.upstream import (
    Relay,
    Trace,
    UpstreamPool,
    refusal_response,
    relay_plain,
    relay_stream,
    relay_to_the_answer,
)
from llmgw.errors import HttpError
from llmgw.httperrors import openai_error_json
from llmgw.routing import Route, Router

log = logging.getLogger(__name__)

# Chat bodies carry whole conversations (long contexts, base64 images); aiohttp's default is 1 MiB.
MAX_BODY_BYTES = 64 * 1024 * 1024

_POOL = web.AppKey("llmgw_gateway_pool", UpstreamPool)
def gateway_pool(app: web.Application) -> UpstreamPool:
    """The gateway app's :class:`UpstreamPool`: its balancer and queues (``pool.loads()``: each
    replica's slots, in flight, queued and picks, for ``ctl replicas`` and the metrics page)."""
    return app[_POOL]


def is_loopback(remote: str | None) -> bool:
    """True for a peer address in 127.0.0.0/8, ``::1`` or IPv4-mapped ``::ffff:127.x.y.z``."""
    if not remote:
        return False
    return remote.startswith(("127.", "::ffff:127.")) or remote == "::1"


@dataclass(eq=False)
class _Gateway:
    """The handlers, bound to one router, key set and upstream pool."""

    router: Router
    pool: UpstreamPool
    _: KW_ONLY
    callers: Callers
    allow_loopback_without_key: bool
    inspector: Inspector | None
    observe: Callable[[Exchange], None] | None
    limiter: Limiter | None = None
    load: LoadCounter = field(default_factory=LoadCounter)  # refusals for want of a replica, for autoscaling
    starting: Starting | None = None  # holds requests of a model starting from zero replicas

    def _starting(self, route: Route, endpoint: Endpoint, caller: Caller, requested: str) -> Starting | None:
        """Where a request of ``route`` (no ready replica) is held while its model starts from zero; None: not held."""
        if self.starting is None or not self.starting.holds(route.model) or route.role != endpoint.role:
            return None
        return self.starting if self.callers.may_use(caller, requested, route.model, self._resolve_name) else None

    # -- key -----------------------------------------------------------------------------------
    def authenticate(self, request: web.Request, kind: str) -> Caller | web.Response:
        """The :class:`Caller` when the client may use the gateway, else the 401 to send (or the 503
        ``keys_unavailable`` for a stored key while the stored keys are stale: :meth:`Callers.stale`).

        A presented key (``Authorization: Bearer`` or ``x-api-key``) must be valid (known, not revoked,
        not expired), from loopback too; only no key (or an empty ``Bearer``) is let in from loopback
        when ``allow_loopback_without_key``. An ``Authorization`` header of another scheme, or of no
        scheme, is a wrong key (401), never an error.

        A refusal is handed to ``observe`` as an :class:`Exchange` with ``refused`` set (``invalid``: a
        key was presented and is not valid; ``missing``: none was) and ``kind`` (``chat``,
        ``completions``, ``embeddings`` or ``models``), so it gets an access-log line and a metric;
        the presented secret goes nowhere.
        """
        started_ns = time.perf_counter_ns()
        header = request.headers.get("Authorization", "").strip()
        scheme, _, key = header.partition(" ")
        key = key.strip()
        bearer = scheme.lower() == "bearer"
        # ``x-api-key`` is how Anthropic's (and other) clients send a key: one sent that way must be
        # valid too, or a wrong key from loopback would be ignored as "no key".
        x_key = request.headers.get("x-api-key", "").strip()
        malformed = bool(header) and not bearer
        lookup = self.callers.lookup
        caller = lookup(key) if bearer and key else None
        x_caller = lookup(x_key) if x_key else None
        presented = bool(key) or malformed or bool(x_key)
        bad = ((bool(key) or malformed) and caller is None) or (bool(x_key) and x_caller is None)
        if presented and not bad:
            who = caller or x_caller or LOOPBACK_CALLER
            age = self.callers.stale(who)
            if age is not None:
                return openai_error_json(
                    503, "keys_unavailable",
                    f"This control plane has not read the API keys from its database for {age:.0f} s (it "
                    "cannot reach it), so it cannot tell whether this key was revoked; retry in a few "
                    "seconds or send the request to another control plane",
                    headers={"Retry-After": str(STALE_RETRY_AFTER_S)},
                )
            return who
        open_here = self.allow_loopback_without_key and is_loopback(request.remote)
        if open_here and not presented:
            return LOOPBACK_CALLER
        self._refused(request, kind, "invalid" if presented else "missing", started_ns)
        if not presented:
            message = "Missing API key: send 'Authorization: Bearer <key>'"
        else:
            # From loopback too: a revoked key is refused, and the client is told so first (the
            # loopback hint alone read as if the key did not matter).
            message = "Incorrect API key provided (unknown, revoked or expired)"
            if malformed:  # 'Token KEY', 'Basic …', a bare KEY: a valid key read as wrong (a new user's finding)
                message = "The Authorization header must be 'Bearer <key>' (this one has another scheme, or none)"
            if open_here:
                message += "; from this machine you may also send no key at all"
        return openai_error_json(401, "invalid_api_key", message)

    def _refused(self, request: web.Request, kind: str, reason: str, started_ns: int) -> None:
        """Tell ``observe`` about a 401 (see :meth:`authenticate`); no model, replica or usage."""
        self._note(request, kind, 401, started_ns, code="invalid_api_key", refused=reason)

    def _note(
        self, request: web.Request, kind: str, status: int, started_ns: int, *, key: str = "", model: str = "",
        code: str = "", refused: str = "",
    ) -> None:
        """Hand ``observe`` an :class:`Exchange` of a request no replica was asked for (a 401, a
        ``/v1/models`` answer), after this handler returns."""
        if self.observe is None:
            return
        asyncio.get_running_loop().call_soon(self.observe, Exchange(
            requested=model,
            model=model,
            replica="",
            status=status,
            stream=False,
            overhead_ms=(time.perf_counter_ns() - started_ns) / 1e6,
            upstream_ms=0.0,
            key=key,
            kind=kind,
            request_id=request_id(request),
            code=code,
            refused=refused,
        ))

    # -- models --------------------------------------------------------------------------------
    def _visible(self, caller: Caller) -> list[Route]:
        """The chat models ``caller`` may use (one read of the table), sorted by name."""
        routes = self.router.chat_models()
        if caller.models is None:
            return routes
        return [r for r in routes if self.callers.may_use(caller, r.model, r.model, self._resolve_name)]

    def _resolve_name(self, name: str) -> str | None:
        route = self.router.resolve(name)
        return route.model if route is not None else None

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the chat models this key may use, OpenAI list shape."""
        started_ns = time.perf_counter_ns()
        caller = self.authenticate(request, "models")
        if isinstance(caller, web.Response):
            return caller
        data = [_model_object(r.model, r.created) for r in self._visible(caller)]
        return self._listed(request, caller, "", web.json_response({"object": "list", "data": data}), started_ns)

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: one model (aliases resolve to their model); 404 for one the key
        may not use, as if it did not exist."""
        started_ns = time.perf_counter_ns()
        caller = self.authenticate(request, "models")
        if isinstance(caller, web.Response):
            return caller
        name = request.match_info["id"]
        route = self.router.resolve(name)
        if route is None or not self.callers.may_use(caller, name, route.model, self._resolve_name):
            return self._listed(request, caller, "", self._not_found(name, caller), started_ns)
        return self._listed(request, caller, route.model, web.json_response(_model_object(route.model, route.created)),
                            started_ns)

    def _listed(
        self, request: web.Request, caller: Caller, model: str, response: web.Response, started_ns: int
    ) -> web.Response:
        """``response`` to a ``/v1/models`` request of ``caller``, noted first (kind ``models``: an
        access-log line and ``llmgw_gateway_requests_total``; not usage, which counts model calls);
        ``model`` the catalog name asked about, "" for the list or one not found."""
        code = _answer_code(response) if response.status >= 400 else ""
        self._note(request, "models", response.status, started_ns, key=caller.name, model=model, code=code)
        return response

    def _not_found(self, name: str, caller: Caller) -> web.Response:
        known = ", ".join(f"{r.model} (alias {', '.join(sorted(r.aliases))})" if r.aliases else r.model
                          for r in self._visible(caller)) or (  # the aliases named: they are what clients type
            f"none this key may use (it may use only {', '.join(sorted(caller.models))}; see 'llmgw ctl key ls')"
            if caller.models is not None else "(none yet)")
        lower, model = name.lower(), self._resolve_name(name.lower())  # 'TB' for the alias 'tb' (an operator's finding)
        hint = f" (names are lowercase: '{lower}')" if lower != name and model and self.callers.may_use(
            caller, lower, model, self._resolve_name) else ""
        return openai_error_json(404, "model_not_found", f"model '{name}' does not exist{hint}; known models: {known}")

    # -- chat, completions, embeddings ------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        return await self.serve(request, CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        return await self.serve(request, COMPLETIONS)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/embeddings``."""
        return await self.serve(request, EMBEDDINGS)

    async def serve(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """One request of any endpoint: see the module docstring for the order of checks."""
        trace = Trace(started_ns=time.perf_counter_ns(), request_id=request_id(request), path=endpoint.path)
        caller = self.authenticate(request, endpoint.kind)
        if isinstance(caller, web.Response):
            return caller
        trace.caller = caller.name
        trace.priority = caller.priority
        requested, model, stream, code, blocked = "", "", False, "", False
        body: dict[str, Any] = {}
        call: Call | None = None
        if self.inspector is not None:
            call = Call(caller=presented_key_id(request.headers), key_name=caller.name)  # keys-file, loopback too
            current_call.set(call)
        try:
            raw = await request.read()
            body = _parse(raw, endpoint)
            requested = body["model"]
            stream = body.get("stream") is True
            route = await self.router.resolve_settled(requested)
            pre: web.StreamResponse | None = None  # a held stream's response, prepared while it waited
            held = self._starting(route, endpoint, caller, requested) if route and not route.upstreams else None
            if route is not None and held is not None:  # a model starting from zero: wait for its replica
                model = route.model  # a hold that ends in a 503 is this model's (it was logged as '-')
                t_held = time.perf_counter_ns()
                try:
                    route, pre = await hold_request(held, request, route, stream=stream)
                finally:  # waiting for a replica, as a queue's wait: upstream time, not the gateway's overhead
                    trace.upstream_ns += time.perf_counter_ns() - t_held
            if route is None or not self.callers.may_use(caller, requested, route.model, self._resolve_name):
                out: web.StreamResponse = self._not_found(requested, caller)
            elif route.role != endpoint.role:
                model = route.model
                out = _wrong_endpoint(route, endpoint)
                code = "wrong_endpoint"
            elif not route.upstreams:
                model = route.model
                self.load.missed(model)  # demand the autoscaler sees (a model at zero replicas starts one)
                e = unavailable_error(route.model, route.unavailable or "no replica is ready yet",
                                      retry=not route.unplaceable)
                out = openai_error_json(e.status, e.code, e.message, headers=e.headers)
            else:
                model = route.model
                self.load.arrived(model)  # a request for scale to zero, however short (load.ModelLoad.arrived)
                echo = echo_text(body) if endpoint is COMPLETIONS else ""  # before upstream_body takes it out
                raw, dropped = upstream_body(body, raw, route.max_output if endpoint.limits_output else 0,
                                             endpoint.forwarded)
                # held against tpm and budgets while in flight, then released; walked only for such a key
                hold, need = reserved_tokens(body) if caller.counts_tokens else (0, 0)
                refused, limit_headers = self.limiter.admit(caller, hold, need) if self.limiter else (None, {})
                if refused is not None:
                    out = openai_error_json(429, refused.code, refused.message, headers=refused.headers)
                    code = refused.code
                else:
                    trace.headers, trace.reserved = limit_headers, hold
                    trace.dropped = dropped_header(dropped) if dropped else ""
                    if stream:
                        raw, asked = with_stream_usage(body, raw)
                        trace.tally = StreamTally(hide=not asked, prompt_chars=prompt_chars(body))
                    refusal = await self.inspector.prompt(route, body) if self.inspector is not None else None
                    if refusal is not None:  # a prompt its judge read and blocked is charged its input
                        out, trace.usage = refusal_response(refusal), blocked_usage(body, refusal.code)
                        code, blocked = refusal.code, refusal.code == "content_blocked"
                    else:
                        relay = Relay(self.pool, route, requested, raw, body, trace, self.inspector, echo=echo)
                        plain = relay_to_the_answer if endpoint.engine_finishes else relay_plain
                        out = await (relay_stream(request, relay, pre) if stream else plain(relay))
        except web.HTTPRequestEntityTooLarge:
            code = "request_too_large"
            out = openai_error_json(413, code, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB")
        except Answered as a:  # a held stream refused after its 200: the refusal is its last event
            out, code = a.response, a.code
        except HttpError as e:  # JsonBodyError included
            code = e.code
            out = openai_error_json(e.status, e.code, e.message, headers=e.headers)
        except asyncio.CancelledError:  # the client went away (handler_cancellation)
            if trace.ended_ns:  # after the stream's last event (llmgw chat, the openai client): answered
                code = _stream_end_code(trace, call)
                self._observe(trace, caller, requested, model, stream, status=200, code=code,
                              blocked=code == "content_blocked", kind=endpoint.kind)
            else:
                if not stream and trace.replica and trace.usage is None:  # charged what was decoded meanwhile
                    trace.usage = self._abandoned(trace, body)
                self._observe(
                    trace, caller, requested, model, stream, status=499, code="client_closed", kind=endpoint.kind
                )
            raise
        finally:  # whatever ended it (the tokens it used are spent in _observe)
            if trace.reserved and self.limiter is not None:
                self.limiter.release(caller, trace.reserved)
        if call is not None and not out.prepared:
            out.headers.update(call.headers)
        if not out.prepared:
            # the gateway's own time, a guard's judging included: a refused request's too (it read 0.000
            # for a prompt the guard took seconds to block, a new user's finding)
            trace.setup_ns = time.perf_counter_ns() - trace.started_ns - trace.upstream_ns
            if trace.replica:
                out.headers["x-llmgw-replica"] = trace.replica
                out.headers["x-llmgw-overhead-ms"] = f"{trace.setup_ns / 1e6:.3f}"
            if trace.dropped:
                out.headers["x-llmgw-dropped"] = trace.dropped
            if trace.headers:
                out.headers.update(trace.headers)
            if out.status >= 400 and not code:
                code = _answer_code(out)
                blocked = blocked or code == "content_blocked"
        elif code := _stream_end_code(trace, call):
            blocked = code == "content_blocked"
        self._observe(
            trace, caller, requested, model, stream, status=out.status, code=code, blocked=blocked, kind=endpoint.kind
        )
        return out

    def _observe(
        self, trace: Trace, caller: Caller, requested: str, model: str, stream: bool, *,
        status: int, code: str = "", blocked: bool = False, kind: str = "chat",
    ) -> None:
        """Count the request's tokens against ``caller``'s limits and hand ``observe`` its
        :class:`Exchange` (499: the client went away first)."""
        usage = trace.usage
        # a stream whose 200 went out is charged what its tally counted, even if no body followed (a
        # held answer the client left, or refused at its end: the replica generated it all the same)
        if usage is None and trace.tally is not None and trace.prepared_ns:
            usage = trace.tally.usage()
        if self.limiter is not None and usage is not None and caller.limited:
            tokens = usage.get("total_tokens")
            if not isinstance(tokens, int):
                tokens = sum(v for k in ("prompt_tokens", "completion_tokens") if isinstance(v := usage.get(k), int))
            self.limiter.spend(caller, tokens)
        if self.observe is None:
            return
        now = time.perf_counter_ns()
        first = trace.first_byte_ns or (0 if stream else now)  # a stream that sent no token has no ttft
        asyncio.get_running_loop().call_soon(self.observe, Exchange(
            requested=requested,
            model=model,
            replica=trace.replica,
            status=status,
            stream=stream,
            overhead_ms=trace.setup_ns / 1e6,
            upstream_ms=trace.upstream_ns / 1e6,
            usage=usage,
            key=caller.name,
            kind=kind,
            request_id=trace.request_id,
            code=code,
            blocked=blocked,
            ttft_ms=(first - trace.started_ns) / 1e6 if first else 0.0,
            queued_ms=trace.queued_ns / 1e6,
        ))

    def _abandoned(self, trace: Trace, body: dict[str, Any]) -> dict[str, Any]:
        """:func:`~llmgw.control.gateway.body.abandoned_usage` of a plain request left after it was sent."""
        load = self.pool.balancer.loads().get(trace.replica)
        cap = body.get("max_tokens")
        return abandoned_usage(body, trace.upstream_ns / 1e9, load.tokens_per_s if load else 0.0,
                               cap if isinstance(cap, int) and not isinstance(cap, bool) else 0)

    async def healthz(self, _: web.Request) -> web.Response:
        """``GET /healthz``: the gateway process answers (no key needed, says nothing about models)."""
        return web.json_response({"status": "ok"})

    async def unknown(self, request: web.Request) -> web.Response:
        """Any other path or method: an OpenAI-shaped error instead of aiohttp's text page; a path
        served with another method is a 405 with ``Allow`` naming the methods it takes (RFC 9110).
        Logged and metered as kind ``other`` (they had no access line: a new user's finding)."""
        started_ns = time.perf_counter_ns()
        allow = _ALLOW.get(request.path) or ("GET" if _MODEL_PATH.fullmatch(request.path) else None)
        if allow is not None:
            self._note(request, "other", 405, started_ns, code="method_not_allowed")
            return openai_error_json(
                405, "method_not_allowed", f"{request.method} is not allowed on {request.path}; use {allow}",
                headers={"Allow": allow},
            )
        self._note(request, "other", 404, started_ns, code="not_found")
        return openai_error_json(404, "not_found", f"unknown path {request.path}; this gateway serves "
                                 "/v1/chat/completions, /v1/completions, /v1/embeddings and /v1/models")


#: The methods each path takes, for a 405's ``Allow`` (the routes of :func:`build_gateway_app`).
_ALLOW = {
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/v1/embeddings": "POST",
    "/v1/models": "GET",
    "/healthz": "GET, HEAD",
}
_MODEL_PATH = re.compile(r"/v1/models/[^/]+")


def _stream_end_code(trace: Trace, call: Call | None) -> str:
    """The code a stream that went out (its 200 sent) ended with: its error event's (a broken replica, a
    refusal) or the guard's block of a held answer (a ``content_filter`` chunk); "" when it ended well."""
    return trace.error_code or (call.blocked if call is not None else "")


def _answer_code(out: web.StreamResponse) -> str:
    """The ``code`` of an OpenAI error envelope already in ``out``'s body ("" when there is none)."""
    body = out.body if isinstance(out, web.Response) else None
    if not isinstance(body, bytes | bytearray):
        return ""
    try:
        err = jsonbody.loads(bytes(body)).get("error")
    except (HttpError, AttributeError):
        return ""
    return str(err.get("code") or "") if isinstance(err, dict) else ""


def _model_object(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "llmgw"}


def _wrong_endpoint(route: Route, endpoint: Endpoint) -> web.Response:
    """400 for a model asked on an endpoint of another role, naming the right one."""
    right = "/v1/embeddings" if route.role == "embedding" else "/v1/chat/completions or /v1/completions"
    return openai_error_json(
        400, "wrong_endpoint",
        f"model '{route.model}' is a{'n' if route.role == 'embedding' else ''} {route.role} model; "
        f"{endpoint.path} does not serve it: use {right}",
    )


def build_gateway_app(
    router: Router,
    *,
    keys: Iterable[str] | GatewayKeys,
    allow_loopback_without_key: bool,
    upstream_timeout_s: float = 600.0,
    inspector: Inspector | None = None,
    observe: Callable[[Exchange], None] | None = None,
    callers: Callers | None = None,
    limiter: Limiter | None = None,
    balancer: Balancer | None = None,
    routing_metrics: RoutingMetrics | None = None,
    holds: Callable[[str], bool] | None = None,
    load: LoadCounter | None = None,
) -> web.Application:
    """The gateway as an aiohttp application (the control plane serves it on ``gateway.listen``).

    Args:
        router: where models' replicas are (see :mod:`llmgw.routing`); read on every request.
        keys: API keys clients may send as ``Authorization: Bearer <key>``: a fixed collection (empty
            strings are ignored) or a :class:`GatewayKeys` that follows ``gateway.keys_file``.
        allow_loopback_without_key: let clients on 127.0.0.0/8 and ::1 in without a key (a key they
            send must still be valid).
        upstream_timeout_s: a non-streamed answer's whole time, and a stream's longest silence (s).
        inspector: the guard's hooks (prompt, answer, stream); None relays untouched.
        observe: called once per authorized request of an endpoint with its :class:`Exchange` (metrics,
            usage, the access log), and once per 401 of any keyed route (``Exchange.refused`` set); must
            not block (it runs on the event loop).
        callers: the keys clients may send (stored keys and ``keys``), when the store's keys are used
            (:mod:`llmgw.control.gateway.callers`); None: ``keys`` only.
        limiter: rate limits and budgets per key (:mod:`llmgw.control.gateway.limits`); None: no limits.
        balancer: the replicas' slots, load and the choice (:mod:`llmgw.control.gateway.balancer`),
            for an owner that shows its state (``ctl replicas``, metrics); None: the app makes its own.
        routing_metrics: where routing decisions, queue waits and queue lengths are counted (the
            control plane's metrics); None: nowhere.
        holds: whether a model's requests are held while it has no ready replica (a model that
            scales from zero: :mod:`llmgw.control.gateway.starting`); None: never, 503 at once.
        load: the counter of requests in flight and refused for want of a replica (the autoscaler's
            demand), for an owner that adds to it (the guard's judges at zero); None: the app's own.

    The app opens one pooled upstream session on startup and closes it on cleanup. Serve it with
    ``web.AppRunner(app, handler_cancellation=True)`` so a client that disconnects frees its
    engine slot (see the module docstring).
    """
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    pool = UpstreamPool(
        upstream_timeout_s=upstream_timeout_s, balancer=balancer, metrics=routing_metrics, routes=router.resolve
    )
    app[_POOL] = pool
    router.watch(pool.routes_changed)  # a replica added while requests wait serves them (an autoscaler's)
    gw = _Gateway(
        router,
        pool,
        callers=callers or Callers(keys if isinstance(keys, GatewayKeys) else GatewayKeys(None, initial=keys)),
        allow_loopback_without_key=allow_loopback_without_key,
        inspector=inspector,
        observe=observe,
        limiter=limiter,
        load=load or LoadCounter(),
    )

    if holds is not None:
        kick = asyncio.Event()  # the load reporter writes at once when a model's first request is held
        gw.starting = Starting(router.resolve, holds=holds, on_hold=kick.set)
        app[LOAD_KICK] = kick
    held = gw.starting.held if gw.starting is not None else dict
    # the autoscaler's signal: in flight per replica (the balancer), queued (the queues and the held)
    app[LOAD] = combined(pool.balancer.loads, lambda: _add(pool.queue_lengths(), held()), gw.load)

    async def _lifecycle(_: web.Application) -> AsyncIterator[None]:
        await pool.start()
        yield
        await pool.close()

    app.cleanup_ctx.append(_lifecycle)
    app.on_response_prepare.append(send_request_id)
    app.router.add_post("/v1/chat/completions", gw.chat)
    app.router.add_post("/v1/completions", gw.completions)
    app.router.add_post("/v1/embeddings", gw.embeddings)
    app.router.add_get("/v1/models", gw.models, allow_head=False)
    app.router.add_get("/v1/models/{id}", gw.model, allow_head=False)
    app.router.add_get("/healthz", gw.healthz)
    app.router.add_route("*", "/{tail:.*}", gw.unknown)
    return app


def _add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Two ``{model: count}`` summed."""
    return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}
