"""The state database's schema (SQLAlchemy Core), shared by the state machine and snapshots.

A snapshot is a copy of this database, so both sides read the same tables: the state
machine to load one, the snapshot store to check that a downloaded copy is the version its
name claims.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

# 2: values live only in ``history``; ``key_heads`` points at each key's newest change and
# every history row at the key's previous one (schema 1 had an ``entries`` table holding the
# values again and a (key, version) index on history: two random B-tree writes per update).
# 3: ``key_heads`` is written behind apply, a slice of keys at a time; ``meta.heads_version``
# says up to which version it is complete (the heads of later changes are in memory, and in
# their history rows). Schema 2 is upgraded in place (its ``key_heads`` is always complete).
# 4: ``history.lease``, the lease a put attached its key to (docs/leases.md), with a partial
# index so a lease's keys are found without a scan; schemas 2 and 3 are upgraded in place.
SCHEMA_VERSION = 4
HISTORY_OP_PUT = 1
HISTORY_OP_DELETE = 2

metadata = sa.MetaData()

# Each key's newest change (a put, or a delete kept until it falls below the horizon), every
# change above ``meta.heads_version`` aside: the only table keyed at random, so apply does
# not write it per change; the state machine keeps every key's head in memory and writes
# the changed ones behind apply in key order (storage/state_heads_sweep.py) and when it
# closes. A snapshot's copy is completed before it is published, so in a snapshot (and in
# a closed database) it holds every head.
key_heads = sa.Table(
    "key_heads",
    metadata,
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("mod_version", sa.Integer, nullable=False),
    sa.Column("mod_seq", sa.Integer, nullable=False),
    sqlite_with_rowid=False,
)

# Every change, appended in (version, seq) order (so appends fill the last pages), holding
# the value; (prev_version, prev_seq) names the same key's previous change (NULL: none), so
# a key's state at a version is found by walking back from its head.
history = sa.Table(
    "history",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    sa.Column("key", sa.Text, nullable=False),
    sa.Column("op", sa.Integer, nullable=False),
    sa.Column("value", sa.LargeBinary, nullable=True),
    sa.Column("content_type", sa.Text, nullable=True),
    sa.Column("create_version", sa.Integer, nullable=False),
    # A put's lease (NULL: none). A delete's content_type holds its lease reason, if any.
    # (Before prev_version here, so statements bind it in that order; ALTER TABLE appends it
    # to an upgraded table, which is the same to every statement: they name their columns.)
    sa.Column("lease", sa.Integer, nullable=True),
    sa.Column("prev_version", sa.Integer, nullable=True),
    sa.Column("prev_seq", sa.Integer, nullable=True),
    sqlite_with_rowid=False,
)
HISTORY_LEASE_INDEX_SQL = "CREATE INDEX IF NOT EXISTS history_lease ON history (lease) WHERE lease IS NOT NULL"

meta = sa.Table(
    "meta",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("schema_version", sa.Integer, nullable=False),
    sa.Column("applied_version", sa.Integer, nullable=False),
    sa.Column("applied_epoch", sa.Integer, nullable=False),
    sa.Column("oldest_version", sa.Integer, nullable=False),
    # key_heads lacks no change up to this version (it may hold newer heads too; see
    # storage/state_heads_sweep.py and complete_key_heads).
    sa.Column("heads_version", sa.Integer, nullable=False, server_default="0"),
    sa.CheckConstraint("id = 1", name="meta_single_row"),
)

# The current entries, as a view (not created by ``metadata.create_all``): readers of a
# state database or snapshot (the pipeline, tests) select from it as from a table.
view_metadata = sa.MetaData()
entries = sa.Table(
    "entries",
    view_metadata,
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("value", sa.LargeBinary, nullable=False),
    sa.Column("content_type", sa.Text, nullable=False),
    sa.Column("mod_version", sa.Integer, nullable=False),
    sa.Column("create_version", sa.Integer, nullable=False),
)


def entries_view_select() -> sa.Select[Any]:
    """The ``entries`` view's query: each key whose head is a put, with that put's value."""
    return sa.select(
        key_heads.c.key, history.c.value, history.c.content_type,
        key_heads.c.mod_version, history.c.create_version,
    ).select_from(key_heads.join(history, sa.and_(
        history.c.version == key_heads.c.mod_version, history.c.seq == key_heads.c.mod_seq,
    ))).where(history.c.op == HISTORY_OP_PUT)


def create_entries_view_sql(dialect: sa.Dialect) -> str:
    query = entries_view_select().compile(dialect=dialect, compile_kwargs={"literal_binds": True})
    return f"CREATE VIEW IF NOT EXISTS {entries.name} AS {query}"


# Set a key's row of key_heads (the rows apply's sweep writes, in key order).
_KEY_HEADS_ON_CONFLICT = (" ON CONFLICT (key) DO UPDATE SET mod_version = excluded.mod_version,"
                          " mod_seq = excluded.mod_seq")
KEY_HEADS_UPSERT_SQL = "INSERT INTO key_heads (key, mod_version, mod_seq) VALUES (?, ?, ?)" + _KEY_HEADS_ON_CONFLICT
# The heads of the changes above meta.heads_version, in key order (neighbouring rows share
# pages) and per key in (version, seq) order, so each key ends at its newest change; then
# key_heads is complete.
COMPLETE_KEY_HEADS_SQL = (
    "INSERT INTO key_heads (key, mod_version, mod_seq) SELECT key, version, seq FROM history"
    " WHERE version > (SELECT heads_version FROM meta WHERE id = 1) ORDER BY key, version, seq"
    + _KEY_HEADS_ON_CONFLICT)
COMPLETE_HEADS_VERSION_SQL = "UPDATE meta SET heads_version = applied_version WHERE id = 1"


# The schemas this code reads; 2 and 3 are upgraded in place (upgrade_schema) before use.
READABLE_SCHEMA_VERSIONS = (2, 3, SCHEMA_VERSION)


@contextmanager
def write_transaction(connection: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` on a connection opened with ``isolation_level=None``.
    Any failure rolls back, a failed COMMIT included (a full disk can leave the transaction
    open, and every later BEGIN on the connection would fail)."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield connection
        connection.execute("COMMIT")
    except BaseException:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        raise


def upgrade_schema(connection: sqlite3.Connection, found: int) -> None:
    """Make a database of schema ``found`` (2 or 3) the current schema, inside the caller's
    transaction. Schema 2 wrote key_heads in every apply call, so it is complete at the
    applied version; before schema 4 no key had a lease."""
    if found == 2:
        connection.execute("ALTER TABLE meta ADD COLUMN heads_version INTEGER NOT NULL DEFAULT 0")
        connection.execute("UPDATE meta SET heads_version = applied_version")
    if "lease" not in [row[1] for row in connection.execute("PRAGMA table_info(history)")]:
        connection.execute("ALTER TABLE history ADD COLUMN lease INTEGER")
    connection.execute(HISTORY_LEASE_INDEX_SQL)
    connection.execute(f"UPDATE meta SET schema_version = {SCHEMA_VERSION}")


def complete_key_heads(connection: sqlite3.Connection) -> None:
    """Bring ``key_heads`` of the database ``connection`` is open on up to its applied
    version, in one transaction (a snapshot's copy before it is published, a state
    database at close)."""
    with write_transaction(connection):
        connection.execute(COMPLETE_KEY_HEADS_SQL)
        connection.execute(COMPLETE_HEADS_VERSION_SQL)


@dataclass(frozen=True, slots=True)
class DatabaseMeta:
    schema_version: int
    applied_version: int
    applied_epoch: int
    oldest_version: int


class NotAStateDatabaseError(ValueError):
    """The file is not a state database (not SQLite, or no meta row)."""


def read_database_meta(database_path: str) -> DatabaseMeta:
    """Read the meta row of a state database file without writing anything next to it."""
    uri = f"file:{urllib.parse.quote(database_path)}?mode=ro&immutable=1"
    engine = sa.create_engine(
        "sqlite://", creator=lambda: sqlite3.connect(uri, uri=True), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            row = connection.execute(sa.select(
                meta.c.schema_version, meta.c.applied_version, meta.c.applied_epoch,
                meta.c.oldest_version).where(meta.c.id == 1)).first()
    except sa.exc.DBAPIError as exc:
        raise NotAStateDatabaseError(f"{database_path}: not a state database: {exc.orig}") from exc
    finally:
        engine.dispose()
    if row is None:
        raise NotAStateDatabaseError(f"{database_path}: no meta row")
    return DatabaseMeta(*row)
