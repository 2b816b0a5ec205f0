"""The log cleaner: compacts the log prefix below the dirty offset the leader announced.

Rules (shared/DESIGN.md section 3, KIP-595's log-compaction discussion):

1. Only offsets below the dirty offset are cleaned, and only whole batches: the cleaned range
   ends at the last batch boundary at or below the dirty offset (``clean_end``). Batch
   boundaries are the same on every replica, so every replica cleans the same range.
2. In that range each key keeps only its newest record, rewritten as an unconditional
   effect: a PUT carrying the value, content type and the key's create_version, or a DELETE
   (a tombstone). Offsets never move, so a kept PUT's offset still gives its mod_version.
3. A tombstone is dropped only when its offset is below the tombstone horizon, i.e. every
   voter has replicated past it; otherwise it is kept, so a replica behind it still learns
   that the key is gone.
4. Control records (leader changes) are kept verbatim: every epoch keeps a record, so
   epoch lookups for divergence still work on a cleaned log.
5. The record at ``clean_end - 1`` always survives (an empty command when nothing else
   stands there), so the cleaned range keeps its end offset.
6. Output depends only on the state the range produces, never on how the input was written:
   cleaning a raw prefix and cleaning an already-cleaned copy of it give byte-identical
   batches. That is what lets every replica clean on its own and still hold identical
   prefixes (the digest in /v1/status shows it).

Conditions (compare-and-set, txn compares) are evaluated with the state machine's own pure
evaluator, so the cleaner and every replica's SQLite rows can never disagree about which
branch of a command ran.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from raft.types import Batch, check
from storage.commands import Command, CommandDecodeError, Op, OpKind, decode_command, encode_command
from storage.state_machine import Entry, evaluate_commands

EMPTY_COMMAND = encode_command(Command((), (), ()))


@dataclass(frozen=True, slots=True)
class CleanResult:
    batches: list[Batch]  # the cleaned replacement for every batch below clean_end
    clean_end: int  # offsets below this were cleaned (a batch boundary <= the dirty offset)
    records_in: int
    records_out: int
    tombstones_dropped: int


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where a surviving record sits and the batch attributes it keeps."""

    epoch: int
    timestamp_ms: int
    control: bool


def cleanable_end(batches: Iterable[Batch], dirty_offset: int) -> int:
    """The last batch boundary at or below ``dirty_offset``."""
    end = 0
    for batch in batches:
        if batch.next_offset > dirty_offset:
            break
        end = batch.next_offset
    return end


def clean_prefix(batches: Sequence[Batch], dirty_offset: int, tombstone_horizon: int) -> CleanResult:
    """Clean ``batches`` (the log from offset 0, in order) below ``dirty_offset``.

    Batches at or above the cleaned range are ignored; the caller keeps them as they are.
    """
    clean_end = cleanable_end(batches, dirty_offset)
    in_range = [batch for batch in batches if batch.next_offset <= clean_end]
    check(not in_range or in_range[0].base_offset >= 0, "negative offset in the log")

    slots: dict[int, _Slot] = {}
    control_records: dict[int, bytes] = {}
    commands: list[tuple[int, Command | str]] = []
    keys: set[str] = set()
    records_in = 0
    for batch in in_range:
        for index, record in enumerate(batch.records):
            offset = batch.base_offset + index
            records_in += 1
            slots[offset] = _Slot(batch.epoch, batch.timestamp_ms, batch.control)
            if batch.control:
                control_records[offset] = record
                continue
            try:
                command = decode_command(record)
            except CommandDecodeError as exc:
                commands.append((offset, f"record does not decode: {exc}"))
                continue
            commands.append((offset, command))
            keys.update(compare.key for compare in command.compare)
            keys.update(op.key for op in (*command.success, *command.failure))

    state: dict[str, Entry | None] = dict.fromkeys(keys)
    results = evaluate_commands(commands, state)

    # The newest effect on each key: (offset, PUT entry or None for a delete).
    newest: dict[str, tuple[int, Entry | None]] = {}
    for result in results:
        for op in result.ops:
            if op.kind == OpKind.PUT:
                newest[op.key] = (result.offset, op.entry)
            elif op.kind == OpKind.DELETE:
                newest[op.key] = (result.offset, None)

    effects: dict[int, list[Op]] = {}
    tombstones_dropped = 0
    for key, (offset, entry) in newest.items():
        if entry is None:
            if offset < tombstone_horizon:
                tombstones_dropped += 1
                continue
            effects.setdefault(offset, []).append(Op(OpKind.DELETE, key))
        else:
            check(state[key] == entry, f"cleaner: newest put of {key!r} is not its final state")
            effects.setdefault(offset, []).append(
                Op(OpKind.PUT, key, entry.value, entry.content_type, entry.create_version))

    records: dict[int, bytes] = dict(control_records)
    for offset, ops in effects.items():
        records[offset] = encode_command(Command((), tuple(sorted(ops, key=lambda op: op.key))))
    if clean_end > 0 and clean_end - 1 not in records:
        records[clean_end - 1] = EMPTY_COMMAND

    cleaned = _group(records, slots)
    return CleanResult(cleaned, clean_end, records_in, sum(len(b.records) for b in cleaned), tombstones_dropped)


def _group(records: dict[int, bytes], slots: dict[int, _Slot]) -> list[Batch]:
    """Pack surviving records into batches: a new batch wherever offsets jump or the batch
    attributes (epoch, timestamp, control) change. Depends only on (offset, slot) pairs."""
    batches: list[Batch] = []
    run: list[bytes] = []
    run_start = -1
    run_slot: _Slot | None = None
    for offset in sorted(records):
        slot = slots[offset]
        if run and (offset != run_start + len(run) or slot != run_slot):
            batches.append(Batch(run_start, run_slot.epoch, run_slot.timestamp_ms, run_slot.control, tuple(run)))  # type: ignore[union-attr]
            run = []
        if not run:
            run_start, run_slot = offset, slot
        run.append(records[offset])
    if run:
        batches.append(Batch(run_start, run_slot.epoch, run_slot.timestamp_ms, run_slot.control, tuple(run)))  # type: ignore[union-attr]
    return batches


def prefix_digest(batches: Iterable[Batch], end_offset: int) -> str:
    """SHA-256 over the encoded batches below ``end_offset``: equal digests mean
    byte-identical cleaned prefixes on two replicas."""
    from storage.batch_codec import encode_batch

    digest = hashlib.sha256()
    for batch in batches:
        if batch.next_offset > end_offset:
            break
        digest.update(encode_batch(batch))
    return digest.hexdigest()
