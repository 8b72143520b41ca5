"""The store's schema and its migrations: SQLAlchemy Core tables, dialect-neutral.

The same tables and the same ordered :data:`MIGRATIONS` serve every SQL backend (SQLite and
PostgreSQL): nothing here names a dialect but the one partial index, whose predicate SQLAlchemy
takes per dialect (:data:`GROUPED`, the same text for both). ``schema_migrations`` records the versions applied,
so opening twice applies nothing twice; a migration is appended, never edited or reordered once
released ("migrations, never delete the file").

The tables below are today's shape, for the store's queries. A migration never reads them for the
shape it creates: migration 1 creates its four tables from a frozen copy of their first shape
(:data:`_V1`; migration 7's ``api_keys``: :data:`_V7`; migration 10's ``gateway_load``:
:data:`_V10`), and each later migration creates its tables or adds its columns as they were when it
was written, so a fresh database goes through the same steps as one made by the first release, and
``test_store.py`` checks that the two end at today's tables. A column is added with SQLAlchemy's own
DDL (:func:`_add_column`: ``CreateColumn`` compiled for the connection's dialect).

Why not Alembic: it would add a dependency and a second version table (``alembic_version``) for
what ``MIGRATIONS`` already does in ~200 lines: an ordered list, applied once under the advisory
lock (PostgreSQL) in one transaction; its autogenerate, the part that saves work, compares a
database with the models, and ``test_store.py`` does that check here. The price is that a
migration's DDL is written by hand (frozen copies, :func:`_add_column`); revisit when a migration
needs what Alembic's batch mode gives (SQLite table rebuilds to drop or alter a column).

Tables: ``models`` (catalog entries as JSON), ``model_names`` (every name and alias a model answers
to, one owner each: migration 4), ``nodes``, ``replicas``, ``explanations``, ``gguf_facts``,
``node_certs`` and ``revoked_certs`` (migration 3), ``cp_leader`` and ``control_planes`` (migration 5:
leadership and membership of an HA cluster, :mod:`llmgw.control.reconcile.election`),
``log_requests`` (migration 6: engine-log reads that cross control planes,
:mod:`llmgw.control.api.logbroker`), ``api_keys``, ``usage_daily`` and ``rate_windows`` (migration 7:
the gateway's keys, usage and cluster-wide rate counts; ``api_keys.priority``: migration 9),
``gateway_load``, ``autoscale_decisions``, ``autoscale_history`` and ``replicas.draining_since``
(migration 10: autoscaling; ``gateway_load.arrived``: migration 13), ``changes`` (migration 12:
the leader's dirty marks; the partial index ``ix_replicas_grouped``: migration 15),
``schema_migrations``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.schema import CreateColumn

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
    # migration 11: protocol.state_digest of the last full heartbeat stored ("": none since)
    sa.Column("digest", sa.String(64), nullable=False, server_default=""),
)

#: The rows of ``replicas`` that are a group's (``members`` not empty), as SQL both dialects read the
#: same: the predicate of the partial index ``ix_replicas_grouped`` (migration 15), and the query
#: that finds a node's group replicas repeats it word for word so the planner may use the index.
GROUPED = "members != '[]'"

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
    sa.Column("members", sa.Text, nullable=False, server_default="[]"),  # migration 8: a group's nodes
    sa.Column("draining_since", sa.Float, nullable=True),  # migration 10: routed no more since; None: serving
    # migration 15: the replicas spread over several nodes (a few), for the node's own list
    # (sqlbeats.select_replicas): without it every heartbeat read scanned every replica.
    sa.Index("ix_replicas_grouped", "id", sqlite_where=sa.text(GROUPED), postgresql_where=sa.text(GROUPED)),
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

model_names_t = sa.Table(
    "model_names",  # migration 4: every name and alias a model answers to, each held by one model
    metadata,
    sa.Column("name", sa.String(253), primary_key=True),  # the uniqueness rule, kept by the database
    sa.Column("model", sa.String(63), nullable=False, index=True),  # the owner: models.name
)

cp_leader_t = sa.Table(
    "cp_leader",  # migration 5: one row (id 1): the leadership term, the fencing token
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("term", sa.BigInteger, nullable=False),  # bumped by every acquisition; 0: never led
    sa.Column("holder", sa.String(253), nullable=False),  # the leading control plane's name
    sa.Column("since", sa.Float, nullable=False),  # unix seconds of the acquisition
    sa.Column("renewed_at", sa.Float, nullable=False),  # unix seconds of the last renewal (a write)
)

control_planes_t = sa.Table(
    "control_planes",  # migration 5: every control plane sharing this database, upserted every few s
    metadata,
    sa.Column("name", sa.String(253), primary_key=True),
    sa.Column("agent_url", sa.String(300), nullable=False),
    sa.Column("last_seen", sa.Float, nullable=False),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("version", sa.String(64), nullable=False),
    sa.Column("node", sa.String(253), nullable=False, server_default=""),  # migration 14: its own node, or ""
)

log_requests_t = sa.Table(
    "log_requests",  # migration 6: engine-log reads in flight between control planes (kept ~1 min)
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # protocol.LogRequest.id
    sa.Column("node", sa.String(253), nullable=False, index=True),  # the node whose agent reads the file
    sa.Column("replica_id", sa.String(80), nullable=False),
    sa.Column("lines", sa.Integer, nullable=False),
    sa.Column("start", sa.BigInteger, nullable=True),  # LogRequest.offset (a byte); None: the last lines
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("handed_at", sa.Float, nullable=True),  # put in a heartbeat reply; None: not yet
    sa.Column("answered_at", sa.Float, nullable=True),  # the agent's LogReply stored; None: not yet
    sa.Column("text", sa.Text, nullable=False, server_default=""),
    sa.Column("next_offset", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("found", sa.Boolean, nullable=False, server_default=sa.true()),
)

api_keys_t = sa.Table(
    "api_keys",  # migration 7: gateway API keys (never the secret: its SHA-256 and first 16 characters)
    metadata,
    sa.Column("name", sa.String(63), primary_key=True),
    sa.Column("revision", sa.Integer, nullable=False),
    sa.Column("prefix", sa.String(16), nullable=False),
    sa.Column("digest", sa.String(64), nullable=False, unique=True),
    sa.Column("models", sa.Text, nullable=False),  # JSON list of names or aliases; [] = every model
    sa.Column("rpm", sa.Integer, nullable=True),
    sa.Column("tpm", sa.BigInteger, nullable=True),
    sa.Column("budget_tokens", sa.BigInteger, nullable=True),
    sa.Column("budget_period", sa.String(8), nullable=False),
    sa.Column("expires_at", sa.Float, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float, nullable=True),
    sa.Column("last_used_at", sa.Float, nullable=True),
    sa.Column("priority", sa.Integer, nullable=False, server_default="0"),  # migration 9: 0-9, 9 first
)

usage_daily_t = sa.Table(
    "usage_daily",  # migration 7: per key, model and UTC day, added to by every control plane
    metadata,
    sa.Column("key", sa.String(63), primary_key=True),
    sa.Column("model", sa.String(63), primary_key=True),
    sa.Column("day", sa.String(10), primary_key=True),  # YYYY-MM-DD
    sa.Column("requests", sa.BigInteger, nullable=False),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False),
    sa.Column("guard_blocks", sa.BigInteger, nullable=False),
    sa.Column("errors", sa.BigInteger, nullable=False),
)

rate_windows_t = sa.Table(
    "rate_windows",  # migration 7: per key, control plane and minute; pruned after ten minutes
    metadata,
    sa.Column("key", sa.String(63), primary_key=True),
    sa.Column("cp", sa.String(253), primary_key=True),
    sa.Column("window", sa.BigInteger, primary_key=True),  # unix seconds of the minute's start
    sa.Column("requests", sa.BigInteger, nullable=False),
    sa.Column("tokens", sa.BigInteger, nullable=False),
)

gateway_load_t = sa.Table(
    "gateway_load",  # migration 10: each control plane's gateway load per model, rewritten every second
    metadata,
    sa.Column("control_plane", sa.String(253), primary_key=True),
    sa.Column("model", sa.String(63), primary_key=True),
    sa.Column("in_flight", sa.Integer, nullable=False),  # requests sent to a replica, not yet answered
    sa.Column("queued", sa.Integer, nullable=False),  # requests waiting at the gateway for a slot
    sa.Column("replicas", sa.Text, nullable=False, server_default="{}"),  # {replica id: in flight}, where known
    sa.Column("at", sa.Float, nullable=False),  # unix seconds of the control plane's reading
    # migration 13: requests of the model that arrived since the control plane's previous reading
    sa.Column("arrived", sa.Integer, nullable=False, server_default="0"),
)

autoscale_decisions_t = sa.Table(
    "autoscale_decisions",  # migration 10: the leader's autoscaling decisions, the last ~100 per model
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("model", sa.String(63), nullable=False, index=True),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("from_n", sa.Integer, nullable=False),
    sa.Column("to_n", sa.Integer, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("panic", sa.Boolean, nullable=False, server_default=sa.false()),  # decided in panic mode
)

autoscale_history_t = sa.Table(
    "autoscale_history",  # migration 10: wanted, ready and load of autoscaled models, every 15 s for an hour
    metadata,
    sa.Column("model", sa.String(63), primary_key=True),
    sa.Column("at", sa.Float, primary_key=True),
    sa.Column("wanted", sa.Integer, nullable=False),
    sa.Column("ready", sa.Integer, nullable=False),
    sa.Column("load", sa.Float, nullable=False),  # requests in flight + queued, summed over control planes
)

changes_t = sa.Table(
    "changes",  # migration 12: what heartbeats and admin writes changed, for the leader's next pass
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("kind", sa.String(8), nullable=False),  # "node" or "model"
    sa.Column("key", sa.String(253), nullable=False),  # the node id or model name
    sa.Column("at", sa.Float, nullable=False),
)

migrations_t = sa.Table(
    "schema_migrations",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("applied_at", sa.Float, nullable=False),
)


_V1 = sa.MetaData()
"""Migration 1's four tables as the first release made them, frozen: never edit (a later shape
is a later migration)."""

sa.Table(
    "models", _V1,
    sa.Column("name", sa.String(63), primary_key=True),
    sa.Column("revision", sa.Integer, nullable=False),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)
sa.Table(
    "nodes", _V1,
    sa.Column("id", sa.String(253), primary_key=True),
    sa.Column("revision", sa.Integer, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("cordoned", sa.Boolean, nullable=False),
    sa.Column("labels", sa.Text, nullable=False),
    sa.Column("inventory", sa.Text, nullable=False),
    sa.Column("engines", sa.Text, nullable=False),
    sa.Column("replicas", sa.Text, nullable=False),
    sa.Column("first_seen", sa.Float, nullable=False),
    sa.Column("last_seen", sa.Float, nullable=False),
)
sa.Table(
    "replicas", _V1,
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
)
sa.Table(
    "explanations", _V1,
    sa.Column("model", sa.String(63), primary_key=True),
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)


_V7 = sa.MetaData()
"""Migration 7's ``api_keys`` as it made it, frozen when migration 9 added ``priority`` to today's
table: never edit."""

sa.Table(
    "api_keys", _V7,
    sa.Column("name", sa.String(63), primary_key=True),
    sa.Column("revision", sa.Integer, nullable=False),
    sa.Column("prefix", sa.String(16), nullable=False),
    sa.Column("digest", sa.String(64), nullable=False, unique=True),
    sa.Column("models", sa.Text, nullable=False),
    sa.Column("rpm", sa.Integer, nullable=True),
    sa.Column("tpm", sa.BigInteger, nullable=True),
    sa.Column("budget_tokens", sa.BigInteger, nullable=True),
    sa.Column("budget_period", sa.String(8), nullable=False),
    sa.Column("expires_at", sa.Float, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float, nullable=True),
    sa.Column("last_used_at", sa.Float, nullable=True),
)


_V5 = sa.MetaData()
"""Migration 5's ``control_planes`` as it made it, frozen when migration 14 added ``node`` to today's
table: never edit."""

sa.Table(
    "control_planes", _V5,
    sa.Column("name", sa.String(253), primary_key=True),
    sa.Column("agent_url", sa.String(300), nullable=False),
    sa.Column("last_seen", sa.Float, nullable=False),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("version", sa.String(64), nullable=False),
)

_V10 = sa.MetaData()
"""Migration 10's ``gateway_load`` as it made it, frozen when migration 13 added ``arrived`` to
today's table: never edit."""

sa.Table(
    "gateway_load", _V10,
    sa.Column("control_plane", sa.String(253), primary_key=True),
    sa.Column("model", sa.String(63), primary_key=True),
    sa.Column("in_flight", sa.Integer, nullable=False),
    sa.Column("queued", sa.Integer, nullable=False),
    sa.Column("replicas", sa.Text, nullable=False, server_default="{}"),
    sa.Column("at", sa.Float, nullable=False),
)


def _add_column(conn: Connection, table: str, column: sa.Column[object]) -> None:
    """``ALTER TABLE table ADD COLUMN <column>``, the column's specification (type, NOT NULL,
    server default) compiled by SQLAlchemy for ``conn``'s dialect (``CreateColumn``); ``column``
    is a fresh :class:`sqlalchemy.Column` written in the migration, never one of today's tables'."""
    sa.Table(table, sa.MetaData(), column)  # CreateColumn compiles a column that belongs to a table
    spec = CreateColumn(column).compile(dialect=conn.dialect)
    conn.exec_driver_sql(f"ALTER TABLE {conn.dialect.identifier_preparer.quote(table)} ADD COLUMN {spec}")


def _migration_1(conn: Connection) -> None:
    """The first schema: models, nodes, replicas, explanations (:data:`_V1`)."""
    _V1.create_all(conn, checkfirst=True)


def _migration_2(conn: Connection) -> None:
    """nodes.instance/cached, replicas.gpu_indexes/last_error/spec_hash, gguf_facts."""
    _add_column(conn, "nodes", sa.Column("instance", sa.String(64), nullable=False, server_default=""))
    _add_column(conn, "nodes", sa.Column("cached", sa.Text, nullable=False, server_default="[]"))
    _add_column(conn, "replicas", sa.Column("gpu_indexes", sa.Text, nullable=False, server_default="[]"))
    _add_column(conn, "replicas", sa.Column("last_error", sa.Text, nullable=False, server_default=""))
    _add_column(conn, "replicas", sa.Column("spec_hash", sa.String(64), nullable=False, server_default=""))
    gguf_facts_t.create(conn, checkfirst=True)


def _migration_3(conn: Connection) -> None:
    """node_certs (serials seen per node) and revoked_certs (the agent API's deny-list)."""
    node_certs_t.create(conn, checkfirst=True)
    revoked_certs_t.create(conn, checkfirst=True)


def _migration_4(conn: Connection) -> None:
    """``model_names``, so that a name or alias answers for one model by a PRIMARY KEY
    instead of a scan of every model at each write; filled from the rows already stored.

    The specs are read as plain JSON (``name``, ``aliases``), not as today's :class:`~llmgw.catalog.Model`:
    a migration must not depend on validation rules that change later, and a row that is not JSON
    at all (broken by hand) holds only its own name.

    Existing data never makes this migration fail. Every model keeps its own name (``models.name``
    is already unique); aliases are then claimed by the oldest model first (``created_at``, then
    name). An alias another model already holds (two models that raced each other before this
    table, or rows written by hand) is left unclaimed and logged: it stays in that model's spec,
    and the model's next update is refused with a :class:`~llmgw.control.store.base.Conflict`
    naming the owner, until the alias is removed from it.
    """
    model_names_t.create(conn, checkfirst=True)
    rows = conn.execute(
        sa.select(models_t.c.name, models_t.c.spec).order_by(models_t.c.created_at, models_t.c.name)
    ).all()
    owner: dict[str, str] = {row.name: row.name for row in rows}
    for row in rows:
        for alias in _spec_aliases(row.spec):
            held = owner.setdefault(alias, row.name)
            if held != row.name:
                log.warning(
                    "migration 4: alias '%s' of model '%s' is already a name or alias of model '%s'; "
                    "it is not reserved for '%s' (remove it from that model with 'llmgw ctl model')",
                    alias, row.name, held, row.name,
                )
    if owner:
        conn.execute(model_names_t.insert(), [{"name": n, "model": m} for n, m in sorted(owner.items())])


def _spec_aliases(spec: str) -> list[str]:
    """The ``aliases`` of a stored spec, read as plain JSON; [] when it has none readable."""
    try:
        aliases = json.loads(spec).get("aliases", [])
    except (ValueError, AttributeError):
        return []
    return [a for a in aliases if isinstance(a, str)] if isinstance(aliases, list) else []


def _migration_5(conn: Connection) -> None:
    """``cp_leader`` with its one row (term 0, no holder) and ``control_planes``."""
    cp_leader_t.create(conn, checkfirst=True)
    _V5.tables["control_planes"].create(conn, checkfirst=True)
    if conn.scalar(sa.select(sa.func.count()).select_from(cp_leader_t)) == 0:
        conn.execute(cp_leader_t.insert().values(id=1, term=0, holder="", since=0.0, renewed_at=0.0))


def _migration_6(conn: Connection) -> None:
    """``log_requests``: engine-log reads asked on one control plane and answered through another."""
    log_requests_t.create(conn, checkfirst=True)


def _migration_7(conn: Connection) -> None:
    """``api_keys`` (as :data:`_V7` froze it), ``usage_daily`` and ``rate_windows``: the gateway's
    stored keys, usage and cluster-wide rate counts (:mod:`llmgw.control.gateway.accounting`)."""
    for table in (_V7.tables["api_keys"], usage_daily_t, rate_windows_t):
        table.create(conn, checkfirst=True)


def _migration_8(conn: Connection) -> None:
    """``replicas.members``: the nodes of a replica spread over several (JSON list of
    :class:`~llmgw.protocol.GroupMember`, ``[]`` for one node)."""
    _add_column(conn, "replicas", sa.Column("members", sa.Text, nullable=False, server_default="[]"))


def _migration_9(conn: Connection) -> None:
    """``api_keys.priority``: the gateway queue's priority band of a key (0-9, higher served first;
    :mod:`llmgw.control.gateway.queue`); keys made before it are 0."""
    _add_column(conn, "api_keys", sa.Column("priority", sa.Integer, nullable=False, server_default="0"))


def _migration_10(conn: Connection) -> None:
    """Autoscaling: ``gateway_load`` (the signal every control plane writes), ``autoscale_decisions``
    (what the leader decided, and why), ``autoscale_history`` (the dashboard's plot) and
    ``replicas.draining_since`` (a replica leaving: routed no more, stopped once its requests
    finished; :mod:`llmgw.control.reconcile.drainer`)."""
    _V10.tables["gateway_load"].create(conn, checkfirst=True)
    autoscale_decisions_t.create(conn, checkfirst=True)
    autoscale_history_t.create(conn, checkfirst=True)
    _add_column(conn, "replicas", sa.Column("draining_since", sa.Float, nullable=True))


def _migration_11(conn: Connection) -> None:
    """``nodes.digest``: :func:`llmgw.protocol.state_digest` of the node's last full heartbeat,
    computed by the control plane; nodes stored before it hold "" (their agents' first pulse is
    answered ``send_full``)."""
    _add_column(conn, "nodes", sa.Column("digest", sa.String(64), nullable=False, server_default=""))


def _migration_12(conn: Connection) -> None:
    """``changes``: the nodes and models heartbeats and admin writes changed, read and deleted by the
    leader's next pass (:mod:`llmgw.control.store.sqlchanges`)."""
    changes_t.create(conn, checkfirst=True)


def _migration_13(conn: Connection) -> None:
    """``gateway_load.arrived``: the requests of a model each control plane saw arrive since its
    previous reading, so that scale to zero counts short requests (ones that start and end between
    two readings were never seen in flight); rows written before it hold 0."""
    _add_column(conn, "gateway_load", sa.Column("arrived", sa.Integer, nullable=False, server_default="0"))


def _migration_14(conn: Connection) -> None:
    """``control_planes.node``: the node on the control plane's own machine (its ``agent.yaml``'s
    ``node_id``), the one node whose ``llmgw.control-plane`` label is honoured
    (:mod:`llmgw.control.api.nodelabels`); rows written before it hold "" until their next write."""
    _add_column(conn, "control_planes", sa.Column("node", sa.String(253), nullable=False, server_default=""))


def _migration_15(conn: Connection) -> None:
    """``ix_replicas_grouped``: a partial index of the replicas spread over several nodes (:data:`GROUPED`),
    so that a node's list of replicas (every heartbeat's read) finds its group replicas without
    reading every row: at 20,000 replicas that scan was 3.0 of a pulse read's 3.8 ms (SQLite,
    2026-12-06). The same statement on SQLite and PostgreSQL (both have partial indexes)."""
    conn.exec_driver_sql(f"CREATE INDEX IF NOT EXISTS ix_replicas_grouped ON replicas (id) WHERE {GROUPED}")


#: Ordered ``(version, apply)`` pairs. Append new ones; never edit or reorder an applied one.
MIGRATIONS: list[tuple[int, Callable[[Connection], None]]] = [
    (1, _migration_1),
    (2, _migration_2),
    (3, _migration_3),
    (4, _migration_4),
    (5, _migration_5),
    (6, _migration_6),
    (7, _migration_7),
    (8, _migration_8),
    (9, _migration_9),
    (10, _migration_10),
    (11, _migration_11),
    (12, _migration_12),
    (13, _migration_13),
    (14, _migration_14),
    (15, _migration_15),
]


def migrate(conn: Connection) -> list[int]:
    """Apply the :data:`MIGRATIONS` not yet recorded in ``schema_migrations``, in ``conn``'s
    transaction; return their versions, ascending."""
    migrations_t.create(conn, checkfirst=True)
    done = set(conn.scalars(sa.select(migrations_t.c.version)))
    applied_now: list[int] = []
    for version, apply in MIGRATIONS:
        if version in done:
            continue
        apply(conn)
        conn.execute(migrations_t.insert().values(version=version, applied_at=time.time()))
        applied_now.append(version)
    return applied_now


