"""The state database's schema (SQLAlchemy Core), shared by the state machine and snapshots.

A snapshot is a copy of this database, so both sides read the same tables: the state
machine to load one, the snapshot store to check that a downloaded copy is the version its
name claims.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

SCHEMA_VERSION = 1
HISTORY_OP_PUT = 1
HISTORY_OP_DELETE = 2

metadata = sa.MetaData()

entries = sa.Table(
    "entries",
    metadata,
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("value", sa.LargeBinary, nullable=False),
    sa.Column("content_type", sa.Text, nullable=False),
    sa.Column("mod_version", sa.Integer, nullable=False),
    sa.Column("create_version", sa.Integer, nullable=False),
    sqlite_with_rowid=False,
)

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
    sa.Index("history_key_version", "key", "version", "seq"),
    sqlite_with_rowid=False,
)

meta = sa.Table(
    "meta",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("schema_version", sa.Integer, nullable=False),
    sa.Column("applied_version", sa.Integer, nullable=False),
    sa.Column("applied_epoch", sa.Integer, nullable=False),
    sa.Column("oldest_version", sa.Integer, nullable=False),
    sa.CheckConstraint("id = 1", name="meta_single_row"),
)



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
