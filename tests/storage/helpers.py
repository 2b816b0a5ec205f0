"""Shared helpers for storage tests: batches, and a model of a power loss."""

from __future__ import annotations

import os
from pathlib import Path

from raft.types import Batch
from storage.segment_log import SegmentLog


def make_batch(base_offset: int, epoch: int, record_count: int, fill: int = 0, record_bytes: int = 40) -> Batch:
    records = tuple(bytes([(fill + index) % 256]) * record_bytes for index in range(record_count))
    return Batch(base_offset, epoch, 1_700_000_000_000 + base_offset, False, records)


def power_loss(log: SegmentLog, keep_unflushed_bytes: int = 0) -> None:
    """Model a machine losing power: every segment keeps what was fsynced, plus at most
    ``keep_unflushed_bytes`` of what was not (the page cache may have written some back).

    The log is closed without any further write; its directory is then reopened by the test.
    """
    durable = log.durable_sizes()
    log.close()
    for path, durable_bytes in durable.items():
        size = os.path.getsize(path)
        os.truncate(path, min(size, durable_bytes + keep_unflushed_bytes))


def segment_files(log_dir: Path) -> list[Path]:
    return sorted(log_dir.glob("*.log"))
