"""The SQLite state machine: committed log batches in, rows readable at one version out.

Why it looks like this (docs/state-machine.md has the full contract):

- The log is the source of truth. SQLite runs in WAL mode with ``synchronous=NORMAL``; the
  ``meta`` row holding ``applied_version`` is written in the same transaction as the changes
  it covers, so after a crash the runtime re-applies from ``applied_version`` and gets the
  same rows (apply skips whatever is already applied).
- Version N is the state after the record at offset N-1: a record at offset o produces
  version o+1, control batches only advance the version.
- Compares are evaluated here, at apply time, from the rows alone, so every replica that
  applies the same log reaches the same outcome.
- Apply works a whole call at a time: it decodes every record, reads every key it may touch
  in one query, evaluates the commands in Python against that overlay, then writes the
  history rows (multi-row INSERTs), each key's new head and the meta row with a handful of
  statements. That keeps per-record cost in Python, not in per-statement round trips. A
  call whose records are all plain PUTs (the common call) skips the command tuples and
  the evaluator: one loop, _apply_puts, gives the same results and rows.
- A value is stored once, in its history row, appended in version order. Every key's head
  (its newest change) is kept in memory, in key order (``_HeadIndex``, the way etcd keeps
  its key index in memory over a store of revisions); ``key_heads`` on disk is written
  behind apply, HEADS_FLUSH_RECORDS records at a time, so an update costs no random B-tree
  write of its own (schema 3, see storage/state_schema.py). At open the index is loaded
  from ``key_heads`` and the history rows above ``meta.heads_version``.
- Reads take the applied version and the heads they need from memory, under a lock the
  writer holds only to publish a committed call, then read the history rows those heads
  name. Reads at an older version walk a key's changes back from its head through the
  links each history row keeps to the key's previous change, in one read transaction that
  also checks the rows are still retained.
- Every thread gets its own SQLite connection (WAL lets readers run beside the one writer).
- Statements are built with SQLAlchemy Core; the few on the hot paths are compiled to SQL
  once and run on the DBAPI cursor of the SQLAlchemy connection, which skips SQLAlchemy's
  per-call parameter processing (see loadtest/bench_state_machine.py for the figures).
"""

from __future__ import annotations

import itertools
import logging
import os
import shlex
import sqlite3
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import msgpack
import sqlalchemy as sa
from sortedcontainers import SortedList
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from raft.snapshots import CorruptSnapshotError
from raft.types import Batch, SnapshotId, check
from storage.commands import (
    COMMAND_VERSION,
    Command,
    CommandDecodeError,
    CompareKind,
    OpKind,
    decode_command,
)
from storage.durable_files import fsync_directory
from storage.snapshot_store import SnapshotStore, extract_database
from storage.state_schema import (
    COMPLETE_KEY_HEADS_SQL,
    HISTORY_OP_DELETE,
    HISTORY_OP_PUT,
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    NotAStateDatabaseError,
    complete_key_heads,
    create_entries_view_sql,
    history,
    key_heads,
    meta,
    metadata,
    read_database_meta,
    upgrade_schema_2,
    write_transaction,
)

logger = logging.getLogger(__name__)

# SQLite's default limit on host parameters is 32766; stay far below it per IN (...) query.
KEY_LOOKUP_CHUNK_KEYS = 500
SQLITE_CACHE_KIB = 32 * 1024
SQLITE_BUSY_TIMEOUT_MS = 10_000
# key_heads is brought up to date in the apply call that reaches this many records since it
# last was (one statement over the history rows since: each changed page written once for
# many updates). Larger means fewer page writes per record, a longer such call and more
# history rows to read at open after a kill.
HEADS_FLUSH_RECORDS = 10_000
# A read whose head row was pruned between taking the head and reading the row takes the
# (newer) head again, and reads its row holding the publish lock, which every call that
# removes rows holds through its COMMIT (so it only makes that writer wait for one read):
# a row still missing then is a damaged database.
READ_ATTEMPTS = 2
_UNLOCKED = nullcontext()
# Checkpoints (copying WAL pages back into the database, with an fsync) run on a background
# thread so that apply never waits for them; the thread is woken after this many records.
CHECKPOINT_EVERY_RECORDS = 2_000
# If the background thread falls behind, the writer checkpoints itself past this WAL size.
WAL_BACKSTOP_PAGES = 16_384
MAX_LIST_LIMIT = 10_000
HISTORY_ROWS_PER_STATEMENT = 100
_KEYS_PLACEHOLDER = "__[POSTCOMPILE_keys]"
MAX_CHANGES_LIMIT = 100_000

@dataclass(frozen=True, slots=True)
class Entry:
    key: str
    value: bytes
    content_type: str
    mod_version: int
    create_version: int


@dataclass(frozen=True, slots=True)
class Event:
    type: str  # "put" | "delete"
    key: str
    mod_version: int
    value: bytes | None
    content_type: str | None


@dataclass(frozen=True, slots=True)
class OpResult:
    kind: OpKind
    key: str
    created: bool
    deleted: bool
    entry: Entry | None  # GET: the entry read; PUT: the entry written; DELETE: None


@dataclass(frozen=True, slots=True)
class ApplyResult:
    offset: int
    version: int
    succeeded: bool
    ops: tuple[OpResult, ...]
    failed_compares: tuple[tuple[str, int], ...]  # (key, its current mod_version; 0 = missing)
    error: str | None = None  # the record did not decode and was applied as a no-op


def _builder_class(cls: type) -> type:
    """A plain class with exactly the slots of the frozen slotted dataclass ``cls``: an
    instance is filled with ordinary attribute stores, then its ``__class__`` is set to
    ``cls``. Python allows that assignment only between classes of the same layout (same
    base, same slots, no __dict__ or __weakref__ on either), and raises TypeError
    otherwise, so a field added to ``cls`` cannot silently leave a slot out of step."""
    return type(f"_{cls.__name__}Builder", (), {"__slots__": cls.__slots__})  # type: ignore[attr-defined]


# Apply builds an Entry, an OpResult and an ApplyResult per record. The __init__ a frozen
# dataclass gets sets each field through object.__setattr__ (a call per field); the
# builders below store the fields with plain attribute stores on a builder instance and
# then give it the dataclass's class: the same objects (these classes have no
# __post_init__, every field is set; tests/state_machine/test_apply.py checks equality,
# hash, repr and that they stay frozen) at about a quarter of the cost of setting the
# slots through their descriptors, and a sixth of the generated __init__ (timeit on the
# build machine: 0.9 against 3.9 µs for the three objects of one PUT record).
_EntryBuilder = _builder_class(Entry)
_OpResultBuilder = _builder_class(OpResult)
_ApplyResultBuilder = _builder_class(ApplyResult)


def _new_entry(key: str, value: bytes, content_type: str, mod_version: int, create_version: int) -> Entry:
    entry = _EntryBuilder()
    entry.key = key
    entry.value = value
    entry.content_type = content_type
    entry.mod_version = mod_version
    entry.create_version = create_version
    entry.__class__ = Entry
    return entry  # type: ignore[return-value]


def _new_op_result(kind: OpKind, key: str, created: bool, deleted: bool, entry: Entry | None) -> OpResult:
    result = _OpResultBuilder()
    result.kind = kind
    result.key = key
    result.created = created
    result.deleted = deleted
    result.entry = entry
    result.__class__ = OpResult
    return result  # type: ignore[return-value]


def _new_apply_result(offset: int, version: int, succeeded: bool, ops: tuple[OpResult, ...],
                      failed_compares: tuple[tuple[str, int], ...], error: str | None = None) -> ApplyResult:
    result = _ApplyResultBuilder()
    result.offset = offset
    result.version = version
    result.succeeded = succeeded
    result.ops = ops
    result.failed_compares = failed_compares
    result.error = error
    result.__class__ = ApplyResult
    return result  # type: ignore[return-value]


# The builders must set every field of their class (a slot left unset would make reading
# that field raise): checked once at import against the dataclasses' own constructors.
check(_new_apply_result(1, 2, True, (_new_op_result(OpKind.PUT, "k", True, False,
                                                    _new_entry("k", b"v", "t", 2, 2)),), (), None)
      == ApplyResult(1, 2, True, (OpResult(OpKind.PUT, "k", True, False, Entry("k", b"v", "t", 2, 2)),), (), None),
      "the result builders must set every field of the result dataclasses")


class VersionCompactedError(Exception):
    """The requested version is below the retained history (HTTP 410)."""

    def __init__(self, requested_version: int, oldest_version: int) -> None:
        super().__init__(
            f"version {requested_version} is compacted; the oldest available is {oldest_version}"
        )
        self.requested_version = requested_version
        self.oldest_version = oldest_version


class VersionNotAppliedError(ValueError):
    """at_version is above this replica's applied version (wait with min_version first)."""

    def __init__(self, requested_version: int, applied_version: int) -> None:
        super().__init__(
            f"version {requested_version} is not applied yet; this replica is at {applied_version}"
        )
        self.requested_version = requested_version
        self.applied_version = applied_version


class SnapshotRejectedError(ValueError):
    """create_snapshot's ``accept`` refused the copy; nothing was published."""


class StateDatabaseError(Exception):
    """state.db cannot be used (not a database, another schema): names the file. The log is
    the source of truth, so the way out is to move the file away and replay the log (or load
    a snapshot)."""


def prefix_upper_bound(prefix: str) -> str | None:
    """The smallest string above every string starting with ``prefix`` (None: no bound).

    SQLite compares TEXT by UTF-8 bytes, which orders like code points, so bumping the last
    code point gives an index-friendly range ``prefix <= key < bound``.
    """
    chars = list(prefix)
    while chars:
        last = ord(chars.pop())
        if last == 0x10FFFF:
            continue
        bumped = 0xE000 if last + 1 == 0xD800 else last + 1
        return "".join(chars) + chr(bumped)
    return None


def _key_range(column: sa.ColumnElement[Any], prefix: str, after: str | None) -> list[Any]:
    conditions: list[Any] = []
    if prefix:
        conditions.append(column >= prefix)
        upper = prefix_upper_bound(prefix)
        if upper is not None:
            conditions.append(column < upper)
    if after is not None:
        conditions.append(column > after)
    return conditions


def _compile(statement: sa.ClauseElement, dialect: sa.Dialect) -> str:
    return str(statement.compile(dialect=dialect))


# For statements that use one parameter twice: sqlite3 binds ":name" parameters from a dict.
_NAMED_DIALECT = sqlite_dialect.dialect(paramstyle="named")


class StateMachine:
    """Applies committed batches to ``db_path`` and answers versioned reads from it."""

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
        self._index = _HeadIndex()
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
    def _read_transaction(self) -> Iterator[Connection]:
        """One read transaction: every statement inside sees the same committed version."""
        connection = self._reader()
        connection.exec_driver_sql("BEGIN")
        try:
            yield connection
        finally:
            connection.exec_driver_sql("COMMIT")

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
                if found == 2:
                    upgrade_schema_2(connection.connection.driver_connection)
                    found = SCHEMA_VERSION
                if found is not None and found != SCHEMA_VERSION:
                    raise StateDatabaseError(
                        f"{self.db_path}: schema version {found}, this code reads {SCHEMA_VERSION};"
                        " the log is the source of truth: move the file away and restart to"
                        " rebuild it from the log")
            metadata.create_all(connection)
            connection.exec_driver_sql(create_entries_view_sql(self._engine.dialect))
            if connection.execute(sa.select(meta.c.id)).first() is None:
                connection.execute(meta.insert().values(
                    id=1, schema_version=SCHEMA_VERSION, applied_version=0,
                    applied_epoch=0, oldest_version=0))

    def _prepare_statements(self) -> None:
        dialect = self._engine.dialect
        # The value of a put head, by the head's (version, seq).
        self._sql_row = _compile(
            sa.select(history.c.value, history.c.content_type)
            .where(history.c.version == sa.bindparam("version"), history.c.seq == sa.bindparam("seq")),
            dialect,
        )
        # The same for many heads: "(version, seq) IN (VALUES (?, ?), ...)", one text per count.
        rows_by_head = _compile(
            sa.select(history.c.version, history.c.seq, history.c.value, history.c.content_type),
            dialect)
        self._sql_rows_by_head_prefix = rows_by_head + " WHERE (history.version, history.seq) IN (VALUES "
        self._sql_rows_by_head: dict[int, str] = {}
        self._sql_history = _compile(
            history.insert().values(
                version=sa.bindparam("version"), seq=sa.bindparam("seq"), key=sa.bindparam("key"),
                op=sa.bindparam("op"), value=sa.bindparam("value"),
                content_type=sa.bindparam("content_type"),
                create_version=sa.bindparam("create_version"),
                prev_version=sa.bindparam("prev_version"), prev_seq=sa.bindparam("prev_seq")),
            dialect,
        )
        head, values_word, row = self._sql_history.rpartition(" VALUES ")
        check(values_word == " VALUES " and row == "(" + ", ".join("?" * 9) + ")",
              "unexpected compiled history insert")
        self._sql_history_values_head = head + " VALUES "
        self._sql_history_values_row = row
        self._sql_history_by_count: dict[int, str] = {}
        self._sql_meta = _compile(
            meta.update().where(meta.c.id == sa.literal_column("1")).values(
                applied_version=sa.bindparam("applied_version"),
                applied_epoch=sa.bindparam("applied_epoch"),
                oldest_version=sa.bindparam("oldest_version"),
                heads_version=sa.bindparam("heads_version")),
            dialect,
        )
        self._sql_meta_versions = _compile(
            sa.select(meta.c.applied_version, meta.c.oldest_version)
            .where(meta.c.id == sa.literal_column("1")), dialect)
        # One key as of a version, walking back from the head the index gave (named
        # parameters "key", "head_version", "head_seq" and "version").
        self._sql_key_at = _compile(
            _states_at_query(sa.select(
                sa.bindparam("key", type_=sa.Text).label("key"),
                sa.bindparam("head_version", type_=sa.Integer).label("version"),
                sa.bindparam("head_seq", type_=sa.Integer).label("seq"))),
            _NAMED_DIALECT,
        )
        # Every head with what the index keeps of it; then the changes key_heads lacks.
        self._sql_all_heads = _compile(
            sa.select(key_heads.c.key, key_heads.c.mod_version, key_heads.c.mod_seq,
                      history.c.op, history.c.create_version)
            .select_from(key_heads.join(history, sa.and_(
                history.c.version == key_heads.c.mod_version, history.c.seq == key_heads.c.mod_seq))),
            dialect)
        self._sql_heads_tail = _compile(
            sa.select(history.c.key, history.c.version, history.c.seq, history.c.op,
                      history.c.create_version)
            .where(history.c.version > sa.bindparam("heads_version"))
            .order_by(history.c.version, history.c.seq),
            dialect)
        # The compiled statements use pysqlite's qmark style; check the order we bind in.
        check([statement.count("?") for statement in (
            self._sql_row, self._sql_history, self._sql_meta,
            self._sql_meta_versions, self._sql_all_heads, self._sql_heads_tail, rows_by_head)]
            == [2, 9, 4, 0, 0, 1, 0], "unexpected compiled statement shape")
        check("?" not in self._sql_key_at and ":head_version" in self._sql_key_at,
              "the at-version statement must use named parameters")

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

    def clear(self) -> None:
        """Drop every row and go back to version 0: the runtime rebuilds the state from a
        log that starts at offset 0 when this state fell behind the log's cleaned prefix."""
        with self._write_lock:
            if self._closed:
                raise RuntimeError("state machine is closed")
            with self._publish_lock:
                with self._write_transaction() as connection:
                    connection.execute(history.delete())
                    connection.execute(key_heads.delete())
                    connection.execute(meta.update().values(
                        applied_version=0, applied_epoch=0, oldest_version=0, heads_version=0))
                self._index.clear()
                self._applied_version = self._applied_epoch = self._oldest_version = 0
                self._heads_version = 0
            self._durable_version = 0

    # ---- apply ---------------------------------------------------------------------

    def apply(self, batches: Sequence[Batch]) -> Sequence[ApplyResult]:
        """Apply committed batches in one transaction; return results of non-control records.

        Records below ``applied_version`` are skipped, so replaying is a no-op. Offsets absent
        between batches (a cleaned log) are skipped too: the version moves to the end of the
        last batch. Any failure rolls the whole call back and leaves the versions unchanged.
        """
        with self._write_lock:
            if self._closed:
                raise RuntimeError("state machine is closed")
            plan, end_version, end_epoch = self._plan(batches)
            applied_before = self._applied_version
            if end_version == applied_before:
                return []
            puts, commands = _decode_call(plan)
            index = self._index
            # BEGIN/COMMIT go straight to the DBAPI connection SQLAlchemy holds: through
            # exec_driver_sql they cost about as much as the rest of a one-record apply.
            writer_cursor = self._writer_cursor
            holding_publish_lock = False
            writer_cursor.execute("BEGIN IMMEDIATE")
            try:
                if commands is None:
                    # Every record a plain PUT (the common call): one loop, see _apply_puts.
                    get = index.heads.get
                    known = {key: head for key in dict.fromkeys([put[1] for put in puts])
                             if (head := get(key)) is not None}
                    results, linked_rows = _apply_puts(puts, known)
                    new_heads = known
                else:
                    current, heads = self._load_entries(writer_cursor, _keys_of(commands))
                    results, history_rows = _evaluate_compact(commands, current)
                    linked_rows, changed = (_link_history(history_rows, heads) if history_rows
                                            else ([], {}))
                    new_heads = {key: (0 if current[key] is None else current[key].create_version,  # type: ignore[union-attr]
                                       version, seq)
                                 for key, (version, seq) in changed.items()}
                if linked_rows:
                    self._insert_history(writer_cursor, linked_rows)
                oldest = self._oldest_version
                horizon = self._retention_horizon(end_version)
                heads_version = self._heads_version
                if (horizon is not None
                        or end_version - heads_version >= self.heads_flush_records):
                    # Before a prune too: it drops the key_heads rows of the deletes it drops.
                    self._flush_heads(writer_cursor)
                    heads_version = end_version
                if horizon is not None:
                    self._prune(self._writer, oldest, horizon)
                    oldest = horizon
                writer_cursor.execute(self._sql_meta, (end_version, end_epoch, oldest, heads_version))
                if horizon is not None:  # the prune removes rows: see _publish_lock
                    self._publish_lock.acquire()
                    holding_publish_lock = True
                writer_cursor.execute("COMMIT")
            except BaseException:
                if holding_publish_lock:
                    self._publish_lock.release()
                # SQLite may already have rolled back (e.g. disk full); a failed COMMIT
                # leaves the transaction open. Either way nothing of this call stays (and
                # the index, changed only after a commit, still holds committed state).
                if self._writer_dbapi.in_transaction:
                    writer_cursor.execute("ROLLBACK")
                raise
            try:
                with self._publish_lock:
                    index.update(new_heads)
                    if horizon is not None:
                        index.forget_deletes_through(horizon)  # the heads the prune dropped
                    self._applied_version = end_version
                    self._applied_epoch = end_epoch
                    self._oldest_version = oldest
                    self._heads_version = heads_version
            finally:
                if holding_publish_lock:
                    self._publish_lock.release()
            self._records_since_checkpoint += end_version - applied_before
            if self._checkpointer is not None and self._records_since_checkpoint >= CHECKPOINT_EVERY_RECORDS:
                self._records_since_checkpoint = 0
                self._checkpointer.wake()
            return results

    @staticmethod
    def _flush_heads(cursor: sqlite3.Cursor) -> None:
        """Bring key_heads up to date inside the caller's write transaction (which then
        sets ``heads_version``): the history rows above ``heads_version``, this call's
        included, upserted in version order by one statement, the same one that completes
        a snapshot's copy. Building the rows in Python instead (the changed keys' heads
        from the index, sorted by key) cost ~1.5x as much per record in uniform updates."""
        cursor.execute(COMPLETE_KEY_HEADS_SQL)

    def _build_index(self) -> None:
        """Load every key's head into the index (at open and after a snapshot load): the
        heads in key_heads, then the changes above ``heads_version`` in version order."""
        heads: dict[str, Head] = {}
        cursor = self._writer_cursor
        for key, version, seq, op, create_version in cursor.execute(self._sql_all_heads):
            heads[key] = (create_version if op == HISTORY_OP_PUT else 0, version, seq)
        for key, version, seq, op, create_version in cursor.execute(
                self._sql_heads_tail, (self._heads_version,)):
            heads[key] = (create_version if op == HISTORY_OP_PUT else 0, version, seq)
        with self._publish_lock:
            self._index.load(heads)

    def _plan(self, batches: Sequence[Batch]) -> tuple[list[tuple[Batch, int]], int, int]:
        """Which batches (and from which record) to apply.

        Batches may leave gaps: a cleaned log keeps only each key's newest record, so the
        offsets of removed records are simply absent (they changed nothing that survives).
        """
        expected = self._applied_version
        epoch = self._applied_epoch
        plan: list[tuple[Batch, int]] = []
        for batch in batches:
            if batch.next_offset <= expected:
                continue
            plan.append((batch, max(0, expected - batch.base_offset)))
            expected = batch.next_offset
            epoch = batch.epoch
        return plan, expected, epoch

    def _insert_history(self, cursor: sqlite3.Cursor, rows: list[tuple[Any, ...]]) -> None:
        """Insert history rows, HISTORY_ROWS_PER_STATEMENT to a multi-row INSERT."""
        for start in range(0, len(rows), HISTORY_ROWS_PER_STATEMENT):
            chunk = rows[start:start + HISTORY_ROWS_PER_STATEMENT]
            if len(chunk) == 1:
                cursor.execute(self._sql_history, chunk[0])
                continue
            sql = self._sql_history_by_count.get(len(chunk))
            if sql is None:
                sql = self._sql_history_values_head + ",".join([self._sql_history_values_row] * len(chunk))
                self._sql_history_by_count[len(chunk)] = sql
            cursor.execute(sql, [value for row in chunk for value in row])

    def _load_entries(self, cursor: sqlite3.Cursor, keys: Iterable[str]
                      ) -> tuple[dict[str, Entry | None], dict[str, tuple[int, int]]]:
        """(key -> its current entry or None, for every key; key -> (version, seq) of its head,
        for keys that have one, deleted keys included). Values are read from the heads'
        history rows."""
        found: dict[str, Entry | None] = dict.fromkeys(keys)
        heads: dict[str, tuple[int, int]] = {}
        index_heads = self._index.heads
        puts: list[tuple[str, Head]] = []
        for key in found:
            head = index_heads.get(key)
            if head is not None:
                heads[key] = (head[1], head[2])
                if head[0]:
                    puts.append((key, head))
        rows = self._rows_of(cursor, [head for _key, head in puts])
        for key, (create_version, version, seq) in puts:
            row = rows.get((version, seq))
            if row is None:
                raise StateDatabaseError(
                    f"{self.db_path}: the head of key {key!r} names history row ({version}, {seq}),"
                    " which is missing")
            value, content_type = row
            found[key] = _new_entry(key, value, content_type, version, create_version)
        return found, heads

    def _rows_of(self, cursor: sqlite3.Cursor, heads: Sequence[Head]
                 ) -> dict[tuple[int, int], tuple[bytes, str]]:
        """(version, seq) -> (value, content_type) of the history rows ``heads`` name (put
        heads); rows not found are left out."""
        rows: dict[tuple[int, int], tuple[bytes, str]] = {}
        for start in range(0, len(heads), KEY_LOOKUP_CHUNK_KEYS):
            chunk = heads[start:start + KEY_LOOKUP_CHUNK_KEYS]
            sql = self._sql_rows_by_head.get(len(chunk))
            if sql is None:
                sql = self._sql_rows_by_head_prefix + ",".join(["(?,?)"] * len(chunk)) + ")"
                self._sql_rows_by_head[len(chunk)] = sql
            for version, seq, value, content_type in cursor.execute(
                    sql, [number for head in chunk for number in head[1:]]):
                rows[version, seq] = (value, content_type)
        return rows

    def _retention_horizon(self, applied_version: int) -> int | None:
        if self.history_retention_versions is None:
            return None
        horizon = applied_version - self.history_retention_versions
        slack_versions = self.history_retention_versions // 4 + 1
        if horizon - self._oldest_version < slack_versions:
            return None
        return horizon

    # ---- history horizon -----------------------------------------------------------

    def prune_history(self, below_version: int) -> None:
        """Raise ``oldest_version`` to ``min(below_version, applied_version)`` and drop the
        history no longer needed to answer at versions at or above it."""
        with self._write_lock:
            if self._closed:
                raise RuntimeError("state machine is closed")
            horizon = min(below_version, self._applied_version)
            if horizon <= self._oldest_version:
                return
            heads_version = self._applied_version
            with self._publish_lock, self._write_transaction() as connection:
                # key_heads complete first: the prune drops the rows of the deletes it drops.
                self._flush_heads(self._writer_cursor)
                self._prune(connection, self._oldest_version, horizon)
                connection.execute(meta.update().where(meta.c.id == 1).values(
                    oldest_version=horizon, heads_version=heads_version))
            with self._publish_lock:
                self._index.forget_deletes_through(horizon)  # the heads the prune dropped
                self._oldest_version = horizon
                self._heads_version = heads_version

    @staticmethod
    def _prune(connection: Connection, oldest_version: int, horizon: int) -> None:
        """Move the horizon from ``oldest_version`` up to ``horizon``.

        Below the old horizon only each key's newest put at or below it is left (earlier
        prunes saw to that). Afterwards the same holds at ``horizon``: a row is superseded
        at the horizon exactly when a change of the same key in (oldest_version, horizon]
        names it as its previous one, so those go; then the deletes in that range, which
        are now each key's newest change at or below the horizon (a delete answers "absent"
        as well as no row does), and with them the heads that point at them. Only rows in
        that range are scanned, by version.
        """
        in_range = (history.c.version > oldest_version, history.c.version <= horizon)
        newer = history.alias("newer")
        connection.execute(history.delete().where(
            sa.tuple_(history.c.version, history.c.seq).in_(
                sa.select(newer.c.prev_version, newer.c.prev_seq).where(
                    newer.c.version > oldest_version, newer.c.version <= horizon,
                    newer.c.prev_version.is_not(None)))))
        deleted = connection.execute(sa.select(history.c.key, history.c.version, history.c.seq).where(
            *in_range, history.c.op == HISTORY_OP_DELETE)).all()
        if deleted:
            connection.execute(
                key_heads.delete().where(key_heads.c.key == sa.bindparam("head_key"),
                                         key_heads.c.mod_version == sa.bindparam("head_version"),
                                         key_heads.c.mod_seq == sa.bindparam("head_seq")),
                [{"head_key": key, "head_version": version, "head_seq": seq}
                 for key, version, seq in deleted])
            connection.execute(history.delete().where(*in_range, history.c.op == HISTORY_OP_DELETE))

    # ---- reads ---------------------------------------------------------------------

    def get(self, key: str, at_version: int | None = None) -> tuple[int, Entry | None]:
        """(version answered at, the entry or None)."""
        cursor = self._reader_cursor()
        if at_version is not None:
            return at_version, self.entries_at([key], at_version)[key]
        for attempt in range(READ_ATTEMPTS):  # the second holding the lock, see READ_ATTEMPTS
            with self._publish_lock if attempt else _UNLOCKED:
                version, head, row = self._current_row(cursor, key)
            if head is None:
                return version, None
            if row is not None:
                return version, _new_entry(key, row[0], row[1], head[1], head[0])
        raise self._missing_rows_error([key])

    def _current_row(self, cursor: sqlite3.Cursor, key: str
                     ) -> tuple[int, Head | None, tuple[bytes, str] | None]:
        """(applied version, the key's head if it is a put, that head's (value, content_type);
        None for a row pruned since the head was taken)."""
        with self._publish_lock:
            version = self._applied_version
            head = self._index.heads.get(key)
        if head is None or not head[0]:
            return version, None, None
        return version, head, cursor.execute(self._sql_row, head[1:]).fetchone()

    def entries_at(self, keys: Sequence[str], version: int) -> dict[str, Entry | None]:
        """Every key's entry (None: absent) as of ``version``, in one read transaction.

        The cleaner uses it as its base state on a log that starts at a snapshot. Raises
        VersionCompactedError / VersionNotAppliedError when ``version`` is not readable.
        """
        cursor = self._reader_cursor()
        with self._publish_lock:
            _check_version(version, self._applied_version, self._oldest_version)
            heads = [(key, self._index.heads.get(key)) for key in keys]
        cursor.execute("BEGIN")
        try:
            found = {key: self._entry_at(cursor, key, head, version) for key, head in heads}
            if None in found.values():
                # A walk that found a row read the key's state at ``version`` (history rows
                # and their links never change); one that found none may have met a row a
                # prune (or clear) dropped since the heads were taken.
                self._check_retained(cursor, version)
        finally:
            cursor.execute("COMMIT")
        return found

    def _check_retained(self, cursor: sqlite3.Cursor, version: int) -> None:
        """In a read transaction that walked heads taken earlier: raise VersionCompactedError
        if a prune since then moved the horizon above ``version`` (the walks may then have
        missed rows it dropped), and VersionNotAppliedError if a clear since then took the
        state back below ``version`` (the walks then found none of its rows)."""
        applied_version, oldest_version = cursor.execute(self._sql_meta_versions).fetchone()
        _check_version(version, applied_version, oldest_version)

    def _entry_at(self, cursor: sqlite3.Cursor, key: str, head: Head | None, version: int) -> Entry | None:
        """The key as of ``version``: walking back from its head, the first change at or
        below ``version``, if that is a put (see docs/state-machine.md, Schema). No head:
        never written, or its delete fell below the horizon; either way absent."""
        if head is None:
            return None
        row = cursor.execute(self._sql_key_at, {
            "key": key, "head_version": head[1], "head_seq": head[2], "version": version}).fetchone()
        return None if row is None else _new_entry(*row)

    def _missing_rows_error(self, keys: Sequence[str]) -> StateDatabaseError:
        return StateDatabaseError(
            f"{self.db_path}: the history rows the heads of {list(keys)[:3]!r} name stay missing"
            " when read holding the publish lock; the log is the source of truth: move the file away"
            " and restart to rebuild it from the log")

    def list(self, prefix: str, *, after: str | None = None, limit: int = 100,
             at_version: int | None = None) -> tuple[int, list[Entry], str | None]:
        """(version, entries under ``prefix`` after ``after`` in key order, next key or None)."""
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise ValueError(f"limit must be between 1 and {MAX_LIST_LIMIT}")
        cursor = self._reader_cursor()
        if at_version is None:
            version, rows = self._list_current(cursor, prefix, after, limit + 1)
        else:
            version = at_version
            rows = self._list_at_version(cursor, prefix, after, limit + 1, at_version)
        found = rows[:limit]
        next_key = found[-1].key if len(rows) > limit else None
        return version, found, next_key

    def _list_current(self, cursor: sqlite3.Cursor, prefix: str, after: str | None, limit: int
                      ) -> tuple[int, list[Entry]]:
        """(applied version, up to ``limit`` entries under ``prefix`` after ``after``)."""
        for attempt in range(READ_ATTEMPTS):  # the second holding the lock, see READ_ATTEMPTS
            with self._publish_lock if attempt else _UNLOCKED:
                version, puts, rows = self._current_rows(cursor, prefix, after, limit)
            if len(rows) == len(puts):
                return version, [_new_entry(key, *rows[head[1], head[2]], head[1], head[0])
                                 for key, head in puts]
        raise self._missing_rows_error([key for key, _head in puts])

    def _current_rows(self, cursor: sqlite3.Cursor, prefix: str, after: str | None, limit: int
                      ) -> tuple[int, list[tuple[str, Head]], dict[tuple[int, int], tuple[bytes, str]]]:
        """(applied version, up to ``limit`` (key, put head) under ``prefix`` after ``after``,
        their rows by (version, seq); rows pruned since the heads were taken are missing)."""
        with self._publish_lock:
            version = self._applied_version
            puts: list[tuple[str, Head]] = []
            for key, head in self._index.range(prefix, after):
                if head[0]:
                    puts.append((key, head))
                    if len(puts) == limit:
                        break
        cursor.execute("BEGIN")
        try:
            rows = self._rows_of(cursor, [head for _key, head in puts])
        finally:
            cursor.execute("COMMIT")
        return version, puts, rows

    def _list_at_version(self, cursor: sqlite3.Cursor, prefix: str, after: str | None, limit: int,
                         version: int) -> list[Entry]:
        """Up to ``limit`` entries under ``prefix`` after ``after`` as of ``version``, in key
        order. Every key that existed at a version at or above the horizon still has a head
        (a delete stays one until it falls below the horizon), so walking the heads in key
        order finds them all. The heads are taken ``limit`` at a time, each page walked in
        a read transaction begun after its heads were taken (so it holds every row they
        name): the state at ``version`` does not change, only whether it is still retained,
        which each transaction checks."""
        with self._publish_lock:
            _check_version(version, self._applied_version, self._oldest_version)
        found: list[Entry] = []
        while len(found) < limit:
            with self._publish_lock:
                page = list(itertools.islice(self._index.range(prefix, after), limit))
            cursor.execute("BEGIN")
            try:
                for key, head in page:
                    entry = self._entry_at(cursor, key, head, version)
                    if entry is not None:
                        found.append(entry)
                        if len(found) == limit:
                            break
                self._check_retained(cursor, version)
            finally:
                cursor.execute("COMMIT")
            if len(page) < limit:
                break
            after = page[-1][0]
        return found

    def changes(self, prefix: str, since: int, limit: int = 1000) -> tuple[int, list[Event]]:
        """(version to watch from next, changes under ``prefix`` with mod_version > since)."""
        if not 1 <= limit <= MAX_CHANGES_LIMIT:
            raise ValueError(f"limit must be between 1 and {MAX_CHANGES_LIMIT}")
        if since < 0:
            raise ValueError("since must be >= 0")
        applied_version = self._applied_version
        if since >= applied_version >= self._oldest_version:
            return applied_version, []  # nothing newer can exist: no need to ask SQLite
        columns = (history.c.version, history.c.seq, history.c.key, history.c.op,
                   history.c.value, history.c.content_type)
        # Scan history in (version, seq) order from ``since`` and filter keys on the way:
        # watchers ask for what is new, so that scan touches only the newest rows and stops
        # at the limit. ("+key" keeps SQLite from ever preferring an index on key, should
        # history get one again: that reads every retained change under the prefix.)
        in_range = _key_range(sa.literal_column("+history.key"), prefix, None)
        with self._read_transaction() as connection:
            row = connection.execute(sa.select(meta.c.applied_version, meta.c.oldest_version)).one()
            if since < row.oldest_version:
                raise VersionCompactedError(since, row.oldest_version)
            version = row.applied_version
            rows = connection.execute(
                sa.select(*columns).where(history.c.version > since, *in_range)
                .order_by(history.c.version, history.c.seq).limit(limit + 1)
            ).all()
            if len(rows) > limit:
                last = rows[limit - 1]
                rows = rows[:limit]
                rows.extend(connection.execute(
                    sa.select(*columns).where(history.c.version == last.version,
                                              history.c.seq > last.seq, *in_range)
                    .order_by(history.c.seq)
                ).all())
                version = last.version
        return version, [_event(row) for row in rows]

    # ---- snapshots -----------------------------------------------------------------

    def create_snapshot(self, snapshot_dir: str | SnapshotStore, epoch: int | None = None,
                        accept: Callable[[SnapshotId], bool] | None = None) -> SnapshotId:
        """Copy the state at one applied version into ``snapshot_dir`` and publish it.

        The copy (VACUUM INTO) runs on a read connection, so apply is not blocked; the id is
        read from the copy itself, so it names exactly the version the copy holds. Pass the
        runtime's ``SnapshotStore`` instead of a directory to use its retention setting.
        ``accept`` sees the id before anything is published (retention may delete older
        snapshots then); a copy it refuses is thrown away (SnapshotRejectedError).
        """
        store = snapshot_dir if isinstance(snapshot_dir, SnapshotStore) else SnapshotStore(snapshot_dir)
        temp_path = store.new_temp_path()
        try:
            self._reader().exec_driver_sql("VACUUM INTO ?", (temp_path,))
            copy = sqlite3.connect(temp_path, isolation_level=None)
            try:
                complete_key_heads(copy)  # the heads apply had not written yet
            finally:
                copy.close()
            copy_meta = read_database_meta(temp_path)
            if copy_meta.applied_version == 0:
                raise ValueError("nothing applied yet: no snapshot of version 0")
            if epoch is not None and epoch != copy_meta.applied_epoch:
                raise ValueError(
                    f"snapshot at version {copy_meta.applied_version} has epoch "
                    f"{copy_meta.applied_epoch}, not {epoch}")
            snapshot_id = SnapshotId(copy_meta.applied_version, copy_meta.applied_epoch)
            if accept is not None and not accept(snapshot_id):
                raise SnapshotRejectedError(f"the state at version {snapshot_id.end_offset} is not a real version")
            store.publish_database(temp_path, snapshot_id)
            return snapshot_id
        finally:
            if os.path.exists(temp_path):
                os.unlink(temp_path)

    def load_snapshot(self, path: str) -> None:
        """Replace every row and the meta row by the snapshot's, in one transaction."""
        temp_path = f"{self.db_path}.snapshot-load.tmp"
        extract_database(path, temp_path)
        try:
            try:
                snapshot_meta = read_database_meta(temp_path)
            except NotAStateDatabaseError as exc:
                raise CorruptSnapshotError(f"{path}: {exc}") from exc
            if snapshot_meta.schema_version not in READABLE_SCHEMA_VERSIONS:
                raise CorruptSnapshotError(
                    f"{path}: schema version {snapshot_meta.schema_version}, this code reads {SCHEMA_VERSION}")
            if snapshot_meta.schema_version == 2:  # from a peer not yet upgraded
                copy = sqlite3.connect(temp_path, isolation_level=None)
                try:
                    with write_transaction(copy):
                        upgrade_schema_2(copy)
                finally:
                    copy.close()
            with self._write_lock:
                if self._closed:
                    raise RuntimeError("state machine is closed")
                with self._publish_lock:
                    self._replace_from(temp_path)
                    self._heads_version = self._writer_cursor.execute(
                        "SELECT heads_version FROM meta WHERE id = 1").fetchone()[0]
                    self._applied_version = snapshot_meta.applied_version
                    self._applied_epoch = snapshot_meta.applied_epoch
                    self._oldest_version = snapshot_meta.oldest_version
                    self._build_index()
                self._durable_version = 0  # a power loss may still take the load back
        finally:
            for suffix in ("", "-wal", "-shm", "-journal"):
                if os.path.exists(temp_path + suffix):
                    os.unlink(temp_path + suffix)

    def _replace_from(self, database_path: str) -> None:
        connection = self._writer
        uri = f"file:{urllib.parse.quote(database_path)}?mode=ro&immutable=1"
        connection.exec_driver_sql("ATTACH DATABASE ? AS snap", (uri,))
        try:
            snap = sa.MetaData(schema="snap")
            with self._write_transaction():
                for table in (key_heads, history, meta):
                    source = table.to_metadata(snap)
                    connection.execute(table.delete())
                    connection.execute(table.insert().from_select(
                        [column.name for column in table.columns], sa.select(source)))
        finally:
            connection.exec_driver_sql("DETACH DATABASE snap")

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
        """Bring key_heads up to date, so the next open reads no history rows for it. A
        failure (a full disk) costs only that read: the database stays consistent."""
        try:
            complete_key_heads(self._writer_dbapi)
        except sqlite3.Error as exc:
            logger.warning("%s: key_heads not brought up to date at close (%s); the next open"
                           " reads them from the history rows", self.db_path, exc)

    def _dispose(self) -> None:
        with self._connections_lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.close()
        self._engine.dispose()

    def __enter__(self) -> StateMachine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


# A key's head as the index keeps it: (create_version, head_version, head_seq), naming the
# key's newest history row; create_version is 0 when that change is a delete (the key is
# absent; the row stays a head until it falls below the horizon, since a later put links
# to it). For a put head the entry's mod_version is head_version. Only ints: the garbage
# collector untracks such a tuple the first time it sees it, so an index of a million keys
# adds nothing to the cost of a full collection.
Head = tuple[int, int, int]


class _HeadIndex:
    """Every key's head (key -> Head) and the keys in order.

    The writer changes it only after a commit, under the state machine's publish lock; a
    reader takes heads under that lock. It holds every key that has a head (no bound: like
    etcd's key index, the keys of a metadata store fit in memory; the values stay in
    SQLite). The heads are a plain dict and the order a separate SortedList that changes
    only when a key is created or forgotten: most calls only update heads, at dict speed.
    """

    def __init__(self) -> None:
        self.heads: dict[str, Head] = {}
        self.keys: SortedList = SortedList()
        # key -> version of its head, for the keys whose head is a delete.
        self._deletes: dict[str, int] = {}

    def clear(self) -> None:
        self.heads = {}
        self.keys = SortedList()
        self._deletes = {}

    def load(self, heads: dict[str, Head]) -> None:
        self.heads = heads
        self.keys = SortedList(heads)
        self._deletes = {key: head[1] for key, head in heads.items() if not head[0]}

    def update(self, new_heads: dict[str, Head]) -> None:
        """Record a committed call's new heads."""
        heads = self.heads
        created = [key for key in new_heads if key not in heads]
        heads.update(new_heads)
        if created:
            self.keys.update(created)
        deletes = self._deletes
        for key, head in new_heads.items():
            if not head[0]:
                deletes[key] = head[1]
            elif deletes:
                deletes.pop(key, None)

    def forget_deletes_through(self, version: int) -> None:
        """Drop the keys whose head is a delete at or below ``version`` (a prune to that
        horizon removed those heads; key_heads was brought up to date before it)."""
        deletes = self._deletes
        gone = [key for key, head_version in deletes.items() if head_version <= version]
        for key in gone:
            del deletes[key]
            del self.heads[key]
            self.keys.remove(key)

    def range(self, prefix: str, after: str | None) -> Iterator[tuple[str, Head]]:
        """(key, head) for the keys starting with ``prefix`` and above ``after``, in key
        order (code point order, which is SQLite's order of UTF-8 TEXT)."""
        heads = self.heads
        upper = prefix_upper_bound(prefix) if prefix else None
        if after is not None and after >= prefix:
            keys = self.keys.irange(after, upper, inclusive=(False, False))
        else:
            keys = self.keys.irange(prefix, upper, inclusive=(True, False))
        for key in keys:
            yield key, heads[key]


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


# The state machine's working form of a command: plain tuples, cheaper to build and read
# than the Command dataclasses, with the same content:
#   (((key, compare_kind, target), ...), ((op_kind, key, value, content_type, create_version), ...) x 2)
# (create_version is 0 except in a PUT the cleaner rewrote, see storage/commands.py)
CompactOp = tuple[int, str, bytes, str, int]
CompactCommand = tuple[tuple[tuple[str, int, Any], ...], tuple[CompactOp, ...], tuple[CompactOp, ...]]
_OP_KINDS = {int(kind): kind for kind in OpKind}
_PUT, _DELETE = int(OpKind.PUT), int(OpKind.DELETE)
_SIMPLE_OP_KINDS = frozenset(_OP_KINDS)


def decode_compact(record: bytes) -> CompactCommand:
    """Decode a record as ``storage.commands.decode_command`` does, into the compact form.

    The common record, one op and no compares, is recognised directly; any other shape goes
    through ``decode_command``, which accepts a superset of what the shortcut accepts and
    gives the same content for it, so both paths agree on every record.
    """
    try:
        value = msgpack.unpackb(record, raw=False)
    except Exception:  # decode_command below reports it the same way every time
        value = None
    if (type(value) is list and len(value) == 4 and type(value[0]) is int
            and value[0] == COMMAND_VERSION and type(value[1]) is list and not value[1]
            and type(value[2]) is list and len(value[2]) == 1 and type(value[3]) is list
            and not value[3]):
        op = value[2][0]
        if (type(op) is list and len(op) == 4 and type(op[0]) is int and op[0] in _SIMPLE_OP_KINDS
                and type(op[1]) is str and type(op[2]) is bytes and type(op[3]) is str):
            return (), ((op[0], op[1], op[2], op[3], 0),), ()
    return compact_command(decode_command(record))


def compact_command(command: Command) -> CompactCommand:
    return (
        tuple((c.key, int(c.kind), c.target) for c in command.compare),
        tuple((int(o.kind), o.key, o.value, o.content_type, o.create_version) for o in command.success),
        tuple((int(o.kind), o.key, o.value, o.content_type, o.create_version) for o in command.failure),
    )


# A plain PUT record as the all-puts path carries it: (offset, key, value, content_type).
PutRecord = tuple[int, str, bytes, str]


def _decode_call(plan: list[tuple[Batch, int]]
                 ) -> tuple[list[PutRecord], list[tuple[int, CompactCommand | str]] | None]:
    """Decode the records ``plan`` covers (control batches have none).

    While every record is a plain PUT (one put op, no compares, no failure ops, no
    create_version: exactly the records decode_compact returns as one PUT op) they are
    kept as PutRecords and ``(puts, None)`` is returned. At the first other record the
    PUTs so far become compact commands and the rest is decoded as decode_compact does:
    ``(puts, commands)``, commands holding every record (or its decode error) in order.
    """
    puts: list[PutRecord] = []
    append = puts.append
    unpackb = msgpack.unpackb
    for position, (batch, first_index) in enumerate(plan):
        if batch.control:
            continue
        records = batch.records
        base_offset = batch.base_offset
        for index in range(first_index, len(records)):
            try:
                value = unpackb(records[index], raw=False)
            except Exception:  # not msgpack: decode_compact reports it, below
                value = None
            if (type(value) is list and len(value) == 4 and type(value[0]) is int
                    and value[0] == COMMAND_VERSION and type(value[1]) is list and not value[1]
                    and type(value[2]) is list and len(value[2]) == 1 and type(value[3]) is list
                    and not value[3]):
                op = value[2][0]
                if (type(op) is list and len(op) == 4 and type(op[0]) is int and op[0] == _PUT
                        and type(op[1]) is str and type(op[2]) is bytes and type(op[3]) is str):
                    append((base_offset + index, op[1], op[2], op[3]))
                    continue
            commands: list[tuple[int, CompactCommand | str]] = [
                (offset, ((), ((_PUT, key, value, content_type, 0),), ()))
                for offset, key, value, content_type in puts]
            _decode_rest(plan, position, index, commands)
            return puts, commands
    return puts, None


def _decode_rest(plan: list[tuple[Batch, int]], position: int, index: int,
                 commands: list[tuple[int, CompactCommand | str]]) -> None:
    """Append (offset, command or decode error) to ``commands`` for every record from
    record ``index`` of ``plan[position]`` on."""
    for batch, first_index in plan[position:]:
        if batch.control:
            continue
        for record_index in range(max(first_index, index), len(batch.records)):
            offset = batch.base_offset + record_index
            try:
                commands.append((offset, decode_compact(batch.records[record_index])))
            except CommandDecodeError as exc:
                logger.warning("record at offset %d does not decode (%s); applied as a no-op",
                               offset, exc)
                commands.append((offset, f"record does not decode: {exc}"))
        index = 0


class PutResults(Sequence[ApplyResult]):
    """The results of a call of plain PUT records, built from its history rows when read.

    A PUT's result is its history row seen another way (created exactly when the row's
    create_version is its own version), so apply keeps the rows and builds an ApplyResult
    (with its OpResult and Entry) only when one is read. Most results never are: a
    follower's, and the leader's for records no client of this node waits for. Building
    them all cost ~1 µs per record plus the garbage collector's walks over thousands of
    young objects per call (gc on/off, 1000-record calls: up to 1.5x the apply rate).
    """

    __slots__ = ("_rows",)

    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> ApplyResult: ...

    @overload
    def __getitem__(self, index: slice) -> list[ApplyResult]: ...

    def __getitem__(self, index: int | slice) -> ApplyResult | list[ApplyResult]:
        if isinstance(index, slice):
            return [_put_result(row) for row in self._rows[index]]
        return _put_result(self._rows[index])

    def __iter__(self) -> Iterator[ApplyResult]:
        return map(_put_result, self._rows)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PutResults({list(self)!r})"


def _put_result(row: tuple[Any, ...]) -> ApplyResult:
    version, _seq, key, _op, value, content_type, create_version = row[:7]
    entry = _new_entry(key, value, content_type, version, create_version)
    return _new_apply_result(version - 1, version, True, (
        _new_op_result(OpKind.PUT, key, create_version == version, False, entry),), ())


def _apply_puts(puts: list[PutRecord], known: dict[str, Head]
                ) -> tuple[PutResults, list[tuple[Any, ...]]]:
    """Apply plain PUT records to ``known`` (key -> Head for every key that has a head;
    updated in place, so a key written twice in the call links to its first write):
    their results (built when read, see PutResults) and their history rows, linked to
    each key's previous change.

    The same results and rows as _evaluate_compact then _link_history give for these
    records (tests/state_machine/test_apply.py compares the two paths), in one loop over
    the records: per record this is most of apply's Python.
    """
    rows: list[tuple[Any, ...]] = []
    append_row = rows.append
    history_put = HISTORY_OP_PUT
    for offset, key, value, content_type in puts:
        version = offset + 1
        previous = known.get(key)
        if previous is None:  # no head: never written, or its delete was pruned
            create_version = version
            append_row((version, 0, key, history_put, value, content_type, version, None, None))
        else:
            # A put after a delete head creates the key again.
            create_version = previous[0] or version
            append_row((version, 0, key, history_put, value, content_type, create_version,
                        previous[1], previous[2]))
        known[key] = (create_version, version, 0)
    return PutResults(rows), rows


def _keys_of(commands: list[tuple[int, CompactCommand | str]]) -> set[str]:
    """Every key the commands may read or write (the common one-op command directly)."""
    keys: set[str] = set()
    add = keys.add
    for _offset, command in commands:
        if type(command) is str:
            continue
        compares, success, failure = command
        if not compares and not failure and len(success) == 1:
            add(success[0][1])
        else:
            keys.update(_command_keys(command))
    return keys


def _command_keys(command: CompactCommand) -> Iterator[str]:
    compares, success, failure = command
    for compare in compares:
        yield compare[0]
    for op in success:
        yield op[1]
    for op in failure:
        yield op[1]


def _compare_holds(kind: int, target: int | bool | bytes, entry: Entry | None) -> bool:
    if kind == CompareKind.MOD_VERSION:
        return (0 if entry is None else entry.mod_version) == target
    if kind == CompareKind.EXISTS:
        return (entry is not None) == target
    return entry is not None and entry.value == target


# The cleaner (storage/cleaner.py) evaluates with these, so it and apply agree on every record.
compare_holds = _compare_holds
command_keys = _command_keys

HistoryRow = tuple[int, int, str, int, bytes | None, str | None, int]


def evaluate_commands(
    commands: Sequence[tuple[int, Command | str]], state: dict[str, Entry | None]
) -> list[ApplyResult]:
    """The apply evaluator on its own: run ``(offset, command or decode error)`` pairs against
    ``state`` (key -> Entry or None, holding every key the commands name; updated in place)
    exactly as apply does, without touching a database. Used by the cleaner."""
    return _evaluate_compact(
        [(offset, command if isinstance(command, str) else compact_command(command))
         for offset, command in commands], state)[0]


def _evaluate_compact(
    commands: list[tuple[int, CompactCommand | str]], state: dict[str, Entry | None]
) -> tuple[list[ApplyResult], list[HistoryRow]]:
    """Run the commands against ``state`` (updated in place); pure and deterministic.

    Returns the results and the history rows (every change, in (version, seq) order).
    """
    results: list[ApplyResult] = []
    history_rows: list[HistoryRow] = []
    append_result = results.append
    append_history = history_rows.append
    for offset, command in commands:
        version = offset + 1
        seq = 0  # position of a change within its record: the same on every replica
        if isinstance(command, str):
            append_result(_new_apply_result(offset, version, False, (), (), command))
            continue
        compares, success, failure = command
        if not compares and len(success) == 1 and success[0][0] == _PUT:
            # The common record, one unconditional PUT: the loop below without its branches.
            _kind, key, value, content_type, op_create_version = success[0]
            previous = state[key]
            create_version = op_create_version or (
                version if previous is None else previous.create_version)
            entry = _new_entry(key, value, content_type, version, create_version)
            state[key] = entry
            append_history((version, 0, key, HISTORY_OP_PUT, value, content_type, create_version))
            append_result(_new_apply_result(
                offset, version, True, (_new_op_result(OpKind.PUT, key, previous is None, False, entry),), ()))
            continue
        failed: tuple[tuple[str, int], ...] = ()
        if compares:
            failed = tuple(
                (key, 0 if state[key] is None else state[key].mod_version)  # type: ignore[union-attr]
                for key, kind, target in compares if not _compare_holds(kind, target, state[key]))
        op_results: list[OpResult] = []
        for kind, key, value, content_type, op_create_version in failure if failed else success:
            previous = state[key]
            if kind == _PUT:
                # A cleaned record restores the create_version of the records it replaced.
                create_version = op_create_version or (
                    version if previous is None else previous.create_version)
                entry = _new_entry(key, value, content_type, version, create_version)
                state[key] = entry
                append_history((version, seq, key, HISTORY_OP_PUT, value, content_type, create_version))
                seq += 1
                op_results.append(_new_op_result(_OP_KINDS[kind], key, previous is None, False, entry))
            elif kind == _DELETE:
                if previous is not None:
                    state[key] = None
                    append_history((version, seq, key, HISTORY_OP_DELETE, None, None,
                                    previous.create_version))
                    seq += 1
                op_results.append(_new_op_result(_OP_KINDS[kind], key, False, previous is not None, None))
            else:
                op_results.append(_new_op_result(_OP_KINDS[kind], key, False, False, previous))
        append_result(_new_apply_result(offset, version, not failed, tuple(op_results), failed))
    return results, history_rows


_NO_PREVIOUS = (None, None)


def _link_history(history_rows: list[HistoryRow], heads: dict[str, tuple[int, int]]
                  ) -> tuple[list[tuple[Any, ...]], dict[str, tuple[int, int]]]:
    """History rows with (prev_version, prev_seq) appended, and the new head (version, seq)
    of every key they change. ``heads`` holds each key's head before the call and is
    updated in place."""
    linked: list[tuple[Any, ...]] = []
    append = linked.append
    changed: dict[str, tuple[int, int]] = {}
    for row in history_rows:
        key = row[2]
        append(row + heads.get(key, _NO_PREVIOUS))  # type: ignore[operator]
        changed[key] = heads[key] = (row[0], row[1])
    return linked, changed


def _check_version(version: int, applied_version: int, oldest_version: int) -> None:
    if version < oldest_version:
        raise VersionCompactedError(version, oldest_version)
    if version > applied_version:
        raise VersionNotAppliedError(version, applied_version)


def _event(row: Any) -> Event:
    if row.op == HISTORY_OP_PUT:
        return Event("put", row.key, row.version, row.value, row.content_type)
    return Event("delete", row.key, row.version, None, None)


def _states_at_query(heads: sa.Select[Any]) -> sa.Select[Any]:
    """Entries (key, value, content_type, mod_version, create_version) as of the version
    bound to the parameter "version", for the keys whose heads ``heads`` selects as (key,
    version, seq): walk back from each head through (prev_version, prev_seq) while the row
    is newer than that version; the row reached is the key's state then if it is a put.
    A walk that ends (no previous change, or one pruned because it was a delete or
    superseded below the horizon) means the key was absent."""
    chain = heads.cte("chain", recursive=True)
    step = history.alias("step")
    chain = chain.union_all(
        sa.select(chain.c.key, step.c.prev_version, step.c.prev_seq)
        .select_from(chain.join(step, sa.and_(step.c.version == chain.c.version,
                                              step.c.seq == chain.c.seq)))
        .where(step.c.version > sa.bindparam("version")))
    found = history.alias("found")
    return (
        sa.select(chain.c.key, found.c.value, found.c.content_type, found.c.version,
                  found.c.create_version)
        .select_from(chain.join(found, sa.and_(found.c.version == chain.c.version,
                                               found.c.seq == chain.c.seq)))
        .where(found.c.version <= sa.bindparam("version"),
               found.c.op == sa.literal_column(str(HISTORY_OP_PUT)))
    )
