"""The choices ``server init`` is given (its flags), with their defaults (docs/install.md, "The steps")."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmgw.serverinit.plan import STARTER_SOURCE


@dataclass
class InitOptions:
    """Everything ``llmgw server init`` can be told.

    Listen addresses are ``HOST:PORT`` or ``:PORT``; each is settable so a test can run beside
    another install. Wait limits are seconds: 20 min for a node's engine (a new node fetches and
    checks its own llama.cpp, often while busy with its own package updates), 30 min for a
    download, 10 min for a model to start, and 90 s before believing placement's "nowhere" (long
    enough for a node still installing its engine).

    HA (:mod:`llmgw.serverinit.steps.database`): ``control_planes`` are the members as
    ``NAME=HOST[:PORT]`` (this machine first) and switch HA on; ``etcd`` the etcd v3 URLs Patroni
    uses (none: Patroni's raft); ``patroni_venv``/``patroni_dir``/``pg_bin_dir`` where Patroni, its
    member's files and PostgreSQL 15 are; ``join`` a standby's bundle from ``server
    add-control-plane``. ``patroni_wait_s``: 90 s for a member to lead or stream (docs/ha.md §1.4: a
    bootstrap took 15-18 s, a rejoin 5-9 s).
    """

    hosts: list[str] = field(default_factory=list)
    cpus: int | None = None
    offline: bool = False
    no_node: bool = False
    no_guard_model: bool = False
    starter_source: str = STARTER_SOURCE
    starter_name: str = ""
    starter_alias: str = ""
    llama_server: Path | None = None
    mirror_url: str = ""
    judge_replicas: int | None = None
    judge_source: str = ""
    judge_format: str = ""
    node_id: str = ""
    admin_listen: str = "127.0.0.1:9090"
    agent_listen: str = ":7443"
    gateway_listen: str = ":8080"
    mirror_listen: str = ":8081"
    mirror_api_listen: str = "127.0.0.1:8082"
    control_planes: list[str] = field(default_factory=list)
    etcd: list[str] = field(default_factory=list)
    patroni_venv: Path | None = None
    patroni_dir: Path | None = None
    pg_bin_dir: Path | None = None
    join: Path | None = None
    patroni_wait_s: float = 90
    node_wait_s: float = 20 * 60
    download_wait_s: float = 30 * 60
    serve_wait_s: float = 10 * 60
    unplaced_grace_s: float = 90
    service_wait_s: float = 30
    poll_s: float = 0.5

    @property
    def ha(self) -> bool:
        """True when init sets up (or joins) an HA cluster rather than a single machine."""
        return bool(self.control_planes) or self.join is not None
