"""A node's part in a replica spread over several nodes (a profile's ``nodes`` above 1), llama.cpp.

The control plane sends the same replica id to every member with its ``role``
(:class:`~llmgw.protocol.GroupRole`) and the group's ``members`` (head first):

- **A worker** runs ``rpc-server`` (the ``rpc-server`` beside the node's ``llama-server``, the same
  llama.cpp build with ``-DGGML_RPC=ON``) isolated in a network namespace of its own, and a
  :class:`~llmgw.agent.groups.groupnet.WorkerTunnel` on the node's ``advertise_address`` that lets only the
  head's certificate in (:mod:`llmgw.agent.groups.groupnet`). It reports ``ready`` with the tunnel's
  ``host:port`` as its endpoint. It needs no weights: the head sends each worker its layers.
- **The head** fetches the weights, waits until every worker's endpoint is in its spec (the control
  plane adds them as the workers report; the spec changes, so the agent starts the head again), then
  starts a :class:`~llmgw.agent.groups.groupnet.HeadForwarder` and ``llama-server --rpc <its local
  ends> --n-gpu-layers N --tensor-split w1,w2…``: the layers split by the members' shares
  (placement's split of the memory, by each node's free memory), the head keeping
  ``n_layers × head share`` on its own CPU. Its readiness is the group's.

:func:`layer_split` is where the numbers come from; :class:`RpcWorker` is a worker's engine;
:class:`RpcGroup` is llama.cpp's :class:`~llmgw.agent.engines.base.GroupPart`, what the replica
runner (:mod:`llmgw.agent.replicas.runner`) drives for a member without knowing it is llama.cpp.
vLLM's groups are :mod:`llmgw.agent.engines.vllm_group`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from llmgw.agent.engines.base import Engine, GroupHost, GroupPart, engine_environment, engine_threads
from llmgw.agent.engines.exits import describe_exit
from llmgw.agent.groups import groupnet, isolation
from llmgw.agent.node.records import private_dir
from llmgw.errors import GroupError
from llmgw.ggufheader import parse_header
from llmgw.protocol import GroupMember, ReplicaState

log = logging.getLogger(__name__)

RPC_BINARY = "rpc-server"
RPC_READY_S = 60.0  # rpc-server listens within a second; a loaded node may take longer


def rpc_binary(llama_server: Path) -> Path:
    """The ``rpc-server`` beside ``llama_server`` (the same build).

    Raises:
        GroupError: there is none (a llama.cpp build without its RPC backend).
    """
    path = llama_server.parent / RPC_BINARY
    if not path.is_file():
        raise GroupError(
            f"this node's llama.cpp build ({llama_server}) has no {RPC_BINARY} beside it: a worker of a "
            "group replica needs llama.cpp built with -DGGML_RPC=ON (its rpc-server, from the "
            "ggml-rpc-server target, installed as rpc-server next to llama-server)"
        )
    return path


def gguf_layers(path: Path) -> int:
    """The number of transformer blocks (``<arch>.block_count``) in the GGUF at ``path``, from its
    header alone (:func:`llmgw.ggufheader.parse_header`; ``gguf.GGUFReader`` took 9.7 s here).

    Raises:
        EstimateError: not a GGUF, or a header without a block count.
    """
    with path.open("rb") as f:
        return parse_header(f, source=str(path), file_size=path.stat().st_size).block_count


def layer_split(n_layers: int, members: Sequence[GroupMember]) -> tuple[int, list[float]]:
    """``(n_gpu_layers, tensor_split)`` for the head's llama-server from the members' shares.

    The workers (the RPC devices, in ``--rpc`` order) get ``n_gpu_layers`` of the ``n_layers``
    blocks, split between them in proportion to their ``memory_gb`` (``--tensor-split``); the head
    keeps the rest on its CPU, its share of the total rounded, at least one block to the workers.
    Shares of 0 (no estimate) count as equal.
    """
    shares = [m.memory_gb if m.memory_gb > 0 else 1.0 for m in members]
    total = sum(shares)
    on_head = round(n_layers * shares[0] / total)
    offloaded = max(1, min(n_layers, n_layers - on_head))
    workers = shares[1:]
    return offloaded, [round(w / sum(workers), 4) for w in workers]


def head_args(n_layers: int, members: Sequence[GroupMember], rpc: str) -> list[str]:
    """The flags a head adds to its llama-server: ``--rpc``, ``--n-gpu-layers``, ``--tensor-split``."""
    ngl, split = layer_split(n_layers, members)
    return ["--rpc", rpc, "--n-gpu-layers", str(ngl), "--tensor-split", ",".join(f"{s:g}" for s in split)]


@dataclass
class RpcWorker:
    """A worker's engine: ``rpc-server`` isolated (:func:`isolation.start_isolated`) behind a
    :class:`groupnet.WorkerTunnel` for ``head``. :meth:`start` returns the tunnel's endpoint."""

    binary: Path
    head: str
    host: str
    tls: tuple[Path, Path, Path]  # ca, cert, key
    threads: int
    engine: isolation.IsolatedProcess | None = None
    tunnel: groupnet.WorkerTunnel | None = None

    async def start(self, log_file: IO[bytes], env: dict[str, str], cwd: Path) -> str:
        """Start the engine (in ``cwd``, the replica's directory) and the tunnel; the endpoint
        ``host:port`` the head dials.

        Raises:
            GroupNetError: the engine did not listen, or the tunnel could not bind.
        """
        argv = isolation.rpc_server_argv(self.binary, "--threads", str(self.threads))
        self.engine = await isolation.start_isolated(
            argv, ready_timeout_s=RPC_READY_S, stdout=log_file, stderr=log_file, env=env, cwd=cwd,
        )
        if not self.engine.link.isolated:
            log_file.write(f"--- llmgw agent: rpc-server is NOT isolated: {self.engine.link.note}\n".encode())
        ca, cert, key = self.tls
        self.tunnel = groupnet.WorkerTunnel(
            engine=self.engine.link, head_node_id=self.head, ca=ca, cert=cert, key=key, host=self.host
        )
        return await self.tunnel.start()

    @property
    def pid(self) -> int | None:
        """The engine's pid, once started."""
        return self.engine.pid if self.engine else None

    def exited(self) -> int | None:
        """The engine's exit status, None while it runs (or before it started)."""
        return self.engine.proc.poll() if self.engine else None

    async def stop(self) -> None:
        """Close the tunnel and stop the engine (idempotent)."""
        if self.tunnel is not None:
            await self.tunnel.close()
            self.tunnel = None
        if self.engine is not None:
            await self.engine.stop()
            self.engine = None


class RpcGroup(GroupPart):
    """llama.cpp's part in a group: a worker runs :class:`RpcWorker` (``rpc-server`` behind its
    tunnel) and reports the tunnel's endpoint; the head waits for every worker's endpoint, starts a
    :class:`~llmgw.agent.groups.groupnet.HeadForwarder` and adds :func:`head_args` to its
    llama-server, whose pid alone may then use the forwarder."""

    def __init__(self, engine: Engine[Any]) -> None:
        self.engine = engine
        self._worker: RpcWorker | None = None  # a worker's rpc-server and tunnel
        self._forwarder: groupnet.HeadForwarder | None = None  # a head's way to its workers

    @property
    def endpoint(self) -> str:
        """A worker's tunnel endpoint (``host:port``) once it listens."""
        if self._worker is not None and self._worker.tunnel is not None:
            return self._worker.tunnel.endpoint
        return ""

    async def run_worker(self, host: GroupHost) -> None:
        """A group worker: ``rpc-server`` behind its tunnel (:class:`RpcWorker`),
        ready once it listens; watched until it exits (failed, with its last lines)."""
        env = host.env
        if env.tls is None:
            raise GroupError("this agent has no TLS files to carry a group's traffic")
        build = self.engine.usable(env.installed(self.engine.name))
        head = next((m.node for m in host.spec.members if m.rank == 0), "")
        private_dir(host.dir)
        host.set_state(ReplicaState.STARTING)
        threads = engine_threads(pinned=None, reserved=host.spec.cpu_cores, node_cores=env.cores,
                                 max_threads=env.max_threads)
        self._worker = RpcWorker(rpc_binary(build.binary), head, env.probe_host, env.tls, threads)
        with host.engine_log(f"starting rpc-server for the head {head}") as logf:
            endpoint = await self._worker.start(logf, engine_environment(env.base_env, host.spec.gpu_indexes), host.dir)
        host.pid, host.started_at = self._worker.pid, time.time()
        log.info("replica %s: rpc-server pid %s for head %s, tunnel on %s", host.spec.id, host.pid, head, endpoint)
        host.set_state(ReplicaState.READY)
        while True:
            await asyncio.sleep(env.watch_interval_s)
            code = self._worker.exited()
            if code is not None:
                raise GroupError(f"rpc-server exited {describe_exit(code)} while serving the head {head}; "
                                 f"its last lines:\n{host.tail()}")

    async def head_args(self, host: GroupHost, build: Any, model_path: Path) -> list[str]:
        """A group head's extra llama-server flags, once every worker has an endpoint; until then
        it waits, ``starting`` (the spec changes when they come, and the agent starts it again)."""
        workers = [m for m in host.spec.members if m.rank > 0]
        missing = [m.node for m in workers if not m.endpoint]
        host.set_state(ReplicaState.STARTING)
        if missing:
            log.info("replica %s: waiting for its workers on %s", host.spec.id, ", ".join(missing))
            await asyncio.Event().wait()  # cancelled when the spec with their endpoints arrives
        if host.env.tls is None:
            raise GroupError("this agent has no TLS files to carry a group's traffic")
        ca, cert, key = host.env.tls
        self._forwarder = groupnet.HeadForwarder(
            workers={m.node: m.endpoint for m in sorted(workers, key=lambda m: m.rank)}, ca=ca, cert=cert, key=key
        )
        await self._forwarder.start()
        layers = await asyncio.to_thread(gguf_layers, model_path)
        return head_args(layers, sorted(host.spec.members, key=lambda m: m.rank), self._forwarder.rpc_arg)

    def launched(self, pid: int) -> None:
        """Let the head's llama-server (``pid``) use the forwarder, before it dials its workers
        (the forwarder refuses every other process)."""
        if self._forwarder is not None:
            self._forwarder.allow(pid)

    async def stop(self, grace_s: float) -> None:
        """Stop a worker's rpc-server and tunnel, close a head's forwarder."""
        if self._worker is not None:
            await self._worker.stop()
        if self._forwarder is not None:
            await self._forwarder.close()
            self._forwarder = None
