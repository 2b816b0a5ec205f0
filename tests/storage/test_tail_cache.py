"""SegmentLog answers reads of the tail it appended from memory (storage/tail_cache.py):
never a truncated or replaced batch, and from disk once the tail passed the cache's bound."""

from __future__ import annotations

from pathlib import Path

import pytest

import storage.segment_log as segment_log_module
from raft.types import Batch, SnapshotId
from storage.segment_log import SegmentLog
from tests.storage.helpers import make_batch

EVERYTHING = 1 << 40


@pytest.fixture
def disk_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the preads SegmentLog makes (one per chunk or batch read from a segment file)."""
    reads: list[int] = []
    original = segment_log_module.read_exact

    def counting(fd: int, size: int, position: int) -> bytes:
        reads.append(size)
        return original(fd, size, position)
    monkeypatch.setattr(segment_log_module, "read_exact", counting)
    return reads


def _on_disk(log_dir: Path, offset: int = 0) -> list[Batch]:
    with SegmentLog(log_dir) as reopened:
        return reopened.read(offset, EVERYTHING)


@pytest.mark.parametrize("cut", [3, 4], ids=["at a batch boundary", "inside a batch"])
def test_a_truncated_tail_is_never_read_from_memory(tmp_path: Path, cut: int) -> None:
    log_dir = tmp_path / "log"
    with SegmentLog(log_dir) as log:
        old = [make_batch(0, 1, 3, fill=1), make_batch(3, 1, 3, fill=2), make_batch(6, 1, 3, fill=3)]
        for batch in old:
            log.append(batch)
        log.flush()
        log.truncate_to(cut)  # a new leader's log diverges from offset ``cut``
        held = log.read(0, EVERYTHING)
        assert held == _on_disk(log_dir)
        assert held[-1].next_offset == cut
        assert all(batch not in held for batch in old[1:])
        new = make_batch(cut, 2, 4, fill=9)
        log.append(new)
        assert log.read(0, EVERYTHING) == held + [new]
        assert log.read(cut, EVERYTHING) == [new]
        log.flush()
        assert log.read(0, EVERYTHING) == _on_disk(log_dir)


def test_a_snapshot_reset_and_a_cleaned_prefix_replace_the_batches_held(tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    with SegmentLog(log_dir) as log:
        for index in range(4):
            log.append(make_batch(index * 2, 1, 2, fill=index))
        log.flush()
        cleaned = [Batch(1, 1, 0, False, (b"kept-1",)), Batch(5, 1, 0, False, (b"kept-5",))]
        log.replace_prefix(cleaned, 6)
        assert log.read(0, EVERYTHING) == cleaned + [make_batch(6, 1, 2, fill=3)]
        assert log.read(0, EVERYTHING) == _on_disk(log_dir)
        log.reset_to_snapshot(SnapshotId(20, 2))
        assert log.read(0, EVERYTHING) == [] and log.cached_bytes() == 0
        log.append(make_batch(20, 2, 1))
        assert log.read(0, EVERYTHING) == [make_batch(20, 2, 1)]


def test_reads_of_the_appended_tail_come_from_memory_until_its_bound(tmp_path: Path, disk_reads: list[int]) -> None:
    log_dir = tmp_path / "log"
    batch_bytes = 34 + 1 + 2 * (2 + 40)  # header, array prefix, two 40-byte records with their prefixes
    with SegmentLog(log_dir, tail_cache_bytes=3 * batch_bytes) as log:
        batches = [make_batch(index * 2, 1, 2, fill=index) for index in range(10)]
        for batch in batches:
            log.append(batch)
        assert log.cached_bytes() == 3 * batch_bytes  # the bound holds: the 3 newest batches
        assert log.read(14, EVERYTHING) == batches[7:]
        assert log.read(15, batch_bytes) == [batches[7]]  # max_bytes counts as on disk
        assert disk_reads == []
        # An apply lagging past the bound reads the disk, and gets the same batches.
        assert log.read(0, EVERYTHING) == batches
        assert disk_reads != []
        disk_reads.clear()
        log.applied_below(18)  # applied: no longer held
        assert log.cached_bytes() == batch_bytes
        assert log.read(16, EVERYTHING) == batches[8:] and disk_reads != []
        disk_reads.clear()
        assert log.read(18, EVERYTHING) == batches[9:] and disk_reads == []
    with SegmentLog(log_dir) as reopened:  # a restart reads from disk
        assert reopened.cached_bytes() == 0
        assert reopened.read(0, EVERYTHING) == batches


def test_a_cache_of_zero_bytes_reads_everything_from_disk(tmp_path: Path, disk_reads: list[int]) -> None:
    with SegmentLog(tmp_path / "log", tail_cache_bytes=0) as log:
        batch = make_batch(0, 1, 2)
        log.append(batch)
        assert log.cached_bytes() == 0
        assert log.read(0, EVERYTHING) == [batch] and disk_reads != []
