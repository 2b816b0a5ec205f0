"""The small files beside the segments that say what the segments cannot: the epoch of
every offset range (leader-epoch-checkpoint) and where the log starts, the newest snapshot
and how far the log was compacted (log-start-checkpoint). Both are replaced atomically.

    leader-epoch-checkpoint      epoch -> start offset (text); derived data, rebuilt from
                                 the segments when missing or unreadable
    log-start-checkpoint         log start offset, latest snapshot id, cleaned end, cleaner
                                 end (JSON); cannot be rebuilt: damage stops startup
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from raft.types import SnapshotId, check
from storage.durable_files import write_file_atomically
from storage.segment_files import CorruptLogError, refetch_way_out

EPOCH_CHECKPOINT_NAME = "leader-epoch-checkpoint"
LOG_START_CHECKPOINT_NAME = "log-start-checkpoint"
EPOCH_CHECKPOINT_HEADER = "metakv-leader-epoch-checkpoint 1"


def encode_epoch_checkpoint(entries: list[tuple[int, int]]) -> bytes:
    lines = [EPOCH_CHECKPOINT_HEADER, str(len(entries))]
    lines += [f"{epoch} {start_offset}" for epoch, start_offset in entries]
    return ("\n".join(lines) + "\n").encode()


def decode_epoch_checkpoint(data: bytes) -> list[tuple[int, int]]:
    """Parse the leader-epoch checkpoint; ValueError names the first bad line."""
    lines = data.decode("ascii", errors="replace").split("\n")
    if lines[-1] == "":
        lines.pop()
    if not lines or lines[0] != EPOCH_CHECKPOINT_HEADER:
        raise ValueError("line 1 is not the checkpoint header")
    if len(lines) < 2 or not lines[1].isdigit() or int(lines[1]) != len(lines) - 2:
        raise ValueError("line 2 does not hold the number of entries that follow")
    entries: list[tuple[int, int]] = []
    for number, line in enumerate(lines[2:], start=3):
        parts = line.split(" ")
        if len(parts) != 2 or not all(part.isdigit() for part in parts):
            raise ValueError(f"line {number} is not 'epoch start_offset'")
        epoch, start_offset = int(parts[0]), int(parts[1])
        if entries and (epoch <= entries[-1][0] or start_offset <= entries[-1][1]):
            raise ValueError(f"line {number} does not increase epoch and start offset")
        entries.append((epoch, start_offset))
    return entries


def write_epoch_checkpoint(log_dir: Path, entries: list[tuple[int, int]]) -> None:
    write_file_atomically(log_dir / EPOCH_CHECKPOINT_NAME, encode_epoch_checkpoint(entries))


def clamp_epoch_entries(entries: list[tuple[int, int]], start_offset: int) -> list[tuple[int, int]]:
    """Entries starting below the log start: keep the newest, moved up to the start."""
    below = [entry for entry in entries if entry[1] < start_offset]
    above = [entry for entry in entries if entry[1] >= start_offset]
    if below and (not above or above[0][1] > start_offset):
        above.insert(0, (below[-1][0], start_offset))
    return above


@dataclass(frozen=True, slots=True)
class LogStartCheckpoint:
    """What cannot be derived from the segments: where the log starts, the newest snapshot,
    how far the prefix was compacted (offsets may jump below ``cleaned_end``), and how far
    this replica's own cleaner compacted it (``cleaner_end``; a copy of the leader's cleaned
    prefix raises only ``cleaned_end``)."""

    start_offset: int
    snapshot_id: SnapshotId | None
    cleaned_end: int = 0
    cleaner_end: int = 0


def read_log_start_checkpoint(log_dir: Path) -> LogStartCheckpoint | None:
    """The log start checkpoint, or None when there is none (a log never cut or cleaned)."""
    path = log_dir / LOG_START_CHECKPOINT_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise CorruptLogError(path, exc.start, "not UTF-8 JSON; it holds the log start offset, the snapshot id "
                              "and how far the log was compacted", None, refetch_way_out(log_dir.parent)) from exc
    try:
        value = json.loads(text)
        start_offset = value["start_offset"]
        snapshot = value["snapshot"]
        cleaned_end = value.get("cleaned_end", 0)
        cleaner_end = value.get("cleaner_end", cleaned_end)  # older files: the cautious reading
        check(type(start_offset) is int and start_offset >= 0, "start_offset")
        check(type(cleaned_end) is int and cleaned_end >= 0, "cleaned_end")
        check(type(cleaner_end) is int and 0 <= cleaner_end <= cleaned_end, "cleaner_end")
        snapshot_id = None
        if snapshot is not None:
            snapshot_id = SnapshotId(snapshot["end_offset"], snapshot["epoch"])
            check(type(snapshot_id.end_offset) is int and type(snapshot_id.epoch) is int, "snapshot")
    except json.JSONDecodeError as exc:
        raise CorruptLogError(path, len(text[: exc.pos].encode()), f"not JSON ({exc.msg}); it holds the log start offset, the "
                              "snapshot id and how far the log was compacted", None,
                              refetch_way_out(log_dir.parent)) from exc
    except Exception as exc:
        raise CorruptLogError(path, 0, f"not a log start checkpoint ({exc!r}); it holds the log start "
                              "offset, the snapshot id and how far the log was compacted", None,
                              refetch_way_out(log_dir.parent)) from exc
    return LogStartCheckpoint(start_offset, snapshot_id, cleaned_end, cleaner_end)


def write_log_start_checkpoint(log_dir: Path, checkpoint: LogStartCheckpoint) -> None:
    snapshot_id = checkpoint.snapshot_id
    snapshot = None if snapshot_id is None else {"end_offset": snapshot_id.end_offset, "epoch": snapshot_id.epoch}
    data = json.dumps({"start_offset": checkpoint.start_offset, "snapshot": snapshot,
                       "cleaned_end": checkpoint.cleaned_end, "cleaner_end": checkpoint.cleaner_end}).encode()
    write_file_atomically(log_dir / LOG_START_CHECKPOINT_NAME, data)

