"""Applying committed batches: versions, idempotence, replay, compares, bad records."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sqlite3
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.commands import (
    Command,
    Compare,
    CompareKind,
    Op,
    OpKind,
    delete,
    put,
)
from storage.snapshot_store import SnapshotStore
from storage.state_machine import (
    ApplyResult,
    Entry,
    OpResult,
    StateDatabaseError,
    StateMachine,
)
from storage.state_schema import SCHEMA_VERSION, read_database_meta
from storage.state_types import builder_class, new_apply_result, new_entry, new_op_result
from storage.state_writes import HISTORY_ROWS_PER_STATEMENT
from tests.state_machine.helpers import (
    batches_for,
    control_batch,
    data_batch,
    dump_tables,
    table_names,
    write_schema_1_database,
)


@pytest.fixture()
def state(tmp_path):
    machine = StateMachine(str(tmp_path / "state.db"))
    yield machine
    machine.close()


def test_versions_follow_offsets_and_control_batches_only_advance(state):
    results = state.apply([control_batch(0), data_batch(1, [put("a", b"1"), put("b", b"2")])])
    assert [(r.offset, r.version) for r in results] == [(1, 2), (2, 3)]
    assert state.applied_version == 3
    assert state.get("a") == (3, Entry("a", b"1", "application/octet-stream", 2, 2))
    results = state.apply([control_batch(3, epoch=2)])
    assert results == []
    assert state.applied_version == 4 and state.applied_epoch == 2
    assert state.get("b")[0] == 4


def test_mod_and_create_versions_and_recreate_after_delete(state):
    state.apply([data_batch(0, [put("k", b"1", "text/plain"), put("k", b"2"), delete("k"), put("k", b"3")])])
    version, entry = state.get("k")
    assert version == 4
    assert entry == Entry("k", b"3", "application/octet-stream", 4, 4)
    assert state.get("k", at_version=2)[1] == Entry("k", b"2", "application/octet-stream", 2, 1)
    assert state.get("k", at_version=1)[1] == Entry("k", b"1", "text/plain", 1, 1)
    assert state.get("k", at_version=3)[1] is None


def test_op_results_report_created_deleted_and_entries(state):
    first = state.apply([data_batch(0, [put("k", b"1")])])[0]
    assert first.succeeded and first.ops[0].created and first.ops[0].entry.mod_version == 1
    second = state.apply([data_batch(1, [put("k", b"2"), delete("k"), delete("k")])])
    assert not second[0].ops[0].created
    assert second[1].ops[0].deleted and second[1].ops[0].entry is None
    assert not second[2].ops[0].deleted
    # Deleting a missing key changes nothing: no history event for it.
    assert [event.mod_version for event in state.changes("", 0)[1]] == [1, 2, 3]


def test_apply_twice_is_a_no_op(state, tmp_path):
    batches = batches_for([put(f"k{i}", b"v%d" % i) for i in range(10)] + [delete("k3")], [4, 4])
    state.apply(batches)
    before = dump_tables(state.db_path)
    assert state.apply(batches) == []
    assert dump_tables(state.db_path) == before


def test_overlapping_batch_applies_only_the_new_part(state):
    state.apply([data_batch(0, [put("a", b"1"), put("b", b"1")])])
    results = state.apply([data_batch(0, [put("a", b"1"), put("b", b"1"), put("a", b"2")])])
    assert [r.offset for r in results] == [2]
    assert state.get("a")[1].value == b"2" and state.get("a")[1].create_version == 1
    assert state.applied_version == 3


def test_offsets_missing_from_a_cleaned_log_are_skipped(state):
    """A cleaned log keeps only each key's newest record: offsets in between are absent,
    and the version still moves to the end of the last batch applied."""
    state.apply([data_batch(0, [put("a", b"1")])])
    results = state.apply([data_batch(1, [put("b", b"1")]), data_batch(5, [put("c", b"1")])])
    assert [r.offset for r in results] == [1, 5]
    assert state.applied_version == 6
    assert state.get("c")[1].mod_version == 6 and state.get("b")[1].mod_version == 2


@pytest.mark.parametrize(("broken_function", "commands"), [
    ("_apply_puts", [put("b", b"1")]),  # a call of plain PUTs only
    ("evaluate_compact", [put("b", b"1"), delete("a")]),  # any other call
])
def test_failed_apply_rolls_back_everything(state, monkeypatch, broken_function, commands):
    state.apply([data_batch(0, [put("a", b"1")])])
    before = dump_tables(state.db_path)

    def broken(*_args):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(f"storage.state_writes.{broken_function}", broken)
    with pytest.raises(sqlite3.OperationalError):
        state.apply([data_batch(1, commands)])
    monkeypatch.undo()
    assert dump_tables(state.db_path) == before
    assert state.applied_version == 1
    state.apply([data_batch(1, commands)])
    assert state.get("b")[1].mod_version == 2


class _CommitFailsCursor:
    """The writer's cursor, except that COMMIT fails the way a full disk makes it fail."""

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self._cursor = cursor

    def execute(self, sql, parameters=()):
        if sql == "COMMIT":
            raise sqlite3.OperationalError("database or disk is full")
        return self._cursor.execute(sql, parameters)

    def executemany(self, sql, rows):
        return self._cursor.executemany(sql, rows)


def test_failed_commit_leaves_nothing_and_the_next_apply_works(state):
    state.apply([data_batch(0, [put("a", b"1")])])
    before = dump_tables(state.db_path)
    real_cursor = state._writer_cursor
    state._writer_cursor = _CommitFailsCursor(real_cursor)
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        state.apply([data_batch(1, [put("b", b"1")])])
    state._writer_cursor = real_cursor
    assert dump_tables(state.db_path) == before
    assert state.applied_version == 1 and state.get("b") == (1, None)
    state.apply([data_batch(1, [put("b", b"1")])])
    assert state.get("b")[1].mod_version == 2


class _CommitFailsConnection:
    """The writer's SQLAlchemy connection, except that COMMIT fails as a full disk makes it
    fail (SQLite may then leave the transaction open)."""

    def __init__(self, connection) -> None:
        self._connection = connection

    def exec_driver_sql(self, sql, *args):
        if sql == "COMMIT":
            raise sqlite3.OperationalError("database or disk is full")
        return self._connection.exec_driver_sql(sql, *args)

    def __getattr__(self, name):
        return getattr(self._connection, name)


@pytest.mark.parametrize("call", ["prune_history", "clear"])
def test_a_failed_commit_of_a_prune_or_clear_leaves_nothing_and_apply_goes_on(tmp_path, call):
    """A prune (which also writes the heads key_heads lacked) or a clear whose COMMIT fails
    changes nothing, in the file or in what reads answer, and the next apply, prune and
    close work: the failed transaction does not stay open on the writer."""
    with StateMachine(str(tmp_path / "state.db"), heads_flush_records=10_000) as state:
        state.apply([data_batch(0, [put("a", b"1"), put("b", b"1"), delete("b"), put("a", b"2")])])
        before = dump_tables(state.db_path)
        real_connection = state._writer
        state._writer = _CommitFailsConnection(real_connection)
        with pytest.raises(sqlite3.OperationalError, match="disk is full"):
            if call == "prune_history":
                state.prune_history(4)
            else:
                state.clear()
        state._writer = real_connection
        assert dump_tables(state.db_path) == before
        assert (state.applied_version, state.oldest_version) == (4, 0)
        assert state.get("b", at_version=2)[1].value == b"1"
        state.apply([data_batch(4, [put("c", b"1")])])
        state.prune_history(4)
        assert state.get("a")[1].value == b"2" and state.get("c")[1].mod_version == 5
    with StateMachine(str(tmp_path / "state.db")) as reopened:
        assert [(e.key, e.value) for e in reopened.list("")[1]] == [("a", b"2"), ("c", b"1")]
        assert reopened.oldest_version == 4


def test_undecodable_record_is_a_logged_no_op(state, caplog):
    results = state.apply([data_batch(0, [put("a", b"1"), b"\xc1 not a command", put("b", b"2")])])
    assert [r.succeeded for r in results] == [True, False, True]
    assert results[1].error is not None and results[1].ops == () and results[1].version == 2
    assert state.applied_version == 3
    assert "offset 1" in caplog.text
    assert state.get("b")[1].mod_version == 3


def test_replay_from_a_lost_sqlite_tail_converges(tmp_path):
    """A state.db that lost its tail (an older copy) replays the whole log to the same rows
    as a replica that never crashed."""
    commands: list[Command] = []
    for i in range(60):
        commands.append(put(f"k{i % 7}", b"%d" % i))
        if i % 5 == 0:
            commands.append(delete(f"k{(i + 3) % 7}"))
    log = batches_for(commands, [3, 10, 1, 20, 7])
    reference_path = str(tmp_path / "reference.db")
    with StateMachine(reference_path) as reference:
        reference.apply(log)
    crashed_path = str(tmp_path / "crashed.db")
    with StateMachine(crashed_path) as crashed:
        crashed.apply(log[:3])
    stale_copy = str(tmp_path / "stale.db")
    shutil.copy(crashed_path, stale_copy)
    with StateMachine(stale_copy) as reopened:
        assert reopened.applied_version == log[2].next_offset
        reopened.apply(log)  # the runtime replays from the start of what it still holds
    assert dump_tables(stale_copy) == dump_tables(reference_path)


def test_state_survives_reopen(tmp_path):
    path = str(tmp_path / "state.db")
    with StateMachine(path) as state:
        state.apply([control_batch(0, epoch=3), data_batch(1, [put("a", b"1")], epoch=3)])
        state.prune_history(1)
    with StateMachine(path) as state:
        assert (state.applied_version, state.applied_epoch, state.oldest_version) == (2, 3, 1)
        assert state.get("a")[1].value == b"1"


def test_compare_mod_version_and_failure_branch(state):
    state.apply([data_batch(0, [put("k", b"1")])])
    command = Command(
        (Compare("k", CompareKind.MOD_VERSION, 7),),
        (Op(OpKind.PUT, "k", b"new"),),
        (Op(OpKind.GET, "k"), Op(OpKind.PUT, "failed", b"yes")),
    )
    result = state.apply([data_batch(1, [command])])[0]
    assert not result.succeeded
    assert result.failed_compares == (("k", 1),)
    assert result.ops[0].kind == OpKind.GET and result.ops[0].entry.value == b"1"
    assert state.get("failed")[1].value == b"yes"
    assert state.get("k")[1].value == b"1"
    cas = put("k", b"2", compare=(Compare("k", CompareKind.MOD_VERSION, 1),))
    assert state.apply([data_batch(2, [cas])])[0].succeeded
    assert state.get("k")[1].mod_version == 3


def test_compare_exists_value_and_missing_key(state):
    create_only = put("k", b"1", compare=(Compare("k", CompareKind.EXISTS, False),))
    value_check = put("k", b"2", compare=(Compare("k", CompareKind.VALUE, b"1"),))
    missing_is_zero = put("m", b"1", compare=(Compare("m", CompareKind.MOD_VERSION, 0),))
    results = state.apply([data_batch(0, [create_only, create_only, value_check, value_check,
                                          missing_is_zero])])
    assert [r.succeeded for r in results] == [True, False, True, False, True]
    assert results[1].failed_compares == (("k", 1),)
    assert results[3].failed_compares == (("k", 3),)


def test_txn_ops_apply_in_order_at_one_version(state):
    txn = Command((), (Op(OpKind.PUT, "a", b"1"), Op(OpKind.GET, "a"), Op(OpKind.DELETE, "a"),
                       Op(OpKind.PUT, "b", b"2")))
    result = state.apply([data_batch(0, [txn])])[0]
    assert result.ops[1].entry == Entry("a", b"1", "application/octet-stream", 1, 1)
    assert state.get("a")[1] is None
    events = state.changes("", 0)[1]
    assert [(e.type, e.key, e.mod_version) for e in events] == [
        ("put", "a", 1), ("delete", "a", 1), ("put", "b", 1)]


def test_not_a_database_is_a_clear_error(tmp_path):
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StateDatabaseError, match=str(path)):
        StateMachine(str(path))


def test_an_older_schema_is_refused_by_name_and_left_untouched(tmp_path):
    path = str(tmp_path / "state.db")
    write_schema_1_database(path)
    tables_before = table_names(path)
    with pytest.raises(StateDatabaseError, match=f"{path}: schema version 1, this code reads {SCHEMA_VERSION}.*rebuild it from the log"):
        StateMachine(path)
    assert table_names(path) == tables_before
    # The documented way out: move it away; a new state.db replays the log from offset 0.
    os.rename(path, path + ".schema-1")
    with StateMachine(path) as state:
        state.apply([data_batch(0, [put("a", b"1")])])
        assert state.get("a")[1].value == b"1"


def test_a_schema_2_database_is_upgraded_in_place(tmp_path):
    """Schema 2 wrote key_heads in every apply call; opened by this code, its rows are kept
    and read as they are, and it becomes schema 3."""
    path = str(tmp_path / "state.db")
    with StateMachine(path) as state:
        state.apply([data_batch(0, [put("a", b"1"), put("b", b"1"), delete("b"), put("a", b"2")])])
    with sqlite3.connect(path) as connection:
        connection.execute("ALTER TABLE meta DROP COLUMN heads_version")
        connection.execute("UPDATE meta SET schema_version = 2")
    with StateMachine(path) as state:
        assert state.get("a") == (4, Entry("a", b"2", "application/octet-stream", 4, 1))
        assert state.get("b", at_version=2)[1].value == b"1"
        state.apply([data_batch(4, [put("b", b"3")])])
        assert state.get("b")[1].create_version == 5
    assert read_database_meta(path).schema_version == SCHEMA_VERSION


def test_close_leaves_no_wal_behind(tmp_path):
    path = str(tmp_path / "state.db")
    with StateMachine(path) as state:
        state.apply([data_batch(0, [put("a", b"1")])])
    assert not os.path.exists(path + "-wal") or os.path.getsize(path + "-wal") == 0


def test_a_cleaned_put_restores_its_create_version(state):
    """The cleaner rewrites a key's newest record as a PUT carrying its create_version."""
    cleaned = Command((), (Op(OpKind.PUT, "k", b"v", "text/plain", create_version=3),))
    result = state.apply([data_batch(0, [put("other", b"1")]), data_batch(9, [cleaned])])
    assert result[-1].ops[0].entry == Entry("k", b"v", "text/plain", 10, 3)
    assert state.get("k")[1].create_version == 3
    assert state.applied_version == 10


def test_key_heads_written_behind_apply_gives_what_writing_it_every_call_gives(tmp_path, monkeypatch):
    """key_heads written every call (heads_flush_records=1, schema 2's way), every few records
    and only at a prune or close: the same results, reads and history after every step, with
    prunes, a failed apply, a snapshot load and reopens in between; the in-memory heads are
    the database's heads, and after close the files are the same."""
    steps = [
        [put("a", b"1"), put("b", b"1"), put("c", b"1")],
        [delete("a"), put("b", b"2"), Command((Compare("c", CompareKind.VALUE, b"1"),),
                                              (Op(OpKind.PUT, "c", b"2"), Op(OpKind.DELETE, "b")))],
        "prune",  # a's delete falls below the horizon: its head goes
        "mark",  # a snapshot of this state, loaded again below
        [put("a", b"3"), put("d", b"1"), delete("c")],
        "fail",
        [put("c", b"4"), put("b", b"5")],
        "snapshot",  # back to the mark: what was written since is gone from the state
        [put("d", b"0"), put("a", b"6"), delete("d"), put("e", b"1"), put("c", b"4"), put("b", b"5")],
        "prune",
        "reopen",  # the heads are loaded from key_heads and the history above heads_version
        [put("d", b"7"), put("a", b"8"), delete("e")],
        "crash",  # reopened without close: key_heads lags behind
        [put("f", b"1"), Command((Compare("d", CompareKind.VALUE, b"7"),), (Op(OpKind.DELETE, "d"),))],
        "prune",
        "reopen",
        [put("e", b"9"), put("b", b"10"), put("d", b"11")],
    ]
    flush_every = {"every_call": 1, "every_4": 4, "rarely": 10_000}
    machines = {name: StateMachine(str(tmp_path / f"{name}.db"), heads_flush_records=records)
                for name, records in flush_every.items()}
    crashed = []
    marked = []
    try:
        offset = 0
        for step in steps:
            if step == "snapshot":
                offset = marked[0].end_offset
            for index, (name, machine) in enumerate(list(machines.items())):
                if step == "reopen":
                    machine.close()
                    machines[name] = StateMachine(machine.db_path, heads_flush_records=flush_every[name])
                elif step == "crash":
                    crashed.append(machine)  # left open: its files are as a killed process leaves them
                    machines[name] = StateMachine(machine.db_path, heads_flush_records=flush_every[name])
                elif step == "prune":
                    machine.prune_history(offset)
                elif step == "mark":  # each keeps its own copy
                    marked.append(machine.create_snapshot(SnapshotStore(str(tmp_path / f"snapshots-{index}"))))
                elif step == "snapshot":
                    machine.load_snapshot(SnapshotStore(str(tmp_path / f"snapshots-{index}")).path_for(marked[index]))
                    assert machine.applied_version == offset
                elif step == "fail":
                    with monkeypatch.context() as patched:
                        patched.setattr("storage.state_writes._link_history", _broken)
                        with pytest.raises(sqlite3.OperationalError):
                            machine.apply([data_batch(offset, [put("a", b"lost"), delete("b")])])
            if isinstance(step, list):
                results = [machine.apply([data_batch(offset, step)]) for machine in machines.values()]
                assert results[0] == results[1] == results[2]
                offset += len(step)
            heads = [machine._index.as_dict() for machine in machines.values()]
            assert heads[0] == heads[1] == heads[2]
            # Written every call, key_heads holds exactly the heads kept in memory.
            assert heads[0] == _heads_in_database(machines["every_call"])
            lists = [machine.list("") for machine in machines.values()]
            assert lists[0] == lists[1] == lists[2]
            histories = [dump_tables(machine.db_path)["history"] for machine in machines.values()]
            assert histories[0] == histories[1] == histories[2]
        assert [(e.key, e.value) for e in machines["rarely"].list("")[1]] == [
            ("a", b"8"), ("b", b"10"), ("c", b"4"), ("d", b"11"), ("e", b"9"), ("f", b"1")]
        for machine in machines.values():
            machine.close()
            with StateMachine(machine.db_path) as reopened:
                assert reopened._index.as_dict() == heads[0]
        dumps = [dump_tables(machine.db_path) for machine in machines.values()]
        assert dumps[0] == dumps[1] == dumps[2]
    finally:
        for machine in [*machines.values(), *crashed]:
            machine.close()


def _heads_in_database(machine: StateMachine) -> dict:
    """key -> Head for every row of key_heads, read from SQLite."""
    with sqlite3.connect(machine.db_path) as connection:
        rows = connection.execute(
            "SELECT h.key, h.mod_version, h.mod_seq, y.op, y.create_version"
            " FROM key_heads h JOIN history y ON y.version = h.mod_version AND y.seq = h.mod_seq").fetchall()
    return {key: (create_version if op == 1 else 0, version, seq)
            for key, version, seq, op, create_version in rows}


def test_a_reopened_state_machine_links_updates_to_the_heads_key_heads_lacked(tmp_path):
    """A process killed before key_heads caught up: at open the heads of the changes above
    heads_version come from their history rows, so updates and re-creates link to the right
    previous changes and keep the right create_version."""
    path = str(tmp_path / "state.db")
    killed = StateMachine(path)
    killed.apply([data_batch(0, [put("a", b"1"), put("b", b"1"), delete("b"), put("c", b"1")])])
    assert _heads_in_database(killed) == {}  # not written yet
    try:
        with StateMachine(path) as machine:
            results = list(machine.apply([data_batch(4, [put("a", b"2"), put("b", b"2"), put("new", b"1")])]))
            results += machine.apply([data_batch(7, [
                Command((Compare("c", CompareKind.VALUE, b"1"),), (Op(OpKind.PUT, "c", b"2"),))])])
            assert [(r.ops[0].created, r.ops[0].entry.create_version) for r in results] == [
                (False, 1), (True, 6), (True, 7), (False, 4)]
            assert machine.get("c", at_version=4)[1].value == b"1"
            assert machine.get("b", at_version=2)[1].value == b"1"
            assert machine.get("b", at_version=3) == (3, None)
        with StateMachine(path) as machine:  # closed: key_heads is complete
            assert _heads_in_database(machine) == machine._index.as_dict()
            assert [e.key for e in machine.list("")[1]] == ["a", "b", "c", "new"]
    finally:
        killed.close()


def _broken(*_args: object) -> None:
    raise sqlite3.OperationalError("disk I/O error")


def test_pruning_during_apply_with_key_heads_written_behind(tmp_path):
    """With history retention, apply prunes inside its own transaction (deleted keys' heads
    go, from key_heads and from memory); writing key_heads every call or rarely ends in the
    same rows."""
    machines = [StateMachine(str(tmp_path / f"{records}.db"), history_retention_versions=3,
                             heads_flush_records=records) for records in (1, 10_000)]
    try:
        for offset in range(60):
            key = f"k{offset % 4}"
            command = delete(key) if offset % 3 == 0 else put(key, b"%d" % offset)
            for machine in machines:
                machine.apply([data_batch(offset, [command])])
        assert machines[0].oldest_version > 0
        assert machines[0]._index.as_dict() == machines[1]._index.as_dict()
        assert machines[0]._index.as_dict() == _heads_in_database(machines[0])
    finally:
        for machine in machines:
            machine.close()
    assert dump_tables(machines[0].db_path) == dump_tables(machines[1].db_path)


def test_apply_results_are_the_public_frozen_dataclasses():
    """Apply builds Entry, OpResult and ApplyResult without their generated __init__; the
    objects are the same as the constructors give: equal, equally hashed, still frozen."""
    entry = new_entry("k", b"v", "text/plain", 3, 2)
    op = new_op_result(OpKind.PUT, "k", False, False, entry)
    result = new_apply_result(2, 3, True, (op,), ())
    expected = ApplyResult(2, 3, True, (OpResult(OpKind.PUT, "k", False, False,
                                                 Entry("k", b"v", "text/plain", 3, 2)),), ())
    assert result == expected and hash(result) == hash(expected) and repr(result) == repr(expected)
    assert new_apply_result(0, 1, False, (), (), "bad").error == "bad"
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.value = b"other"  # type: ignore[misc]
    assert type(result) is ApplyResult and type(op) is OpResult and type(entry) is Entry
    assert dataclasses.replace(entry, value=b"w") == Entry("k", b"w", "text/plain", 3, 2)


def test_a_builder_of_another_layout_cannot_become_the_dataclass():
    """The builders rely on Python refusing a __class__ change between different layouts:
    a builder missing a field (as one would be if a field were added to Entry alone) fails
    loudly instead of making an Entry with a slot left out."""
    short = type("ShortBuilder", (), {"__slots__": ("key", "value", "content_type", "mod_version")})()
    with pytest.raises(TypeError):
        short.__class__ = Entry
    assert type(builder_class(Entry)()) is not Entry


def _general_path_only(real_decode_call):
    """decode_call, except that a call of plain PUTs also comes back as compact commands,
    so apply takes the general path (evaluate_compact, _link_history) for every call."""
    def decode_call(plan):
        puts, commands = real_decode_call(plan)
        if commands is None:
            commands = [(offset, ((), ((int(OpKind.PUT), key, value, content_type, 0, 0),), ()))
                        for offset, key, value, content_type in puts]
        return puts, commands
    return decode_call


_PUT_HEAVY_COMMANDS = st.lists(
    st.one_of(
        st.builds(put, st.sampled_from("abcdef"), st.binary(max_size=3)),
        st.builds(put, st.sampled_from("abcdef"), st.binary(max_size=3), st.just("text/plain")),
        st.builds(delete, st.sampled_from("abcdef")),
        st.builds(lambda key: Command((), (Op(OpKind.PUT, key, b"c", create_version=1),)),
                  st.sampled_from("abcdef")),
        st.just(b"\xc1 not a command"),
    ),
    min_size=1, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(st.one_of(_PUT_HEAVY_COMMANDS,
                                st.lists(st.builds(put, st.sampled_from("abcdef"), st.binary(max_size=3)),
                                         min_size=1, max_size=12)),
                      min_size=1, max_size=8),
       prune_after=st.integers(min_value=0, max_value=8))
def test_plain_put_calls_write_what_the_general_path_writes(tmp_path, monkeypatch, calls, prune_after):
    """A call whose records are all plain PUTs takes its own path (_apply_puts): it gives
    the same results, rows and heads as the general path, repeated keys in one call
    included, and the same rows as applying each record in its own call (also with
    key_heads written every call)."""
    import storage.state_writes as state_writes_module

    with tempfile.TemporaryDirectory(dir=tmp_path) as directory:
        machines = {name: StateMachine(os.path.join(directory, f"{name}.db"), heads_flush_records=records)
                    for name, records in (("fast", 10_000), ("general", 10_000),
                                          ("every_call", 1), ("one_by_one", 10_000))}
        real_decode_call = state_writes_module.decode_call
        try:
            offset = 0
            for index, commands in enumerate(calls):
                batch = data_batch(offset, commands)
                results = {}
                for name, machine in machines.items():
                    if name == "general":
                        monkeypatch.setattr(state_writes_module, "decode_call",
                                            _general_path_only(real_decode_call))
                    try:
                        if name == "one_by_one":
                            results[name] = [result for record_offset in range(offset, offset + len(commands))
                                             for result in machine.apply([data_batch(
                                                 record_offset, [commands[record_offset - offset]])])]
                        else:
                            results[name] = machine.apply([batch])
                    finally:
                        monkeypatch.setattr(state_writes_module, "decode_call", real_decode_call)
                    if index == prune_after:
                        machine.prune_history(offset)
                assert results["fast"] == results["general"] == results["every_call"] == results["one_by_one"]
                offset += len(commands)
                histories = {name: dump_tables(machine.db_path)["history"] for name, machine in machines.items()}
                assert (histories["fast"] == histories["general"] == histories["every_call"]
                        == histories["one_by_one"])
                heads = {name: machine._index.as_dict() for name, machine in machines.items()}
                assert heads["fast"] == heads["general"] == heads["every_call"] == heads["one_by_one"]
                assert heads["every_call"] == _heads_in_database(machines["every_call"])
        finally:
            for machine in machines.values():
                machine.close()


@pytest.mark.parametrize("record_count", [HISTORY_ROWS_PER_STATEMENT * 2 + 1, HISTORY_ROWS_PER_STATEMENT + 37])
def test_a_large_call_writes_the_rows_of_one_record_calls(tmp_path, record_count):
    """History rows go HISTORY_ROWS_PER_STATEMENT to a statement (the last chunk shorter,
    possibly one row): a call of many records, repeated keys and a txn included, writes
    what one call per record writes."""
    commands = [put(f"k{index % 70}", bytes([index % 256])) for index in range(record_count)]
    commands[5] = Command((), (Op(OpKind.PUT, "t1", b"x"), Op(OpKind.DELETE, "k1"), Op(OpKind.PUT, "t2", b"y")))
    whole = StateMachine(str(tmp_path / "whole.db"))
    puts_only = StateMachine(str(tmp_path / "puts.db"))
    single = StateMachine(str(tmp_path / "single.db"))
    try:
        whole_results = whole.apply([data_batch(0, commands)])
        puts_only.apply([data_batch(0, commands[:6])])
        puts_results = puts_only.apply([data_batch(6, commands[6:])])  # plain PUTs only
        single_results = [result for offset, command in enumerate(commands)
                          for result in single.apply([data_batch(offset, [command])])]
        assert whole_results == single_results
        assert puts_results == single_results[6:]
        assert dump_tables(whole.db_path) == dump_tables(single.db_path) == dump_tables(puts_only.db_path)
        assert len(dump_tables(whole.db_path)["history"]) == record_count + 2
    finally:
        for machine in (whole, puts_only, single):
            machine.close()


def test_plain_put_results_read_like_a_list_of_the_results(state):
    """A call of plain PUTs returns its results built on reading: index (also from the
    end), slice, iterate and compare them as the list of ApplyResults they stand for."""
    state.apply([data_batch(0, [put("gone", b"0"), delete("gone")])])
    results = state.apply([data_batch(2, [put("a", b"1"), put("gone", b"2"), put("a", b"3")])])
    expected = [
        ApplyResult(2, 3, True, (OpResult(OpKind.PUT, "a", True, False,
                                          Entry("a", b"1", "application/octet-stream", 3, 3)),), ()),
        ApplyResult(3, 4, True, (OpResult(OpKind.PUT, "gone", True, False,
                                          Entry("gone", b"2", "application/octet-stream", 4, 4)),), ()),
        ApplyResult(4, 5, True, (OpResult(OpKind.PUT, "a", False, False,
                                          Entry("a", b"3", "application/octet-stream", 5, 3)),), ()),
    ]
    assert type(results) is not list
    assert len(results) == 3
    assert list(results) == expected and results == expected and expected == results
    assert results[-1] == expected[2] and results[1:] == expected[1:]
    assert results != expected[:2]
    assert {result.offset: result.version for result in results} == {2: 3, 3: 4, 4: 5}
    with pytest.raises(TypeError):
        hash(results)
