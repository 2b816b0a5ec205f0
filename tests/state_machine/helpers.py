"""Shared builders for the state machine tests: batches of commands, and table dumps."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from raft.types import Batch, encode_control_record
from storage.commands import Command, encode_command


def data_batch(base_offset: int, commands: Sequence[Command | bytes], epoch: int = 1) -> Batch:
    records = tuple(c if isinstance(c, bytes) else encode_command(c) for c in commands)
    return Batch(base_offset, epoch, 0, False, records)


def control_batch(base_offset: int, epoch: int = 1) -> Batch:
    return Batch(base_offset, epoch, 0, True,
                 (encode_control_record("leader_change", leader_id=1, voters=[1]),))


def batches_for(commands: Sequence[Command | bytes], sizes: Sequence[int], epoch: int = 1) -> list[Batch]:
    """Split ``commands`` into consecutive data batches of the given sizes (the last takes
    the rest)."""
    batches: list[Batch] = []
    offset = 0
    for size in sizes:
        if offset >= len(commands):
            break
        batches.append(data_batch(offset, commands[offset:offset + size], epoch))
        offset += size
    if offset < len(commands):
        batches.append(data_batch(offset, commands[offset:], epoch))
    return batches


def dump_tables(db_path: str) -> dict[str, list[tuple[object, ...]]]:
    """Every row of every state table, in a fixed order (read with plain sqlite3)."""
    connection = sqlite3.connect(db_path)
    try:
        return {
            "entries": connection.execute("SELECT * FROM entries ORDER BY key").fetchall(),
            "key_heads": connection.execute("SELECT * FROM key_heads ORDER BY key").fetchall(),
            "history": connection.execute("SELECT * FROM history ORDER BY version, seq").fetchall(),
            "meta": connection.execute(
                "SELECT applied_version, applied_epoch, oldest_version FROM meta").fetchall(),
        }
    finally:
        connection.close()


# The schema-1 layout (before values moved out of the key table), to check that such a file
# is refused by name rather than read wrongly.
SCHEMA_1_TABLES = (
    "CREATE TABLE entries (key TEXT PRIMARY KEY, value BLOB NOT NULL, content_type TEXT NOT NULL,"
    " mod_version INTEGER NOT NULL, create_version INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE TABLE history (version INTEGER, seq INTEGER, key TEXT NOT NULL, op INTEGER NOT NULL,"
    " value BLOB, content_type TEXT, create_version INTEGER NOT NULL, PRIMARY KEY (version, seq))"
    " WITHOUT ROWID",
    "CREATE INDEX history_key_version ON history (key, version, seq)",
    "CREATE TABLE meta (id INTEGER PRIMARY KEY, schema_version INTEGER NOT NULL,"
    " applied_version INTEGER NOT NULL, applied_epoch INTEGER NOT NULL,"
    " oldest_version INTEGER NOT NULL, CONSTRAINT meta_single_row CHECK (id = 1))",
    "INSERT INTO entries VALUES ('a', x'31', 'application/octet-stream', 1, 1)",
    "INSERT INTO history VALUES (1, 0, 'a', 1, x'31', 'application/octet-stream', 1)",
    "INSERT INTO meta VALUES (1, 1, 1, 1, 0)",
)


def downgrade_to_schema(connection: sqlite3.Connection, version: int) -> None:
    """Make a database this code wrote look like one of schema ``version`` (2 or 3): what
    an older node (or its snapshot) hands this code."""
    connection.execute("DROP VIEW IF EXISTS entries")
    connection.execute("ALTER TABLE history DROP COLUMN key_version")
    if version == 2:
        connection.execute("ALTER TABLE meta DROP COLUMN heads_version")
    connection.execute(f"UPDATE meta SET schema_version = {version}")


def write_schema_1_database(path: str) -> None:
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in SCHEMA_1_TABLES:
            connection.execute(statement)
    finally:
        connection.close()


def table_names(path: str) -> list[str]:
    connection = sqlite3.connect(path)
    try:
        return sorted(row[0] for row in connection.execute("SELECT name FROM sqlite_master"))
    finally:
        connection.close()
