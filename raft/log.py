"""The log as the core sees it: a narrow protocol, and an in-memory twin for the simulator.

storage/segment_log.py implements ``RaftLog`` on disk. The protocol holds only what raft/
calls; the caller's side (``flush``, the cleaner's ``replace_prefix``, snapshots and
retention) is on the concrete logs, ``SegmentLog`` and ``MemoryLog``, whose ``reopen()``
models a crash: everything appended but not flushed is lost.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from raft.types import Batch, SnapshotId, check


@dataclass(frozen=True, slots=True)
class QuorumStateRecord:
    """What a node must persist before acting on it: its epoch, vote and known leader."""

    epoch: int
    voted_id: int  # -1 when it has not voted in this epoch
    leader_id: int  # -1 when no leader is known in this epoch
    # A voter acknowledged records of its log: an empty log at a restart means it was lost.
    log_acknowledged: bool = False
    # Its log was lost: no (pre-)votes, no campaign until it caught up (roles.py rule 12).
    log_lost: bool = False
    # Committed voters records (offset, record), so the set in force survives a prefix that
    # was replaced by a snapshot (raft/voters.py); empty while the log holds none.
    voters: tuple[tuple[int, bytes], ...] = ()


class RaftLog(Protocol):
    """The log operations the core calls. Offsets count records, not bytes."""

    def start_offset(self) -> int:
        """The first offset still held (above 0 once a prefix was replaced by a snapshot)."""

    def end_offset(self) -> int:
        """The offset the next appended record gets."""

    def flushed_offset(self) -> int:
        """Every offset below this is durable (fsynced); never above end_offset()."""

    def last_epoch(self) -> int:
        """Epoch of the last batch; the snapshot's epoch when the log is empty past it; else 0."""

    def append(self, batch: Batch) -> None:
        """Append one batch; its epoch >= last_epoch(), and batch.base_offset == end_offset(),
        or above it only when the whole batch lies below cleaned_end()."""

    def truncate_to(self, offset: int) -> None:
        """Drop every record at ``offset`` and above (never below start_offset(); the core
        never asks below its high watermark: raft/follower.py checks that first)."""

    def read(self, offset: int, max_bytes: int) -> list[Batch]:
        """Whole batches holding offsets >= ``offset`` (at least one when any exist, even if
        larger than max_bytes). The first batch may start below ``offset``."""

    def end_offset_for_epoch(self, epoch: int) -> tuple[int, int]:
        """(largest epoch <= ``epoch`` held, the end offset of that epoch); (0, 0) when none.
        For epoch >= last_epoch() this is (last_epoch(), end_offset())."""

    def latest_snapshot_id(self) -> SnapshotId | None:
        """The newest snapshot the log knows of, or None."""

    def reset_to_snapshot(self, snapshot_id: SnapshotId) -> None:
        """Replace the whole log by a snapshot: start = end = snapshot_id.end_offset."""

    def cleaned_end(self) -> int:
        """Offsets below this were compacted (replace_prefix) or copied from a compacted
        log: offsets may jump there. 0 for a log never cleaned."""

    def allow_gaps_below(self, offset: int) -> None:
        """Durably let appends below ``offset`` skip offsets (a follower copying the
        leader's cleaned prefix). Raises cleaned_end(); never lowers it."""


class MemoryLog:
    """An in-memory ``RaftLog``; ``reopen()`` returns what survives a crash."""

    def __init__(self) -> None:
        self._batches: list[Batch] = []
        self._start_offset = 0
        self._flushed_offset = 0
        self._snapshot_id: SnapshotId | None = None
        self._cleaned_end = 0  # offsets below may jump (compacted prefix)
        self._cleaner_end = 0  # ... compacted by this log's own replace_prefix
        # Durable copy of what was flushed, kept separately so a crash after a
        # truncation followed by appends cannot resurrect or invent records.
        self._durable_batches: list[Batch] = []

    def start_offset(self) -> int:
        return self._start_offset

    def end_offset(self) -> int:
        return self._batches[-1].next_offset if self._batches else self._start_offset

    def flushed_offset(self) -> int:
        return self._flushed_offset

    def last_epoch(self) -> int:
        if self._batches:
            return self._batches[-1].epoch
        return self._snapshot_id.epoch if self._snapshot_id else 0

    def append(self, batch: Batch) -> None:
        end = self.end_offset()
        check(batch.base_offset == end or end < batch.base_offset < batch.next_offset <= self._cleaned_end,
              f"append at {batch.base_offset}, end is {end}")
        check(batch.epoch >= self.last_epoch(), f"append epoch {batch.epoch} below {self.last_epoch()}")
        check(len(batch.records) > 0, "empty batch")
        self._batches.append(batch)

    def truncate_to(self, offset: int) -> None:
        check(offset >= self._start_offset, f"truncate to {offset} below start {self._start_offset}")
        kept = [b for b in self._batches if b.next_offset <= offset]
        partial = [b for b in self._batches if b.base_offset < offset < b.next_offset]
        for batch in partial:  # cut inside a batch: keep the records below offset
            kept.append(Batch(batch.base_offset, batch.epoch, batch.timestamp_ms, batch.control,
                              batch.records[: offset - batch.base_offset]))
        self._batches = kept
        self._flushed_offset = min(self._flushed_offset, offset)
        self._durable_batches = _cut(self._durable_batches, offset)

    def read(self, offset: int, max_bytes: int) -> list[Batch]:
        result: list[Batch] = []
        size = 0
        first = bisect.bisect_right(self._batches, offset, key=_next_offset)
        for batch in itertools.islice(self._batches, first, None):
            size += batch.size_bytes()
            if result and size > max_bytes:
                break
            result.append(batch)
        return result

    def end_offset_for_epoch(self, epoch: int) -> tuple[int, int]:
        # The end of an epoch is where the next epoch starts (not the last record held of
        # it: a cleaned prefix may have dropped that record, never the next epoch's first).
        if epoch >= self.last_epoch():
            return self.last_epoch(), self.end_offset()
        best: tuple[int, int] = (0, 0)
        found = False  # an epoch <= ``epoch`` is held: the snapshot's, or a batch's
        if self._snapshot_id and self._snapshot_id.epoch <= epoch:
            best = (self._snapshot_id.epoch, self._snapshot_id.end_offset)
            found = True
        for batch in self._batches:
            if batch.epoch <= epoch:
                best = (batch.epoch, batch.next_offset)
                found = True
            else:
                return (best[0], batch.base_offset) if found else best
        return best

    def flush(self) -> int:
        """Make everything appended durable (the caller's flush; Ready.flush asks for it)."""
        self._flushed_offset = self.end_offset()
        self._durable_batches = list(self._batches)
        return self._flushed_offset

    def latest_snapshot_id(self) -> SnapshotId | None:
        return self._snapshot_id

    def reset_to_snapshot(self, snapshot_id: SnapshotId) -> None:
        self._snapshot_id = snapshot_id
        self._batches = []
        self._durable_batches = []
        self._start_offset = snapshot_id.end_offset
        self._flushed_offset = snapshot_id.end_offset
        self._cleaner_end = min(self._cleaner_end, snapshot_id.end_offset)

    def cleaned_end(self) -> int:
        return self._cleaned_end

    def cleaner_end(self) -> int:
        """SegmentLog.cleaner_end's twin: the end of what replace_prefix compacted."""
        return self._cleaner_end

    def allow_gaps_below(self, offset: int) -> None:
        self._cleaned_end = max(self._cleaned_end, offset)

    def replace_prefix(self, batches: Sequence[Batch], clean_end: int) -> None:
        """SegmentLog.replace_prefix's contract: ``batches`` keep their offsets, lie in
        [start_offset, clean_end) and end exactly at ``clean_end``, a batch boundary at or
        below the flushed offset; the swap is atomic and durable (in memory: one step)."""
        check(self._start_offset < clean_end <= self._flushed_offset,
              f"clean_end {clean_end} outside ({self._start_offset}, {self._flushed_offset}]")
        check(bool(batches) and batches[-1].next_offset == clean_end,
              f"the cleaned batches must end at clean_end {clean_end}")
        check(any(b.next_offset == clean_end for b in self._batches), f"{clean_end} is not a batch boundary")
        previous_end = self._start_offset
        for batch in batches:
            check(batch.base_offset >= previous_end and len(batch.records) > 0,
                  f"cleaned batch at {batch.base_offset} overlaps the one before or is empty")
            previous_end = batch.next_offset
        self._batches = list(batches) + [b for b in self._batches if b.base_offset >= clean_end]
        self._durable_batches = list(batches) + [b for b in self._durable_batches if b.base_offset >= clean_end]
        self._cleaned_end = max(self._cleaned_end, clean_end)
        self._cleaner_end = max(self._cleaner_end, clean_end)

    def record_snapshot(self, snapshot_id: SnapshotId) -> None:
        """Remember a snapshot taken locally (SegmentLog.record_snapshot's twin), so the
        leader can name it to fetchers."""
        check(snapshot_id.end_offset >= self._start_offset,
              f"snapshot end {snapshot_id.end_offset} below log start {self._start_offset}")
        if self._snapshot_id is None or snapshot_id.end_offset > self._snapshot_id.end_offset:
            self._snapshot_id = snapshot_id

    def delete_before(self, offset: int) -> int:
        """Start the log at ``offset``, dropping every batch below it; durable when it returns.

        SegmentLog.delete_before's twin. The real log drops whole segments, so it moves the
        start to a segment boundary at or below the offset it is asked for; the model is given
        that boundary: a batch boundary at or below both the flushed offset and the recorded
        snapshot's end (the snapshot holds the state of everything dropped)."""
        snapshot_end = self._snapshot_id.end_offset if self._snapshot_id is not None else 0
        check(self._start_offset <= offset <= min(snapshot_end, self._flushed_offset),
              f"delete_before({offset}) outside [{self._start_offset}, "
              f"min(snapshot end {snapshot_end}, flushed {self._flushed_offset})]")
        check(offset in (self._start_offset, self.end_offset())
              or any(b.base_offset == offset for b in self._batches),
              f"delete_before({offset}) is not a batch boundary")
        self._batches = [b for b in self._batches if b.base_offset >= offset]
        self._durable_batches = [b for b in self._durable_batches if b.base_offset >= offset]
        self._start_offset = offset
        return offset

    def batches(self) -> list[Batch]:
        """Every batch held, in order (the simulator's cleaner reads the prefix)."""
        return list(self._batches)

    def reopen(self) -> MemoryLog:
        """What a restarted node finds: the flushed prefix, nothing else."""
        log = MemoryLog()
        log._start_offset = self._start_offset
        log._snapshot_id = self._snapshot_id
        log._cleaned_end = self._cleaned_end
        log._cleaner_end = self._cleaner_end
        log._batches = list(self._durable_batches)
        log._durable_batches = list(self._durable_batches)
        log._flushed_offset = log.end_offset()
        return log


def _next_offset(batch: Batch) -> int:
    return batch.base_offset + len(batch.records)


def _cut(batches: list[Batch], offset: int) -> list[Batch]:
    kept: list[Batch] = []
    for batch in batches:
        if batch.next_offset <= offset:
            kept.append(batch)
        elif batch.base_offset < offset:
            kept.append(Batch(batch.base_offset, batch.epoch, batch.timestamp_ms, batch.control,
                              batch.records[: offset - batch.base_offset]))
    return kept
