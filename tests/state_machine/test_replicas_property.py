"""Property: random command logs applied in different batchings (with replays) give
identical rows on independent replicas, and agree with a plain-Python model at every
version, also after pruning the history."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raft.types import Batch, encode_control_record
from storage.commands import Command, Compare, CompareKind, Op, OpKind, encode_command
from storage.state_machine import ApplyResult, Entry, StateMachine
from tests.state_machine.helpers import dump_tables

KEYS = ["a", "b", "d/x", "d/y", "é"]
VALUES = [b"", b"1", b"2", b"\x00\xff"]
CONTENT_TYPES = ["application/octet-stream", "text/plain"]
CONTROL = "control"
GARBAGE = b"\x93\x01\x02\x03"  # msgpack [1, 2, 3]: not a command

keys = st.sampled_from(KEYS)
ops = st.one_of(
    st.builds(Op, st.just(OpKind.PUT), keys, st.sampled_from(VALUES), st.sampled_from(CONTENT_TYPES)),
    st.builds(Op, st.just(OpKind.DELETE), keys),
    st.builds(Op, st.just(OpKind.GET), keys),
)
compares = st.one_of(
    st.builds(Compare, keys, st.just(CompareKind.MOD_VERSION), st.integers(0, 12)),
    st.builds(Compare, keys, st.just(CompareKind.EXISTS), st.booleans()),
    st.builds(Compare, keys, st.just(CompareKind.VALUE), st.sampled_from(VALUES)),
)
commands = st.builds(
    Command,
    st.lists(compares, max_size=2).map(tuple),
    st.lists(ops, min_size=1, max_size=3).map(tuple),
    st.lists(ops, max_size=2).map(tuple),
)
items = st.lists(
    st.one_of(commands, commands, commands, st.just(CONTROL), st.just(GARBAGE)),
    min_size=1, max_size=30,
)


def build_log(log_items: list[object], sizes: list[int]) -> list[Batch]:
    """Consecutive batches: a control item is its own batch; commands are grouped by sizes."""
    batches: list[Batch] = []
    offset = 0
    pending: list[bytes] = []
    size_index = 0

    def close_pending() -> None:
        nonlocal offset, pending, size_index
        if pending:
            batches.append(Batch(offset, 1, 0, False, tuple(pending)))
            offset += len(pending)
            pending = []
            size_index += 1

    for item in log_items:
        if item == CONTROL:
            close_pending()
            batches.append(Batch(offset, 1, 0, True, (encode_control_record("leader_change", leader_id=1),)))
            offset += 1
            continue
        pending.append(item if isinstance(item, bytes) else encode_command(item))
        if len(pending) >= sizes[size_index % len(sizes)]:
            close_pending()
    close_pending()
    return batches


@dataclass
class ModelRun:
    states: list[dict[str, tuple[bytes, str, int, int]]]  # index = version
    events: list[tuple[str, str, int, bytes | None]]
    results: list[tuple[int, bool, tuple[tuple[str, int], ...], tuple[object, ...]]]


def run_model(log_items: list[object]) -> ModelRun:
    state: dict[str, tuple[bytes, str, int, int]] = {}
    states = [dict(state)]
    events: list[tuple[str, str, int, bytes | None]] = []
    results = []
    for offset, item in enumerate(log_items):
        version = offset + 1
        if isinstance(item, Command):
            failed = []
            for compare in item.compare:
                current = state.get(compare.key)
                if compare.kind == CompareKind.MOD_VERSION:
                    holds = (current[2] if current else 0) == compare.target
                elif compare.kind == CompareKind.EXISTS:
                    holds = (current is not None) == compare.target
                else:
                    holds = current is not None and current[0] == compare.target
                if not holds:
                    failed.append((compare.key, current[2] if current else 0))
            seen = []
            for op in item.success if not failed else item.failure:
                current = state.get(op.key)
                if op.kind == OpKind.PUT:
                    created = current[3] if current else version
                    state[op.key] = (op.value, op.content_type, version, created)
                    events.append(("put", op.key, version, op.value))
                    seen.append(("put", current is None, state[op.key]))
                elif op.kind == OpKind.DELETE:
                    if current is not None:
                        del state[op.key]
                        events.append(("delete", op.key, version, None))
                    seen.append(("delete", current is not None))
                else:
                    seen.append(("get", current))
            results.append((offset, not failed, tuple(failed), tuple(seen)))
        elif item == GARBAGE:
            results.append((offset, False, (), ()))
        states.append(dict(state))
    return ModelRun(states, events, results)


def result_shape(result: ApplyResult) -> tuple[int, bool, tuple[tuple[str, int], ...], tuple[object, ...]]:
    seen: list[object] = []
    for op in result.ops:
        entry = op.entry
        as_tuple = None if entry is None else (entry.value, entry.content_type, entry.mod_version,
                                               entry.create_version)
        if op.kind == OpKind.PUT:
            seen.append(("put", op.created, as_tuple))
        elif op.kind == OpKind.DELETE:
            seen.append(("delete", op.deleted))
        else:
            seen.append(("get", as_tuple))
    return result.offset, result.succeeded, result.failed_compares, tuple(seen)


def listing(state: StateMachine, version: int, limit: int = 100) -> dict[str, tuple[bytes, str, int, int]]:
    """Every entry at ``version``, read in pages of ``limit``."""
    found: list[Entry] = []
    after = None
    while True:
        answered, page, after = state.list("", after=after, limit=limit, at_version=version)
        assert answered == version
        found.extend(page)
        if after is None:
            return {e.key: (e.value, e.content_type, e.mod_version, e.create_version) for e in found}


def check_at_every_version(replica: StateMachine, model: ModelRun, horizon: int, final_version: int) -> None:
    for version in range(horizon, final_version + 1):
        assert listing(replica, version) == model.states[version]
        assert listing(replica, version, limit=2) == model.states[version]
        for key in KEYS:
            entry = replica.get(key, at_version=version)[1]
            expected = model.states[version].get(key)
            assert (None if entry is None else (entry.value, entry.content_type,
                                               entry.mod_version, entry.create_version)) == expected
    assert [(e.type, e.key, e.mod_version, e.value)
            for e in replica.changes("", horizon, limit=1000)[1]] == [
        event for event in model.events if event[2] > horizon]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    log_items=items,
    sizes_a=st.lists(st.integers(1, 8), min_size=1, max_size=4),
    sizes_b=st.lists(st.integers(1, 8), min_size=1, max_size=4),
    calls_b=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=8),
    horizon_fractions=st.lists(st.floats(0, 1), min_size=1, max_size=3).map(sorted),
)
def test_replicas_agree_with_each_other_and_the_model(log_items, sizes_a, sizes_b, calls_b,
                                                      horizon_fractions):
    model = run_model(log_items)
    log_a = build_log(log_items, sizes_a)
    log_b = build_log(log_items, sizes_b)
    with tempfile.TemporaryDirectory() as directory:
        path_a = os.path.join(directory, "a.db")
        path_b = os.path.join(directory, "b.db")
        with StateMachine(path_a) as replica_a, StateMachine(path_b, background_checkpoint=False) as replica_b:
            results_a = [r for batch in log_a for r in replica_a.apply([batch])]
            # Replica B applies groups of batches, each call re-sending a few already applied.
            results_b: list[ApplyResult] = []
            position = 0
            call = 0
            while position < len(log_b):
                back, count = calls_b[call % len(calls_b)]
                call += 1
                start = max(0, position - back)
                results_b.extend(replica_b.apply(log_b[start:position + count]))
                position += count
            final_version = len(log_items)
            assert replica_a.applied_version == replica_b.applied_version == final_version
            assert [result_shape(r) for r in results_a] == model.results
            assert [result_shape(r) for r in results_b] == model.results
            assert dump_tables(path_a) == dump_tables(path_b)

            events = [(e.type, e.key, e.mod_version, e.value) for e in replica_a.changes("", 0, limit=1000)[1]]
            assert events == model.events
            # The horizon moves up in steps: each prune starts from the one before.
            for horizon_fraction in horizon_fractions:
                horizon = int(horizon_fraction * final_version)
                replica_a.prune_history(horizon)
                check_at_every_version(replica_a, model, horizon, final_version)
            assert listing(replica_b, final_version) == model.states[final_version]
