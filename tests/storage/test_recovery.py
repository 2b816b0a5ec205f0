"""Recovery on open: each kind of damage gives the outcome docs/storage.md documents."""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from app.cli import main as metakv_main
from raft.types import Batch, SnapshotId
from storage.log_checkpoints import EPOCH_CHECKPOINT_NAME, LOG_START_CHECKPOINT_NAME
from storage.repair import main as repair_main
from storage.segment_files import CorruptLogError
from storage.segment_log import SegmentLog
from storage.state_machine import StateDatabaseError, StateMachine
from tests.storage.helpers import make_batch, segment_files

SEGMENT_BYTES = 2048
EVERYTHING = 1 << 40


def write_log(log_dir: Path, batch_count: int, epoch_every: int = 7) -> list[Batch]:
    """A flushed, closed log of ``batch_count`` batches spread over several segments."""
    batches = []
    with SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES, index_interval_bytes=200) as log:
        for index in range(batch_count):
            batch = make_batch(log.end_offset(), index // epoch_every, 1 + index % 3, fill=index)
            log.append(batch)
            batches.append(batch)
        log.flush()
    return batches


def open_log(log_dir: Path, **options: object) -> SegmentLog:
    return SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES, index_interval_bytes=200, **options)


def flip_bit(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x10
    path.write_bytes(bytes(data))


def batch_positions(path: Path) -> list[int]:
    """Byte positions of the batches in a segment (walking the length fields)."""
    data, positions, at = path.read_bytes(), [], 0
    while at < len(data):
        positions.append(at)
        at += 4 + int.from_bytes(data[at : at + 4], "big")
    return positions


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "data" / "log"


def test_clean_reopen_keeps_every_batch(log_dir: Path) -> None:
    batches = write_log(log_dir, 60)
    assert len(segment_files(log_dir)) > 3
    with open_log(log_dir) as log:
        assert log.read(0, EVERYTHING) == batches
        assert log.end_offset() == log.flushed_offset() == batches[-1].next_offset
        assert log.last_epoch() == batches[-1].epoch


def test_torn_last_batch_is_cut_with_a_warning(log_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    batches = write_log(log_dir, 30)
    last = segment_files(log_dir)[-1]
    size, last_batch_position = last.stat().st_size, batch_positions(last)[-1]
    os.truncate(last, size - 11)
    with caplog.at_level(logging.WARNING), open_log(log_dir) as log:
        assert log.read(0, EVERYTHING) == batches[:-1]
        assert log.end_offset() == batches[-1].base_offset
    assert f"at byte {last_batch_position}" in caplog.text and str(last) in caplog.text
    assert f"dropped {size - 11 - last_batch_position} bytes" in caplog.text
    assert last.stat().st_size == last_batch_position
    # The cut is durable and the log is writable at the cut.
    with open_log(log_dir) as log:
        log.append(batches[-1])
        log.flush()
    with open_log(log_dir) as log:
        assert log.read(0, EVERYTHING) == batches


def test_flipped_bit_in_the_last_batch_is_a_torn_tail(log_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    batches = write_log(log_dir, 30)
    last = segment_files(log_dir)[-1]
    flip_bit(last, batch_positions(last)[-1] + 40)
    with caplog.at_level(logging.WARNING), open_log(log_dir) as log:
        assert log.read(0, EVERYTHING) == batches[:-1]
    assert "CRC32C mismatch" in caplog.text and "dropped" in caplog.text


def test_flipped_bit_followed_by_good_batches_stops_startup(log_dir: Path) -> None:
    batches = write_log(log_dir, 30)
    last = segment_files(log_dir)[-1]
    positions = batch_positions(last)
    assert len(positions) >= 3
    flip_bit(last, positions[1] + 40)
    bad_offset = [b for b in batches if b.base_offset >= int(last.stem)][1].base_offset
    with pytest.raises(CorruptLogError) as caught:
        open_log(log_dir)
    message = str(caught.value)
    assert str(last) in message and f"at byte {positions[1]}" in message
    assert f"run: metakv repair --data-dir {log_dir.parent} --truncate-at {bad_offset}" in message
    assert caught.value.truncate_at_offset == bad_offset
    # Nothing was changed on disk by the failed open.
    assert len(batch_positions(last)) == len(positions)


def test_flipped_bit_in_an_old_segment_stops_startup(log_dir: Path) -> None:
    batches = write_log(log_dir, 60)
    old = segment_files(log_dir)[1]
    position = batch_positions(old)[2]
    flip_bit(old, position + 40)
    with pytest.raises(CorruptLogError) as caught:
        open_log(log_dir)
    assert str(old) in str(caught.value) and f"at byte {position}" in str(caught.value)
    assert "sealed segment" in str(caught.value)
    bad_offset = caught.value.truncate_at_offset
    assert bad_offset == [b for b in batches if b.base_offset >= int(old.stem)][2].base_offset


def test_flipped_bit_in_an_old_segment_without_verification_fails_the_read(log_dir: Path) -> None:
    write_log(log_dir, 60)
    old = segment_files(log_dir)[1]
    position = batch_positions(old)[2]
    flip_bit(old, position + 40)
    with open_log(log_dir, verify_sealed_segments=False) as log:
        with pytest.raises(CorruptLogError) as caught:
            log.read(0, EVERYTHING)
    assert str(old) in str(caught.value) and f"at byte {position}" in str(caught.value)


def test_repair_truncates_at_the_named_offset_and_the_log_opens(log_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batches = write_log(log_dir, 60)
    old = segment_files(log_dir)[1]
    flip_bit(old, batch_positions(old)[2] + 40)
    with pytest.raises(CorruptLogError) as caught:
        open_log(log_dir)
    bad_offset = caught.value.truncate_at_offset
    assert repair_main(["--data-dir", str(log_dir.parent), "--verify"]) == 1
    assert f"at byte {batch_positions(old)[2]}" in capsys.readouterr().err
    assert repair_main(["--data-dir", str(log_dir.parent), "--truncate-at", str(bad_offset)]) == 0
    assert f"every record at offset {bad_offset} and above" in capsys.readouterr().out
    with open_log(log_dir) as log:
        assert log.read(0, EVERYTHING) == [b for b in batches if b.next_offset <= bad_offset]
        assert log.end_offset() == bad_offset
    assert repair_main(["--data-dir", str(log_dir.parent), "--verify"]) == 0


def test_repair_inside_a_batch_keeps_the_records_below(log_dir: Path) -> None:
    batches = write_log(log_dir, 20)
    straddling = next(b for b in batches if len(b.records) == 3)
    cut = straddling.base_offset + 1
    assert repair_main(["--data-dir", str(log_dir.parent), "--truncate-at", str(cut)]) == 0
    with open_log(log_dir) as log:
        held = log.read(0, EVERYTHING)
    assert held[-1] == Batch(straddling.base_offset, straddling.epoch, straddling.timestamp_ms, False,
                             straddling.records[:1])
    assert held[:-1] == [b for b in batches if b.next_offset <= straddling.base_offset]


def test_repair_refuses_an_offset_above_the_corruption(log_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batches = write_log(log_dir, 30)
    last = segment_files(log_dir)[-1]
    positions = batch_positions(last)
    flip_bit(last, positions[1] + 40)
    bad_offset = [b for b in batches if b.base_offset >= int(last.stem)][1].base_offset
    assert repair_main(["--data-dir", str(log_dir.parent), "--truncate-at", str(batches[-1].base_offset)]) == 2
    assert f"use --truncate-at {bad_offset}" in capsys.readouterr().err


def test_truncated_index_is_rebuilt(log_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    batches = write_log(log_dir, 60)
    index = segment_files(log_dir)[1].with_suffix(".index")
    complete = index.read_bytes()
    os.truncate(index, len(complete) - 5)
    for verify in (True, False):
        caplog.clear()
        with caplog.at_level(logging.WARNING), open_log(log_dir, verify_sealed_segments=verify) as log:
            assert log.read(0, EVERYTHING) == batches
            assert log.read(batches[20].base_offset, 1) == [batches[20]]
        assert f"rebuilding index {index}" in caplog.text
        assert index.read_bytes() == complete
        os.truncate(index, 16)  # whole entries missing this time


def test_missing_index_is_rebuilt(log_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    batches = write_log(log_dir, 60)
    index = segment_files(log_dir)[0].with_suffix(".index")
    complete = index.read_bytes()
    index.unlink()
    with caplog.at_level(logging.WARNING), open_log(log_dir, verify_sealed_segments=False) as log:
        assert log.read(0, EVERYTHING) == batches
    assert "rebuilding index" in caplog.text and index.read_bytes() == complete


@pytest.mark.parametrize("verify", [True, False])
def test_missing_epoch_file_is_rebuilt(log_dir: Path, caplog: pytest.LogCaptureFixture, verify: bool) -> None:
    batches = write_log(log_dir, 60, epoch_every=5)
    checkpoint = log_dir / EPOCH_CHECKPOINT_NAME
    with open_log(log_dir) as log:
        expected = [log.end_offset_for_epoch(epoch) for epoch in range(15)]
    complete = checkpoint.read_bytes()
    checkpoint.unlink()
    with caplog.at_level(logging.WARNING), open_log(log_dir, verify_sealed_segments=verify) as log:
        assert [log.end_offset_for_epoch(epoch) for epoch in range(15)] == expected
        assert log.last_epoch() == batches[-1].epoch
    assert f"{checkpoint} is missing" in caplog.text
    assert checkpoint.read_bytes() == complete


def test_garbage_epoch_file_is_rebuilt(log_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_log(log_dir, 60, epoch_every=5)
    checkpoint = log_dir / EPOCH_CHECKPOINT_NAME
    open_log(log_dir).close()  # recovery adds the active segment's epochs to the file
    complete = checkpoint.read_bytes()
    checkpoint.write_bytes(b"\x00garbage\n")
    with caplog.at_level(logging.WARNING), open_log(log_dir, verify_sealed_segments=False):
        pass
    assert "unreadable" in caplog.text and checkpoint.read_bytes() == complete


def test_missing_segment_in_the_middle_stops_startup(log_dir: Path) -> None:
    write_log(log_dir, 60)
    segment_files(log_dir)[2].unlink()
    with pytest.raises(CorruptLogError, match="but the next segment starts at offset"):
        open_log(log_dir)


def test_missing_first_segment_stops_startup(log_dir: Path) -> None:
    write_log(log_dir, 60)
    with open_log(log_dir) as log:  # make the start offset durable in the checkpoint
        log.record_snapshot(SnapshotId(1, 0))
    segment_files(log_dir)[0].unlink()
    with pytest.raises(CorruptLogError, match="segment files are missing"):
        open_log(log_dir)


def printed_command(message: str, program: str) -> list[str]:
    """The argv of the command a corruption message tells the operator to run."""
    match = re.search(rf"run: ({program} .*)$", message)
    assert match is not None, message
    return shlex.split(match.group(1))


def test_the_printed_repair_command_works_as_printed_from_any_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = tmp_path / "data dir" / "log"  # a space in the path: the command must quote it
    batches = write_log(log_dir, 30)
    last = segment_files(log_dir)[-1]
    flip_bit(last, batch_positions(last)[1] + 40)
    with pytest.raises(CorruptLogError) as caught:
        open_log(log_dir)
    argv = printed_command(str(caught.value), "metakv")
    assert argv[:2] == ["metakv", "repair"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the repository root: python -m storage.repair fails here
    assert metakv_main(argv[1:]) == 0
    bad_offset = caught.value.truncate_at_offset
    assert f"removed every record at offset {bad_offset} and above" in capsys.readouterr().out
    with open_log(log_dir) as log:
        assert log.read(0, EVERYTHING) == [b for b in batches if b.next_offset <= bad_offset]


def write_cut_log(log_dir: Path) -> list[Batch]:
    """A log whose start moved past a snapshot, so its log start checkpoint says something."""
    batches = write_log(log_dir, 60)
    with open_log(log_dir) as log:
        log.record_snapshot(SnapshotId(batches[20].base_offset, batches[20].epoch))
        log.delete_before(batches[20].base_offset)
    return batches


@pytest.mark.parametrize(("garbage", "position"), [
    (b"\x00" * 40, 0), (b'{"start_offset": 3, "snapsh', 20), (b"\xff\xfe{}", 0), (b"[1, 2]", 0)])
def test_garbage_log_start_checkpoint_names_file_byte_and_the_way_out(
        log_dir: Path, garbage: bytes, position: int) -> None:
    write_cut_log(log_dir)
    (log_dir / LOG_START_CHECKPOINT_NAME).write_bytes(garbage)
    with pytest.raises(CorruptLogError) as caught:
        open_log(log_dir)
    message = str(caught.value)
    data_dir = log_dir.parent
    assert message.startswith(f"corrupt log file {log_dir / LOG_START_CHECKPOINT_NAME} at byte {position}: ")
    assert "cannot be rebuilt from the segments" in message
    assert (f"move {data_dir}/log, {data_dir}/snapshots and {data_dir}/state.db" in message
            and f"keep {data_dir}/quorum-state" in message and "fetches a snapshot and the log from the leader"
            in message)
    assert caught.value.truncate_at_offset is None and "--truncate-at" not in message


def test_missing_first_segment_names_the_way_out(log_dir: Path) -> None:
    write_cut_log(log_dir)
    segment_files(log_dir)[0].unlink()
    with pytest.raises(CorruptLogError) as caught:
        open_log(log_dir)
    assert "segment files are missing" in str(caught.value)
    assert f"keep {log_dir.parent}/quorum-state" in str(caught.value)


def test_garbage_state_database_names_the_file_and_the_way_out_that_works(tmp_path: Path) -> None:
    db_path = tmp_path / "data" / "state.db"
    db_path.parent.mkdir()
    db_path.write_bytes(b"this is no sqlite file, just garbage " * 200)
    with pytest.raises(StateDatabaseError) as caught:
        StateMachine(str(db_path), background_checkpoint=False)
    message = str(caught.value)
    assert message.startswith(f"{db_path}: cannot open the state database: file is not a database")
    assert f"move {db_path} (and any {db_path}-wal and -shm next to it) away and restart" in message
    # The way out as printed: once the file is moved away, a fresh state database opens.
    shutil.move(db_path, tmp_path / "state.db.bad")
    state = StateMachine(str(db_path), background_checkpoint=False)
    try:
        assert state.applied_version == 0
    finally:
        state.close()


@pytest.mark.parametrize("damage", ["zeros appended", "half-written last batch", "flipped bit in the last batch"])
def test_verify_reports_a_torn_tail_as_startup_will_cut_it_with_exit_0(
        log_dir: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, damage: str) -> None:
    batches = write_log(log_dir, 30)
    last = segment_files(log_dir)[-1]
    size, last_batch_position = last.stat().st_size, batch_positions(last)[-1]
    if damage == "zeros appended":
        with open(last, "ab") as file:
            file.write(bytes(100))
        cut_at, dropped, end_offset = size, 100, batches[-1].next_offset
    elif damage == "half-written last batch":
        os.truncate(last, last_batch_position + (size - last_batch_position) // 2)
        cut_at, dropped = last_batch_position, (size - last_batch_position) // 2
        end_offset = batches[-1].base_offset
    else:
        flip_bit(last, last_batch_position + 40)
        cut_at, dropped, end_offset = last_batch_position, size - last_batch_position, batches[-1].base_offset
    assert repair_main(["--data-dir", str(log_dir.parent), "--verify"]) == 0
    out = capsys.readouterr().out
    assert (f"torn tail: {dropped} bytes after byte {cut_at} of {last}" in out
            and "will be cut at the next start" in out and f"the log then ends at offset {end_offset}" in out)
    with caplog.at_level(logging.WARNING), open_log(log_dir) as log:  # startup cuts exactly that
        assert log.end_offset() == end_offset
    assert f"at byte {cut_at}" in caplog.text and f"dropped {dropped} bytes" in caplog.text
    assert repair_main(["--data-dir", str(log_dir.parent), "--verify"]) == 0
    assert "torn tail" not in capsys.readouterr().out


def test_verify_still_fails_on_corruption_before_the_tail_of_the_last_segment(
        log_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batches = write_log(log_dir, 30)
    last = segment_files(log_dir)[-1]
    positions = batch_positions(last)
    flip_bit(last, positions[1] + 40)
    with open(last, "ab") as file:
        file.write(bytes(100))  # a torn tail after the corruption changes nothing
    bad_offset = [b for b in batches if b.base_offset >= int(last.stem)][1].base_offset
    assert repair_main(["--data-dir", str(log_dir.parent), "--verify"]) == 1
    err = capsys.readouterr().err
    assert f"corrupt log file {last} at byte {positions[1]}" in err and "this is not a torn tail" in err
    assert f"--truncate-at {bad_offset}" in err


def test_verify_still_fails_on_a_torn_end_of_an_older_segment(log_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_log(log_dir, 60)
    old = segment_files(log_dir)[1]
    os.truncate(old, old.stat().st_size - 5)  # only the last segment can have a torn tail
    assert repair_main(["--data-dir", str(log_dir.parent), "--verify"]) == 1
    assert f"corrupt log file {old}" in capsys.readouterr().err
def test_repair_refuses_a_data_directory_a_running_node_holds(log_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Truncating a running node's log under it would lose what it appends meanwhile."""
    from storage.data_dir import DataDirLock

    batches = write_log(log_dir, 5)
    holder = DataDirLock(log_dir.parent)
    try:
        assert repair_main(["--data-dir", str(log_dir.parent), "--truncate-at", "0"]) == 2  # 1 means corrupt
        assert "in use by another process" in capsys.readouterr().err
    finally:
        holder.close()
    with open_log(log_dir) as log:
        assert log.read(0, EVERYTHING) == batches  # nothing was cut
    assert repair_main(["--data-dir", str(log_dir.parent), "--verify"]) == 0  # runs once it is free
