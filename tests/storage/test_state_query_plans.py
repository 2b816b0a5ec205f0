"""No state machine statement scans a table that grows with the data (issue 19).

Every SQL statement the state machine runs is captured through sqlite3's trace callback
(on every connection it opens, the snapshot copy's included) while apply, the reads, the
watch read, prune, snapshots, clear, close and open run on a populated store; then
``EXPLAIN QUERY PLAN`` of each is read on that store, and a full ``SCAN`` of ``history``
or ``key_heads`` (under any alias) fails the test. A statement added later is caught as
soon as a path runs it; a statement the state machine prepares but these paths never run
fails the test too (so its path gets exercised here).

The few statements that read a whole table by contract (loading the key index at open, a
snapshot load copying the snapshot's tables, clear) are listed in WHOLE_TABLE_STATEMENTS
with the reason; each must still be seen, so the list cannot rot.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterator

import pytest

from storage.commands import Command, Compare, CompareKind, Op, OpKind, delete, lease_key, put
from storage.snapshot_store import SnapshotStore
from storage.state_machine import StateMachine
from tests.state_machine.helpers import control_batch, data_batch

KEYS = 600
GROWING_TABLES = ("history", "key_heads")

# Statements allowed to read a whole table, by a pattern of their normalized text.
WHOLE_TABLE_STATEMENTS: dict[str, str] = {
    # The key index holds every key: opening a database (or loading a snapshot) reads
    # every head once.
    r"^SELECT key_heads\.\"?key\"?, key_heads\.mod_version, key_heads\.mod_seq, history\.op,"
    r" history\.create_version FROM key_heads JOIN history":
        "loading the key index reads every head",
    # load_snapshot replaces every row with the snapshot's.
    r"^INSERT INTO (main\.)?(history|key_heads|meta) .*FROM snap\.":
        "a snapshot load copies every row of the snapshot",
}

_LITERAL = re.compile(r"""x'[0-9a-fA-F]*'|'(?:[^']|'')*'|\b\d+(?:\.\d+)?\b|\bNULL\b|:\w+|\?""")
_REPEATED_TUPLE = re.compile(r"(\(\?(?:, ?\?)*\))(?:, ?\1)+")


def normalize(sql: str) -> str:
    """The statement's shape: literals and parameters as ``?``, a repeated row of a
    multi-row VALUES as one, whitespace collapsed."""
    shape = _LITERAL.sub("?", " ".join(sql.split()))
    return _REPEATED_TUPLE.sub(r"\1", shape)


def growing_table_names(sql: str) -> set[str]:
    """The names (the tables and their aliases) under which ``sql`` reads history or key_heads."""
    names: set[str] = set()
    for match in re.finditer(r"\b(?:FROM|JOIN|UPDATE|INTO)\s+(?:\w+\.)?(\w+)(?:\s+(?:AS\s+)?(\w+))?",
                             sql, re.IGNORECASE):
        table, alias = match.group(1), match.group(2)
        if table in GROWING_TABLES:
            names.add(table)
            if alias and alias.upper() not in {"WHERE", "ON", "JOIN", "SET", "ORDER", "GROUP",
                                               "LIMIT", "VALUES", "SELECT", "CROSS", "INNER",
                                               "LEFT", "DEFAULT"}:
                names.add(alias)
    return names


def full_scans(connection: sqlite3.Connection, sql: str) -> list[str]:
    """The plan lines of ``sql`` that scan history or key_heads whole."""
    names = growing_table_names(sql)
    scans = []
    for _id, _parent, _unused, detail in connection.execute("EXPLAIN QUERY PLAN " + sql):
        match = re.match(r"SCAN (?:\w+\.)?(\w+)", detail)
        if match and match.group(1) in names:
            scans.append(detail)
    return scans


@pytest.fixture()
def traced(monkeypatch) -> Iterator[list[str]]:
    """Every statement run on any sqlite3 connection opened while the test runs."""
    statements: list[str] = []
    real_connect: Callable[..., sqlite3.Connection] = sqlite3.connect

    def connect(*args: object, **kwargs: object) -> sqlite3.Connection:
        connection = real_connect(*args, **kwargs)
        connection.set_trace_callback(statements.append)  # expanded: values in place of ?
        return connection

    monkeypatch.setattr(sqlite3, "connect", connect)
    yield statements


def _txn(key: str, other: str, mod_version: int) -> Command:
    return Command(
        compare=(Compare(key, CompareKind.MOD_VERSION, mod_version),),
        success=(Op(OpKind.PUT, key, b"txn", "text/plain"), Op(OpKind.DELETE, other, b"", ""),
                 Op(OpKind.GET, key, b"", "")),
        failure=(Op(OpKind.GET, other, b"", ""),))


def _run_every_path(tmp_path) -> tuple[str, list[str]]:
    """Run every state machine path on a populated store; (a populated copy to plan on, the
    prepared statement templates)."""
    path = str(tmp_path / "state.db")
    state = StateMachine(path, heads_flush_records=250)
    offset = 0

    def apply(commands: list[Command | bytes]) -> None:
        nonlocal offset
        state.apply([data_batch(offset, commands)])
        offset += len(commands)

    apply([put(f"k/{index:05d}", b"v" * 40) for index in range(KEYS)])  # creates
    for round_number in range(3):  # updates: plain PUTs, and the general path
        apply([put(f"k/{index:05d}", b"u%d" % round_number) for index in range(0, KEYS, 2)])
        apply([delete(f"k/{index:05d}") for index in range(round_number, KEYS, 7)]
              + [_txn(f"k/{index:05d}", f"k/{index + 1:05d}", 0) for index in range(1, 60, 3)]
              + [b"\x93not a command"])
    state.apply([control_batch(offset)])
    offset += 1
    middle = state.applied_version // 2
    present = state.list("k/", limit=1)[1][0].key
    state.get(present)
    state.get(present, at_version=middle)
    state.get("absent")
    apply([Command((Compare(lease_key(1), CompareKind.EXISTS, False),), (Op(OpKind.PUT, lease_key(1), b"60"),)),
           Command((), (Op(OpKind.PUT, "k/leased", b"v", lease=1),))])
    state.lease(1)
    state.leases()
    state.list("k/", limit=100)
    state.list("k/", after="k/00100", limit=100, at_version=middle)
    state.changes("k/", middle, limit=50)
    state.changes("", 0, limit=100_000)
    state.entries_at([f"k/{index:05d}" for index in range(0, 50)], middle)
    state.prune_history(middle // 2)
    store = SnapshotStore(str(tmp_path / "snapshots"))
    snapshot_id = state.create_snapshot(store)
    templates = [value for name, value in vars(state).items()
                 if name.startswith("_sql_") and isinstance(value, str)]
    templates += [text for name, value in vars(state).items() if name.startswith("_sql_")
                  and isinstance(value, dict) for text in value.values()]
    state.close()  # writes key_heads behind
    state = StateMachine(path, history_retention_versions=200, heads_flush_records=250)
    # Apply with a retention: apply prunes in its own transaction.
    for _round in range(4):
        apply([put(f"k/{index:05d}", b"r") for index in range(0, KEYS, 3)]
              + [delete(f"k/{index:05d}") for index in range(1, KEYS, 11)])
    state.close()
    state = StateMachine(path)  # opens with key_heads behind: reads the tail of history
    state.close()
    plan_copy = str(tmp_path / "plan.db")
    with StateMachine(str(tmp_path / "other.db")) as other:
        other.apply([data_batch(0, [put("x", b"1")])])
        other.load_snapshot(store.path_for(snapshot_id))
        other.create_snapshot(str(tmp_path / "more"))
        other.clear()
    with sqlite3.connect(path) as source, sqlite3.connect(plan_copy) as copy:
        source.backup(copy)
    return plan_copy, templates


def test_no_statement_scans_history_or_key_heads(tmp_path, traced):
    plan_path, templates = _run_every_path(tmp_path)
    seen: dict[str, str] = {}
    for sql in traced:
        seen.setdefault(normalize(sql), sql)
    connection = sqlite3.connect(plan_path)
    connection.execute("ATTACH DATABASE ? AS snap", (plan_path,))
    offenders: dict[str, list[str]] = {}
    allowed_seen: set[str] = set()
    for shape, sql in seen.items():
        if not re.match(r"(SELECT|INSERT|UPDATE|DELETE|WITH)\b", shape, re.IGNORECASE):
            continue  # PRAGMA, BEGIN, COMMIT, ATTACH, VACUUM INTO: no query plan
        scans = full_scans(connection, sql)
        if not scans:
            continue
        allowed = [pattern for pattern in WHOLE_TABLE_STATEMENTS if re.search(pattern, shape)]
        if allowed:
            allowed_seen.update(allowed)
            continue
        offenders[shape[:300]] = scans
    connection.close()
    assert offenders == {}, "statements that scan a table growing with the data"
    assert allowed_seen == set(WHOLE_TABLE_STATEMENTS), "allowed whole-table statements not seen"
    # Every statement prepared ahead was run by the paths above (so it was planned here).
    shapes = set(seen)
    assert [template for template in templates if normalize(template) not in shapes] == []


def test_the_guard_sees_a_full_scan(tmp_path):
    """The check itself: a lookup by a column without an index is a full scan, under an
    alias too; a primary-key lookup is not."""
    connection = sqlite3.connect(str(tmp_path / "plain.db"))
    StateMachine(str(tmp_path / "plain.db")).close()
    assert full_scans(connection, "SELECT value FROM history AS h WHERE h.key = 'a'") == ["SCAN h"]
    assert full_scans(connection, "SELECT version FROM history WHERE (version, seq) IN (VALUES (1, 0), (2, 0))") \
        == ["SCAN history"]
    assert full_scans(connection, "SELECT value FROM history WHERE version = 1 AND seq = 0") == []
    connection.close()
