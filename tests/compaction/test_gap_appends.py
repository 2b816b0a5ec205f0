"""A follower copying the leader's cleaned prefix appends batches whose offsets jump; only
below cleaned_end, durably announced first, so recovery accepts the gaps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raft.log import MemoryLog
from raft.types import Batch, ProtocolInvariantError, SnapshotId
from storage.log_checkpoints import LOG_START_CHECKPOINT_NAME
from storage.segment_log import SegmentLog


def _batch(base: int, epoch: int, count: int = 1) -> Batch:
    return Batch(base, epoch, 0, False, tuple(b"r%d" % (base + i) for i in range(count)))


def test_segment_log_gap_appends_survive_reopen(tmp_path: Path) -> None:
    log = SegmentLog(tmp_path / "log")
    with pytest.raises(ProtocolInvariantError):
        log.append(_batch(3, 1))  # no cleaned prefix announced: a gap is refused
    log.allow_gaps_below(10)
    log.append(_batch(3, 1))
    log.append(_batch(7, 2, 3))  # ends at 10 = cleaned_end
    with pytest.raises(ProtocolInvariantError):
        log.append(_batch(12, 2))  # past cleaned_end offsets must be contiguous again
    log.append(_batch(10, 2))
    log.flush()
    log.close()
    reopened = SegmentLog(tmp_path / "log")
    assert reopened.cleaned_end() == 10 and reopened.end_offset() == 11
    assert reopened.cleaner_end() == 0  # a copy: this replica's own cleaner compacted nothing
    assert [b.base_offset for b in reopened.read(0, 1 << 20)] == [3, 7, 10]
    assert reopened.end_offset_for_epoch(1) == (1, 7)  # epoch 1 ends where epoch 2 starts
    reopened.close()


def test_memory_log_gap_appends_and_epoch_ends() -> None:
    log = MemoryLog()
    log.allow_gaps_below(10)
    log.append(_batch(3, 1))
    log.append(_batch(7, 2, 3))
    assert log.end_offset() == 10
    assert log.end_offset_for_epoch(1) == (1, 7)
    assert log.reopen().cleaned_end() == 10
    assert log.reopen().cleaner_end() == 0


def test_segment_log_remembers_what_its_own_cleaner_compacted(tmp_path: Path) -> None:
    """cleaner_end (docs/compaction.md rule 9): raised by replace_prefix, not by a copy of
    the leader's cleaned prefix, kept across a reopen, lowered by a reset to a snapshot."""
    log = SegmentLog(tmp_path / "log")
    for base in range(6):
        log.append(_batch(base, 1))
    log.flush()
    log.replace_prefix([_batch(1, 1), _batch(3, 1)], 4)
    log.allow_gaps_below(5)
    assert (log.cleaned_end(), log.cleaner_end()) == (5, 4)
    log.close()
    reopened = SegmentLog(tmp_path / "log")
    assert (reopened.cleaned_end(), reopened.cleaner_end()) == (5, 4)
    reopened.reset_to_snapshot(SnapshotId(2, 1))
    assert reopened.cleaner_end() == 2
    reopened.close()
    assert SegmentLog(tmp_path / "log").cleaner_end() == 2


def test_a_checkpoint_from_before_cleaner_end_reads_it_cautiously(tmp_path: Path) -> None:
    """A log-start checkpoint written before cleaner_end existed cannot tell a copied
    cleaned prefix from one this replica cleaned: it is read as all cleaned here, so startup
    never replays a state through it from below (docs/compaction.md rule 9)."""
    log = SegmentLog(tmp_path / "log")
    log.allow_gaps_below(10)
    log.append(_batch(3, 1))
    log.flush()
    log.close()
    checkpoint = tmp_path / "log" / LOG_START_CHECKPOINT_NAME
    old = json.loads(checkpoint.read_text())
    del old["cleaner_end"]
    checkpoint.write_text(json.dumps(old))
    reopened = SegmentLog(tmp_path / "log")
    assert (reopened.cleaned_end(), reopened.cleaner_end()) == (10, 10)
    reopened.close()


@pytest.mark.parametrize("kind", ["memory", "segment"])
def test_snapshot_epoch_ends_where_the_next_epoch_starts(tmp_path: Path, kind: str) -> None:
    """A log reset to a snapshot of epoch 1 whose copied records of epoch 1 were all cleaned
    away still ends epoch 1 where epoch 2 starts, not at the snapshot (found by the
    compaction simulator, seed 42: a fetcher there would be told to truncate too far)."""
    log = MemoryLog() if kind == "memory" else SegmentLog(tmp_path / "log")
    log.reset_to_snapshot(SnapshotId(5, 1))
    log.allow_gaps_below(10)
    log.append(_batch(8, 2, 2))  # epoch 1 held [5, 8) in the leader's log: cleaned away
    assert log.end_offset_for_epoch(1) == (1, 8)
    assert log.end_offset_for_epoch(0) == (0, 0)
