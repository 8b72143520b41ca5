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

:func:`layer_split` is where the numbers come from; :class:`RpcWorker` is a worker's engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from llmgw.agent.groups import groupnet
from llmgw.errors import GroupError
from llmgw.ggufheader import parse_header
from llmgw.protocol import GroupMember

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
    """A worker's engine: ``rpc-server`` isolated (:func:`groupnet.start_isolated`) behind a
    :class:`groupnet.WorkerTunnel` for ``head``. :meth:`start` returns the tunnel's endpoint."""

    binary: Path
    head: str
    host: str
    tls: tuple[Path, Path, Path]  # ca, cert, key
    threads: int
    engine: groupnet.IsolatedProcess | None = None
    tunnel: groupnet.WorkerTunnel | None = None

    async def start(self, log_file: IO[bytes], env: dict[str, str], cwd: Path) -> str:
        """Start the engine (in ``cwd``, the replica's directory) and the tunnel; the endpoint
        ``host:port`` the head dials.

        Raises:
            GroupNetError: the engine did not listen, or the tunnel could not bind.
        """
        argv = groupnet.rpc_server_argv(self.binary, "--threads", str(self.threads))
        self.engine = await groupnet.start_isolated(
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


# --- vLLM groups: a Ray cluster per group ---------------------------------------------------------
#
# vLLM spreads one model over nodes on a Ray cluster (its "multi-node" serving): the head node runs
# ``ray start --head``, every worker ``ray start --address <head>``, and once Ray counts every node
# the head runs ``vllm serve … --tensor-parallel-size <cards per node> --pipeline-parallel-size
# <nodes> --distributed-executor-backend ray`` (one pipeline stage per node, tensor parallel within
# it). The head reports its Ray address (``ReplicaStatus.group_endpoint``); the control plane gives
# it to the workers in their spec. ``ray`` is the one beside the node's ``vllm`` (the same venv:
# ``pip install vllm ray[default]``). The profile's ``env`` (NCCL_*/GLOO_*…) goes to every process.

RAY_BINARY = "ray"
RAY_STATUS_EVERY_S = 1.0


def ray_binary(vllm: Path) -> Path:
    """The ``ray`` beside ``vllm`` (its venv).

    Raises:
        GroupError: there is none.
    """
    path = vllm.parent / RAY_BINARY
    if not path.is_file():
        raise GroupError(
            f"no {RAY_BINARY} beside {vllm}: a vLLM group needs Ray in vLLM's environment "
            f"('{vllm.parent / 'pip'} install \"ray[default]\"')"
        )
    return path


def ray_head_argv(ray: Path, host: str, port: int) -> list[str]:
    """``ray start --head`` on ``host:port``, in the foreground (the agent owns the process)."""
    return [str(ray), "start", "--head", "--node-ip-address", host, "--port", str(port),
            "--disable-usage-stats", "--block"]


def ray_worker_argv(ray: Path, head: str, host: str) -> list[str]:
    """``ray start --address <head>`` from ``host``, in the foreground."""
    return [str(ray), "start", "--address", head, "--node-ip-address", host, "--disable-usage-stats", "--block"]


def ray_status_argv(ray: Path, head: str) -> list[str]:
    """``ray status --address <head>``: the autoscaler's view, whose ``Active:`` block lists the nodes."""
    return [str(ray), "status", "--address", head]


def active_nodes(status: str) -> int:
    """How many nodes ``ray status`` lists as active: the `` 1 node_<id>`` lines of its ``Active:``
    block (Ray 2.x's format)."""
    count, inside = 0, False
    for line in status.splitlines():
        text = line.strip()
        if text == "Active:":
            inside = True
            continue
        if inside:
            if not text or text.endswith(":"):
                break
            parts = text.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1].startswith("node_"):
                count += int(parts[0])
    return count


def vllm_group_args(nodes: int, cards: int) -> list[str]:
    """``vllm serve``'s flags for a group of ``nodes`` with ``cards`` GPUs each."""
    return ["--tensor-parallel-size", str(max(cards, 1)), "--pipeline-parallel-size", str(nodes),
            "--distributed-executor-backend", "ray"]
