"""The gateway's side toward the engines: one pooled client, replica choice, and the two relays.

Mechanism, per chat request:

1. :meth:`UpstreamPool.send` takes a slot on one of the model's replicas from the
   :class:`~llmgw.control.gateway.balancer.Balancer` (cache-aware or round-robin, only a replica
   with a free slot; none free: the request waits in the model's
   :class:`~llmgw.control.gateway.queue.FairQueue`, bounded by the catalog's ``queue.size`` and
   ``queue.wait_s``; past them 429 ``model_busy`` with ``Retry-After`` at once) and POSTs the body
   (the client's bytes, or what :mod:`llmgw.control.gateway.request` made of them) to
   ``http://{endpoint}{path}`` with that replica's key. When the connection is refused (or the
   connect times out), nothing was sent: the slot is given back, the replica is passed over for a
   few seconds (so is one whose connection broke mid-request: waiting requests then go elsewhere),
   and another replica is taken (each at most once, through the queue again); when every one
   refused, the client gets 502. A replica is never retried after the request went out
   (generation is not idempotent and may be half done).
2. :func:`relay_plain` reads the whole answer, rewrites its ``model`` to the name the client used
   (re-encoding it only when the name differs: a client that asks by the catalog name gets the
   replica's bytes), and returns the replica's status. :func:`relay_stream` answers ``text/event-stream`` and writes
   every network chunk as it arrives (``iter_any``), never parsing the SSE's JSON; only the
   ``"model"`` field is swapped on bytes for the client's name (:class:`ModelRewriter`), since
   llama-server writes its model file's path there. A ``/v1/completions`` answer that asked for
   ``logprobs`` gets them in OpenAI's legacy shape, and one that asked for ``echo`` its prompt before
   the text (:mod:`.legacylogprobs`). Both give the slot back (:meth:`~llmgw.control.gateway.balancer.Lease.release`)
   on every way out: the answer's end, an error, a client gone (the handler cancelled).
3. Replica errors (llama-server's are OpenAI-shaped) pass through with their status, scrubbed of the
   replica's address and key; a 500 that llama-server gives for the client's own mistake (a field of
   the wrong type, an image sent to a text-only model: :data:`_CLIENT_MISTAKES`) becomes the 400
   ``invalid_request_error`` it is. Two are the gateway's problem, not the client's, and become 502: a
   401/403 (the replica does not know the gateway's key: it was restarted with a new one) and a
   dead replica mid-request. Mid-stream, after the 200 went out, that 502 is a final
   ``data: {"error": ...}`` event.

The client is :mod:`.replicaclient` (asyncio protocols and ``httptools``' parser): aiohttp's
``ClientSession`` cost ~80 µs of the gateway's CPU per proxied request (a bare proxy: 165 µs with it,
83 µs with this one; ``wrk -t2 -c16``, 2 cores); httpx cost more still (160-270 µs per SSE event).

The slot, the queue and their metrics cost the request path ~10 µs: ``bench/gateway_overhead.py``,
5 runs each way alternating with the round-robin code before them (2026-12-03, load 6-7 on 2 cores
from other jobs): ``x-llmgw-overhead-ms`` median 0.217 ms before, 0.228 ms after; ``added_p50_ms``
1.10-1.60 ms before and 1.13-1.52 ms after (noise larger than the change). Of it, by timeit: the
two Prometheus calls (``routed``, ``waited``) ~8 µs, :meth:`Balancer.take` and the release ~4 µs.

Timeouts are LLM-sized: connect 5 s; a non-streamed answer may take
``upstream_timeout_s`` in all (long prefill plus long generation); a stream has no total limit,
only ``upstream_timeout_s`` of silence between chunks (which covers a long prefill).

Not guaranteed: that a stream broken mid-way tells the client more than the final error event; that
a request which the replica got before it died is not half-processed there.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from llmgw.control.gateway.balancer import BUSY, QUEUED, Balancer, Lease, ReplicaLoad, RoutingMetrics
from llmgw.control.gateway.inspect import Inspector, Refusal, current_call
from llmgw.control.gateway.legacylogprobs import CompletionsRewriter, reshape_completion, reshaped
from llmgw.control.gateway.prefix import prefix_key
from llmgw.control.gateway.queue import Defer, FairQueue
from llmgw.control.gateway.replicaclient import (
    ReplicaBroken,
    ReplicaClient,
    ReplicaClosed,
    ReplicaResponse,
    ReplicaUnreachable,
    request_head,
)
from llmgw.control.gateway.replicaerrors import replica_error
from llmgw.control.gateway.request import EMBEDDINGS, check_dimensions
from llmgw.control.gateway.sse import ModelRewriter, StreamTally, pump
from llmgw.control.gateway.starting import answer_on_stream
from llmgw.errors import HttpError, WaitedOut
from llmgw.httperrors import openai_error_event, openai_error_json
from llmgw.routing import Route, Upstream

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
# cpp-httplib (llama-server's HTTP server) closes idle keep-alive connections after 5 s; dropping
# ours at 4 s avoids POSTing into a connection the engine is closing (aiohttp does not retry POSTs).
KEEPALIVE_S = 4.0
#: ``GET /props`` (a replica's slots) gets this long (s); it is read once per replica, off the request path.
PROPS_TIMEOUT_S = 5.0
# Many concurrent streams are normal for an LLM gateway; the engine queues what its slots can't take.
MAX_CONNECTIONS = 1024


def refusal_response(refusal: Refusal) -> web.Response:
    """An inspector's :class:`Refusal` as an OpenAI error envelope, its ``extra`` fields included."""
    return openai_error_json(refusal.status, refusal.code, refusal.message, extra=refusal.extra)


def _give_back(lease: Lease) -> None:
    """A queue's waiter left after it was handed a slot: the slot goes back (its queue walks again)."""
    lease.release(answered=False)


# A stream's connection is not kept: llama-server (b0.3.36 here) drops a kept-alive connection
# after a streamed answer in a way the next request on it, or a new one opened meanwhile, fails
# ("Server disconnected", "Can not write request body"): measured, 10 of 20 sequential streams
# failed on one client, 3-6 of 20-30 through the gateway (502); with "Connection: close" 20 of 20
# passed. Plain answers keep their connections (20 of 20 on one connection).
@functools.lru_cache(maxsize=4096)
def _head(endpoint: str, path: str, key: str, stream: bool) -> bytes:
    """A POST's head up to its ``x-request-id`` value (endpoints, paths and keys repeat)."""
    headers = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
    if stream:
        headers["Connection"] = "close"
    return request_head("POST", endpoint, path, headers) + b"x-request-id: "


@dataclass(slots=True)
class Trace:
    """What one proxied request measured: filled in by :class:`UpstreamPool` and the relays.

    ``upstream_ns`` is time waiting on the replica (connect, answer, body); ``setup_ns`` the
    gateway's own time from the handler's start to the first byte (streams) or to the response
    being ready (non-streamed), minus the upstream wait inside it. ``dropped``: the
    ``x-llmgw-dropped`` header's value, "" when no field was dropped. ``request_id`` is sent to the
    replica as ``x-request-id``; ``headers`` are added to the client's response (rate-limit headers);
    ``tally`` counts a stream's tokens; ``first_byte_ns`` is when the first byte of a stream's body went
    out (``perf_counter_ns``: the first token, not the headers), 0 before; ``ended_ns`` when its last
    event (``data: [DONE]``) went out, 0 before; ``prepared_ns`` when its
    headers (the 200) went out, 0 before; ``error_code`` is the code of
    the error event that ended a stream after its 200 (a refusal, a broken replica), "" otherwise;
    ``path`` is the endpoint's path on the engine; ``caller`` and ``priority`` are the key's name and
    priority (the queue's fairness); ``queued_ns``: time spent waiting for a slot, counted in
    ``upstream_ns`` too (it is the replicas' time, not the gateway's); ``reserved``: the tokens held
    against the key's limits while the request is in flight (:func:`~llmgw.control.gateway.body.reserved_tokens`).
    """

    started_ns: int
    replica: str = ""
    upstream_ns: int = 0
    setup_ns: int = 0
    usage: dict[str, Any] | None = None
    dropped: str = ""
    request_id: str = ""
    headers: dict[str, str] | None = None
    reserved: int = 0
    tally: StreamTally | None = None
    first_byte_ns: int = 0
    ended_ns: int = 0
    prepared_ns: int = 0
    error_code: str = ""
    path: str = "/v1/chat/completions"
    caller: str = ""
    priority: int = 0
    queued_ns: int = 0


class UpstreamPool:
    """One shared :class:`~.replicaclient.ReplicaClient` (pooled keep-alive connections) and the choice of replica.

    Call :meth:`start` on app startup and :meth:`close` on cleanup. ``upstream_timeout_s``: see the
    module docstring. ``balancer``: the slots and the choice (one is made when None; its slot reader
    is :meth:`read_slots`). ``metrics``: where decisions and waits are counted (:class:`RoutingMetrics`).
    ``routes``: the model's route now, by catalog name (the router's ``resolve``), read again by a
    request waiting in the queue each time it is offered a slot, so it can take a replica added
    while it waits (an autoscaler's); None: a request keeps the route it came with.
    """

    def __init__(
        self,
        *,
        upstream_timeout_s: float,
        balancer: Balancer | None = None,
        metrics: RoutingMetrics | None = None,
        routes: Callable[[str], Route | None] | None = None,
    ) -> None:
        self.routes = routes
        self._client: ReplicaClient | None = None
        self.upstream_timeout_s = upstream_timeout_s
        self.balancer = balancer or Balancer()
        if self.balancer.read_slots is None:
            self.balancer.read_slots = self.read_slots
        self.balancer.on_free = self._wake
        #: Model → its queue (made on the model's first request, sized from its route).
        self.queues: dict[str, FairQueue[Lease]] = {}
        self.metrics = metrics
        if metrics is not None:
            metrics.track_queues(self.queue_lengths)

    async def start(self) -> None:
        """Open the shared client (inside the running loop)."""
        self._client = ReplicaClient(
            keepalive_s=KEEPALIVE_S, connect_timeout_s=CONNECT_TIMEOUT_S, limit=MAX_CONNECTIONS
        )

    async def close(self) -> None:
        """Close the client's pooled connections."""
        if self._client is not None:
            self._client.close()
            self._client = None

    async def read_slots(self, up: Upstream) -> int | None:
        """The replica's slots from llama-server's ``GET /props`` (``total_slots``), with its key; None
        when the engine does not answer it (vLLM has no ``/props``) or it cannot be reached."""
        if self._client is None:
            return None
        try:
            head = request_head("GET", up.endpoint, "/props", {"Authorization": "Bearer " + up.key})
            resp = await self._client.request(up.endpoint, head, total_s=PROPS_TIMEOUT_S)
            try:
                props = json.loads(await resp.read()) if resp.status == 200 else None
            finally:
                resp.release()
        except (ReplicaUnreachable, ReplicaBroken, TimeoutError, ValueError) as e:
            log.info("replica %s: GET /props failed: %r", up.replica_id, e)
            return None
        slots = props.get("total_slots") if isinstance(props, dict) else None
        return slots if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0 else None

    def _wake(self, model: str) -> None:
        """A slot of ``model`` may have come free: its queue hands it to the next waiter."""
        queue = self.queues.get(model)
        if queue is not None:
            queue.wake()

    def routes_changed(self, models: Iterable[str]) -> None:
        """The routed replicas of ``models`` changed (:meth:`llmgw.routing.Router.watch`): their
        waiting requests are offered the replicas as they are now (one added while they wait serves
        them at once, not only the requests that come after it). On the loop."""
        for model in models:
            self._wake(model)

    def _latest(self, route: Route) -> Route:
        """``route`` as the router has it now (see ``routes``); ``route`` itself when the router has
        none for the model or none with a ready replica (a waiter keeps what it had rather than none)."""
        now = self.routes(route.model) if self.routes is not None else None
        return now if now is not None and now.upstreams and now.model == route.model else route

    def _queue(self, route: Route) -> FairQueue[Lease]:
        """The model's queue, its bounds as the route (the catalog) says now."""
        queue = self.queues.get(route.model)
        if queue is None:
            queue = self.queues[route.model] = FairQueue(
                route.model, size=route.queue_size, wait_s=route.queue_wait_s, give_back=_give_back
            )
        else:
            queue.size, queue.wait_s = route.queue_size, route.queue_wait_s
        return queue

    def queue_lengths(self) -> dict[str, int]:
        """Model → requests waiting in its queue now (every model that has had a request)."""
        return {m: len(q) for m, q in self.queues.items()}

    def loads(self) -> dict[str, ReplicaLoad]:
        """Every replica this gateway has sent to: slots, in flight, picks, and its model's queue
        (:class:`~llmgw.control.gateway.balancer.ReplicaLoad`), for ``ctl replicas``."""
        return self.balancer.loads(self.queue_lengths())

    async def _reserve(self, route: Route, key: int | None, tried: set[str], trace: Trace) -> Lease:
        """A slot on a replica not in ``tried``, at once or after waiting in the model's queue in fair
        order (see the module docstring, step 1).

        Raises:
            HttpError: 429 ``model_busy`` with ``Retry-After`` when every slot is busy and the queue
                is full, or the wait would pass (or passed) ``queue_wait_s``; 502
                ``upstream_unreachable`` when every replica was tried.
        """
        if len(tried) >= len(route.upstreams):
            raise HttpError(
                502,
                "upstream_unreachable",
                f"no replica of model '{route.model}' accepts connections right now; retry shortly",
            )
        balancer, queue = self.balancer, self._queue(route)
        inner = balancer.taker(route, key, tried, queue.__len__)
        if not len(queue):  # nobody waits: a free slot is taken at once, without the queue's estimate
            got = inner()
            if isinstance(got, Lease):
                if self.metrics is not None:
                    self.metrics.waited(route.model, 0.0)
                    self.metrics.routed(route.model, got.reason)
                return got
        first: list[Lease | Defer | None] = []  # what the first take() got: it waited unless that is the answer
        taking, taker = route, inner  # the route this waiter takes from and its taker, renewed when it changes

        def take() -> Lease | Defer | None:
            nonlocal taking, taker
            now = self._latest(route)
            if now is not taking:  # the table was rebuilt while this request waited (a replica added)
                taking, taker = now, balancer.taker(now, key, tried, queue.__len__)
            got = taker()
            if not first:
                first.append(got)
            return got

        t0 = time.perf_counter_ns()
        try:
            lease = await queue.acquire(
                trace.caller, trace.priority, take, service_s=balancer.service_s(route), slots=balancer.slots(route)
            )
        except HttpError as e:
            if self.metrics is not None:
                if isinstance(e, WaitedOut):  # it waited, then was refused: the wait counts too
                    self.metrics.waited(route.model, (time.perf_counter_ns() - t0) / 1e9)
                self.metrics.routed(route.model, BUSY)
            raise
        finally:
            waited = time.perf_counter_ns() - t0
            trace.queued_ns += waited
        if self.metrics is not None:
            queued = not first or first[0] is not lease
            self.metrics.waited(route.model, waited / 1e9 if queued else 0.0)
            if queued:
                self.metrics.routed(route.model, QUEUED)
            self.metrics.routed(route.model, lease.reason)
        return lease

    async def send(
        self,
        route: Route,
        body: bytes,
        trace: Trace,
        *,
        stream: bool,
        request_json: dict[str, Any] | None = None,
    ) -> tuple[Lease, ReplicaResponse]:
        """Take a slot on one of the route's replicas and POST ``body`` to it; return the slot's
        :class:`~llmgw.control.gateway.balancer.Lease` (``lease.up`` is the replica) and the response
        once its headers arrived. ``request_json``: the parsed body, for the cache-aware key.

        Sets ``trace.replica`` and adds the wait to ``trace.upstream_ns``. The caller must release
        (or close) the response and release the lease (:func:`relay_plain` and :func:`relay_stream`
        do both on every way out).

        Raises:
            HttpError: 429 ``model_busy`` (no free slot); 502 ``upstream_unreachable`` when no replica
                tried accepted the connection; 504 ``upstream_timeout`` / 502 ``upstream_failed`` when
                the chosen one did not answer.
        """
        client = self._client
        assert client is not None, "UpstreamPool.start() was not awaited"  # noqa: S101
        key = None
        if route.routing == "cache-aware" and len(route.upstreams) > 1 and request_json is not None:
            key = prefix_key(request_json)
        total_s, read_s = (None, self.upstream_timeout_s) if stream else (self.upstream_timeout_s, None)
        rid = trace.request_id.encode() + b"\r\n"
        tried: set[str] = set()
        t0 = time.perf_counter_ns()
        try:
            while True:
                route = self._latest(route) if tried else route  # a retry sees replicas added since
                lease = await self._reserve(route, key, tried, trace)
                up = lease.up
                trace.replica = up.replica_id
                try:
                    resp = await client.request(
                        up.endpoint, _head(up.endpoint, trace.path, up.key, stream) + rid, body,
                        total_s=total_s, read_s=read_s, keep_alive=not stream,
                    )
                except ReplicaUnreachable as e:
                    self.balancer.refused(up.replica_id)  # before the slot frees: no waiter takes it
                    lease.release(answered=False)
                    tried.add(up.replica_id)
                    log.warning(
                        "replica %s of %s at %s: cannot connect: %s", up.replica_id, route.model, up.endpoint, e
                    )
                except TimeoutError as e:
                    lease.release(answered=False)
                    raise self.timeout_error(route) from e
                except ReplicaBroken as e:
                    self.balancer.refused(up.replica_id)  # broken, likely dead: waiters pass it over
                    lease.release(answered=False)
                    log.warning(
                        "replica %s of %s at %s failed: %r", up.replica_id, route.model, up.endpoint, e
                    )
                    raise self.broken_error(route, cause=e) from e
                except BaseException:  # cancelled (the client left): the slot goes back
                    lease.release(answered=False)
                    raise
                else:
                    if 300 <= resp.status < 400 or resp.status >= 600:  # a redirect (never followed), or no status
                        resp.close()
                        lease.release(answered=False)
                        raise invalid_status(route, resp.status)
                    return lease, resp
        finally:
            trace.upstream_ns += time.perf_counter_ns() - t0

    def timeout_error(self, route: Route) -> HttpError:
        """504 ``upstream_timeout``: the replica took longer than ``upstream_timeout_s``."""
        return HttpError(
            504, "upstream_timeout", f"model '{route.model}' did not answer within {self.upstream_timeout_s:g} s"
        )

    @staticmethod
    def broken_error(route: Route, *, mid_answer: bool = False, cause: BaseException | None = None) -> HttpError:
        """502 ``upstream_failed``: the replica's connection broke after the request went out (``mid_answer``:
        after part of a stream was relayed), or it sent an answer the client refused (``cause``'s words)."""
        when = "in the middle of its answer" if mid_answer else "before answering"
        if isinstance(cause, ReplicaBroken) and not isinstance(cause, ReplicaClosed):
            message = f"the replica of model '{route.model}' sent an answer the gateway refused {when} ({cause}); retry"
        else:
            message = f"the replica of model '{route.model}' closed the connection {when}; retry"
        return HttpError(502, "upstream_failed", message)


@dataclass(frozen=True, slots=True)
class Relay:
    """One request to proxy, for :func:`relay_plain` and :func:`relay_stream`.

    Attributes:
        pool: the replicas' connections, balancer and queues.
        route: the model's route (its replicas and routing policy).
        requested: the model name the client asked for (an alias too), put back into answers.
        body: the bytes sent to the replica (the client's body less what engines may not see).
        request_json: the parsed request, for the prefix key and the guard.
        trace: the request's timings, replica and usage, filled in on the way.
        inspector: the guard's hook, None when no policy covers the model.
        echo: the prompt put before each choice's text (:func:`~llmgw.control.gateway.request.echo_text`), or "".
    """

    pool: UpstreamPool
    route: Route
    requested: str
    body: bytes
    request_json: dict[str, Any]
    trace: Trace
    inspector: Inspector | None
    echo: str = ""


async def relay_to_the_answer(relay: Relay) -> web.Response:
    """:func:`relay_plain`, carried on to the replica's answer when the client leaves first, for an
    engine that computes what it accepted whatever the connection (``Endpoint.engine_finishes``):
    llama-server went on with an abandoned embeddings request while the gateway, taking the slot for
    free, sent it the next one, so abandoned requests queued inside the engine out of the fair
    queue's sight (5,900 tokens each, a 2-token request waited 3 min 10 s: a security tester's
    finding). Once a replica's slot is taken (``trace.replica``), it is held until the engine answers;
    the request is charged as abandoned. One still waiting for a slot is dropped: nothing reached an
    engine, and carried on it would reach one for free."""
    task = asyncio.ensure_future(relay_plain(relay))
    task.add_done_callback(_retrieved)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not relay.trace.replica:
            task.cancel()
        raise


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Mark a shielded relay's outcome retrieved (a client that left has no one to raise it to)."""
    if not task.cancelled():
        task.exception()


async def relay_plain(relay: Relay) -> web.Response:
    """Proxy a non-streamed request: the replica's answer with ``model`` set to ``relay.requested``.

    Raises:
        HttpError: as :meth:`UpstreamPool.send`; 502 ``upstream_invalid`` when a 200 is not JSON.
    """
    pool, route, requested, trace, inspector = relay.pool, relay.route, relay.requested, relay.trace, relay.inspector
    request_json = relay.request_json
    lease, resp = await pool.send(route, relay.body, trace, stream=False, request_json=request_json)
    up = lease.up
    t0 = time.perf_counter_ns()
    answered = False
    try:
        if resp.status >= 400:
            return await replica_error(route, up, resp)
        data = await resp.read()
        answered = True
    except TimeoutError as e:
        raise pool.timeout_error(route) from e
    except ReplicaBroken as e:
        pool.balancer.refused(up.replica_id)
        raise pool.broken_error(route, cause=e) from e
    finally:
        resp.release()
        lease.release(answered=answered)
        trace.upstream_ns += time.perf_counter_ns() - t0
    try:
        answer = json.loads(data)
        same = answer.get("model") == requested  # llama-server's --alias is the catalog name: the bytes stand
        answer["model"] = requested
        if reshaped(trace.path, relay.echo, request_json):
            # llama-server's chat-shaped logprobs in the legacy shape; the prompt echoed
            same = not reshape_completion(answer, echo=relay.echo) and same
    except (ValueError, TypeError, AttributeError) as e:
        raise HttpError(
            502, "upstream_invalid", f"the replica of model '{route.model}' sent an answer that is not JSON"
        ) from e
    usage = answer.get("usage")
    trace.usage = usage if isinstance(usage, dict) else None
    if answered:
        lease.observe(answer.get("timings"))
    if trace.path == EMBEDDINGS.path and "dimensions" in request_json:
        check_dimensions(route.model, request_json, answer)  # llama-server ignores it: a 400, not the wrong width
    if inspector is not None:
        refusal = await inspector.answer(route, request_json, answer)
        if refusal is not None:
            return refusal_response(refusal)
    body_out = data if same else json.dumps(answer).encode()
    return web.Response(body=body_out, status=resp.status, content_type="application/json")


async def relay_stream(
    request: web.Request, relay: Relay, prepared: web.StreamResponse | None = None
) -> web.StreamResponse:
    """Proxy a streamed request: ``text/event-stream``, each upstream network chunk written as it comes.

    ``prepared``: the stream answered 200 while held for a replica (:mod:`.starting`); errors end it as an event.

    Each chunk's complete lines go out with ``model`` set to ``relay.requested`` (:class:`ModelRewriter`).

    Errors before the first byte raise :class:`HttpError` (as :meth:`UpstreamPool.send`) or return the
    replica's error; after it, a dead replica or a refusal ends the stream with an error event. A
    client that goes away closes the upstream connection, which makes llama-server stop generating.
    """
    pool, route, requested, trace, inspector = relay.pool, relay.route, relay.requested, relay.trace, relay.inspector
    request_json = relay.request_json
    try:
        lease, resp = await pool.send(route, relay.body, trace, stream=True, request_json=request_json)
    except HttpError as e:
        if prepared is None:
            raise
        await answer_on_stream(prepared, e)
        return prepared
    up = lease.up
    closed_cleanly = False
    try:
        if resp.status >= 400:
            if prepared is not None:
                await answer_on_stream(prepared, HttpError(502, "upstream_failed", f"model '{route.model}' failed"))
                return prepared
            return await replica_error(route, up, resp)
        watcher = inspector.stream(route, request_json) if inspector is not None else None
        headers = {
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "x-llmgw-replica": trace.replica,
            "x-llmgw-overhead-ms": _ms(time.perf_counter_ns() - trace.started_ns - trace.upstream_ns),
        }
        if trace.dropped:
            headers["x-llmgw-dropped"] = trace.dropped
        if trace.headers:
            headers.update(trace.headers)
        if watcher is not None and (call := current_call.get()) is not None:
            headers.update(call.headers)
        out = prepared or web.StreamResponse(headers=headers)
        trace.setup_ns = time.perf_counter_ns() - trace.started_ns - trace.upstream_ns
        if prepared is None:
            await out.prepare(request)
        t0 = trace.prepared_ns = time.perf_counter_ns()
        try:
            legacy = reshaped(trace.path, relay.echo, request_json)
            rewriter = CompletionsRewriter(requested, echo=relay.echo) if legacy else ModelRewriter(requested)
            refusal = await pump(resp, out, watcher, rewriter, trace)
            closed_cleanly = refusal is None
            if refusal is not None:
                trace.error_code = refusal.code
                await out.write(openai_error_event(refusal.status, refusal.code, refusal.message, extra=refusal.extra))
        except ConnectionResetError:  # the client went away; finally closes the upstream
            return out
        except (TimeoutError, ReplicaBroken) as e:
            timed_out = isinstance(e, TimeoutError)
            err = pool.timeout_error(route) if timed_out else pool.broken_error(route, mid_answer=True, cause=e)
            if not timed_out:
                pool.balancer.refused(up.replica_id)
            log.warning("stream of %s broke: %r", route.model, e)
            trace.error_code = err.code
            await out.write(openai_error_event(err.status, err.code, err.message))
        finally:
            trace.upstream_ns += time.perf_counter_ns() - t0
        await out.write_eof()
        return out
    finally:
        if closed_cleanly:
            resp.release()
        else:
            resp.close()
        answered = closed_cleanly or trace.ended_ns > 0  # a client may close once it has read [DONE]
        lease.release(answered=answered)
        if answered and trace.tally is not None:
            lease.observe(trace.tally.timings)


def invalid_status(route: Route, status: int) -> HttpError:
    """502 ``upstream_invalid``: the replica's status is no answer (a 3xx, never followed, or past 599)."""
    return HttpError(502, "upstream_invalid", f"the replica of model '{route.model}' answered status {status}")


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f}"
