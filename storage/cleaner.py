"""The log cleaner: compacts the log below the dirty offset the leader announced.

Rules (docs/compaction.md, Rules; KIP-595's log-compaction discussion):

1. The cleaned range runs from the log start offset (0, or the end of the snapshot the log
   was reset to) to ``clean_end``, the last batch boundary at or below the dirty offset.
   Batch boundaries are the same on every replica, so replicas with the same log start
   clean the same range.
2. In that range each key keeps only its newest effect, rewritten as an unconditional one:
   a PUT carrying the value, content type and the key's create_version, or a DELETE (a
   tombstone; every DELETE op that ran counts, whether or not the key existed). Offsets
   never move, so a kept PUT's offset still gives its mod_version.
3. A tombstone is dropped only when its offset is below the tombstone horizon given (every
   voter has replicated past it); otherwise it is kept, so a replica behind it still learns
   that the key is gone.
4. Control records (leader changes) are kept verbatim: every epoch keeps a record, so
   epoch lookups for divergence still work on a cleaned log.
5. The record at ``clean_end - 1`` always survives (an empty command when nothing else
   stands there), so the cleaned range keeps its end offset.
6. The output depends only on (log start, clean_end, tombstone horizon, the log's contents
   and the state at the log start), never on how or how often the range was cleaned
   before: cleaning a raw prefix, an already-cleaned copy of it, or a copy cleaned to some
   earlier offsets gives byte-identical batches. That is what lets every replica clean on
   its own and still hold identical prefixes (the digest in /v1/status shows it).

Incremental cleaning (Kafka's cleaner builds its offset map from the dirty section only):
records whose effect does not depend on the state (no compares, every PUT carrying its
create_version: everything a previous cleaning wrote, and plain deletes) are read directly;
only from the first record whose effect depends on the state (a compare, or a PUT that
must learn the key's create_version) does the cleaner run the state machine's evaluator,
starting from the state the records before it produce. A cleaned section therefore costs
one msgpack decode per surviving record and is rewritten without evaluation; the new dirty
section is evaluated once. When the log starts above offset 0, keys the records before that
point do not name are looked up in ``base_state`` (the state machine at that version).

Conditions are evaluated with apply's own pure evaluator (storage/evaluator.py), so the
cleaner and every replica's SQLite rows can never disagree about which branch of a command
ran.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from raft.types import Batch, check
from storage.commands import (
    COMMAND_VERSION,
    DEFAULT_CONTENT_TYPE,
    Command,
    CommandDecodeError,
    OpKind,
    encode_command,
)
from storage.evaluator import CompactCommand, command_keys, decode_compact, evaluate_compact
from storage.state_types import Entry

EMPTY_COMMAND = encode_command(Command((), (), ()))
PAUSE_EVERY_RECORDS = 256  # output records built between two calls of clean_prefix's pause
EVALUATE_CHUNK_RECORDS = 1_000  # records evaluated per call of the evaluator
_PUT, _DELETE, _GET = int(OpKind.PUT), int(OpKind.DELETE), int(OpKind.GET)

# an entry as the cleaner tracks it: Entry's fields as a plain tuple (cheaper to build)
_Row = tuple[str, bytes, str, int, int] | tuple[str, bytes, str, int, int, int]
# keys -> their entries (None: absent) as of the given version; see clean_prefix
BaseState = Callable[[Sequence[str], int], Mapping[str, Entry | None]]


class CleanerInputError(Exception):
    """The cleaner cannot learn the state it needs (for example the state machine no longer
    answers at the version where evaluation must start). Nothing was changed."""


@dataclass(frozen=True, slots=True)
class CleanResult:
    batches: list[Batch]  # the cleaned replacement for every batch in [start, clean_end)
    clean_end: int  # offsets below this were cleaned (a batch boundary <= the dirty offset)
    records_in: int
    records_out: int
    tombstones_dropped: int
    evaluated_from: int = 0  # first offset run through the evaluator (clean_end: none was)


def cleanable_end(batches: Iterable[Batch], dirty_offset: int) -> int:
    """The last batch boundary at or below ``dirty_offset`` (the log start when none is)."""
    end = -1
    for batch in batches:
        if end < 0:
            end = batch.base_offset
        if batch.next_offset > dirty_offset:
            break
        end = batch.next_offset
    return max(end, 0)


def clean_prefix(batches: Sequence[Batch], dirty_offset: int, tombstone_horizon: int, *,
                 start_offset: int = 0, base_state: BaseState | None = None,
                 pause: Callable[[], None] = lambda: None) -> CleanResult:
    """Clean ``batches`` (the log from ``start_offset``, its log start, in order; the first
    batch may start later in a cleaned log) below ``dirty_offset``.

    ``base_state`` answers the state at a version for keys the records before it do not
    name; it is needed only when the log starts above 0 (a log from 0 starts from the empty
    store). Batches at or above the cleaned range are ignored; the caller keeps them.
    Raises CleanerInputError when ``base_state`` cannot answer. ``pause`` is called after
    every batch read and every batch built (a throttle may sleep there).
    """
    clean_end = cleanable_end(batches, dirty_offset)
    in_range = [batch for batch in batches if batch.next_offset <= clean_end]
    if not in_range:
        return CleanResult([], clean_end, 0, 0, 0, clean_end)
    start = start_offset
    check(0 <= start <= in_range[0].base_offset, f"batches start below the log start {start}")
    check(start == 0 or base_state is not None, "a log that starts above 0 needs base_state")

    # newest effect per key: (offset, (PUT, key, value, content_type, create_version) or None)
    newest: dict[str, tuple[int, Any]] = {}
    known: dict[str, _Row | None] = {}  # the state the direct section produces, per key named
    control_records: dict[int, bytes] = {}
    pending: list[tuple[int, CompactCommand]] = []  # from the first state-dependent record on
    pending_keys: set[str] = set()
    records_in = 0
    for batch in in_range:
        pause()
        records = batch.records
        base = batch.base_offset
        records_in += len(records)
        if batch.control:
            for index, record in enumerate(records):
                control_records[base + index] = record
            continue
        for index, record in enumerate(records):
            offset = base + index
            if not pending:
                ops = _state_independent_ops(record)
                if ops is not None:
                    for op in ops:
                        kind, key = op[0], op[1]
                        if kind == _PUT:
                            newest[key] = (offset, op)
                            known[key] = (key, op[2], op[3], offset + 1, op[4], *op[5:6])
                        elif kind == _DELETE:
                            newest[key] = (offset, None)
                            known[key] = None
                    continue
            try:
                command = decode_compact(record)
            except CommandDecodeError:
                continue  # applied as a no-op by every replica: no effect in any state
            pending.append((offset, command))
            compares, success, failure = command
            if not compares and len(success) == 1 and not failure and not success[0][5]:
                pending_keys.add(success[0][1])
            else:
                pending_keys.update(command_keys(command))

    evaluated_from = pending[0][0] if pending else clean_end
    if pending:
        state = _state_at(pending_keys, known, start, evaluated_from, base_state)
        _evaluate(pending, state, newest)

    effects: dict[int, list[tuple[Any, ...]]] = {}
    tombstones_dropped = 0
    for key, (offset, op) in newest.items():
        if op is None:
            if offset < tombstone_horizon:
                tombstones_dropped += 1
                continue
            op = (_DELETE, key, b"", DEFAULT_CONTENT_TYPE)
        effects.setdefault(offset, []).append(op)

    records_out: dict[int, bytes] = dict(control_records)
    for count, (offset, ops) in enumerate(effects.items()):
        if count % PAUSE_EVERY_RECORDS == 0:
            pause()
        if len(ops) > 1:
            ops.sort(key=lambda item: item[1])
        records_out[offset] = msgpack.packb([COMMAND_VERSION, [], [list(op) for op in ops], []],
                                            use_bin_type=True)
    if clean_end - 1 not in records_out:
        records_out[clean_end - 1] = EMPTY_COMMAND
    cleaned = _group(records_out, in_range)
    return CleanResult(cleaned, clean_end, records_in, len(records_out), tombstones_dropped, evaluated_from)


def _state_independent_ops(record: bytes) -> list[Any] | None:
    """The ops of a record whose effect does not depend on the state, else None: no
    compares, no failure ops, every PUT carrying its create_version (what the cleaner
    writes), DELETEs and GETs of any key. Such a record has the same effect on any state."""
    try:
        value = msgpack.unpackb(record, raw=False)
    except Exception:  # the evaluator reports it as a record that does not decode
        return None
    if (type(value) is not list or len(value) != 4 or value[0] != COMMAND_VERSION
            or type(value[0]) is not int or value[1] != [] or value[3] != [] or type(value[2]) is not list):
        return None
    ops = value[2]
    for op in ops:
        if type(op) is not list or len(op) not in (4, 5, 6) or type(op[1]) is not str:
            return None
        kind = op[0]
        if kind == _PUT:
            if (len(op) not in (5, 6) or type(op[2]) is not bytes or type(op[3]) is not str
                    or type(op[4]) is not int or op[4] <= 0 or type(op[-1]) is not int):
                return None
        elif kind in (_DELETE, _GET):
            if len(op) != 4 or type(op[2]) is not bytes or type(op[3]) is not str:
                return None
        else:
            return None
    return ops


def _state_at(keys: set[str], known: dict[str, _Row | None], start: int, version: int,
              base_state: BaseState | None) -> dict[str, Entry | None]:
    """The state at ``version`` of ``keys``: what the direct section produced, else (a log
    from 0) absent, else what ``base_state`` says."""
    state: dict[str, Entry | None] = {}
    unknown: list[str] = []
    for key in keys:
        if key in known:
            row = known[key]
            state[key] = None if row is None else Entry(*row)
        elif start == 0:
            state[key] = None
        else:
            unknown.append(key)
    if unknown:
        unknown.sort()
        looked_up = base_state(unknown, version)  # type: ignore[misc]
        for key in unknown:
            if key not in looked_up:
                raise CleanerInputError(f"base state at version {version} does not name key {key!r}")
            state[key] = looked_up[key]
    return state


def _evaluate(pending: list[tuple[int, CompactCommand]], state: dict[str, Entry | None],
              newest: dict[str, tuple[int, Any]]) -> None:
    """Run the commands against ``state`` through apply's own evaluator (storage/evaluator.py),
    recording each key's newest effect: the entry a PUT wrote, or a tombstone for every
    DELETE op that ran, whether or not the key existed (rule 2). A chunk at a time, so the
    results (which the cleaner reads once) are freed young."""
    for start in range(0, len(pending), EVALUATE_CHUNK_RECORDS):
        results, _history_rows = evaluate_compact(pending[start:start + EVALUATE_CHUNK_RECORDS], state)
        for result in results:
            offset = result.offset
            for op in result.ops:
                if op.kind == OpKind.PUT:
                    entry: Entry = op.entry  # type: ignore[assignment]
                    newest[op.key] = (offset, (_PUT, op.key, entry.value, entry.content_type,
                                               entry.create_version, *((entry.lease,) if entry.lease else ())))
                elif op.kind == OpKind.DELETE:
                    newest[op.key] = (offset, None)


def _group(records: dict[int, bytes], in_range: list[Batch]) -> list[Batch]:
    """Pack surviving records into batches: a new batch wherever offsets jump or the source
    batch changes (its epoch, timestamp and control flag are kept). Depends only on the
    (offset, source batch attributes) pairs, so equal inputs give equal batches."""
    bases = [batch.base_offset for batch in in_range]
    batches: list[Batch] = []
    run: list[bytes] = []
    run_start = -1
    run_slot: tuple[int, int, bool] | None = None
    for offset in sorted(records):
        source = in_range[bisect.bisect_right(bases, offset) - 1]
        check(source.base_offset <= offset < source.next_offset, f"offset {offset} outside the cleaned batches")
        slot = (source.epoch, source.timestamp_ms, source.control)
        if run and (offset != run_start + len(run) or slot != run_slot):
            batches.append(Batch(run_start, run_slot[0], run_slot[1], run_slot[2], tuple(run)))  # type: ignore[index]
            run = []
        if not run:
            run_start, run_slot = offset, slot
        run.append(records[offset])
    if run:
        batches.append(Batch(run_start, run_slot[0], run_slot[1], run_slot[2], tuple(run)))  # type: ignore[index]
    return batches


def prefix_digest(batches: Iterable[Batch], end_offset: int, pause: Callable[[], None] = lambda: None) -> str:
    """SHA-256 over the encoded batches below ``end_offset`` (the cleaned range
    [log start, end_offset)): equal digests at equal (log start, end offset) mean
    byte-identical cleaned ranges on two replicas."""
    from storage.batch_codec import encode_batch

    digest = hashlib.sha256()
    for batch in batches:
        if batch.next_offset > end_offset:
            break
        pause()
        digest.update(encode_batch(batch))
    return digest.hexdigest()
