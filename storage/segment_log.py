"""The raft log on disk (``SegmentLog``): appends, reads, flushes, truncations, snapshots
and compacted prefixes over a directory of segment files.
Over 800 lines: every operation shares one lock and the durability rules below.

Layout of ``log_dir`` (normally ``<data-dir>/log``), and the modules that own each file::

    <base_offset:020d>.log       batches back to back, storage/batch_codec.py format
    <base_offset:020d>.index     sparse offset index (storage/segment_files.py)
    leader-epoch-checkpoint      epoch -> start offset (storage/log_checkpoints.py)
    log-start-checkpoint         log start offset, latest snapshot id, cleaned ends (the same)
    cleaner-swap, *.log.cleaned  only while replace_prefix installs a compacted prefix
                                 (storage/cleaned_segments.py)

Durability rules (why the code is ordered the way it is):

- ``append`` writes into the page cache only; ``flush`` fsyncs the active segment (and the
  directory when files were created or deleted) and only then raises ``flushed_offset``.
  ``flush`` runs on a worker thread while the event loop keeps appending, so it captures the
  end offset and a truncation generation under the lock, fsyncs a dup of the file descriptor
  outside it, and raises ``flushed_offset`` only if no truncation happened meanwhile.
- Rolling to a new segment first fsyncs the old one and writes the epoch checkpoint, so every
  sealed segment is durable and complete: only the last segment can have a torn tail.
- ``truncate_to`` is durable when it returns (the cut file is fsynced, deleted files are
  removed from the directory durably, newest first): a truncated record must never come
  back after a crash, and a crash halfway leaves a shorter log, never a gap.
- Any failed write or fsync (ENOSPC, EIO) puts the log in a failed state: appends, truncations
  and flushes raise ``LogWriteError`` until the log is reopened (after an fsync failure the page
  cache can no longer be trusted); reads keep working on what was written before.

Recovery on open is storage/segment_recovery.py's (see docs/storage.md): only the last
segment may lose a torn tail; any other damage raises ``CorruptLogError`` with the repair
command.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from raft.types import Batch, SnapshotId, check
from storage.batch_codec import (
    HEADER_BYTES,
    BatchEncoder,
    BatchHeader,
    CorruptBatchError,
    TruncatedBatchError,
    decode_batch,
    decode_header,
)
from storage.cleaned_segments import (
    SWAP_MARKER_NAME,
    copy_segment_tail,
    finish_cleaned_file,
    remove_cleaned_files,
    swap_cleaned_files,
    write_cleaned_segments,
    write_swap_marker,
)
from storage.descriptors import deferred_flush, out_of_descriptors
from storage.durable_files import fsync_directory, write_all_parts
from storage.failpoints import Failpoints
from storage.log_checkpoints import (
    LogStartCheckpoint,
    clamp_epoch_entries,
    write_epoch_checkpoint,
    write_log_start_checkpoint,
)
from storage.segment_files import (
    DEFAULT_INDEX_INTERVAL_BYTES,
    READ_CHUNK_BYTES,
    CorruptLogError,
    Segment,
    create_segment,
    read_exact,
    rewrite_cut_batch,
    write_index,
)
from storage.segment_recovery import recover_log_dir
from storage.tail_cache import DEFAULT_TAIL_CACHE_BYTES, TailCache

logger = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
ITERATE_CHUNK_BYTES = 1024 * 1024  # bound on the bytes one iter_batches step holds
ROLL_RETRY_S = 0.1  # out of descriptors, a roll is retried at most this often (as a flush is)


class LogWriteError(Exception):
    """A write or fsync failed (disk full, I/O error); the log refuses writes until reopened."""


class LogChangedError(Exception):
    """replace_prefix gave up, changing nothing: the log was truncated, reset or had segments
    deleted while the cleaned copy was written. Cleaning again later is safe."""



class SegmentLog:
    """``raft.log.RaftLog`` on disk. Thread-safe: one lock guards every method."""

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES,
        failpoints: Failpoints | None = None,
        verify_sealed_segments: bool = True,
        tail_cache_bytes: int = DEFAULT_TAIL_CACHE_BYTES,
    ) -> None:
        """Open (recovering) or create the log in ``log_dir``.

        ``verify_sealed_segments`` (default) CRC-checks every sealed segment on open, so that a
        flipped bit anywhere stops startup instead of surfacing when the record is next read;
        opening then reads the whole log once. Without it, sealed segments are trusted through
        their index (rebuilt by a scan when damaged) and only the last segment is scanned.

        ``tail_cache_bytes`` bounds the batches appended in this process that reads answer
        from memory (storage/tail_cache.py; 0 turns it off).
        """
        check(segment_bytes >= 1024, f"segment_bytes {segment_bytes} below 1024")
        check(index_interval_bytes > 0, "index_interval_bytes must be positive")
        self._log_dir = Path(log_dir)
        self._segment_bytes = segment_bytes
        self._index_interval_bytes = index_interval_bytes
        self._verify_sealed_segments = verify_sealed_segments
        self._failpoints = failpoints if failpoints is not None else Failpoints.from_env()
        self._lock = threading.Lock()
        self._encoder = BatchEncoder()  # used under _lock only
        self._tail_cache = TailCache(tail_cache_bytes)  # used under _lock only
        self._segments: list[Segment] = []
        self._segment_bases: list[int] = []
        self._epoch_entries: list[tuple[int, int]] = []  # (epoch, start offset), increasing
        self._epoch_checkpoint_dirty = False
        self._start_offset = 0
        self._snapshot_id: SnapshotId | None = None
        self._cleaned_end = 0  # offsets below this were compacted by replace_prefix: gaps allowed
        self._cleaner_end = 0  # ... by this replica's own replace_prefix (not copied)
        self._flushed_offset = 0
        self._truncation_generation = 0
        self._directory_dirty = False
        self._roll_retry_at_s = 0.0  # set while a roll waits for a file descriptor
        self.roll_deferrals = 0  # rolls that found no file descriptor, so far
        self._failure: LogWriteError | None = None
        self._closed = False
        self._log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._recover()
        except BaseException:
            self._close_files()
            raise

    # ------------------------------------------------------------------ RaftLog protocol

    def start_offset(self) -> int:
        with self._lock:
            return self._start_offset

    def end_offset(self) -> int:
        with self._lock:
            return self._end_offset()

    def flushed_offset(self) -> int:
        with self._lock:
            return self._flushed_offset

    def last_epoch(self) -> int:
        with self._lock:
            return self._last_epoch()

    def append(self, batch: Batch) -> None:
        with self._lock:
            self._check_writable()
            end_offset = self._end_offset()
            check(batch.base_offset == end_offset
                  or end_offset < batch.base_offset < batch.next_offset <= self._cleaned_end,
                  f"append at {batch.base_offset}, end is {end_offset}")
            check(batch.epoch >= self._last_epoch(), f"append epoch {batch.epoch} below {self._last_epoch()}")
            check(len(batch.records) > 0, "empty batch")
            with self._encoder.parts(batch) as parts:
                size_bytes = len(parts[0]) + len(parts[1])
                active = self._segments[-1]
                if active.size_bytes > 0 and active.size_bytes + size_bytes > self._segment_bytes:
                    self._roll()
                self._append_encoded(batch, parts)
            self._tail_cache.appended(batch, size_bytes, end_offset)

    def truncate_to(self, offset: int) -> None:
        with self._lock:
            self._check_writable()
            check(offset >= self._start_offset, f"truncate to {offset} below start {self._start_offset}")
            if offset >= self._end_offset():
                return
            self._truncation_generation += 1
            self._tail_cache.truncated(offset)
            try:
                self._truncate_locked(offset)
            except OSError as exc:
                raise self._fail(exc) from exc

    def read(self, offset: int, max_bytes: int) -> list[Batch]:
        with self._lock:
            result: list[Batch] = []
            if offset >= self._end_offset():
                return result
            offset = max(offset, self._start_offset)
            cached = self._tail_cache.read(offset, max_bytes)
            if cached is not None:
                return cached
            total_bytes = 0
            slot = max(bisect.bisect_right(self._segment_bases, offset) - 1, 0)
            for segment in self._segments[slot:]:
                position = segment.position_for(offset) if not result else 0
                total_bytes, full = self._read_segment(segment, position, offset, max_bytes, total_bytes, result)
                if full:
                    break
            return result

    def end_offset_for_epoch(self, epoch: int) -> tuple[int, int]:
        with self._lock:
            last_epoch = self._last_epoch()
            if epoch >= last_epoch:
                return last_epoch, self._end_offset()
            best = (0, 0)
            entries = self._epoch_entries
            if self._snapshot_id is not None and self._snapshot_id.epoch <= epoch:
                # The snapshot's epoch lasts until the first epoch held after it (a cleaned
                # copy may hold no record of the snapshot's own epoch).
                best = (self._snapshot_id.epoch, entries[0][1] if entries else self._end_offset())
            for slot, (entry_epoch, _start) in enumerate(entries):
                if entry_epoch > epoch:
                    break
                best = (entry_epoch, entries[slot + 1][1] if slot + 1 < len(entries) else self._end_offset())
            return best

    def flush(self) -> int:
        with self._lock:
            self._check_writable()
            target_offset = self._end_offset()
            if target_offset <= self._flushed_offset and not self._directory_dirty:
                return self._flushed_offset
            generation = self._truncation_generation
            segment = self._segments[-1]
            captured_bytes = segment.size_bytes
            try:
                fd = os.dup(segment.fd)
            except OSError as exc:
                if out_of_descriptors(exc):  # a dup writes nothing: retryable, not an fsync failure
                    raise deferred_flush(exc) from exc
                raise
            sync_directory = self._directory_dirty
            self._directory_dirty = False
        try:
            self._failpoints.hit("segment.before_fsync")
            os.fsync(fd)
            self._failpoints.hit("segment.after_fsync")
            if sync_directory:
                fsync_directory(self._log_dir)
        except OSError as exc:
            with self._lock:
                if out_of_descriptors(exc):  # opening the directory, not an fsync: nothing lost
                    self._directory_dirty = True
                    raise deferred_flush(exc) from exc
                raise self._fail(exc) from exc
        finally:
            os.close(fd)
        with self._lock:
            if generation == self._truncation_generation:
                self._flushed_offset = max(self._flushed_offset, target_offset)
                segment.durable_bytes = max(segment.durable_bytes, captured_bytes)
            return self._flushed_offset

    def latest_snapshot_id(self) -> SnapshotId | None:
        with self._lock:
            return self._snapshot_id

    def reset_to_snapshot(self, snapshot_id: SnapshotId) -> None:
        """Replace the whole log by ``snapshot_id``; durable when it returns.

        Order: delete segments at or above the snapshot's end (a plain suffix truncation),
        persist the new start offset, then delete the rest; recovery deletes any segment
        below the persisted start, so a crash anywhere leaves a consistent log.
        """
        with self._lock:
            self._check_writable()
            self._truncation_generation += 1
            self._tail_cache.clear()
            new_start = snapshot_id.end_offset
            try:
                above = [s for s in reversed(self._segments) if s.base_offset >= new_start]
                self._delete_segments(above)  # newest first: a crash leaves no gap
                if above:
                    fsync_directory(self._log_dir)
                cleaner_end = min(self._cleaner_end, new_start)
                self._write_start_checkpoint(start_offset=new_start, snapshot_id=snapshot_id,
                                             cleaner_end=cleaner_end)
                self._delete_segments([s for s in self._segments if s.base_offset < new_start])
                self._segments, self._segment_bases = [], []
                self._create_segment(new_start)
                self._epoch_entries = []
                self._write_epoch_checkpoint()
                fsync_directory(self._log_dir)
            except OSError as exc:
                raise self._fail(exc) from exc
            self._directory_dirty = False
            self._start_offset = new_start
            self._snapshot_id = snapshot_id
            self._flushed_offset = new_start
            self._cleaner_end = cleaner_end

    def cleaned_end(self) -> int:
        with self._lock:
            return self._cleaned_end

    def _write_start_checkpoint(self, **changes: int | SnapshotId | None) -> None:
        """Persist the log-start checkpoint: this log's fields with ``changes`` applied (the
        caller takes them over once the write succeeded)."""
        current = LogStartCheckpoint(self._start_offset, self._snapshot_id, self._cleaned_end, self._cleaner_end)
        write_log_start_checkpoint(self._log_dir, dataclasses.replace(current, **changes))  # type: ignore[arg-type]

    def cleaner_end(self) -> int:
        """Offsets below this were compacted by this replica's own cleaner (replace_prefix).
        A state older than it cannot be replayed through the log (docs/compaction.md rule
        9); one older than a copied cleaned prefix can (the leader kept every tombstone at
        and above the offset the copy started from)."""
        with self._lock:
            return self._cleaner_end

    def allow_gaps_below(self, offset: int) -> None:
        """Durably raise cleaned_end to ``offset`` before appending batches copied from the
        leader's cleaned prefix (offsets jump there), so recovery accepts those gaps."""
        with self._lock:
            self._check_writable()
            if offset <= self._cleaned_end:
                return
            try:
                self._write_start_checkpoint(cleaned_end=offset)
            except OSError as exc:
                raise self._fail(exc) from exc
            self._cleaned_end = offset

    # ------------------------------------------------------------------ beyond the protocol

    def record_snapshot(self, snapshot_id: SnapshotId) -> None:
        """Remember a snapshot taken locally, so latest_snapshot_id() and delete_before see it."""
        with self._lock:
            self._check_writable()
            check(snapshot_id.end_offset >= self._start_offset,
                  f"snapshot end {snapshot_id.end_offset} below log start {self._start_offset}")
            if self._snapshot_id is not None and snapshot_id.end_offset <= self._snapshot_id.end_offset:
                return
            try:
                self._write_start_checkpoint(snapshot_id=snapshot_id)
            except OSError as exc:
                raise self._fail(exc) from exc
            self._snapshot_id = snapshot_id

    def delete_before(self, offset: int) -> int:
        """Drop whole segments holding only offsets below ``offset``; return the new start offset.

        ``offset`` must be covered by the recorded snapshot. The active segment is never
        dropped. The new start offset is persisted before any file is deleted, and recovery
        deletes segments below it, so a crash in between leaves no gap.
        """
        with self._lock:
            self._check_writable()
            snapshot_end = self._snapshot_id.end_offset if self._snapshot_id is not None else 0
            check(offset <= snapshot_end, f"delete_before({offset}) above the snapshot end {snapshot_end}")
            doomed = [s for s in self._segments[:-1] if s.next_offset <= offset]
            if not doomed:
                return self._start_offset
            new_start = self._segments[len(doomed)].base_offset
            self._tail_cache.drop_below(new_start)
            try:
                self._write_start_checkpoint(start_offset=new_start)
                self._delete_segments(doomed)
                self._segments = self._segments[len(doomed):]
                self._segment_bases = self._segment_bases[len(doomed):]
                self._start_offset = new_start
                self._epoch_entries = clamp_epoch_entries(self._epoch_entries, self._start_offset)
                self._write_epoch_checkpoint()
                fsync_directory(self._log_dir)
            except OSError as exc:
                raise self._fail(exc) from exc
            return new_start

    def replace_prefix(self, batches: Sequence[Batch], clean_end: int) -> None:
        """Replace every batch below ``clean_end`` by ``batches``, a compacted copy of that prefix.

        ``batches`` keep their offsets (records may be missing, never moved), lie in
        [start_offset, clean_end), increase, and the last one ends exactly at ``clean_end``,
        a batch boundary of this log. Offsets below ``clean_end`` may jump from then on.
        Epoch boundaries are kept as they are (the cleaner keeps every control record).

        Crash safety: the new segments are written as ``*.log.cleaned`` and fsynced, a
        ``cleaner-swap`` marker naming old and new files is written atomically, then the new
        files are renamed over the old ones and the old ones deleted, and the marker removed.
        Recovery finishes a swap whose marker exists and deletes ``*.cleaned`` files without
        one, so a crash leaves either the old prefix or the new one, never a mix.

        Appends go on meanwhile: the cleaned copy, with the segment holding ``clean_end`` as
        far as it was written when the call began, is written and fsynced without the lock;
        under the lock are only the few batches appended since then and the swap itself.
        Holding the lock for the whole copy stalled appends (and so the event loop) for
        12-41 ms per cleaning. Raises LogChangedError, changing nothing, when the log was
        truncated, reset or had segments deleted while the copy was written.
        """
        with self._lock:
            self._check_writable()
            check(self._start_offset < clean_end <= self._end_offset(),
                  f"clean_end {clean_end} outside ({self._start_offset}, {self._end_offset()}]")
            check(bool(batches) and batches[-1].next_offset == clean_end,
                  f"the cleaned batches must end at clean_end {clean_end}")
            previous_end = self._start_offset
            for batch in batches:
                check(batch.base_offset >= previous_end and len(batch.records) > 0,
                      f"cleaned batch at {batch.base_offset} overlaps the one before or is empty")
                previous_end = batch.next_offset
            slot = bisect.bisect_right(self._segment_bases, clean_end - 1) - 1
            holder = self._segments[slot]
            try:
                cut_position, partial, _ = self._locate_cut(holder, clean_end)
            except OSError as exc:
                raise self._fail(exc) from exc
            check(partial is None, f"clean_end {clean_end} is not a batch boundary")
            generation = self._truncation_generation
            copied_end = holder.size_bytes
            read_fd = os.dup(holder.fd)  # stays valid even if the segment is deleted meanwhile
        pending: list[Segment] = []
        try:
            try:
                last_fd = self._write_cleaned_segments(batches, read_fd, holder.path, cut_position, copied_end,
                                                       pending)
            finally:
                os.close(read_fd)
        except (OSError, CorruptLogError) as exc:
            remove_cleaned_files(self._log_dir, pending)
            with self._lock:
                if self._truncation_generation != generation:
                    raise LogChangedError("the log changed while its cleaned prefix was written") from exc
                if isinstance(exc, OSError):
                    raise self._fail(exc) from exc
                raise
        with self._lock:
            if (self._truncation_generation != generation or slot >= len(self._segments)
                    or self._segments[slot] is not holder):
                os.close(last_fd)
                remove_cleaned_files(self._log_dir, pending)
                raise LogChangedError("the log changed while its cleaned prefix was written")
            try:
                self._check_writable()
            except BaseException:
                os.close(last_fd)
                remove_cleaned_files(self._log_dir, pending)
                raise
            self._truncation_generation += 1
            self._tail_cache.drop_below(clean_end)  # the cleaned copies replace those batches
            try:
                self._finish_replace_prefix_locked(pending, last_fd, slot, holder, copied_end, clean_end)
            except OSError as exc:
                raise self._fail(exc) from exc

    def iter_batches(self, from_offset: int | None = None,
                     chunk_bytes: int = ITERATE_CHUNK_BYTES) -> Iterator[Batch]:
        """Every batch from ``from_offset`` (default: the start) to the end, in order.

        Reads ``chunk_bytes`` at a time under the lock, so appends continue between steps.
        """
        offset = self.start_offset() if from_offset is None else from_offset
        while True:
            batches = self.read(offset, chunk_bytes)
            if not batches:
                return
            yield from batches
            offset = batches[-1].next_offset

    def applied_below(self, offset: int) -> None:
        """The caller applied every offset below ``offset``: reads there may go to disk, so
        the batches held in memory for them are let go (storage/tail_cache.py)."""
        with self._lock:
            self._tail_cache.drop_below(offset)

    def cached_bytes(self) -> int:
        """Encoded bytes of the appended batches held in memory for reads (at most the
        ``tail_cache_bytes`` bound)."""
        with self._lock:
            return self._tail_cache.size_bytes

    def size_bytes(self) -> int:
        """Total bytes of all segment files (for metrics)."""
        with self._lock:
            return sum(segment.size_bytes for segment in self._segments)

    def segment_count(self) -> int:
        with self._lock:
            return len(self._segments)

    def segment_paths(self) -> list[Path]:
        """Segment files, oldest first; every one but the last is sealed and immutable."""
        with self._lock:
            return [segment.path for segment in self._segments]

    def durable_sizes(self) -> dict[Path, int]:
        """Bytes of each segment known to be on stable storage; tests use it to model a power loss."""
        with self._lock:
            return {segment.path: segment.durable_bytes for segment in self._segments}

    def failed(self) -> bool:
        with self._lock:
            return self._failure is not None

    def close(self) -> None:
        """Close the files. No flush and no checkpoint write: closing behaves like a crash, so the
        recovery path is the only open path and is exercised on every restart."""
        with self._lock:
            self._close_files()
            self._tail_cache.clear()
            self._closed = True

    def __enter__(self) -> SegmentLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals (lock held)

    def _end_offset(self) -> int:
        return self._segments[-1].next_offset

    def _last_epoch(self) -> int:
        if self._epoch_entries:
            return self._epoch_entries[-1][0]
        return self._snapshot_id.epoch if self._snapshot_id is not None else 0

    def _check_writable(self) -> None:
        check(not self._closed, "log is closed")
        if self._failure is not None:
            raise self._failure

    def _fail(self, exc: OSError) -> LogWriteError:
        """Enter the failed state: nothing more is written until the log is reopened."""
        if self._failure is None:
            self._failure = LogWriteError(
                f"writing the log in {self._log_dir} failed ({exc}); the log refuses writes "
                "until it is reopened, reads keep working"
            )
            logger.error("%s", self._failure)
        return self._failure

    def _append_encoded(self, batch: Batch, parts: Sequence[bytes | memoryview]) -> None:
        """Write an encoded batch (its parts, in order) at the end of the active segment."""
        active = self._segments[-1]
        try:
            self._failpoints.hit("segment.before_write")
            write_all_parts(active.fd, parts)
            self._failpoints.hit("segment.after_write")
        except OSError as exc:
            try:  # do not leave half a batch for the next append to follow
                os.ftruncate(active.fd, active.size_bytes)
            except OSError:
                logger.warning("could not cut %s back to %d bytes after a failed write",
                               active.path, active.size_bytes)
            raise self._fail(exc) from exc
        self._note_written(active, batch, active.size_bytes, sum(len(part) for part in parts))

    def _note_written(self, active: Segment, batch: Batch, position: int, size_bytes: int) -> None:
        """Account for ``batch``, written at ``position`` as the active segment's last batch."""
        active.size_bytes = position + size_bytes
        active.next_offset = batch.next_offset
        # The active segment's index lives in memory until the segment is sealed: recovery
        # rebuilds it by scanning the last segment anyway, and a write to a second file here
        # costs a syscall and most likely makes the fsync commit that file's growth too
        # (ext4 data=ordered); batches of 100+ records wrote one every append (docs/storage.md).
        active.add_index_entry(batch.base_offset, position, self._index_interval_bytes)
        if not self._epoch_entries or batch.epoch > self._epoch_entries[-1][0]:
            # An entry starting here covers no offset (only the entry delete_before clamped
            # to an empty log's start can): drop it, as Kafka's epoch cache does, so that
            # end_offset_for_epoch never answers for an epoch the log does not hold.
            while self._epoch_entries and self._epoch_entries[-1][1] >= batch.base_offset:
                self._epoch_entries.pop()
            self._epoch_entries.append((batch.epoch, batch.base_offset))
            self._epoch_checkpoint_dirty = True

    def _fsync(self, fd: int) -> None:
        self._failpoints.hit("segment.before_fsync")
        os.fsync(fd)
        self._failpoints.hit("segment.after_fsync")

    def _roll(self) -> None:
        """Seal the active segment (durable, indexed) and start a new one at the end offset.

        Out of file descriptors (EMFILE, ENFILE) the roll waits instead of failing the log:
        before the new segment exists nothing changed, so appends go on into the active
        segment and the roll is tried again at most every ROLL_RETRY_S; after it exists, the
        sealed index (rebuilt from the segment on open when missing) and the directory sync
        (left to the next flush) can wait. Only a failed write or fsync fails the log."""
        if time.monotonic() < self._roll_retry_at_s:
            return
        old = self._segments[-1]
        try:
            self._fsync(old.fd)
            old.durable_bytes = old.size_bytes
            if self._epoch_checkpoint_dirty:
                self._write_epoch_checkpoint()
            self._failpoints.hit("segment.before_create")
            self._create_segment(old.next_offset)
        except OSError as exc:
            if out_of_descriptors(exc):
                self._defer_roll(exc)
                return
            raise self._fail(exc) from exc
        try:
            self._failpoints.hit("segment.after_roll")
            write_index(old, old.next_offset)
            fsync_directory(self._log_dir)
        except OSError as exc:
            if out_of_descriptors(exc):  # the new segment is in place: the rest can wait
                self._defer_roll(exc)
                self._roll_retry_at_s = 0.0
                return
            raise self._fail(exc) from exc
        if self._roll_retry_at_s:
            logger.warning("the log rolls to new segments again (file descriptors are back)")
            self._roll_retry_at_s = 0.0
        self._directory_dirty = False
        # Everything below the old segment's end is now durable, truncations included.
        self._flushed_offset = max(self._flushed_offset, old.next_offset)

    def _defer_roll(self, exc: OSError) -> None:
        """No descriptor for the roll: nothing was lost; warn once per shortage, retry later."""
        if not self._roll_retry_at_s:
            logger.warning("no file descriptor left to roll the log to a new segment (%s); appends go on "
                           "into the active segment and the roll is retried", exc.strerror)
        self.roll_deferrals += 1
        self._roll_retry_at_s = time.monotonic() + ROLL_RETRY_S

    def _create_segment(self, base_offset: int) -> Segment:
        segment = create_segment(self._log_dir, base_offset)
        self._segments.append(segment)
        self._segment_bases.append(base_offset)
        self._directory_dirty = True
        return segment

    def _delete_segments(self, doomed: list[Segment]) -> None:
        for segment in doomed:
            os.close(segment.fd)
            segment.fd = -1
            segment.path.unlink(missing_ok=True)
            segment.index_path.unlink(missing_ok=True)
        if doomed:
            self._directory_dirty = True

    def _truncate_locked(self, offset: int) -> None:
        slot = max(bisect.bisect_right(self._segment_bases, offset) - 1, 0)
        self._delete_segments(self._segments[:slot:-1])  # newest first: a crash leaves no gap
        del self._segments[slot + 1 :]
        del self._segment_bases[slot + 1 :]
        segment = self._segments[-1]
        position, partial, partial_end = self._locate_cut(segment, offset)
        if partial is None:
            os.ftruncate(segment.fd, position)
        else:  # keep the records of the cut batch that lie below ``offset``
            kept = Batch(partial.base_offset, partial.epoch, partial.timestamp_ms, partial.control,
                         partial.records[: offset - partial.base_offset])
            kept_bytes = rewrite_cut_batch(segment.path, position, partial_end, kept, self._failpoints) - position
        segment.size_bytes = position
        segment.next_offset = partial.base_offset if partial is not None else offset
        segment.cut_index(segment.next_offset)
        write_index(segment, None)
        self._epoch_entries = [(e, start) for e, start in self._epoch_entries if start < segment.next_offset]
        if partial is not None:
            self._note_written(segment, kept, position, kept_bytes)
        self._fsync(segment.fd)
        segment.durable_bytes = segment.size_bytes
        self._write_epoch_checkpoint()
        if self._directory_dirty:
            fsync_directory(self._log_dir)
            self._directory_dirty = False
        # Everything below ``offset`` is durable now: sealed segments were synced when sealed.
        self._flushed_offset = offset

    def _locate_cut(self, segment: Segment, offset: int) -> tuple[int, Batch | None, int]:
        """Byte position where records >= ``offset`` begin, the batch cut in two there (if
        any), and the byte position where that batch ends (else the first position again)."""
        position = segment.position_for(offset)
        while position < segment.size_bytes:
            header = self._read_header(segment, position)
            next_offset = header.base_offset + header.count
            if next_offset > offset:
                if header.base_offset >= offset:
                    return position, None, position
                batch, _ = self._read_batch(segment, position, header.total_bytes)
                return position, batch, position + header.total_bytes
            position += header.total_bytes
        return position, None, position

    def _read_header(self, segment: Segment, position: int) -> BatchHeader:
        data = read_exact(segment.fd, HEADER_BYTES, position)
        try:
            return decode_header(data)
        except CorruptBatchError as exc:
            raise CorruptLogError(segment.path, position, exc.reason, self._offset_near(segment, position)) from exc

    def _read_batch(self, segment: Segment, position: int, total_bytes: int) -> tuple[Batch, int]:
        data = read_exact(segment.fd, total_bytes, position)
        try:
            batch, _end = decode_batch(data)
        except CorruptBatchError as exc:
            raise CorruptLogError(segment.path, position, exc.reason, self._offset_near(segment, position)) from exc
        return batch, position + total_bytes

    def _offset_near(self, segment: Segment, position: int) -> int:
        """The offset of the last indexed batch at or before ``position``: safe to truncate at."""
        slot = bisect.bisect_right(segment.index_positions, position) - 1
        return segment.index_offsets[slot] if slot >= 0 else segment.base_offset

    def _read_segment(self, segment: Segment, position: int, offset: int, max_bytes: int,
                      total_bytes: int, result: list[Batch]) -> tuple[int, bool]:
        """Append to ``result`` the batches of ``segment`` from ``position`` holding offsets >= ``offset``.

        Returns the new byte total and whether ``max_bytes`` was reached.
        """
        while position < segment.size_bytes:
            chunk_bytes = min(segment.size_bytes - position, READ_CHUNK_BYTES)
            chunk = read_exact(segment.fd, chunk_bytes, position)
            at = 0
            while at < len(chunk):
                try:
                    header = decode_header(chunk, at)
                except TruncatedBatchError:
                    break
                except CorruptBatchError as exc:
                    raise CorruptLogError(segment.path, position + at, exc.reason,
                                          self._offset_near(segment, position + at)) from exc
                if header.base_offset + header.count <= offset:
                    at += header.total_bytes
                    continue
                if result and total_bytes + header.total_bytes > max_bytes:
                    return total_bytes, True
                if at + header.total_bytes > len(chunk):
                    if at == 0:  # a batch larger than the chunk: read it whole
                        batch, _ = self._read_batch(segment, position, header.total_bytes)
                        result.append(batch)
                        total_bytes += header.total_bytes
                        at = header.total_bytes
                    break
                try:
                    batch, _end = decode_batch(chunk, at)
                except CorruptBatchError as exc:
                    raise CorruptLogError(segment.path, position + at, exc.reason,
                                          self._offset_near(segment, position + at)) from exc
                result.append(batch)
                total_bytes += header.total_bytes
                at += header.total_bytes
            position += at
        return total_bytes, False

    def _write_epoch_checkpoint(self) -> None:
        write_epoch_checkpoint(self._log_dir, self._epoch_entries)
        self._epoch_checkpoint_dirty = False

    def _close_files(self) -> None:
        for segment in self._segments:
            if segment.fd >= 0:
                try:
                    os.close(segment.fd)
                except OSError:
                    pass
            segment.fd = -1

    def _finish_replace_prefix_locked(self, pending: list[Segment], last_fd: int, slot: int,
                                      holder: Segment, copied_end: int, clean_end: int) -> None:
        """Under the lock: append what the holder gained since the copy began to the last
        cleaned file and fsync it, then swap the cleaned files in."""
        holder_is_active = slot == len(self._segments) - 1
        buffer = bytearray()
        try:
            copy_segment_tail(holder.fd, holder.path, copied_end, holder.size_bytes, pending[-1], last_fd, buffer,
                              self._index_interval_bytes)
            finished, last_fd = last_fd, -1
            finish_cleaned_file(finished, buffer)
        finally:
            if last_fd >= 0:
                os.close(last_fd)
        pending[-1].next_offset = holder.next_offset
        # The cleaned files may seal epochs that so far lived in the active segment (whose
        # epochs recovery takes from its scan, the sealed ones' from the checkpoint): the
        # checkpoint must hold them before the swap. Cleaning keeps every epoch boundary.
        self._write_epoch_checkpoint()
        new_bases = [segment.base_offset for segment in pending]
        old_bases = self._segment_bases[: slot + 1]
        self._cleaned_end = max(self._cleaned_end, clean_end)
        self._cleaner_end = max(self._cleaner_end, clean_end)
        self._write_start_checkpoint()
        self._failpoints.hit("segment.before_swap_marker")
        write_swap_marker(self._log_dir, old_bases, new_bases)
        self._failpoints.hit("segment.before_swap")
        for segment in self._segments[: slot + 1]:
            if segment.fd >= 0:
                os.close(segment.fd)
            segment.fd = -1
        swap_cleaned_files(self._log_dir, old_bases, new_bases)
        self._failpoints.hit("segment.after_swap")
        (self._log_dir / SWAP_MARKER_NAME).unlink()
        fsync_directory(self._log_dir)
        for segment in pending:
            segment.fd = os.open(segment.path, os.O_RDWR | os.O_APPEND)
            segment.durable_bytes = segment.size_bytes
        following = self._segments[slot + 1 :]
        self._segments = pending + following
        self._segment_bases = new_bases + self._segment_bases[slot + 1 :]
        for index, segment in enumerate(self._segments[: len(pending)]):
            if index < len(self._segments) - 1:
                write_index(segment, self._segments[index + 1].base_offset)
        if holder_is_active:  # the active segment was rewritten and fsynced whole
            write_index(self._segments[-1], None)
            self._flushed_offset = self._end_offset()

    def _write_cleaned_segments(self, batches: Sequence[Batch], holder_fd: int, holder_path: Path,
                                cut_position: int, copied_end: int, pending: list[Segment]) -> int:
        """storage/cleaned_segments.write_cleaned_segments for this log (a method, so tests
        can act while it runs without the lock)."""
        return write_cleaned_segments(
            self._log_dir, batches, start_offset=self._start_offset, segment_bytes=self._segment_bytes,
            index_interval_bytes=self._index_interval_bytes, holder_fd=holder_fd, holder_path=holder_path,
            cut_position=cut_position, copied_end=copied_end, pending=pending)

    def _recover(self) -> None:
        recovered = recover_log_dir(self._log_dir, self._index_interval_bytes, self._verify_sealed_segments)
        self._segments = recovered.segments
        self._segment_bases = [segment.base_offset for segment in recovered.segments]
        self._start_offset, self._snapshot_id = recovered.start_offset, recovered.snapshot_id
        self._cleaned_end, self._cleaner_end = recovered.cleaned_end, recovered.cleaner_end
        self._epoch_entries = recovered.epoch_entries
        self._flushed_offset = self._end_offset()
