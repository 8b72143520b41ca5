"""The control plane's state: models, nodes, replicas and placement explanations, in one database.

SQLite (WAL) is the embedded default (``sqlite:///<paths.database>``); PostgreSQL is the store for
HA (``store.url`` in server.yaml). Both run the same SQLAlchemy Core tables and queries.

Rules this module keeps:

* **Optimistic concurrency.** Every row has a ``revision`` that starts at 1. Every update is
  ``UPDATE … WHERE <key>=? AND revision=?`` and bumps it; when no row matched, the row changed (or
  went) since it was read and :class:`Conflict` is raised. Callers re-read and decide again; no
  read-then-overwrite.
* **Migrations, never "delete the file".** :data:`MIGRATIONS` is an ordered list applied at open;
  ``schema_migrations`` records the versions applied, so opening twice applies nothing twice.
* **One bad row never hides the others.** A model row that no longer validates (written by an
  older version, or by hand) is skipped by :meth:`Store.list_models` and :meth:`Store.get_model`,
  logged once, and listed by :meth:`Store.list_broken_models` with the reason, so the admin API
  names it and ``ctl model rm`` deletes it; heartbeats, placement and the gateway go on with the
  rest.
* **Separate shapes.** The rows here (:class:`ModelRow`, :class:`NodeRow`, :class:`ReplicaRow`)
  are storage shapes; API views live in :mod:`llmgw.control.api.views`, wire shapes in
  :mod:`llmgw.protocol`.

Calls are synchronous (the control plane makes them on a thread pool, never on its event loop:
:mod:`llmgw.control.store.offloop`), and the gateway's hot path never reaches the store (it reads
:class:`~llmgw.control.gateway.table.StoreRouter`'s memory).

**One writer at a time, in process.** SQLite lets one transaction write; a second one waits in
SQLite's busy handler, which *sleeps* 1, 2, 5, 10 … 100 ms between tries, so writers on several
threads (heartbeats, a leader pass) made heartbeats wait hundreds of milliseconds behind a pass
that wrote 50 explanations (issue 9, item 17: p99 518 ms). Write transactions therefore take a
``threading.Lock`` first (SQLite only), which hands over at once. Reads take no lock (WAL).

Errors: :class:`Conflict` (HTTP 409 at the admin API), :class:`StoreError` (the database cannot be
opened or migrated, with the driver's error chained).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pydantic import ValidationError
from sqlalchemy.engine import Connection, Engine

from llmgw.catalog import STORED, Model
from llmgw.control.api.views import ExplainView
from llmgw.errors import Conflict, Revoked, StoreError
from llmgw.protocol import EngineStatus, Heartbeat, Inventory, ReplicaState, ReplicaStatus

log = logging.getLogger(__name__)


metadata = sa.MetaData()

models_t = sa.Table(
    "models",
    metadata,
    sa.Column("name", sa.String(63), primary_key=True),
    sa.Column("revision", sa.Integer, nullable=False),
    sa.Column("spec", sa.Text, nullable=False),  # catalog.Model as JSON
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)

nodes_t = sa.Table(
    "nodes",
    metadata,
    sa.Column("id", sa.String(253), primary_key=True),
    sa.Column("revision", sa.Integer, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("cordoned", sa.Boolean, nullable=False),
    sa.Column("labels", sa.Text, nullable=False),  # {str: str}
    sa.Column("inventory", sa.Text, nullable=False),  # protocol.Inventory
    sa.Column("engines", sa.Text, nullable=False),  # [protocol.EngineStatus]
    sa.Column("replicas", sa.Text, nullable=False),  # [protocol.ReplicaStatus] as last reported
    sa.Column("first_seen", sa.Float, nullable=False),
    sa.Column("last_seen", sa.Float, nullable=False),
    sa.Column("instance", sa.String(64), nullable=False, server_default=""),  # migration 2
    sa.Column("cached", sa.Text, nullable=False, server_default="[]"),  # migration 2: ["model/version"]
)

replicas_t = sa.Table(
    "replicas",
    metadata,
    sa.Column("id", sa.String(80), primary_key=True),
    sa.Column("model", sa.String(63), nullable=False, index=True),
    sa.Column("node", sa.String(253), nullable=False, index=True),
    sa.Column("profile", sa.String(128), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("err", sa.Text, nullable=False),
    sa.Column("key", sa.String(128), nullable=False),
    sa.Column("endpoint", sa.String(300), nullable=False),
    sa.Column("revision", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("ready_at", sa.Float, nullable=True),
    sa.Column("restarts", sa.Integer, nullable=False),
    sa.Column("gpu_indexes", sa.Text, nullable=False, server_default="[]"),  # migration 2
    sa.Column("last_error", sa.Text, nullable=False, server_default=""),  # migration 2
    sa.Column("spec_hash", sa.String(64), nullable=False, server_default=""),  # migration 2
)

gguf_facts_t = sa.Table(
    "gguf_facts",  # migration 2: estimate.GgufFacts per model source URL
    metadata,
    sa.Column("source", sa.String(2048), primary_key=True),
    sa.Column("body", sa.Text, nullable=False),  # estimate.GgufFacts as JSON, "" when it failed
    sa.Column("error", sa.Text, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)

explanations_t = sa.Table(
    "explanations",
    metadata,
    sa.Column("model", sa.String(63), primary_key=True),
    sa.Column("body", sa.Text, nullable=False),  # views.ExplainView
    sa.Column("updated_at", sa.Float, nullable=False),
)

node_certs_t = sa.Table(
    "node_certs",  # migration 3: the certificate serials each node's agent presented
    metadata,
    sa.Column("node", sa.String(253), primary_key=True),
    sa.Column("serial", sa.String(64), primary_key=True),  # upper-case hex, no leading zeros
    sa.Column("first_seen", sa.Float, nullable=False),
)

revoked_certs_t = sa.Table(
    "revoked_certs",  # migration 3: the agent API's deny-list (serials of removed nodes)
    metadata,
    sa.Column("serial", sa.String(64), primary_key=True),
    sa.Column("node", sa.String(253), nullable=False),
    sa.Column("revoked_at", sa.Float, nullable=False),
)

migrations_t = sa.Table(
    "schema_migrations",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("applied_at", sa.Float, nullable=False),
)


def _migration_1(conn: Connection) -> None:
    """The first schema: models, nodes, replicas, explanations."""
    for table in (models_t, nodes_t, replicas_t, explanations_t):
        table.create(conn, checkfirst=True)


_MIGRATION_2_COLUMNS = {
    "nodes": ["instance", "cached"],
    "replicas": ["gpu_indexes", "last_error", "spec_hash"],
}


def _migration_2(conn: Connection) -> None:
    """Issue 3: nodes.instance/cached, replicas.gpu_indexes/last_error/spec_hash, gguf_facts.

    Columns are added only where missing: migration 1 creates tables from the current definitions,
    so a database made today already has them."""
    inspector = sa.inspect(conn)
    for table_name, columns in _MIGRATION_2_COLUMNS.items():
        have = {c["name"] for c in inspector.get_columns(table_name)}
        table = metadata.tables[table_name]
        for name in columns:
            if name in have:
                continue
            col = table.c[name]
            ddl = col.type.compile(dialect=conn.dialect)
            default = col.server_default.arg if col.server_default is not None else ""  # type: ignore[attr-defined]
            conn.execute(
                sa.text(f"ALTER TABLE {table_name} ADD COLUMN {name} {ddl} NOT NULL DEFAULT '{default}'")
            )
    gguf_facts_t.create(conn, checkfirst=True)


def _migration_3(conn: Connection) -> None:
    """Issue 9: node_certs (serials seen per node) and revoked_certs (the agent API's deny-list)."""
    node_certs_t.create(conn, checkfirst=True)
    revoked_certs_t.create(conn, checkfirst=True)


#: Ordered ``(version, apply)`` pairs. Append new ones; never edit or reorder an applied one.
MIGRATIONS: list[tuple[int, Callable[[Connection], None]]] = [
    (1, _migration_1),
    (2, _migration_2),
    (3, _migration_3),
]


# --- rows ---


@dataclass(frozen=True)
class ModelRow:
    """A catalog entry as stored: the model, its revision and times (unix seconds)."""

    model: Model
    revision: int
    created_at: float
    updated_at: float

    @property
    def name(self) -> str:
        """The model's name (the primary key)."""
        return self.model.name


@dataclass(frozen=True)
class BrokenModel:
    """A model row that cannot be read back as a :class:`Model`: its name, why (the first
    validation problems), and when it was last written (unix seconds)."""

    name: str
    reason: str
    updated_at: float


@dataclass(frozen=True)
class NodeRow:
    """A node as stored. ``state``: ``ready`` (heartbeats arriving) or ``lost`` (the leader saw none
    for ``node_lost_after_s``). ``replicas`` is what the node last reported, verbatim."""

    id: str
    revision: int
    state: str
    cordoned: bool
    labels: dict[str, str]
    inventory: Inventory
    engines: list[EngineStatus]
    replicas: list[ReplicaStatus]
    first_seen: float
    last_seen: float
    instance: str = ""
    cached: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ReplicaRow:
    """A replica the control plane wants: placed on ``node`` with ``profile``.

    ``state`` is ``pending`` until the node reports it, then what the node says
    (:class:`~llmgw.protocol.ReplicaState`). ``key`` is the engine's ``--api-key``.
    """

    id: str
    model: str
    node: str
    profile: str
    key: str
    state: str = ReplicaState.PENDING.value
    err: str = ""
    endpoint: str = ""
    revision: int = 1
    created_at: float = 0.0
    updated_at: float = 0.0
    ready_at: float | None = None
    restarts: int = 0
    gpu_indexes: tuple[int, ...] = ()
    last_error: str = ""
    spec_hash: str = ""


@dataclass(frozen=True)
class ReportResult:
    """What :meth:`Store.apply_reports` changed: replica ids whose state/err/endpoint moved."""

    changed: list[str] = field(default_factory=list)


def default_url(store_url: str, database: Path) -> str:
    """``store_url`` when set, else the SQLite file ``database`` (``paths.database``)."""
    return store_url or f"sqlite:///{database}"


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


class Store:
    """The state store. Open with :meth:`Store.open`; every method is one short transaction.

    Example::

        store = Store.open("sqlite:////var/lib/llmgw/llmgw.db")
        store.add_model(model, now=time.time())
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._logged_broken: set[tuple[str, int]] = set()
        self._writer: contextlib.AbstractContextManager[object] = (
            threading.Lock() if engine.dialect.name == "sqlite" else contextlib.nullcontext()
        )

    @classmethod
    def open(cls, url: str) -> Store:
        """Connect to ``url`` and apply pending migrations.

        SQLite: the parent directory is created, the file runs in WAL mode with a 5 s busy timeout
        (a second process, such as ``server init`` reading, waits instead of failing).

        Raises:
            StoreError: the database cannot be opened or migrated.
        """
        try:
            sa_url = sa.make_url(url)
        except sa.exc.ArgumentError as e:
            raise StoreError(
                f"store.url '{url}' is not a database URL; use sqlite:///PATH or postgresql+psycopg://…"
            ) from e
        if sa_url.get_backend_name() == "sqlite" and sa_url.database not in (None, "", ":memory:"):
            _private_sqlite(Path(sa_url.database))
        engine = sa.create_engine(sa_url)
        if engine.dialect.name == "sqlite":
            sa.event.listen(engine, "connect", _sqlite_pragmas)
        store = cls(engine)
        try:
            store.migrate()
        except sa.exc.SQLAlchemyError as e:
            engine.dispose()
            raise StoreError(f"cannot open the store at {sa_url.render_as_string()}: {e}") from e
        return store

    def close(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _wtx(self) -> Iterator[Connection]:
        """A transaction that writes: one at a time in this process (see the module docstring)."""
        with self._writer, self.engine.begin() as conn:
            yield conn

    def migrate(self) -> list[int]:
        """Apply the migrations not yet recorded in ``schema_migrations``; return their versions."""
        applied_now: list[int] = []
        with self._wtx() as conn:
            migrations_t.create(conn, checkfirst=True)
            done = set(conn.scalars(sa.select(migrations_t.c.version)))
            for version, apply in MIGRATIONS:
                if version in done:
                    continue
                apply(conn)
                conn.execute(migrations_t.insert().values(version=version, applied_at=time.time()))
                applied_now.append(version)
        return applied_now

    def schema_versions(self) -> list[int]:
        """The migration versions applied, ascending."""
        with self._tx() as conn:
            return sorted(conn.scalars(sa.select(migrations_t.c.version)))

    # --- models ---

    def add_model(self, model: Model, *, now: float) -> ModelRow:
        """Add a catalog entry at revision 1.

        Raises:
            Conflict: the name is taken, or a name or alias of it is another model's name or alias.
        """
        mine = {model.name, *model.aliases}
        with self._wtx() as conn:
            for row in conn.execute(sa.select(models_t.c.name, models_t.c.spec)):
                other = self._readable(row.name, row.spec)
                if row.name == model.name:
                    how = "PATCH it or DELETE it first" if other else "its stored row is broken: DELETE it first"
                    raise Conflict(f"model '{model.name}' already exists; {how}")
                if other is None:
                    continue
                clash = sorted(mine & {other.name, *other.aliases})
                if clash:
                    raise Conflict(
                        f"'{clash[0]}' is already a name or alias of model '{other.name}'; "
                        "pick another alias or remove it from that model"
                    )
            try:
                conn.execute(
                    models_t.insert().values(
                        name=model.name,
                        revision=1,
                        spec=model.model_dump_json(),
                        created_at=now,
                        updated_at=now,
                    )
                )
            except sa.exc.IntegrityError as e:
                raise Conflict(f"model '{model.name}' already exists; PATCH it or DELETE it first") from e
        return ModelRow(model, 1, now, now)

    def get_model(self, name: str) -> ModelRow | None:
        """The model named ``name`` (not an alias), or None (also when its row is broken)."""
        with self._tx() as conn:
            row = conn.execute(sa.select(models_t).where(models_t.c.name == name)).first()
        return self._model_row(row) if row else None

    def list_models(self) -> list[ModelRow]:
        """Every readable catalog entry, by name; broken rows are skipped (:meth:`list_broken_models`)."""
        with self._tx() as conn:
            rows = conn.execute(sa.select(models_t).order_by(models_t.c.name)).all()
        return [m for m in (self._model_row(r) for r in rows) if m is not None]

    def list_broken_models(self) -> list[BrokenModel]:
        """The model rows that cannot be read as a :class:`Model`, by name, with the reason."""
        with self._tx() as conn:
            rows = conn.execute(sa.select(models_t).order_by(models_t.c.name)).all()
        out = []
        for r in rows:
            try:
                Model.model_validate_json(r.spec, context=STORED)
            except ValidationError as e:
                out.append(BrokenModel(r.name, _first_problems(e), r.updated_at))
        return out

    def _readable(self, name: str, spec: str) -> Model | None:
        """``spec`` as a Model, or None when it does not validate (logged once per name and spec)."""
        try:
            return Model.model_validate_json(spec, context=STORED)
        except ValidationError as e:
            key = (name, hash(spec))
            if key not in self._logged_broken:
                self._logged_broken.add(key)
                log.warning(
                    "model '%s' in the store cannot be read (%s); it is skipped: delete it with "
                    "'llmgw ctl model rm %s' and add it again", name, _first_problems(e), name,
                )
            return None

    def _model_row(self, row: sa.Row[Any]) -> ModelRow | None:
        model = self._readable(row.name, row.spec)
        return ModelRow(model, row.revision, row.created_at, row.updated_at) if model else None

    def update_model(self, model: Model, *, revision: int, now: float) -> ModelRow:
        """Replace the entry named ``model.name`` if it is still at ``revision``.

        Raises:
            Conflict: the row changed or went since ``revision`` was read, or an alias clashes.
        """
        mine = {model.name, *model.aliases}
        with self._wtx() as conn:
            for row in conn.execute(
                sa.select(models_t.c.name, models_t.c.spec).where(models_t.c.name != model.name)
            ):
                other = self._readable(row.name, row.spec)
                if other is None:
                    continue
                clash = sorted(mine & {other.name, *other.aliases})
                if clash:
                    raise Conflict(f"'{clash[0]}' is already a name or alias of model '{other.name}'")
            result = conn.execute(
                models_t.update()
                .where(models_t.c.name == model.name, models_t.c.revision == revision)
                .values(spec=model.model_dump_json(), revision=revision + 1, updated_at=now)
                .returning(models_t.c.created_at)
            )
            created = result.scalar_one_or_none()
        if created is None:
            raise Conflict(f"model '{model.name}' changed since revision {revision} was read; read it again")
        return ModelRow(model, revision + 1, created, now)

    def delete_model(self, name: str) -> bool:
        """Delete the entry and its explanation; True when there was one. Its replicas go at the
        leader's next pass (the agents then stop them)."""
        with self._wtx() as conn:
            n = conn.execute(models_t.delete().where(models_t.c.name == name)).rowcount
            conn.execute(explanations_t.delete().where(explanations_t.c.model == name))
        return n > 0

    # --- nodes ---

    def upsert_node_heartbeat(self, node_id: str, hb: Heartbeat, now: float) -> NodeRow:
        """Record a heartbeat: the node is ``ready``, with this inventory, labels, engines and
        reported replicas; ``last_seen`` = ``now``. Inserts the node on its first heartbeat.

        A racing writer (the leader marking the node lost) makes the update miss its revision; the
        row is then re-read and the heartbeat applied again (a heartbeat always wins: it is newer).
        """
        values = _heartbeat_values(hb, now)
        for _ in range(5):
            try:
                with self._wtx() as conn:
                    n = _upsert_node(conn, node_id, values, now)
            except sa.exc.IntegrityError:
                n = 0  # inserted by another writer meanwhile: update it on the next try
            if n:
                return self._node(node_id)
        raise Conflict(f"node '{node_id}' kept changing while its heartbeat was recorded; it will retry")

    def record_heartbeats(self, beats: Sequence[tuple[str, Heartbeat, float, str]]) -> list[Conflict | None]:
        """Record several heartbeats ``(node_id, heartbeat, now, serial)`` in one write transaction,
        as :meth:`upsert_node_heartbeat` records one; the result has one entry per heartbeat, None
        when it was recorded, else the :class:`Conflict` it would have raised, or :class:`Revoked`
        when ``serial`` (the agent certificate's, ``""`` when unknown) is on the deny-list.

        The deny-list is read in the same write transaction that :meth:`remove_node` takes, so a
        heartbeat that was in flight while its node was removed cannot write the node back.

        One transaction for a batch: with SQLite every write transaction takes the file's single
        write lock, and 200 agents beating every 2 s made that lock the queue heartbeats waited in
        (:mod:`llmgw.control.store.offloop` batches the heartbeats that arrive while one batch is written).
        """
        prepared = [(node_id, _heartbeat_values(hb, now), now, serial) for node_id, hb, now, serial in beats]
        out: list[Conflict | None] = []
        try:
            with self._wtx() as conn:
                serials = [b[3] for b in beats if b[3]]
                denied = {
                    r.serial: r
                    for r in conn.execute(sa.select(revoked_certs_t).where(revoked_certs_t.c.serial.in_(serials)))
                } if serials else {}
                for node_id, values, now, serial in prepared:
                    gone = denied.get(serial)
                    if gone is not None:
                        out.append(Revoked(serial, gone.node, gone.revoked_at))
                        continue
                    done = any(_upsert_node(conn, node_id, values, now) for _ in range(5))
                    out.append(None if done else Conflict(
                        f"node '{node_id}' kept changing while its heartbeat was recorded; it will retry"
                    ))
        except sa.exc.IntegrityError:
            # Another process inserted one of these nodes meanwhile: record them one by one.
            out = []
            for node_id, hb, now, serial in beats:
                was = self.revoked(serial) if serial else None
                if was is not None:
                    out.append(Revoked(serial, *was))
                    continue
                try:
                    self.upsert_node_heartbeat(node_id, hb, now)
                    out.append(None)
                except Conflict as e:
                    out.append(e)
        return out

    def _node(self, node_id: str) -> NodeRow:
        row = self.get_node(node_id)
        if row is None:
            raise Conflict(f"node '{node_id}' was removed while being written")
        return row

    def get_node(self, node_id: str) -> NodeRow | None:
        """The node, or None."""
        with self._tx() as conn:
            row = conn.execute(sa.select(nodes_t).where(nodes_t.c.id == node_id)).first()
        return _node_row(row) if row else None

    def list_nodes(self) -> list[NodeRow]:
        """Every node, by id."""
        with self._tx() as conn:
            rows = conn.execute(sa.select(nodes_t).order_by(nodes_t.c.id)).all()
        return [_node_row(r) for r in rows]

    def update_node(
        self, node: NodeRow, *, state: str | None = None, cordoned: bool | None = None
    ) -> NodeRow:
        """Set ``state`` and/or ``cordoned`` on ``node`` if it is still at ``node.revision``.

        Raises:
            Conflict: the node changed (a heartbeat arrived) or went since it was read.
        """
        changes: dict[str, Any] = {}
        if state is not None:
            changes["state"] = state
        if cordoned is not None:
            changes["cordoned"] = cordoned
        with self._wtx() as conn:
            n = conn.execute(
                nodes_t.update()
                .where(nodes_t.c.id == node.id, nodes_t.c.revision == node.revision)
                .values(revision=node.revision + 1, **changes)
            ).rowcount
        if not n:
            raise Conflict(f"node '{node.id}' changed since revision {node.revision} was read")
        return replace(node, revision=node.revision + 1, **changes)

    # --- node removal and certificate revocation (migration 3) ---

    def note_cert(self, node_id: str, serial: str, now: float) -> None:
        """Remember that ``node_id``'s agent presented the certificate ``serial`` (upper-case hex);
        a pair already known is left as it is. ``ctl node rm`` revokes what is remembered here."""
        try:
            with self._wtx() as conn:
                known = conn.scalar(
                    sa.select(sa.func.count())
                    .select_from(node_certs_t)
                    .where(node_certs_t.c.node == node_id, node_certs_t.c.serial == serial)
                )
                if not known:
                    conn.execute(node_certs_t.insert().values(node=node_id, serial=serial, first_seen=now))
        except sa.exc.IntegrityError:
            pass  # another control plane recorded it meanwhile

    def node_serials(self, node_id: str) -> list[str]:
        """The certificate serials ``node_id``'s agent presented, oldest first."""
        with self._tx() as conn:
            return list(
                conn.scalars(
                    sa.select(node_certs_t.c.serial)
                    .where(node_certs_t.c.node == node_id)
                    .order_by(node_certs_t.c.first_seen, node_certs_t.c.serial)
                )
            )

    def revoked(self, serial: str) -> tuple[str, float] | None:
        """``(node, revoked_at)`` when the certificate ``serial`` is revoked, else None."""
        with self._tx() as conn:
            row = conn.execute(
                sa.select(revoked_certs_t.c.node, revoked_certs_t.c.revoked_at).where(
                    revoked_certs_t.c.serial == serial
                )
            ).first()
        return (row.node, row.revoked_at) if row else None

    def remove_node(self, node_id: str, *, now: float) -> list[str]:
        """Delete ``node_id``, the replicas placed on it and its remembered serials, and revoke those
        serials, in one transaction; returns the serials revoked (sorted).

        A node removed this way can join again only with a new certificate (``llmgw server
        add-node``): its old ones stay on the deny-list for good.

        Raises:
            Conflict: there is no node ``node_id``.
        """
        with self._wtx() as conn:
            n = conn.execute(nodes_t.delete().where(nodes_t.c.id == node_id)).rowcount
            if not n:
                raise Conflict(f"node '{node_id}' was removed meanwhile")
            serials = sorted(
                conn.scalars(sa.select(node_certs_t.c.serial).where(node_certs_t.c.node == node_id))
            )
            known = set(
                conn.scalars(sa.select(revoked_certs_t.c.serial).where(revoked_certs_t.c.serial.in_(serials)))
            )
            for serial in serials:
                if serial not in known:
                    conn.execute(revoked_certs_t.insert().values(serial=serial, node=node_id, revoked_at=now))
            conn.execute(node_certs_t.delete().where(node_certs_t.c.node == node_id))
            conn.execute(replicas_t.delete().where(replicas_t.c.node == node_id))
        return serials

    # --- replicas ---

    def add_replica(self, replica: ReplicaRow) -> ReplicaRow:
        """Insert ``replica`` at revision 1. Raises :class:`Conflict` when the id exists."""
        row = replace(replica, revision=1)
        try:
            with self._wtx() as conn:
                conn.execute(replicas_t.insert().values(**_replica_values(row)))
        except sa.exc.IntegrityError as e:
            raise Conflict(f"replica '{replica.id}' already exists") from e
        return row

    def get_replica(self, replica_id: str) -> ReplicaRow | None:
        """The replica, or None."""
        with self._tx() as conn:
            row = conn.execute(sa.select(replicas_t).where(replicas_t.c.id == replica_id)).first()
        return _replica_row(row) if row else None

    def list_replicas(self, *, model: str | None = None, node: str | None = None) -> list[ReplicaRow]:
        """Replicas, optionally of one model and/or on one node, by creation time then id."""
        q = sa.select(replicas_t).order_by(replicas_t.c.created_at, replicas_t.c.id)
        if model is not None:
            q = q.where(replicas_t.c.model == model)
        if node is not None:
            q = q.where(replicas_t.c.node == node)
        with self._tx() as conn:
            rows = conn.execute(q).all()
        return [_replica_row(r) for r in rows]

    def update_replica(self, replica: ReplicaRow) -> ReplicaRow:
        """Write ``replica``'s fields if the stored row is still at ``replica.revision``.

        Raises:
            Conflict: the row changed or went since it was read.
        """
        new = replace(replica, revision=replica.revision + 1)
        values = _replica_values(new)
        del values["id"]
        with self._wtx() as conn:
            n = conn.execute(
                replicas_t.update()
                .where(replicas_t.c.id == replica.id, replicas_t.c.revision == replica.revision)
                .values(**values)
            ).rowcount
        if not n:
            raise Conflict(f"replica '{replica.id}' changed since revision {replica.revision} was read")
        return new

    def delete_replica(self, replica_id: str, *, revision: int | None = None) -> bool:
        """Delete a replica (only at ``revision`` when given); True when a row went."""
        q = replicas_t.delete().where(replicas_t.c.id == replica_id)
        if revision is not None:
            q = q.where(replicas_t.c.revision == revision)
        with self._wtx() as conn:
            return conn.execute(q).rowcount > 0

    def apply_reports(self, node_id: str, reports: Sequence[ReplicaStatus], now: float) -> ReportResult:
        """Copy a node's reported replica states (state, err, endpoint) onto the replicas placed there.

        Reports for replicas not placed on ``node_id`` are ignored (a node cannot speak for another's
        replicas). ``ready_at`` is set when a replica becomes ready. A revision race (the leader or
        an admin touched the row) skips that replica until the next heartbeat, a couple of seconds on.
        """
        mine = {r.id: r for r in self.list_replicas(node=node_id)}
        result = ReportResult()
        for rep in reports:
            row = mine.get(rep.id)
            if row is None:
                continue
            state = rep.state.value
            if (row.state, row.err, row.endpoint) == (state, rep.err, rep.endpoint):
                continue
            ready_at = row.ready_at
            if state == ReplicaState.READY and row.state != ReplicaState.READY:
                ready_at = now
            try:
                self.update_replica(
                    replace(
                        row,
                        state=state,
                        err=rep.err,
                        endpoint=rep.endpoint,
                        updated_at=now,
                        ready_at=ready_at,
                    )
                )
            except Conflict:
                continue
            result.changed.append(rep.id)
        return result

    # --- explanations ---

    def set_explanation(self, view: ExplainView, *, now: float) -> None:
        """Store placement's explanation for ``view.model`` (replacing the previous one)."""
        body = view.model_dump_json()
        with self._wtx() as conn:
            n = conn.execute(
                explanations_t.update()
                .where(explanations_t.c.model == view.model)
                .values(body=body, updated_at=now)
            ).rowcount
            if not n:
                conn.execute(explanations_t.insert().values(model=view.model, body=body, updated_at=now))

    def get_explanation(self, model: str) -> ExplainView | None:
        """The last explanation stored for ``model``, or None."""
        with self._tx() as conn:
            body = conn.scalar(sa.select(explanations_t.c.body).where(explanations_t.c.model == model))
        return ExplainView.model_validate_json(body) if body else None

    def list_explanations(self) -> dict[str, ExplainView]:
        """Every stored explanation, by model."""
        with self._tx() as conn:
            rows = conn.execute(sa.select(explanations_t.c.model, explanations_t.c.body)).all()
        return {r.model: ExplainView.model_validate_json(r.body) for r in rows}

    def explanation_summaries(self) -> dict[str, str]:
        """Every stored explanation's one-line summary, by model (the routing table needs only
        these; parsing whole explanations, a verdict per node each, cost a heartbeat's worth of
        CPU per model with 200 nodes)."""
        with self._tx() as conn:
            rows = conn.execute(sa.select(explanations_t.c.model, explanations_t.c.body)).all()
        return {r.model: str(json.loads(r.body).get("summary", "")) for r in rows}

    def delete_explanation(self, model: str) -> None:
        """Forget the explanation for ``model``."""
        with self._wtx() as conn:
            conn.execute(explanations_t.delete().where(explanations_t.c.model == model))

    # --- GGUF facts (memory estimates) ---

    def set_gguf_facts(self, source: str, *, body: str, error: str, now: float) -> None:
        """Store what the GGUF header at ``source`` says (``body``: estimate.GgufFacts JSON), or
        why it could not be read (``error``, body empty)."""
        with self._wtx() as conn:
            n = conn.execute(
                gguf_facts_t.update()
                .where(gguf_facts_t.c.source == source)
                .values(body=body, error=error, updated_at=now)
            ).rowcount
            if not n:
                conn.execute(gguf_facts_t.insert().values(source=source, body=body, error=error, updated_at=now))

    def list_gguf_facts(self) -> dict[str, tuple[str, str, float]]:
        """Every stored header: ``{source: (body, error, updated_at)}``."""
        with self._tx() as conn:
            rows = conn.execute(sa.select(gguf_facts_t)).all()
        return {r.source: (r.body, r.error, r.updated_at) for r in rows}


def _private_sqlite(db: Path) -> None:
    """Make ``db``'s directory (0700 when new) and the file itself 0600 before SQLite opens it.

    The database holds replica API keys. SQLite creates ``-wal`` and ``-shm`` with the database
    file's permissions, so a 0600 file keeps all three from other local users; files left looser
    by an older version are narrowed here.
    """
    db.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(db, os.O_RDWR | os.O_CREAT, 0o600))
    for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_mode & 0o077:
                path.chmod(0o600)


def _heartbeat_values(hb: Heartbeat, now: float) -> dict[str, Any]:
    """The ``nodes`` columns a heartbeat sets."""
    return {
        "state": "ready",
        "labels": _dumps(hb.labels),
        "inventory": hb.inventory.model_dump_json(),
        "engines": _dumps([e.model_dump(mode="json") for e in hb.engines]),
        "replicas": _dumps([r.model_dump(mode="json") for r in hb.replicas]),
        "last_seen": now,
        "instance": hb.instance,
        "cached": _dumps(sorted(hb.cached)),
    }


def _upsert_node(conn: Connection, node_id: str, values: dict[str, Any], now: float) -> int:
    """Insert the node or update it at the revision just read; rows written (0: it raced)."""
    cur = conn.execute(sa.select(nodes_t.c.revision).where(nodes_t.c.id == node_id)).first()
    if cur is None:
        return int(
            conn.execute(
                nodes_t.insert().values(id=node_id, revision=1, cordoned=False, first_seen=now, **values)
            ).rowcount
        )
    return int(
        conn.execute(
            nodes_t.update()
            .where(nodes_t.c.id == node_id, nodes_t.c.revision == cur.revision)
            .values(revision=cur.revision + 1, **values)
        ).rowcount
    )


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _first_problems(err: ValidationError) -> str:
    """``profiles.0.min_memory_gb: Input should be a valid number`` (at most three problems)."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(spec)'}: {e['msg']}" for e in err.errors()[:3]
    )


def _node_row(row: sa.Row[Any]) -> NodeRow:
    return NodeRow(
        id=row.id,
        revision=row.revision,
        state=row.state,
        cordoned=bool(row.cordoned),
        labels=json.loads(row.labels),
        inventory=Inventory.model_validate_json(row.inventory),
        engines=[EngineStatus.model_validate(e) for e in json.loads(row.engines)],
        replicas=[ReplicaStatus.model_validate(r) for r in json.loads(row.replicas)],
        first_seen=row.first_seen,
        last_seen=row.last_seen,
        instance=row.instance,
        cached=json.loads(row.cached),
    )


def _replica_row(row: sa.Row[Any]) -> ReplicaRow:
    return ReplicaRow(
        id=row.id,
        model=row.model,
        node=row.node,
        profile=row.profile,
        key=row.key,
        state=row.state,
        err=row.err,
        endpoint=row.endpoint,
        revision=row.revision,
        created_at=row.created_at,
        updated_at=row.updated_at,
        ready_at=row.ready_at,
        restarts=row.restarts,
        gpu_indexes=tuple(json.loads(row.gpu_indexes)),
        last_error=row.last_error,
        spec_hash=row.spec_hash,
    )


def _replica_values(r: ReplicaRow) -> dict[str, Any]:
    return {
        "id": r.id,
        "model": r.model,
        "node": r.node,
        "profile": r.profile,
        "key": r.key,
        "state": r.state,
        "err": r.err,
        "endpoint": r.endpoint,
        "revision": r.revision,
        "created_at": r.created_at,
        "updated_at": r.updated_at,
        "ready_at": r.ready_at,
        "restarts": r.restarts,
        "gpu_indexes": _dumps(list(r.gpu_indexes)),
        "last_error": r.last_error,
        "spec_hash": r.spec_hash,
    }
