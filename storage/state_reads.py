"""The read path: get, list, entries_at (at the applied version or an older one) and changes.

Every read returns the version it answered at, and all of it is at that one version:
reads take the applied version and the heads they need from the key index, under the
publish lock the writer holds only to publish a committed call, then read the history rows
those heads name. Reads at an older version walk a key's changes back from its head
through the links each history row keeps to the key's previous change, in one read
transaction that also checks the rows are still retained. Watches (changes) scan history
by version.
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection

from raft.types import check
from storage.key_index import Head, prefix_upper_bound
from storage.state_database import StateDatabase, compile_sql
from storage.state_schema import HISTORY_OP_PUT, history, meta
from storage.state_types import (
    Entry,
    Event,
    StateDatabaseError,
    VersionCompactedError,
    VersionNotAppliedError,
    new_entry,
)

# A read whose head row was pruned between taking the head and reading the row takes the
# (newer) head again, and reads its row holding the publish lock, which every call that
# removes rows holds through its COMMIT (so it only makes that writer wait for one read):
# a row still missing then is a damaged database.
READ_ATTEMPTS = 2
_UNLOCKED = nullcontext()
MAX_LIST_LIMIT = 10_000
MAX_CHANGES_LIMIT = 100_000
# For statements that use one parameter twice: sqlite3 binds ":name" parameters from a dict.
_NAMED_DIALECT = sqlite_dialect.dialect(paramstyle="named")


class StateReads(StateDatabase):
    """The reads; any number of threads may read at once, beside the one writer."""

    def _prepare_statements(self) -> None:
        super()._prepare_statements()
        dialect = self._engine.dialect
        # The value of a put head, by the head's (version, seq).
        self._sql_row = compile_sql(
            sa.select(history.c.value, history.c.content_type, history.c.lease)
            .where(history.c.version == sa.bindparam("version"), history.c.seq == sa.bindparam("seq")),
            dialect,
        )
        # Which versions are readable, read inside a read transaction (see _check_retained).
        self._sql_meta_versions = compile_sql(
            sa.select(meta.c.applied_version, meta.c.oldest_version)
            .where(meta.c.id == sa.literal_column("1")), dialect)
        # One key as of a version, walking back from the head the index gave (named
        # parameters "key", "head_version", "head_seq" and "version").
        self._sql_key_at = compile_sql(
            _states_at_query(sa.select(
                sa.bindparam("key", type_=sa.Text).label("key"),
                sa.bindparam("head_version", type_=sa.Integer).label("version"),
                sa.bindparam("head_seq", type_=sa.Integer).label("seq"))),
            _NAMED_DIALECT,
        )
        # The compiled statements use pysqlite's qmark style; check the order we bind in.
        check([self._sql_row.count("?"), self._sql_meta_versions.count("?")] == [2, 0],
              "unexpected compiled statement shape")
        check("?" not in self._sql_key_at and ":head_version" in self._sql_key_at,
              "the at-version statement must use named parameters")

    @contextmanager
    def _read_transaction(self) -> Iterator[Connection]:
        """One read transaction: every statement inside sees the same committed version."""
        connection = self._reader()
        connection.exec_driver_sql("BEGIN")
        try:
            yield connection
        finally:
            connection.exec_driver_sql("COMMIT")

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
                return version, new_entry(key, row[0], row[1], head[1], head[0], row[2] or 0)
        raise self._missing_rows_error([key])

    def _current_row(self, cursor: sqlite3.Cursor, key: str
                     ) -> tuple[int, Head | None, tuple[bytes, str, int | None] | None]:
        """(applied version, the key's head if it is a put, that head's (value, content_type, lease);
        None for a row pruned since the head was taken)."""
        with self._publish_lock:
            version = self._applied_version
            head = self._index.get(key)
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
            heads = [(key, self._index.get(key)) for key in keys]
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
        return None if row is None else new_entry(*row)

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
                return version, [_current_entry(key, head, rows[head[1], head[2]]) for key, head in puts]
        raise self._missing_rows_error([key for key, _head in puts])

    def _current_rows(self, cursor: sqlite3.Cursor, prefix: str, after: str | None, limit: int
                      ) -> tuple[int, list[tuple[str, Head]], dict[tuple[int, int], tuple[bytes, str, int | None]]]:
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


def _check_version(version: int, applied_version: int, oldest_version: int) -> None:
    if version < oldest_version:
        raise VersionCompactedError(version, oldest_version)
    if version > applied_version:
        raise VersionNotAppliedError(version, applied_version)


def _event(row: Any) -> Event:
    if row.op == HISTORY_OP_PUT:
        return Event("put", row.key, row.version, row.value, row.content_type)
    # A delete row's content_type is its lease reason (NULL: an ordinary delete).
    return Event("delete", row.key, row.version, None, None, row.content_type)


def _current_entry(key: str, head: Head, row: tuple[bytes, str, int | None]) -> Entry:
    value, content_type, lease = row
    return new_entry(key, value, content_type, head[1], head[0], lease or 0)


def _states_at_query(heads: sa.Select[Any]) -> sa.Select[Any]:
    """Entries (key, value, content_type, mod_version, create_version, lease) as of the version
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
                  found.c.create_version, sa.func.coalesce(found.c.lease, sa.literal_column("0")))
        .select_from(chain.join(found, sa.and_(found.c.version == chain.c.version,
                                               found.c.seq == chain.c.seq)))
        .where(found.c.version <= sa.bindparam("version"),
               found.c.op == sa.literal_column(str(HISTORY_OP_PUT)))
    )


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
