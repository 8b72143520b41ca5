"""The processes bench/routing.py measures: llama-server replicas, gateway processes, and a client.

- :class:`Fleet`: ``n`` real llama-server replicas of the gemma-3-270m GGUF (each its own free port and
  ``--api-key``), started together and waited on (``GET /health`` 200), and one or more gateway
  processes (``python bench/routing_fleet.py --role gateway``) in front of them, each a separate
  control plane sharing nothing with the others. :meth:`Fleet.close` stops every process it
  started (SIGTERM, then SIGKILL after 10 s); each child also gets ``PR_SET_PDEATHSIG`` so it dies
  with this process even when that is killed outright.
- The gateway process builds the gateway app the control plane builds
  (:func:`llmgw.control.gateway.app.build_gateway_app`) on a :class:`~llmgw.routing.StaticRouter`
  with one model per routing policy (``rr``: ``round-robin``; ``ca``: ``cache-aware``, only where
  :class:`~llmgw.routing.Route` has the ``routing`` field) over the same replicas, and stored keys
  (named, so limits and fairness see distinct callers), served with ``handler_cancellation=True``.
- :func:`chat`: one chat request through a gateway, streamed or not, and what it measured
  (:class:`Answer`: time to first content token, total time, the replica from ``x-llmgw-replica``,
  and llama-server's ``timings``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

CACHE = Path(os.environ.get("LLMGW_ASSETS", Path.home() / ".cache" / "llmgw"))
SERVER = Path(os.environ.get("LLAMA_SERVER") or CACHE / "llama-cpp-0.3.36-rpc" / "bin" / "llama-server")
MODEL = Path(os.environ.get("MODEL") or CACHE / "models" / "gemma-3-270m-q4_k_m.gguf")
#: The gateway's own keys: one per client the workloads play (named: fairness is per key name).
KEYS = {"bench": "sk-llmgw-bench-0001", "flood": "sk-llmgw-flood-0002", "other": "sk-llmgw-other-0003"}
#: Model name → routing policy, as the catalog would say it (``routing:`` per model).
POLICIES = {"rr": "round-robin", "ca": "cache-aware"}
#: Gateway queue per model when the Route has one: deep and patient enough that
#: workload D's flood is queued, not refused, so the other key's wait is what is measured.
QUEUE_SIZE = 512
QUEUE_WAIT_S = 300.0
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def policy_merged() -> bool:
    """Whether this gateway has per-model routing policies (``Route.routing``)."""
    from llmgw.routing import Route  # noqa: PLC0415

    return "routing" in {f.name for f in dataclasses.fields(Route)}


@dataclass
class ReplicaSpec:
    """How to start one replica: llama-server's sizing ``args``, an argv ``prefix`` (``taskset``...),
    and ``duty``: the share of wall time it may run (1.0: always; 0.33: stopped with SIGSTOP for 67 ms
    of every :data:`DUTY_PERIOD_S`, as ``cpulimit`` does: a machine a third as fast)."""

    replica_id: str
    args: list[str]
    prefix: list[str] = field(default_factory=list)
    duty: float = 1.0


#: The duty cycle's period (s): short beside a request (hundreds of ms), long beside a scheduler tick.
DUTY_PERIOD_S = 0.1


@dataclass
class _Running:
    spec: ReplicaSpec
    port: int
    key: str
    proc: subprocess.Popen[bytes]
    log: Path


class Fleet:
    """Replicas and gateways, started by :meth:`start` and all stopped by :meth:`close`.

    Use as ``with Fleet(specs, gateways=2, workdir=tmp) as fleet:``; ``fleet.gateways`` are
    the gateway base URLs (``http://127.0.0.1:PORT``). Raises SystemExit when a process does not
    start within 90 s (its log's tail in the message).
    """

    def __init__(self, specs: list[ReplicaSpec], *, gateways: int, workdir: Path) -> None:
        self.specs = specs
        self.n_gateways = gateways
        self.workdir = workdir
        self.replicas: list[_Running] = []
        self.gateway_procs: list[subprocess.Popen[bytes]] = []
        self.gateways: list[str] = []
        self._duty_stop = threading.Event()
        self._duty_thread: threading.Thread | None = None

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _spawn(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)  # noqa: PLW1509

    def start(self) -> None:
        """Start every replica, wait for all to be healthy, then start the gateways on them."""
        waits = []
        for spec in self.specs:
            port, key = free_port(), f"replica-key-{spec.replica_id}-{os.getpid()}"
            log = self.workdir / f"{spec.replica_id}-{port}.log"
            argv = [*spec.prefix, str(SERVER), "-m", str(MODEL), "--host", "127.0.0.1", "--port", str(port),
                    "--api-key", key, "--no-webui", *spec.args]
            self.replicas.append(_Running(spec, port, key, self._spawn(argv, log), log))
            waits.append((f"http://127.0.0.1:{port}/health", self.replicas[-1].proc, log))
        for wait in waits:
            _wait_ok(*wait)
        if any(r.spec.duty < 1 for r in self.replicas):
            self._duty_thread = threading.Thread(target=self._duty_cycle, daemon=True)
            self._duty_thread.start()
        config = {
            "replicas": [[r.spec.replica_id, f"127.0.0.1:{r.port}", r.key] for r in self.replicas],
            "slots": self.slots(),
        }
        waits = []
        for i in range(self.n_gateways):
            cfg = self.workdir / f"gateway-{i}.json"
            port = free_port()
            cfg.write_text(json.dumps({**config, "port": port}))
            log = self.workdir / f"gateway-{i}-{port}.log"
            proc = self._spawn([sys.executable, __file__, "--role", "gateway", "--config", str(cfg)], log)
            self.gateway_procs.append(proc)
            self.gateways.append(f"http://127.0.0.1:{port}")
            waits.append((f"http://127.0.0.1:{port}/healthz", proc, log))
        for wait in waits:
            _wait_ok(*wait)
        self._warm_up()

    def _warm_up(self) -> None:
        """A few one-token requests per gateway and model, so every gateway has met every replica (and
        read its slots, ``GET /props``) before anything is measured: a control plane runs for days."""
        models = [m for m, p in POLICIES.items() if p == "round-robin" or policy_merged()]
        body = {"messages": [{"role": "user", "content": "Say ok."}], "max_tokens": 1}
        auth = {"Authorization": f"Bearer {KEYS['bench']}"}
        for url in self.gateways:
            for model in models:
                for _ in self.replicas:
                    resp = httpx.post(f"{url}/v1/chat/completions", json={**body, "model": model}, headers=auth,
                                      timeout=120)
                    if resp.status_code not in (200, 429):
                        raise SystemExit(f"FAIL: warm-up through {url} ({model}): {resp.status_code} {resp.text}")
        time.sleep(1.0)

    def slots(self) -> int:
        """Slots per replica: ``--parallel`` in the first replica's args (what ``GET /props`` reports)."""
        args = self.specs[0].args
        return int(args[args.index("--parallel") + 1]) if "--parallel" in args else 1

    def props(self, index: int = 0) -> dict[str, Any]:
        """Replica ``index``'s ``GET /props`` (``total_slots``, ``default_generation_settings``...)."""
        r = self.replicas[index]
        resp = httpx.get(f"http://127.0.0.1:{r.port}/props", headers={"Authorization": f"Bearer {r.key}"}, timeout=5)
        resp.raise_for_status()
        return dict(resp.json())

    def _duty_cycle(self) -> None:
        """Stop and continue each replica with ``duty`` < 1 so it runs that share of the time."""
        slowed = [r for r in self.replicas if r.spec.duty < 1]
        while not self._duty_stop.is_set():
            for r in slowed:
                r.proc.send_signal(signal.SIGCONT)
            self._duty_stop.wait(DUTY_PERIOD_S * slowed[0].spec.duty)
            if self._duty_stop.is_set():
                break
            for r in slowed:
                r.proc.send_signal(signal.SIGSTOP)
            self._duty_stop.wait(DUTY_PERIOD_S * (1 - slowed[0].spec.duty))
        for r in slowed:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        """Stop every process started (SIGTERM, SIGKILL after 10 s); safe to call twice."""
        self._duty_stop.set()
        if self._duty_thread is not None:
            self._duty_thread.join()
            self._duty_thread = None
        procs = [*self.gateway_procs, *(r.proc for r in self.replicas)]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.gateway_procs, self.replicas = [], []


def _wait_ok(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 90
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
            raise SystemExit(f"FAIL: {url} did not come up (exit {proc.poll()}); {log}:\n{tail}")
        time.sleep(0.2)


# -- the client --------------------------------------------------------------------------------------


@dataclass
class Answer:
    """One request as the client saw it.

    ``ttft_s``: seconds from sending to the first non-empty content delta (streams; the total for a
    non-streamed answer); ``total_s``: to the end of the body; ``replica``: ``x-llmgw-replica``;
    ``prompt_n``/``cache_n``/``prompt_ms``/``predicted_ms``: llama-server's ``timings`` (tokens
    evaluated, tokens reused from the slot's cache, their ms); ``status``/``error``: the HTTP status
    and, when not 200, the body; ``refused``: 429s retried before it, ``broken``: 502
    ``upstream_failed`` retried before it (see :func:`chat`).
    """

    status: int
    ttft_s: float = 0.0
    total_s: float = 0.0
    replica: str = ""
    text: str = ""
    prompt_n: int = 0
    cache_n: int = 0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    prompt_tokens: int = 0
    error: str = ""
    started: float = 0.0
    refused: int = 0
    broken: int = 0

    @property
    def engine_s(self) -> float:
        """The engine's own time on this request (prompt + generation), seconds."""
        return (self.prompt_ms + self.predicted_ms) / 1000


def _take_timings(a: Answer, data: dict[str, Any]) -> None:
    t = data.get("timings")
    if isinstance(t, dict):
        a.prompt_n, a.cache_n = int(t.get("prompt_n", 0)), int(t.get("cache_n", 0))
        a.prompt_ms, a.predicted_ms = float(t.get("prompt_ms", 0.0)), float(t.get("predicted_ms", 0.0))
    usage = data.get("usage")
    if isinstance(usage, dict):
        a.prompt_tokens = int(usage.get("prompt_tokens", 0))


async def chat(
    session: aiohttp.ClientSession, gateway: str, key: str, model: str, messages: list[dict[str, str]],
    *, max_tokens: int = 16, stream: bool = False, retry_busy: bool = True,
) -> Answer:
    """POST a chat completion (temperature 0) to ``gateway`` as ``key``; an :class:`Answer` (never raises
    for an HTTP status: the caller decides which statuses are failures).

    With ``retry_busy``, a 429 is retried after its ``Retry-After`` (seconds; 1 when absent), as a
    well-behaved client does, and counted in ``Answer.refused``; a 502 ``upstream_failed`` (the replica
    closed the connection before answering: the gateway says to retry) is retried up to twice, counted
    in ``Answer.broken``; the times count from the first try.
    """
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "stream": stream}
    if stream:
        # llama-server puts ``timings`` on a stream's last event: the usage event when this is asked,
        # and the gateway removes that event for a client that did not ask for it.
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    a = Answer(status=0, started=t0)
    while True:
        async with session.post(f"{gateway}/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as resp:
            a.status, a.replica = resp.status, resp.headers.get("x-llmgw-replica", "")
            if resp.status == 429 and retry_busy:
                a.refused += 1
                await resp.read()
                await asyncio.sleep(float(resp.headers.get("Retry-After", "1") or 1))
                continue
            if resp.status != 200:
                a.error = (await resp.text())[:500]
                if resp.status == 502 and "upstream_failed" in a.error and a.broken < 2:
                    # the gateway POSTed onto a keep-alive connection the engine had closed: nothing
                    # was generated, and the gateway's message says to retry
                    a.broken += 1
                    continue
            elif not stream:
                data = await resp.json()
                a.text = data["choices"][0]["message"].get("content") or ""
                _take_timings(a, data)
                a.ttft_s = time.perf_counter() - t0
            else:
                await _read_stream(resp, a, t0)
        a.total_s = time.perf_counter() - t0
        a.ttft_s = a.ttft_s or a.total_s  # an answer without content: its first token is its end
        return a


async def _read_stream(resp: aiohttp.ClientResponse, a: Answer, t0: float) -> None:
    """Fill ``a`` from an SSE answer: content, time to its first piece, the last event's timings."""
    async for line in resp.content:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            a.status, a.error = 502, json.dumps(event)[:500]
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece and not a.text:
                a.ttft_s = time.perf_counter() - t0
            a.text += piece
        _take_timings(a, event)


# -- the gateway process -----------------------------------------------------------------------------


def gateway_app(config: dict[str, Any]) -> Any:
    """The gateway for ``config`` (``replicas``: ``[id, host:port, key]``, ``slots``): model ``rr``, and
    ``ca`` where the policy exists, each over every replica; the stored keys of :data:`KEYS`."""
    from llmgw.apikeys import key_digest, key_prefix  # noqa: PLC0415
    from llmgw.control.gateway.app import build_gateway_app  # noqa: PLC0415
    from llmgw.control.gateway.callers import Callers  # noqa: PLC0415
    from llmgw.control.gateway.keys import GatewayKeys  # noqa: PLC0415
    from llmgw.control.store.rows import ApiKeyRow  # noqa: PLC0415
    from llmgw.routing import Route, StaticRouter, Upstream  # noqa: PLC0415

    up_fields = {f.name for f in dataclasses.fields(Upstream)}
    up_extra = {"slots": config["slots"]} if "slots" in up_fields else {}
    upstreams = tuple(Upstream(rid, endpoint, key, **up_extra) for rid, endpoint, key in config["replicas"])
    route_fields = {f.name for f in dataclasses.fields(Route)}
    routes = {}
    for model, policy in POLICIES.items():
        extra: dict[str, Any] = {}
        if "routing" in route_fields:
            extra["routing"] = policy
        elif policy != "round-robin":
            continue  # today's gateway: round-robin only
        if "queue_size" in route_fields:
            extra |= {"queue_size": QUEUE_SIZE, "queue_wait_s": QUEUE_WAIT_S}
        routes[model] = Route(model, upstreams, **extra)
    callers = Callers(GatewayKeys(None))
    callers.set_rows(ApiKeyRow(name, key_prefix(secret), key_digest(secret), created_at=time.time())
                     for name, secret in KEYS.items())
    return build_gateway_app(StaticRouter(routes), keys=(), allow_loopback_without_key=False, callers=callers)


async def _serve_gateway(config: dict[str, Any]) -> None:
    from aiohttp import web  # noqa: PLC0415

    runner = web.AppRunner(gateway_app(config), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", config["port"]).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await runner.cleanup()


def _main() -> None:
    ap = argparse.ArgumentParser(description="a gateway process for bench/routing.py")
    ap.add_argument("--role", choices=["gateway"], required=True)
    ap.add_argument("--config", type=Path, required=True)
    args = ap.parse_args()
    asyncio.run(_serve_gateway(json.loads(args.config.read_text())))


if __name__ == "__main__":
    _main()
