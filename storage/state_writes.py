"""The write path: committed batches applied to the state database, history pruned.

- Version N is the state after the record at offset N-1: a record at offset o produces
  version o+1, control batches only advance the version.
- Compares are evaluated here, at apply time, from the rows alone (storage/evaluator.py),
  so every replica that applies the same log reaches the same outcome.
- Apply works a whole call at a time: it decodes every record, takes every key it may touch
  from the key index (reading values in one query when needed), evaluates the commands in
  Python against that overlay, then writes the history rows (multi-row INSERTs) and the
  meta row with a handful of statements. That keeps per-record cost in Python, not in
  per-statement round trips. A call whose records are all plain PUTs (the common call)
  skips the command tuples and the evaluator: one loop, _apply_puts, gives the same
  results and rows.
- A value is stored once, in its history row, appended in version order. ``key_heads`` on
  disk is written behind apply, a slice of the keys in key order per call (see
  storage/state_heads_sweep.py), so an update costs no random B-tree write of its own
  (schema 3, see storage/state_schema.py); the new heads go into the in-memory index after
  the COMMIT.
- No call does work that grows with the store: the sweep's slice is proportional to the
  call's records, and a retention prune moves the horizon by at most
  APPLY_PRUNE_STEP_VERSIONS (or twice the call's versions): at a million keys each pruned
  version deletes a row on a page of its own.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import sqlalchemy as sa

from raft.types import Batch, check
from storage.commands import OpKind
from storage.evaluator import (
    HistoryRow,
    PutRecord,
    decode_call,
    evaluate_compact,
    keys_of,
)
from storage.key_index import Head
from storage.state_database import CHECKPOINT_EVERY_RECORDS, StateDatabase, compile_sql
from storage.state_heads_sweep import SweepStep
from storage.state_schema import (
    HISTORY_OP_DELETE,
    HISTORY_OP_PUT,
    KEY_HEADS_UPSERT_SQL,
    history,
    key_heads,
    meta,
)
from storage.state_types import (
    ApplyResult,
    Entry,
    StateDatabaseError,
    new_apply_result,
    new_entry,
    new_op_result,
)

HISTORY_ROWS_PER_STATEMENT = 100
# The value of an entry apply did not read (see _load_entries); never seen outside apply.
UNREAD_VALUE = b""
UNREAD_VALUE_TYPE = ""
# Versions one retention prune in apply moves the horizon by, at most (as the runtime's
# prune after a cleaning steps, storage/cleaning_run.py PRUNE_STEP_VERSIONS).
APPLY_PRUNE_STEP_VERSIONS = 100


class StateWrites(StateDatabase):
    """Apply, clear and prune_history: everything that writes rows (one writer at a time)."""

    def _prepare_statements(self) -> None:
        super()._prepare_statements()
        dialect = self._engine.dialect
        self._sql_history = compile_sql(
            history.insert().values(
                version=sa.bindparam("version"), seq=sa.bindparam("seq"), key=sa.bindparam("key"),
                op=sa.bindparam("op"), value=sa.bindparam("value"),
                content_type=sa.bindparam("content_type"),
                create_version=sa.bindparam("create_version"), lease=sa.bindparam("lease"),
                prev_version=sa.bindparam("prev_version"), prev_seq=sa.bindparam("prev_seq")),
            dialect,
        )
        head, values_word, row = self._sql_history.rpartition(" VALUES ")
        check(values_word == " VALUES " and row == "(" + ", ".join("?" * 10) + ")",
              "unexpected compiled history insert")
        # (the text up to VALUES, one row's parameters): fragments, so not a str "_sql_"
        # attribute (tests/storage/test_state_query_plans.py plans every such statement).
        self._sql_history_values_parts = (head + " VALUES ", row)
        self._sql_history_by_count: dict[int, str] = {}
        self._sql_meta = compile_sql(
            meta.update().where(meta.c.id == sa.literal_column("1")).values(
                applied_version=sa.bindparam("applied_version"),
                applied_epoch=sa.bindparam("applied_epoch"),
                oldest_version=sa.bindparam("oldest_version"),
                heads_version=sa.bindparam("heads_version")),
            dialect,
        )
        # The prune's statements (see _prune), each on the versions (?, ?].
        in_range = (history.c.version > sa.bindparam("oldest"), history.c.version <= sa.bindparam("horizon"))
        newer = history.alias("newer")
        self._sql_prune_superseded = compile_sql(history.delete().where(
            sa.tuple_(history.c.version, history.c.seq).in_(
                sa.select(newer.c.prev_version, newer.c.prev_seq).where(
                    newer.c.version > sa.bindparam("oldest"), newer.c.version <= sa.bindparam("horizon"),
                    newer.c.prev_version.is_not(None)))), dialect)
        deletes = (*in_range, history.c.op == sa.literal_column(str(HISTORY_OP_DELETE)))
        self._sql_prune_deletes = compile_sql(
            sa.select(history.c.key, history.c.version, history.c.seq).where(*deletes), dialect)
        self._sql_prune_delete_heads = compile_sql(
            key_heads.delete().where(key_heads.c.key == sa.bindparam("key")), dialect)
        self._sql_prune_delete_rows = compile_sql(history.delete().where(*deletes), dialect)
        # The compiled statements use pysqlite's qmark style; check the order we bind in.
        check([self._sql_history.count("?"), self._sql_meta.count("?"), self._sql_prune_superseded.count("?"),
               self._sql_prune_deletes.count("?"), self._sql_prune_delete_heads.count("?"),
               self._sql_prune_delete_rows.count("?")] == [10, 4, 2, 2, 1, 2],
              "unexpected compiled statement shape")

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
                self._sweep.reset({})
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
            puts, commands = decode_call(plan)
            index = self._index
            # BEGIN/COMMIT go straight to the DBAPI connection SQLAlchemy holds: through
            # exec_driver_sql they cost about as much as the rest of a one-record apply.
            writer_cursor = self._writer_cursor
            holding_publish_lock = False
            writer_cursor.execute("BEGIN IMMEDIATE")
            try:
                if commands is None:
                    # Every record a plain PUT (the common call): one loop, see _apply_puts.
                    get = index.get
                    known = {key: head for key in dict.fromkeys([put[1] for put in puts])
                             if (head := get(key)) is not None}
                    results, linked_rows = _apply_puts(puts, known)
                    new_heads = known
                else:
                    current, heads = self._load_entries(writer_cursor, *keys_of(commands))
                    results, history_rows = evaluate_compact(commands, current)
                    linked_rows, changed = (_link_history(history_rows, heads) if history_rows
                                            else ([], {}))
                    new_heads = {key: (0 if current[key] is None else current[key].create_version,  # type: ignore[union-attr]
                                       version, seq)
                                 for key, (version, seq) in changed.items()}
                if linked_rows:
                    self._insert_history(writer_cursor, linked_rows)
                oldest = self._oldest_version
                call_versions = end_version - applied_before
                heads_version = self._heads_version
                sweep: SweepStep | None = None
                if end_version - heads_version >= self.heads_flush_records:
                    sweep = self._sweep.step(index, new_heads, call_versions, applied_before, end_version)
                    if sweep.rows:
                        writer_cursor.executemany(KEY_HEADS_UPSERT_SQL, sweep.rows)
                    if sweep.heads_version is not None:
                        heads_version = sweep.heads_version
                horizon = self._retention_horizon(end_version, call_versions)
                forgotten: list[tuple[str, int, int]] = []
                if horizon is not None:
                    forgotten = self._prune(writer_cursor, oldest, horizon, new_heads)
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
            self._sweep.commit(sweep, new_heads)
            if forgotten:
                self._sweep.forget(key for key, _version, _seq in forgotten)
            try:
                with self._publish_lock:
                    index.update(new_heads)
                    if forgotten:
                        index.forget_deletes(forgotten)  # the heads the prune dropped
                    self._applied_version = end_version
                    self._applied_epoch = end_epoch
                    self._oldest_version = oldest
                    self._heads_version = heads_version
            finally:
                if holding_publish_lock:
                    self._publish_lock.release()
            self._count_for_checkpoint(end_version - applied_before)
            return results

    def _count_for_checkpoint(self, records: int) -> None:
        """Wake the checkpoint thread every CHECKPOINT_EVERY_RECORDS records written (or
        versions pruned): else the WAL reaches WAL_BACKSTOP_PAGES and the writer copies it
        back itself, inside a call."""
        self._records_since_checkpoint += records
        if self._checkpointer is not None and self._records_since_checkpoint >= CHECKPOINT_EVERY_RECORDS:
            self._records_since_checkpoint = 0
            self._checkpointer.wake()

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
                head, row = self._sql_history_values_parts
                sql = head + ",".join([row] * len(chunk))
                self._sql_history_by_count[len(chunk)] = sql
            cursor.execute(sql, [value for row in chunk for value in row])

    def _load_entries(self, cursor: sqlite3.Cursor, keys: Iterable[str], value_keys: set[str]
                      ) -> tuple[dict[str, Entry | None], dict[str, tuple[int, int]]]:
        """(key -> its current entry or None, for every key; key -> (version, seq) of its head,
        for keys that have one, deleted keys included).

        Only the entries of ``value_keys`` (a GET's, a VALUE compare's) hold their value,
        read from the heads' history rows; the others hold UNREAD_VALUE. The evaluator reads
        nothing else of an entry's value, and a value it writes is its own: a random row
        read per key (a page each, past the cache, in a large store) is saved for the keys
        that are only written or compared by version."""
        found: dict[str, Entry | None] = dict.fromkeys(keys)
        heads: dict[str, tuple[int, int]] = {}
        index_get = self._index.get
        puts: list[tuple[str, Head]] = []
        for key in found:
            head = index_get(key)
            if head is not None:
                heads[key] = (head[1], head[2])
                if head[0]:
                    if key in value_keys:
                        puts.append((key, head))
                    else:
                        found[key] = new_entry(key, UNREAD_VALUE, UNREAD_VALUE_TYPE, head[1], head[0])
        rows = self._rows_of(cursor, [head for _key, head in puts])
        for key, (create_version, version, seq) in puts:
            row = rows.get((version, seq))
            if row is None:
                raise StateDatabaseError(
                    f"{self.db_path}: the head of key {key!r} names history row ({version}, {seq}),"
                    " which is missing")
            value, content_type, lease = row
            found[key] = new_entry(key, value, content_type, version, create_version, lease or 0)
        return found, heads

    def _retention_horizon(self, applied_version: int, call_versions: int) -> int | None:
        """The horizon this call prunes to (None: no prune): toward ``applied_version -
        history_retention_versions`` once it lags by R/4 + 1, a bounded step at a time."""
        if self.history_retention_versions is None:
            return None
        horizon = applied_version - self.history_retention_versions
        slack_versions = self.history_retention_versions // 4 + 1
        if horizon - self._oldest_version < slack_versions:
            return None
        return min(horizon, self._oldest_version + max(APPLY_PRUNE_STEP_VERSIONS, 2 * call_versions))

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
            cursor = self._writer_cursor
            with self._publish_lock, self._write_transaction():
                forgotten = self._prune(cursor, self._oldest_version, horizon, {})
                cursor.execute(self._sql_meta, (self._applied_version, self._applied_epoch,
                                                horizon, self._heads_version))
            self._sweep.forget(key for key, _version, _seq in forgotten)
            with self._publish_lock:
                self._index.forget_deletes(forgotten)  # the heads the prune dropped
                pruned_versions = horizon - self._oldest_version
                self._oldest_version = horizon
            self._count_for_checkpoint(pruned_versions)

    def _prune(self, cursor: sqlite3.Cursor, oldest_version: int, horizon: int,
               new_heads: dict[str, Head]) -> list[tuple[str, int, int]]:
        """Move the horizon from ``oldest_version`` up to ``horizon``.

        Below the old horizon only each key's newest put at or below it is left (earlier
        prunes saw to that). Afterwards the same holds at ``horizon``: a row is superseded
        at the horizon exactly when a change of the same key in (oldest_version, horizon]
        names it as its previous one, so those go; then the deletes in that range, which
        are now each key's newest change at or below the horizon (a delete answers "absent"
        as well as no row does); a key whose head (``new_heads``, a call's not yet in the
        index, else the index's) is such a delete is forgotten, its key_heads row with it.
        Only rows in that range are scanned, by version. Returns the forgotten keys' heads
        (key, version, seq).
        """
        in_range = (oldest_version, horizon)
        cursor.execute(self._sql_prune_superseded, in_range)
        deleted: list[tuple[str, int, int]] = cursor.execute(self._sql_prune_deletes, in_range).fetchall()
        if not deleted:
            return []
        index_get = self._index.get
        forgotten = [(key, version, seq) for key, version, seq in deleted
                     if (new_heads.get(key) or index_get(key)) == (0, version, seq)]
        cursor.executemany(self._sql_prune_delete_heads, [(key,) for key, _version, _seq in forgotten])
        cursor.execute(self._sql_prune_delete_rows, in_range)
        return forgotten


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
    entry = new_entry(key, value, content_type, version, create_version)
    return new_apply_result(version - 1, version, True, (
        new_op_result(OpKind.PUT, key, create_version == version, False, entry),), ())


def _apply_puts(puts: list[PutRecord], known: dict[str, Head]
                ) -> tuple[PutResults, list[tuple[Any, ...]]]:
    """Apply plain PUT records to ``known`` (key -> Head for every key that has a head;
    updated in place, so a key written twice in the call links to its first write):
    their results (built when read, see PutResults) and their history rows, linked to
    each key's previous change.

    The same results and rows as evaluate_compact then _link_history give for these
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
            append_row((version, 0, key, history_put, value, content_type, version, None, None, None))
        else:
            # A put after a delete head creates the key again.
            create_version = previous[0] or version
            append_row((version, 0, key, history_put, value, content_type, create_version, None,
                        previous[1], previous[2]))
        known[key] = (create_version, version, 0)
    return PutResults(rows), rows


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


