"""Which control planes share the database, who leads, and the term: written and read every second.

Every control plane (leader or not) runs :class:`Membership`: each :data:`WRITE_EVERY_S` it upserts
its own ``control_planes`` row (name, agent URL, version, last seen), and each :data:`READ_EVERY_S`
it reads every row and the ``cp_leader`` row, off the event loop (the store's
:class:`~llmgw.control.store.offloop.OffLoop`, whose deadline bounds a hung call). What it read is
kept in memory, so heartbeat replies (``term``, ``leader``, ``control_planes``), ``GET
/api/v1/health`` and ``GET /api/v1/cluster`` answer without a store call, database down or not.

A member is **alive** when it wrote its row within :data:`ALIVE_S` (three writes). The leader is
this control plane while its own election says it leads; else the ``cp_leader`` holder while its
lease is fresh (``renewed_at``, the database's clock, within ``cluster.lease_s`` of this machine's
clock) and its control plane alive; none otherwise, and then :meth:`Membership.no_leader_since`
says since when (a holder that stepped down used to be named exactly while no reconciler ran).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from llmgw.config import parse_listen
from llmgw.control.reconcile.election import Election
from llmgw.control.store import Store
from llmgw.control.store.offloop import OffLoop
from llmgw.control.store.rows import ControlPlaneRow, LeaderRow

log = logging.getLogger(__name__)

#: Seconds between two writes of this control plane's row.
WRITE_EVERY_S = 2.0

#: Seconds between two reads of the members and the term (heartbeat replies carry a term at most
#: this old).
READ_EVERY_S = 1.0

#: A member that has not written its row for this long (three writes) is not alive.
ALIVE_S = 3 * WRITE_EVERY_S


def default_agent_url(agent_listen: str, port: int | None = None) -> str:
    """How agents reach this control plane when ``cluster.agent_url`` is not set:
    ``https://HOST:PORT`` from ``agent_listen`` (the machine's host name when it listens on every
    interface), ``port`` overriding the configured one (``:0`` binds a free port).

    Example::

        >>> default_agent_url("10.0.0.5:7443")
        'https://10.0.0.5:7443'
    """
    host, listen_port = parse_listen(agent_listen)
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{port or listen_port}"


@dataclass(frozen=True)
class Snapshot:
    """What the last successful read saw.

    Attributes:
        read_at: unix seconds of that read (0: none yet).
        leader: the ``cp_leader`` row.
        members: every ``control_planes`` row, by name.
    """

    read_at: float = 0.0
    leader: LeaderRow = field(default_factory=lambda: LeaderRow(0, "", 0.0, 0.0))
    members: tuple[ControlPlaneRow, ...] = field(default_factory=tuple)


@dataclass(eq=False, repr=False)
class Membership:
    """This control plane's row, and the cluster as last read (module docstring).

    Args:
        store: the (unfenced) store.
        db: the pool with a deadline that store calls run on.
        election: this control plane's election (whether it leads now).
        name: ``cluster.name``.
        agent_url: ``cluster.agent_url`` (or :func:`default_agent_url`).
        version: the llmgw version this control plane runs.
        clock: unix seconds.
        lease_s: ``cluster.lease_s``: a holder whose ``renewed_at`` is older than this leads no more.
        node: the node on this control plane's machine (its ``agent.yaml``'s ``node_id``), "" for none.
        find_node: reads ``node`` again while it is "" (init writes the agent.yaml after it started the
            control plane), before each write of the row.
    """

    store: Store
    db: OffLoop
    election: Election
    _: KW_ONLY
    name: str
    agent_url: str
    version: str
    clock: Callable[[], float] = time.time
    lease_s: float = 5.0
    node: str = ""
    find_node: Callable[[], str] | None = None
    started_at: float = field(init=False)
    snapshot: Snapshot = field(default_factory=Snapshot, init=False)
    database_error: str = field(default="", init=False)  # "" while the last store call succeeded
    _written: float = field(default=0.0, init=False)
    #: the agent URL of another control plane last seen writing our row.
    _intruder: str = field(default="", init=False)

    def __post_init__(self) -> None:
        self.started_at = self.clock()

    @property
    def database_ok(self) -> bool:
        """Whether the last read or write of the database succeeded."""
        return not self.database_error

    async def run(self, stop: asyncio.Event) -> None:
        """Write and read (:meth:`tick`) every :data:`READ_EVERY_S` until ``stop`` is set."""
        while not stop.is_set():
            await self.tick()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), READ_EVERY_S)

    async def tick(self) -> None:
        """One write (when due) and read; a failure is kept as :attr:`database_error` (logged on change)."""
        now = self.clock()
        try:
            if now - self._written >= WRITE_EVERY_S:
                self._find_node()
                row = ControlPlaneRow(self.name, self.agent_url, now, self.started_at, self.version, self.node)
                await self.db.run(self.store.upsert_control_plane, row)
                self._written = now
            leader, members = await self.db.run(self._read)
        except Exception as e:
            why = str(e) or e.__class__.__name__
            if why != self.database_error:
                log.warning("control plane %s: the database cannot be read: %s", self.name, why)
            self.database_error = why
            return
        if self.database_error:
            log.info("control plane %s: the database answers again", self.name)
        self.database_error = ""
        self.snapshot = Snapshot(now, leader, tuple(members))
        self._check_name(members, now)

    def _check_name(self, members: list[ControlPlaneRow], now: float) -> None:
        """Log (once per intruder) when another live process wrote this control plane's row: two
        control planes with one ``cluster.name`` overwrite each other's agent URL, and agents learn
        whichever wrote last."""
        row = next((m for m in members if m.name == self.name), None)
        if row is None or now - row.last_seen > ALIVE_S:
            return
        if (row.started_at, row.agent_url) != (self.started_at, self.agent_url) and row.agent_url != self._intruder:
            self._intruder = row.agent_url
            log.error(
                "control plane %s: another control plane uses the same cluster.name (its agent URL %s, this "
                "one's %s); give each control plane its own name in server.yaml (cluster.name)",
                self.name, row.agent_url, self.agent_url,
            )

    def _read(self) -> tuple[LeaderRow, list[ControlPlaneRow]]:
        return self.store.leader(), self.store.list_control_planes()

    def alive(self, row: ControlPlaneRow, now: float | None = None) -> bool:
        """Whether ``row``'s control plane wrote its row within :data:`ALIVE_S` (this one: always)."""
        if row.name == self.name:
            return True
        return (now if now is not None else self.clock()) - row.last_seen <= ALIVE_S

    def leader_name(self) -> str:
        """The leading control plane's name, "" when none leads (as far as this one knows)."""
        if self.election.leading:
            return self.name
        lease = self.snapshot.leader
        holder = lease.holder
        if not holder or holder == self.name or self.clock() - lease.renewed_at > self.lease_s:
            return ""
        row = next((m for m in self.snapshot.members if m.name == holder), None)
        return holder if row is not None and self.alive(row) else ""

    def no_leader_since(self) -> float | None:
        """None while :meth:`leader_name` names a leader; else unix seconds since which none leads:
        the lease's end (``renewed_at + lease_s``) once it has passed, the last renewal when the
        holder is known gone sooner (its control plane not alive, or this one, stepped down), 0.0
        when none ever led."""
        if self.leader_name():
            return None
        lease = self.snapshot.leader
        if lease.term == 0 or not lease.holder:
            return 0.0
        end = lease.renewed_at + self.lease_s
        return end if end <= self.clock() else lease.renewed_at

    def term(self) -> int:
        """The newest term known: this control plane's own while it leads, else the database's as last read."""
        return max(self.election.term if self.election.leading else 0, self.snapshot.leader.term)

    def members(self) -> list[ControlPlaneRow]:
        """Every member as last read, this control plane included (even before its first write)."""
        rows = [m for m in self.snapshot.members if m.name != self.name]
        me = ControlPlaneRow(
            self.name, self.agent_url, self._written or self.started_at, self.started_at, self.version, self.node
        )
        return sorted([*rows, me], key=lambda r: r.name)

    def own_nodes(self) -> frozenset[str]:
        """The nodes on the members' own machines, as last read (this one's included, read again now
        while it is unknown: init starts the agent right after writing its agent.yaml, and its first
        beat lost the label until the next write of the row, ~2 s): the nodes whose
        ``llmgw.control-plane`` label the agent API honours (:mod:`llmgw.control.api.nodelabels`)."""
        self._find_node()
        return frozenset(m.node for m in self.members() if m.node)

    def _find_node(self) -> None:
        """:attr:`node` read again (``find_node``) while it is unknown."""
        if not self.node and self.find_node is not None:
            self.node = self.find_node()

    def reply_fields(self) -> tuple[int, str, list[str]]:
        """What a heartbeat reply carries: ``(term, leader's agent URL or "", alive members' agent URLs)``."""
        now = self.clock()
        leader = self.leader_name()
        members = self.members()
        leader_url = next((m.agent_url for m in members if m.name == leader), "") if leader else ""
        return self.term(), leader_url, [m.agent_url for m in members if self.alive(m, now)]
