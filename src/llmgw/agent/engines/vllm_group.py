"""A vLLM replica spread over several nodes: a Ray cluster per group (:class:`RayGroup`).

vLLM spreads one model over nodes on a Ray cluster (its "multi-node" serving): the head node runs
``ray start --head``, every worker ``ray start --address <head>``, and once Ray counts every node
the head runs ``vllm serve … --tensor-parallel-size <cards per node> --pipeline-parallel-size
<nodes> --distributed-executor-backend ray`` (one pipeline stage per node, tensor parallel within
it). The head reports its Ray address (``ReplicaStatus.group_endpoint``); the control plane gives
it to the workers in their spec. ``ray`` is the one beside the node's ``vllm`` (the same venv:
``pip install vllm ray[default]``). The profile's ``env`` (NCCL_*/GLOO_*…) goes to every process.

:class:`RayGroup` is vLLM's :class:`~llmgw.agent.engines.base.GroupPart`: the replica runner
(:mod:`llmgw.agent.replicas.runner`) drives it without knowing it is Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import time
from pathlib import Path
from typing import Any

from llmgw.agent.engines.base import Engine, GroupHost, GroupPart, engine_environment, host_port
from llmgw.agent.engines.exits import describe_exit
from llmgw.agent.node.records import private_dir, stop_process_group
from llmgw.errors import GroupError
from llmgw.protocol import ReplicaState

log = logging.getLogger(__name__)

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


class RayGroup(GroupPart):
    """vLLM's part in a group: a worker joins its head's Ray cluster (``ray start --address``); the
    head starts one (``ray start --head``), reports its address and waits until Ray counts every
    member before ``vllm serve`` runs with :func:`vllm_group_args` and ``RAY_ADDRESS``."""

    def __init__(self, engine: Engine[Any]) -> None:
        self.engine = engine
        self._ray: subprocess.Popen[bytes] | None = None  # this member's `ray start --block`
        self._ray_head = ""  # a head: its Ray address, reported for the workers

    @property
    def group_endpoint(self) -> str:
        """A head's Ray address (``host:port``) once it started Ray, for the workers to join."""
        return self._ray_head

    def _start_ray(self, host: GroupHost, argv: list[str]) -> subprocess.Popen[bytes]:
        """Start ``ray start … --block`` (its own session, output to the engine log)."""
        private_dir(host.dir)
        env = {**engine_environment(host.env.base_env, host.spec.gpu_indexes), **host.spec.env}
        with host.engine_log(f"starting {' '.join(argv)}") as logf:
            try:
                self._ray = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                             start_new_session=True, cwd=host.dir, env=env)
            except OSError as e:
                raise GroupError(f"cannot run {argv[0]}: {e}") from e
        return self._ray

    def _ray_exited(self, host: GroupHost, what: str) -> None:
        code = self._ray.poll() if self._ray is not None else None
        if code is not None:
            raise GroupError(f"{what} exited {describe_exit(code)}; its last lines:\n{host.tail()}")

    async def run_worker(self, host: GroupHost) -> None:
        """A vLLM group worker: fetches the weights (its stage loads them here), then joins its head's
        Ray cluster once the spec carries the head's address (until then ``starting``; the spec
        changes when it comes); ready while ``ray start`` runs."""
        head = next((m.endpoint for m in host.spec.members if m.rank == 0), "")
        # vLLM loads each pipeline stage's weights on its own node, from the path the head serves:
        # the node cache's path, the same on every node with the same agent state directory.
        await host.fetch_weights()
        host.set_state(ReplicaState.STARTING)
        if not head:
            log.info("replica %s: waiting for its head's Ray address", host.spec.id)
            await asyncio.Event().wait()  # cancelled when the spec with the address arrives
        build = self.engine.usable(host.env.installed(self.engine.name))
        ray = self._start_ray(host, ray_worker_argv(ray_binary(build.binary), head, host.env.probe_host))
        host.pid, host.started_at = ray.pid, time.time()
        await asyncio.sleep(host.env.probe_interval_s)
        self._ray_exited(host, "ray start (joining the head)")
        host.set_state(ReplicaState.READY)
        while True:
            await asyncio.sleep(host.env.watch_interval_s)
            self._ray_exited(host, f"ray (worker of the head at {head})")

    async def head_args(self, host: GroupHost, build: Any, model_path: Path) -> list[str]:
        """A vLLM group head: ``ray start --head``, report its address, wait until Ray counts every
        member (``ray status``), then the flags for ``vllm serve``. Raises GroupError past the start
        deadline or when Ray exits."""
        ray = ray_binary(build.binary)
        port = host.env.port_picker(host.env.advertise_address)
        address = host_port(host.env.probe_host, port)
        self._start_ray(host, ray_head_argv(ray, host.env.probe_host, port))
        host.set_state(ReplicaState.STARTING)
        self._ray_head = address
        host.env.on_change()  # the workers need the address: heartbeat now
        want = len(host.spec.members)
        deadline = host.env.clock() + host.env.installed(self.engine.name).start_deadline_s
        seen = 0
        while True:
            self._ray_exited(host, "ray start --head")
            try:
                done = await asyncio.to_thread(
                    subprocess.run, ray_status_argv(ray, address), capture_output=True, text=True, timeout=30,
                    check=False,
                )
                seen = active_nodes(done.stdout)
            except subprocess.TimeoutExpired:
                seen = 0  # Ray busy starting: ask again (the start deadline bounds the wait)
            if seen >= want:
                break
            if host.env.clock() > deadline:
                raise GroupError(f"Ray counts {seen} of the group's {want} nodes after the start deadline")
            await asyncio.sleep(RAY_STATUS_EVERY_S)
        log.info("replica %s: Ray cluster at %s has all %d nodes; starting vllm", host.spec.id, address, want)
        return vllm_group_args(want, len(host.spec.gpu_indexes))

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """``RAY_ADDRESS``: ``vllm serve`` joins the group's Ray cluster."""
        if self._ray_head:
            env["RAY_ADDRESS"] = self._ray_head
        return env

    async def stop(self, grace_s: float) -> None:
        """Stop this member's ``ray start`` (its process group), if it runs."""
        if self._ray is not None:
            if self._ray.poll() is None:
                await asyncio.to_thread(stop_process_group, self._ray.pid, grace_s=grace_s, reap=False)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(self._ray.wait, 5)
            self._ray = None
