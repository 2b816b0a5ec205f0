"""Property test: SegmentLog behaves like raft.log.MemoryLog through appends, flushes,
truncations, snapshots, cleaned prefixes (replace_prefix), a log start moved behind a
snapshot (delete_before) and power losses: after a crash exactly the flushed prefix
survives, batch for batch. Reads of the tail appended since the log was opened come from
memory (storage/tail_cache.py), bounded to a few batches or not, and let go when applied:
they must answer as the disk would.

SegmentLog makes a few things durable earlier than MemoryLog (rolling a segment fsyncs it,
truncate_to is durable when it returns, replace_prefix rewrites and fsyncs the active segment
when the cut lies in it); the model is told with ``flush()`` when that happens, and the test
asserts that it happens only at those points. delete_before drops whole segments, so the
real log picks the new start (a segment boundary); the test checks that choice is allowed
and hands it to the model.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from raft.log import MemoryLog
from raft.types import Batch, SnapshotId
from storage.segment_log import SegmentLog
from tests.storage.helpers import make_batch, power_loss

SEGMENT_BYTES = 1024
INDEX_INTERVAL_BYTES = 150
EVERYTHING = 1 << 40


class SegmentLogMatchesMemoryLog(RuleBasedStateMachine):
    @initialize(verify_sealed_segments=st.booleans(), tail_cache_bytes=st.sampled_from([0, 300, 1 << 20]))
    def open_logs(self, verify_sealed_segments: bool, tail_cache_bytes: int) -> None:
        self.verify_sealed_segments = verify_sealed_segments
        self.tail_cache_bytes = tail_cache_bytes
        self.directory = Path(tempfile.mkdtemp(prefix="segment-log-model-"))
        self.log_dir = self.directory / "log"
        self.real = self._open()
        self.model = MemoryLog()
        self.fill = 0

    def _open(self) -> SegmentLog:
        return SegmentLog(self.log_dir, segment_bytes=SEGMENT_BYTES, index_interval_bytes=INDEX_INTERVAL_BYTES,
                          verify_sealed_segments=self.verify_sealed_segments, tail_cache_bytes=self.tail_cache_bytes)

    def teardown(self) -> None:
        if hasattr(self, "real"):
            self.real.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    @rule(record_count=st.integers(1, 12), epoch_step=st.sampled_from([0, 0, 0, 1, 2]), control=st.booleans())
    def append(self, record_count: int, epoch_step: int, control: bool) -> None:
        base = self.model.end_offset()
        batch = make_batch(base, self.model.last_epoch() + epoch_step, record_count, fill=self.fill)
        batch = Batch(batch.base_offset, batch.epoch, batch.timestamp_ms, control, batch.records)
        self.fill += 1
        flushed_before = self.real.flushed_offset()
        self.real.append(batch)
        if self.real.flushed_offset() != flushed_before:
            # A segment roll fsyncs the sealed segment: everything before this batch is durable.
            assert self.real.flushed_offset() == base
            self.model.flush()
        self.model.append(batch)

    @rule()
    def flush(self) -> None:
        assert self.real.flush() == self.model.flush()

    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        # Raft truncates only above the high watermark, and the cleaned prefix and every
        # snapshot (of applied, so committed, state) lie below it.
        snapshot = self.model.latest_snapshot_id()
        lowest = max(self.model.start_offset(), self.model.cleaned_end(),
                     snapshot.end_offset if snapshot is not None else 0)
        offset = data.draw(st.integers(lowest, max(lowest, self.model.end_offset())))
        changes = offset < self.model.end_offset()
        self.real.truncate_to(offset)
        self.model.truncate_to(offset)
        if changes:  # truncate_to is durable, and so is everything below it
            assert self.real.flushed_offset() == offset
            self.model.flush()

    @rule(keep_unflushed_bytes=st.sampled_from([0, 0, 1, 37, 200, 5000]))
    def crash_and_reopen(self, keep_unflushed_bytes: int) -> None:
        before_crash = self.real.read(0, EVERYTHING)
        power_loss(self.real, keep_unflushed_bytes)
        self.real = self._open()
        self.model = self.model.reopen()
        survived = self.real.read(0, EVERYTHING)
        flushed_prefix = self.model.read(0, EVERYTHING)
        # The flushed prefix always survives; unflushed bytes that happened to reach the disk
        # may add whole batches from before the crash, never anything else.
        assert survived[: len(flushed_prefix)] == flushed_prefix
        assert survived == before_crash[: len(survived)]
        if len(survived) > len(flushed_prefix):
            self.real.truncate_to(self.model.end_offset())
        assert self.real.read(0, EVERYTHING) == flushed_prefix

    @precondition(lambda self: self.model.end_offset() > self.model.start_offset())
    @rule(data=st.data())
    def reset_to_snapshot(self, data: st.DataObject) -> None:
        end = data.draw(st.integers(self.model.end_offset(), self.model.end_offset() + 50))
        snapshot_id = SnapshotId(end, self.model.last_epoch() + data.draw(st.integers(0, 1)))
        self.real.reset_to_snapshot(snapshot_id)
        self.model.reset_to_snapshot(snapshot_id)

    @precondition(lambda self: _clean_ends(self.model))
    @rule(data=st.data())
    def replace_prefix(self, data: st.DataObject) -> None:
        clean_end = data.draw(st.sampled_from(_clean_ends(self.model)[::-1]))
        prefix = [b for b in self.model.batches() if b.next_offset <= clean_end]
        kept = data.draw(st.lists(st.booleans(), min_size=sum(len(b.records) for b in prefix),
                                  max_size=sum(len(b.records) for b in prefix)))
        cleaned = compact(prefix, kept)
        flushed_before = self.real.flushed_offset()
        self.real.replace_prefix(cleaned, clean_end)
        self.model.replace_prefix(cleaned, clean_end)
        if self.real.flushed_offset() != flushed_before:
            # The cut lay in the active segment, which was rewritten and fsynced whole.
            assert self.real.flushed_offset() == self.model.end_offset()
            self.model.flush()

    @precondition(lambda self: self.model.flushed_offset() > self.model.start_offset())
    @rule(data=st.data())
    def snapshot_and_delete_before(self, data: st.DataObject) -> None:
        """A snapshot taken at an applied (flushed) batch end, then the log start moved
        behind it, as the runtime does after taking a snapshot."""
        ends = [b for b in self.model.batches() if b.next_offset <= self.model.flushed_offset()]
        covered = data.draw(st.sampled_from(ends[::-1]))  # newest first: shrinks to the usual case
        snapshot_id = SnapshotId(covered.next_offset, covered.epoch)
        self.real.record_snapshot(snapshot_id)
        self.model.record_snapshot(snapshot_id)
        snapshot_end = self.model.latest_snapshot_id().end_offset  # an older one may be newer
        asked = data.draw(st.one_of(st.just(snapshot_end),
                                    st.integers(self.model.start_offset(), snapshot_end)))
        start_before = self.model.start_offset()
        new_start = self.real.delete_before(asked)
        assert start_before <= new_start <= asked
        self.model.delete_before(new_start)  # checks it is a batch boundary, flushed, covered

    @rule(data=st.data())
    def apply_to(self, data: st.DataObject) -> None:
        """The runtime applied up to some offset: the batches below it leave memory."""
        self.real.applied_below(data.draw(st.integers(self.model.start_offset(), self.model.end_offset())))
        assert self.real.cached_bytes() <= self.tail_cache_bytes

    @rule(data=st.data())
    def read_from(self, data: st.DataObject) -> None:
        offset = data.draw(st.integers(self.model.start_offset(), self.model.end_offset()))
        assert self.real.read(offset, EVERYTHING) == self.model.read(offset, EVERYTHING)
        one = self.real.read(offset, 1)
        if offset < self.model.end_offset():
            assert len(one) == 1 and offset < one[0].next_offset
            # Below cleaned_end the offset may be a removed record: the next batch answers.
            assert one[0].base_offset <= offset or offset < self.model.cleaned_end()
        else:
            assert one == []

    @invariant()
    def same_view(self) -> None:
        if not hasattr(self, "real"):
            return
        real, model = self.real, self.model
        assert real.start_offset() == model.start_offset()
        assert real.end_offset() == model.end_offset()
        assert real.flushed_offset() == model.flushed_offset()
        assert real.last_epoch() == model.last_epoch()
        assert real.latest_snapshot_id() == model.latest_snapshot_id()
        assert real.cleaned_end() == model.cleaned_end()
        for epoch in range(model.last_epoch() + 2):
            assert real.end_offset_for_epoch(epoch) == model.end_offset_for_epoch(epoch), epoch
        assert real.read(model.start_offset(), EVERYTHING) == model.read(model.start_offset(), EVERYTHING)


def _clean_ends(model: MemoryLog) -> list[int]:
    """Batch boundaries a cleaner may cut at: above the start, at or below the flushed offset
    (the dirty offset never passes the high watermark, which is flushed on a majority)."""
    return [b.next_offset for b in model.batches()
            if model.start_offset() < b.next_offset <= model.flushed_offset()]


def compact(prefix: list[Batch], kept: list[bool]) -> list[Batch]:
    """A stand-in for the cleaner: drop the records ``kept`` marks False, never moving an
    offset, regrouped into runs of consecutive offsets. Like the real cleaner it keeps every
    control batch, the first record of each epoch (epoch boundaries stay where they are) and
    the last record of the prefix (the cleaned copy ends at clean_end)."""
    cleaned: list[Batch] = []
    position = 0
    previous_epoch = -1
    for batch_number, batch in enumerate(prefix):
        run: list[bytes] = []
        run_start = -1
        for index, record in enumerate(batch.records):
            keep = (kept[position] or batch.control
                    or (index == 0 and batch.epoch != previous_epoch)
                    or (batch_number == len(prefix) - 1 and index == len(batch.records) - 1))
            position += 1
            offset = batch.base_offset + index
            if not keep:
                if run:
                    cleaned.append(Batch(run_start, batch.epoch, batch.timestamp_ms, batch.control, tuple(run)))
                    run = []
                continue
            if not run:
                run_start = offset
            run.append(record)
        if run:
            cleaned.append(Batch(run_start, batch.epoch, batch.timestamp_ms, batch.control, tuple(run)))
        previous_epoch = batch.epoch
    return cleaned


SegmentLogMatchesMemoryLog.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSegmentLogMatchesMemoryLog = SegmentLogMatchesMemoryLog.TestCase
