"""The state machine's SQLite database: connections, schema, versions, the key index, close.

StateDatabase is the base the write path (storage/state_writes.py), the read path
(storage/state_reads.py) and snapshots (storage/state_snapshots.py) extend; StateMachine
(storage/state_machine.py) combines them. What they share lives here:

- The log is the source of truth. SQLite runs in WAL mode with ``synchronous=NORMAL``; the
  ``meta`` row holding ``applied_version`` is written in the same transaction as the changes
  it covers, so after a crash the runtime re-applies from ``applied_version``.
- Every key's head (its newest change) is kept in memory (storage/key_index.py); at open
  the index is loaded from ``key_heads`` and the history rows above ``meta.heads_version``,
  and apply writes the changed heads back behind itself (storage/state_heads_sweep.py).
- Two locks: the write lock (one writer call at a time) and the publish lock, which the
  writer holds only to publish a committed call and readers hold to take the version and
  the heads they answer at.
- Every thread gets its own SQLite connection (WAL lets readers run beside the one writer).
- Statements are built with SQLAlchemy Core; the few on the hot paths are compiled to SQL
  once and run on the DBAPI cursor of the SQLAlchemy connection, which skips SQLAlchemy's
  per-call parameter processing (see loadtest/bench_state_machine.py for the figures).
- WAL checkpoints run on a background thread, so apply never waits for their fsyncs.
"""

from __future__ import annotations

import logging
import os
import shlex
import sqlite3
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Self

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from raft.types import check
from storage.durable_files import fsync_directory
from storage.key_index import Head, HeadIndex
from storage.state_heads_sweep import HeadsSweep
from storage.state_schema import (
    COMPLETE_HEADS_VERSION_SQL,
    HISTORY_LEASE_INDEX_SQL,
    HISTORY_OP_PUT,
    KEY_HEADS_UPSERT_SQL,
    SCHEMA_VERSION,
    create_entries_view_sql,
    history,
    key_heads,
    meta,
    metadata,
    upgrade_schema,
)
from storage.state_types import StateDatabaseError

logger = logging.getLogger(__name__)

# SQLite's default limit on host parameters is 32766; stay far below it per IN (...) query.
KEY_LOOKUP_CHUNK_KEYS = 500
SQLITE_CACHE_KIB = 32 * 1024
SQLITE_BUSY_TIMEOUT_MS = 10_000
# Apply's sweep writes key_heads only while it lags this many records or more behind the
# applied version (storage/state_heads_sweep.py): a small store's pass is short, and letting
# its heads gather first writes each key fewer times. Larger means more history rows to
# read at open after a kill.
HEADS_FLUSH_RECORDS = 10_000
# Checkpoints (copying WAL pages back into the database, with an fsync) run on a background
# thread so that apply never waits for them; the thread is woken after this many records.
CHECKPOINT_EVERY_RECORDS = 2_000
# If the background thread falls behind, the writer checkpoints itself past this WAL size.
WAL_BACKSTOP_PAGES = 16_384


def compile_sql(statement: sa.ClauseElement, dialect: sa.Dialect) -> str:
    return str(statement.compile(dialect=dialect))


class StateDatabase:
    """The state database at ``db_path``, opened (created if new), with its key index.

    ``history_retention_versions=R``: apply prunes history itself to ``applied_version - R``
    (None: only prune_history does). ``background_checkpoint``: WAL checkpoints on a thread
    of their own. ``heads_flush_records``: how many records apply lets ``key_heads`` lag.
    """

    def __init__(self, db_path: str, *, history_retention_versions: int | None = None,
                 background_checkpoint: bool = True,
                 heads_flush_records: int = HEADS_FLUSH_RECORDS) -> None:
        check(history_retention_versions is None or history_retention_versions >= 0,
              "history_retention_versions must be >= 0")
        check(heads_flush_records >= 1, "heads_flush_records must be >= 1")
        self.db_path = os.path.abspath(db_path)
        self.history_retention_versions = history_retention_versions
        self.heads_flush_records = heads_flush_records
        self._write_lock = threading.Lock()
        # Held by the writer while it publishes a committed call (the index and the
        # versions), and by readers while they take the heads and the version they answer at.
        # A call that removes history rows (a prune, a snapshot load, clear) holds it from
        # before its COMMIT: a reader whose head's row went takes the head again and gets the
        # new one. Reentrant: such a call publishes inside it.
        self._publish_lock = threading.RLock()
        self._connections_lock = threading.Lock()
        self._connections: list[Connection] = []
        self._local = threading.local()
        self._closed = False
        self._engine = self._create_engine(self.db_path)
        try:
            self._writer = self._open_connection()
            self._create_schema()
            row = self._writer.execute(sa.select(meta)).one()
        except sa.exc.DBAPIError as exc:
            self._dispose()
            raise StateDatabaseError(
                f"{self.db_path}: cannot open the state database: {exc.orig}; the log is the source of truth: "
                f"with the node stopped, move {shlex.quote(self.db_path)} (and any {shlex.quote(self.db_path)}-wal "
                f"and -shm next to it) away and restart to rebuild it from the log") from exc
        except StateDatabaseError:
            self._dispose()
            raise
        self._applied_version: int = row.applied_version
        self._durable_version = 0  # the newest version sync() saw made durable
        self._applied_epoch: int = row.applied_epoch
        self._oldest_version: int = row.oldest_version
        self._heads_version: int = row.heads_version
        self._prepare_statements()
        # The writer's DBAPI connection and one cursor on it, reused by every apply call.
        self._writer_dbapi: sqlite3.Connection = self._writer.connection.driver_connection
        self._writer_cursor: sqlite3.Cursor = self._writer_dbapi.cursor()
        self._writer.exec_driver_sql(
            f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_PAGES if background_checkpoint else 1000}")
        self._records_since_checkpoint = 0
        self._index = HeadIndex()
        self._sweep = HeadsSweep()
        try:
            self._build_index()
        except BaseException:
            self._dispose()
            raise
        self._checkpointer: _Checkpointer | None = None
        if background_checkpoint:
            self._checkpointer = _Checkpointer(self._open_connection(), self.db_path)
            self._checkpointer.start()

    # ---- connections ---------------------------------------------------------------

    @staticmethod
    def _create_engine(db_path: str) -> Engine:
        uri = f"file:{urllib.parse.quote(db_path)}?mode=rwc"

        def connect() -> sqlite3.Connection:
            # isolation_level=None: no implicit BEGIN; transactions are explicit statements.
            return sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)

        engine = sa.create_engine("sqlite://", creator=connect, poolclass=NullPool)

        @sa.event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection: sqlite3.Connection, _record: object) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute(f"PRAGMA cache_size=-{SQLITE_CACHE_KIB}")
            cursor.execute("PRAGMA temp_store=MEMORY")
            cursor.close()

        return engine

    def _open_connection(self) -> Connection:
        connection = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        with self._connections_lock:
            self._connections.append(connection)
        return connection

    def _reader(self) -> Connection:
        """This thread's read connection (SQLite connections must not be shared by threads
        running at once)."""
        if self._closed:
            raise RuntimeError("state machine is closed")
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._open_connection()
            self._local.connection = connection
            self._local.cursor = connection.connection.driver_connection.cursor()
        return connection

    def _reader_cursor(self) -> sqlite3.Cursor:
        self._reader()
        return self._local.cursor

    @contextmanager
    def _write_transaction(self) -> Iterator[Connection]:
        """One write transaction on the writer's SQLAlchemy connection (as
        state_schema.write_transaction on a plain sqlite3 one)."""
        connection = self._writer
        connection.exec_driver_sql("BEGIN IMMEDIATE")
        try:
            yield connection
            connection.exec_driver_sql("COMMIT")
        except BaseException:
            # As in apply: SQLite may already have rolled back, and a failed COMMIT (a full
            # disk) may leave the transaction open, which would fail every later BEGIN.
            if connection.connection.driver_connection.in_transaction:
                connection.exec_driver_sql("ROLLBACK")
            raise

    def _create_schema(self) -> None:
        """Create the tables in a new file; refuse, changing nothing, a file of another schema."""
        with self._write_transaction() as connection:
            if sa.inspect(connection).has_table(meta.name):
                found = connection.exec_driver_sql("SELECT schema_version FROM meta").scalar()
                if found in (2, 3):
                    upgrade_schema(connection.connection.driver_connection, found)
                    found = SCHEMA_VERSION
                if found is not None and found != SCHEMA_VERSION:
                    raise StateDatabaseError(
                        f"{self.db_path}: schema version {found}, this code reads {SCHEMA_VERSION};"
                        " the log is the source of truth: move the file away and restart to"
                        " rebuild it from the log")
            metadata.create_all(connection)
            connection.exec_driver_sql(HISTORY_LEASE_INDEX_SQL)
            connection.exec_driver_sql(create_entries_view_sql(self._engine.dialect))
            if connection.execute(sa.select(meta.c.id)).first() is None:
                connection.execute(meta.insert().values(
                    id=1, schema_version=SCHEMA_VERSION, applied_version=0,
                    applied_epoch=0, oldest_version=0))

    def _prepare_statements(self) -> None:
        """Compile the statements this class runs; the write and read paths extend it."""
        dialect = self._engine.dialect
        # The values of many put heads, one text per count (see _rows_of): the heads as a
        # VALUES list CROSS JOINed to history, so SQLite walks the list and looks each row
        # up by primary key. "(version, seq) IN (VALUES ...)" was planned as a SCAN of
        # history: every call read the whole table (tests/storage/test_state_query_plans.py).
        rows_by_head = compile_sql(
            sa.select(history.c.version, history.c.seq, history.c.value, history.c.content_type,
                      history.c.lease),
            dialect)
        columns, from_word, table = " ".join(rows_by_head.split()).rpartition(" FROM ")
        check(from_word == " FROM " and table == "history", "unexpected compiled history select")
        self._sql_rows_by_head_parts = (
            columns + " FROM (VALUES ",
            ") AS wanted CROSS JOIN history"
            " ON history.version = wanted.column1 AND history.seq = wanted.column2")
        self._sql_rows_by_head: dict[int, str] = {}
        # Every head with what the index keeps of it; then the changes key_heads lacks.
        self._sql_all_heads = compile_sql(
            sa.select(key_heads.c.key, key_heads.c.mod_version, key_heads.c.mod_seq,
                      history.c.op, history.c.create_version)
            .select_from(key_heads.join(history, sa.and_(
                history.c.version == key_heads.c.mod_version, history.c.seq == key_heads.c.mod_seq))),
            dialect)
        self._sql_heads_tail = compile_sql(
            sa.select(history.c.key, history.c.version, history.c.seq, history.c.op,
                      history.c.create_version)
            .where(history.c.version > sa.bindparam("heads_version"))
            .order_by(history.c.version, history.c.seq),
            dialect)
        # The compiled statements use pysqlite's qmark style; check the order we bind in.
        check([statement.count("?") for statement in (
            self._sql_all_heads, self._sql_heads_tail, rows_by_head)]
            == [0, 1, 0], "unexpected compiled statement shape")

    # ---- properties ----------------------------------------------------------------

    @property
    def applied_version(self) -> int:
        return self._applied_version

    @property
    def applied_epoch(self) -> int:
        return self._applied_epoch

    @property
    def oldest_version(self) -> int:
        return self._oldest_version

    # ---- durability ----------------------------------------------------------------

    def sync(self) -> int:
        """Make every applied version durable; return the newest version known to be.

        SQLite runs with ``synchronous=NORMAL``: a commit reaches the WAL file without an
        fsync, so a power loss may take back the newest versions. That is harmless while the
        log holds every record above them (startup re-applies), but not once the log's prefix
        was cleaned: a replay from the middle of a cleaned prefix misses the deletes whose
        tombstones the cleaner dropped. So the runtime cleans only below the version this
        returns (docs/compaction.md rule 9).

        An fsync of the WAL file makes every commit written to it before the call durable;
        what a checkpoint copied into the main file was synced there by SQLite before the WAL
        could be reused. The main file is never opened here: closing any descriptor of it
        would drop the POSIX locks SQLite holds on it, and another process opening the
        database would then take itself for the last connection and delete the live WAL. No
        WAL file (someone removed it) proves nothing: the last known version is returned."""
        if self._closed:
            raise RuntimeError("state machine is closed")
        version = self._applied_version  # assigned only after its COMMIT returned
        try:
            fd = os.open(self.db_path + "-wal", os.O_RDONLY)
        except FileNotFoundError:
            return self._durable_version
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_directory(Path(self.db_path).parent)  # a WAL file created since the last sync
        self._durable_version = version
        return version

    def _build_index(self) -> None:
        """Load every key's head into the index (at open and after a snapshot load): the
        heads in key_heads, then the changes above ``heads_version`` in version order; the
        keys whose head that changed are the sweep's to write."""
        heads: dict[str, Head] = {}
        cursor = self._writer_cursor
        for key, version, seq, op, create_version in cursor.execute(self._sql_all_heads):
            heads[key] = (create_version if op == HISTORY_OP_PUT else 0, version, seq)
        in_table: dict[str, Head | None] = {}  # the row key_heads has, for the keys changed since
        for key, version, seq, op, create_version in cursor.execute(
                self._sql_heads_tail, (self._heads_version,)):
            if key not in in_table:
                in_table[key] = heads.get(key)
            heads[key] = (create_version if op == HISTORY_OP_PUT else 0, version, seq)
        self._sweep.reset({key: heads[key] for key, head in in_table.items() if heads[key] != head})
        with self._publish_lock:
            self._index.load(heads)

    def _rows_of(self, cursor: sqlite3.Cursor, heads: Sequence[Head]
                 ) -> dict[tuple[int, int], tuple[bytes, str, int | None]]:
        """(version, seq) -> (value, content_type, lease) of the history rows ``heads`` name
        (put heads); rows not found are left out."""
        rows: dict[tuple[int, int], tuple[bytes, str, int | None]] = {}
        for start in range(0, len(heads), KEY_LOOKUP_CHUNK_KEYS):
            chunk = heads[start:start + KEY_LOOKUP_CHUNK_KEYS]
            sql = self._sql_rows_by_head.get(len(chunk))
            if sql is None:
                head, tail = self._sql_rows_by_head_parts
                sql = head + ",".join(["(?,?)"] * len(chunk)) + tail
                self._sql_rows_by_head[len(chunk)] = sql
            for version, seq, value, content_type, lease in cursor.execute(
                    sql, [number for head in chunk for number in head[1:]]):
                rows[version, seq] = (value, content_type, lease)
        return rows

    # ---- lifecycle -----------------------------------------------------------------

    def close(self) -> None:
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
            if self._checkpointer is not None:
                self._checkpointer.stop()
            try:
                if self._heads_version < self._applied_version:
                    self._flush_on_close()
                # Leave a self-contained database file behind (empty WAL).
                self._writer.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                self._dispose()

    def _flush_on_close(self) -> None:
        """Bring key_heads up to date (the heads the sweep has not written, in key order),
        so the next open reads no history rows for it. A failure (a full disk) costs only
        that read: the database stays consistent."""
        try:
            with self._write_transaction():
                self._writer_cursor.executemany(KEY_HEADS_UPSERT_SQL, self._sweep.drain())
                self._writer_cursor.execute(COMPLETE_HEADS_VERSION_SQL)
        except (sqlite3.Error, sa.exc.DBAPIError) as exc:
            logger.warning("%s: key_heads not brought up to date at close (%s); the next open"
                           " reads them from the history rows", self.db_path, exc)

    def _dispose(self) -> None:
        with self._connections_lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.close()
        self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class _Checkpointer(threading.Thread):
    """Runs PASSIVE WAL checkpoints on its own connection when woken (see
    CHECKPOINT_EVERY_RECORDS); sqlite3 releases the GIL while it works."""

    def __init__(self, connection: Connection, db_path: str) -> None:
        super().__init__(name=f"checkpoint:{os.path.basename(db_path)}", daemon=True)
        self._connection = connection
        self._wake = threading.Event()
        self._stopping = False

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self.join()

    def run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            try:
                self._connection.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
            except sa.exc.DBAPIError:
                logger.exception("background WAL checkpoint failed; the writer's backstop applies")

