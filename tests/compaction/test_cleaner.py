"""The cleaner on random histories: it preserves state, is deterministic across replicas,
keeps tombstones a replica may still need, and never resurrects a deleted key."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raft.types import Batch, encode_control_record
from storage.batch_codec import encode_batch
from storage.cleaner import clean_prefix, prefix_digest
from storage.commands import (
    DEFAULT_CONTENT_TYPE,
    Command,
    Compare,
    CompareKind,
    Op,
    OpKind,
    decode_command,
    delete,
    encode_command,
    put,
)
from storage.state_machine import Entry, StateMachine

KEYS = ["a", "b", "c", "d"]

key = st.sampled_from(KEYS)
value = st.binary(min_size=0, max_size=3)
compare = st.one_of(
    st.builds(Compare, key, st.just(CompareKind.MOD_VERSION), st.integers(0, 12)),
    st.builds(Compare, key, st.just(CompareKind.EXISTS), st.booleans()),
    st.builds(Compare, key, st.just(CompareKind.VALUE), value),
)
op = st.one_of(
    st.builds(Op, st.just(OpKind.PUT), key, value, st.sampled_from(["text/plain", "application/json"])),
    st.builds(Op, st.just(OpKind.DELETE), key),
    st.builds(Op, st.just(OpKind.GET), key),
)
command = st.one_of(
    st.builds(lambda k, v: put(k, v), key, value),
    st.builds(lambda k: delete(k), key),
    st.builds(Command, st.lists(compare, max_size=2).map(tuple), st.lists(op, max_size=3).map(tuple),
              st.lists(op, max_size=2).map(tuple)),
)


@st.composite
def logs(draw: st.DrawFn) -> list[Batch]:
    """A log from offset 0: command batches of 1-4 records, with leader changes between epochs."""
    batches: list[Batch] = []
    offset, epoch = 0, 1
    for _ in range(draw(st.integers(1, 14))):
        if draw(st.integers(0, 5)) == 0:
            epoch += 1
            record = encode_control_record("leader_change", leader_id=1, epoch=epoch)
            batches.append(Batch(offset, epoch, 1000 + offset, True, (record,)))
            offset += 1
        records = tuple(encode_command(c) for c in draw(st.lists(command, min_size=1, max_size=4)))
        batches.append(Batch(offset, epoch, 1000 + offset, False, records))
        offset += len(records)
    return batches


def rows(batches: list[Batch], directory: Path, name: str) -> list[tuple]:
    machine = StateMachine(str(directory / f"{name}.db"))
    try:
        machine.apply(batches)
        _, entries, _ = machine.list("", limit=1000)
        return [(e.key, e.value, e.content_type, e.mod_version, e.create_version, e.key_version) for e in entries]
    finally:
        machine.close()


def tail(batches: list[Batch], clean_end: int) -> list[Batch]:
    return [b for b in batches if b.next_offset > clean_end]


SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(logs(), st.data())
def test_cleaned_log_replays_to_the_same_rows(batches: list[Batch], data: st.DataObject) -> None:
    end = batches[-1].next_offset
    dirty = data.draw(st.integers(0, end))
    horizon = data.draw(st.integers(0, dirty))
    result = clean_prefix(batches, dirty, horizon)
    cleaned_log = result.batches + tail(batches, result.clean_end)
    with tempfile.TemporaryDirectory() as directory:
        assert rows(cleaned_log, Path(directory), "cleaned") == rows(batches, Path(directory), "raw")
    # The cleaned range keeps its end offset and never grows.
    if result.clean_end:
        assert result.batches[-1].next_offset == result.clean_end
    assert result.records_out <= result.records_in


@SETTINGS
@given(logs(), st.data())
def test_cleaning_is_deterministic_and_idempotent(batches: list[Batch], data: st.DataObject) -> None:
    end = batches[-1].next_offset
    dirty_first = data.draw(st.integers(0, end))
    dirty = data.draw(st.integers(dirty_first, end))
    horizon_first = data.draw(st.integers(0, dirty_first))
    horizon = data.draw(st.integers(horizon_first, dirty))
    one_shot = clean_prefix(batches, dirty, horizon)
    # A replica that cleaned earlier to a lower offset, then cleans again, ends up byte-identical.
    first = clean_prefix(batches, dirty_first, horizon_first)
    incremental = clean_prefix(first.batches + tail(batches, first.clean_end), dirty, horizon)
    again = clean_prefix(one_shot.batches + tail(batches, one_shot.clean_end), dirty, horizon)
    encode = lambda result: [encode_batch(b) for b in result.batches]  # noqa: E731
    assert encode(incremental) == encode(one_shot) == encode(again)
    assert prefix_digest(incremental.batches, one_shot.clean_end) == prefix_digest(one_shot.batches, one_shot.clean_end)


@SETTINGS
@given(logs(), st.data())
def test_a_replica_behind_the_horizon_never_sees_a_deleted_key_return(batches: list[Batch], data: st.DataObject) -> None:
    """A voter that replicated the raw log up to ``replicated`` and then fetches the rest from a
    leader whose log is cleaned reaches the leader's rows, as long as the tombstone horizon is
    not above ``replicated`` (the leader never raises it past any voter)."""
    end = batches[-1].next_offset
    dirty = data.draw(st.integers(0, end))
    replicated = data.draw(st.sampled_from([0] + [b.next_offset for b in batches if b.next_offset <= end]))
    horizon = data.draw(st.integers(0, min(dirty, replicated)))
    result = clean_prefix(batches, dirty, horizon)
    leader_log = result.batches + tail(batches, result.clean_end)
    follower_log = [b for b in batches if b.next_offset <= replicated] + [
        b for b in leader_log if b.base_offset >= replicated]
    with tempfile.TemporaryDirectory() as directory:
        assert rows(follower_log, Path(directory), "follower") == rows(batches, Path(directory), "raw")


def test_tombstones_are_kept_until_the_horizon_passes_them() -> None:
    batches = [
        Batch(0, 1, 1, False, (encode_command(put("k", b"v")),)),
        Batch(1, 1, 2, False, (encode_command(delete("k")),)),
        Batch(2, 1, 3, False, (encode_command(put("other", b"x")),)),
    ]
    kept = clean_prefix(batches, dirty_offset=3, tombstone_horizon=1)
    assert [b.base_offset for b in kept.batches] == [1, 2]  # the put of k is gone, its tombstone stays
    dropped = clean_prefix(batches, dirty_offset=3, tombstone_horizon=2)
    assert [b.base_offset for b in dropped.batches] == [2] and dropped.tombstones_dropped == 1


def test_leader_changes_survive_and_the_last_offset_is_held() -> None:
    leader_change = encode_control_record("leader_change", leader_id=2, epoch=2)
    batches = [
        Batch(0, 1, 1, False, (encode_command(put("k", b"1")), encode_command(put("k", b"2")))),
        Batch(2, 2, 5, True, (leader_change,)),
        Batch(3, 2, 6, False, (encode_command(Command((Compare("k", CompareKind.EXISTS, False),), (Op(OpKind.PUT, "k", b"3"),))),)),
    ]
    result = clean_prefix(batches, dirty_offset=4, tombstone_horizon=0)
    offsets = [(b.base_offset, b.control, len(b.records)) for b in result.batches]
    assert offsets == [(1, False, 1), (2, True, 1), (3, False, 1)]  # failed create-only kept as an empty command
    assert result.batches[1].records == (leader_change,)


@st.composite
def logs_with_start(draw: st.DrawFn) -> tuple[list[Batch], int]:
    """A log and a batch boundary where a replica's log starts (it re-bootstrapped there)."""
    batches = draw(logs())
    start = draw(st.sampled_from([b.base_offset for b in batches]))
    return batches, start


@SETTINGS
@given(logs_with_start(), st.data())
def test_a_log_that_starts_at_a_snapshot_cleans_deterministically(
        drawn: tuple[list[Batch], int], data: st.DataObject) -> None:
    """A replica whose log starts at a snapshot (offset ``start`` > 0 or not) cleans
    [start, dirty) with the state machine as its base state: cleaning to an earlier offset
    first, or cleaning an already cleaned copy, gives the same bytes as cleaning once, and
    the snapshot's rows plus the cleaned log replay to the raw log's rows."""
    batches, start = drawn
    end = batches[-1].next_offset
    dirty_first = data.draw(st.integers(start, end))
    dirty = data.draw(st.integers(dirty_first, end))
    horizon_first = data.draw(st.integers(0, dirty_first))
    horizon = data.draw(st.integers(horizon_first, dirty))
    from_start = [b for b in batches if b.base_offset >= start]
    with tempfile.TemporaryDirectory() as directory:
        machine = StateMachine(str(Path(directory) / "full.db"))
        try:
            machine.apply(batches)  # every version stays readable: the base state at any offset
            clean = lambda log, d, h: clean_prefix(  # noqa: E731
                log, d, h, start_offset=start, base_state=machine.entries_at)
            one_shot = clean(from_start, dirty, horizon)
            first = clean(from_start, dirty_first, horizon_first)
            incremental = clean(first.batches + tail(from_start, first.clean_end), dirty, horizon)
            again = clean(one_shot.batches + tail(from_start, one_shot.clean_end), dirty, horizon)
            kept = clean(from_start, dirty, start)
        finally:
            machine.close()
        encode = lambda result: [encode_batch(b) for b in result.batches]  # noqa: E731
        assert encode(incremental) == encode(one_shot) == encode(again)
        assert all(b.base_offset >= start for b in one_shot.batches)
        # With no tombstone dropped at or above the log start, the snapshot at ``start``
        # followed by the cleaned log reaches the raw log's rows.
        below = [b for b in batches if b.next_offset <= start]
        assert rows(below + kept.batches + tail(from_start, kept.clean_end), Path(directory), "snap") == \
            rows(batches, Path(directory), "raw")


def test_base_state_is_asked_only_for_keys_the_log_does_not_name() -> None:
    """From the first record whose effect depends on the state, the cleaner evaluates; keys a
    cleaned record before it names come from that record, others from the base state."""
    batches = [
        Batch(10, 1, 1, False, (encode_command(Command((), (Op(OpKind.PUT, "a", b"1", "text/plain", 3, key_version=1),))),)),
        Batch(11, 1, 2, False, (encode_command(Command(
            (Compare("a", CompareKind.EXISTS, True), Compare("b", CompareKind.EXISTS, True)),
            (Op(OpKind.PUT, "c", b"both"),), (Op(OpKind.PUT, "c", b"not both"),))),)),
    ]
    asked: list[tuple[list[str], int]] = []

    def base_state(keys: list[str], version: int) -> dict[str, Entry | None]:
        asked.append((list(keys), version))
        return {key: Entry(key, b"old", "text/plain", 5, 2) if key == "b" else None for key in keys}

    result = clean_prefix(batches, 12, 0, start_offset=10, base_state=base_state)
    assert asked == [(["b", "c"], 11)]
    assert result.evaluated_from == 11
    survivor = decode_command(result.batches[-1].records[-1])
    assert survivor.success == (Op(OpKind.PUT, "c", b"both", DEFAULT_CONTENT_TYPE, 12, key_version=1),)


def test_records_that_do_not_decode_are_no_ops_in_any_position(tmp_path: Path) -> None:
    """Malformed records (the state machine applies them as no-ops) neither stop the cleaner
    nor change what survives, before or after the first record it must evaluate."""
    import msgpack

    garbage = (b"\xc1 not msgpack", msgpack.packb([1, [], [[1]], []]), msgpack.packb([1, [], [[2, "k"]], []]),
               msgpack.packb([1, 0, [], []]))
    batches = [
        Batch(0, 1, 1, False, (*garbage, encode_command(Command((), (Op(OpKind.PUT, "a", b"1", "text/plain", 4, key_version=1),))))),
        Batch(5, 1, 2, False, (encode_command(put("b", b"2")), *garbage, encode_command(delete("a")))),
    ]
    result = clean_prefix(batches, 11, 0)
    assert result.evaluated_from == 5 and result.records_in == 11
    assert rows(result.batches, tmp_path, "cleaned") == rows(batches, tmp_path, "raw") == [
        ("b", b"2", DEFAULT_CONTENT_TYPE, 6, 6, 1)]
    assert [decode_command(record) for batch in result.batches for record in batch.records] == [
        Command((), (Op(OpKind.PUT, "b", b"2", DEFAULT_CONTENT_TYPE, 6, key_version=1),)), delete("a")]
