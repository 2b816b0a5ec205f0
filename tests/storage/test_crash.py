"""Crash tests with real processes: a child appends and fsyncs, reporting every flushed offset
on a pipe; the parent SIGKILLs it at a random point, reopens the log, and checks that every
batch reported flushed is there (and nothing that was never written).

``METAKV_CRASH_ITERATIONS`` (default 100) sets how many kills; ``make test-storage-crash``
runs 2000.
"""

from __future__ import annotations

import os
import random
import select
import signal
import time
from pathlib import Path

import pytest

from raft.types import Batch
from storage.failpoints import FAILPOINT_CRASH_EXIT_CODE, Failpoints
from storage.segment_log import SegmentLog

CRASH_ITERATIONS = int(os.environ.get("METAKV_CRASH_ITERATIONS", "100"))
SEGMENT_BYTES = 16 * 1024
REPORT_WAIT_S = 30.0  # bound on waiting for the child's next report (a hung child fails the test)
EVERYTHING = 1 << 40


def record_for(offset: int) -> bytes:
    """Record contents are a function of the offset, so the parent can check every byte."""
    return offset.to_bytes(8, "big") * (1 + offset % 7)


def batch_at(offset: int, epoch: int, record_count: int) -> Batch:
    return Batch(offset, epoch, offset, False, tuple(record_for(o) for o in range(offset, offset + record_count)))


def child_main(log_dir: Path, epoch: int, seed: int, report_fd: int, failpoints: str) -> None:
    """Append and flush forever (until killed), writing 'flushed offset' lines to ``report_fd``."""
    rng = random.Random(seed)
    log = SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES, index_interval_bytes=512,
                     failpoints=Failpoints(failpoints))
    os.write(report_fd, f"open {log.end_offset()}\n".encode())
    while True:
        for _ in range(rng.randint(1, 4)):
            log.append(batch_at(log.end_offset(), epoch, rng.randint(1, 8)))
        flushed = log.flush()
        os.write(report_fd, f"flushed {flushed}\n".encode())


def spawn_child(log_dir: Path, epoch: int, seed: int, failpoints: str = "") -> tuple[int, int]:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        exit_code = 1
        try:
            os.close(read_fd)
            child_main(log_dir, epoch, seed, write_fd, failpoints)
        except BaseException:  # a real failure: the parent sees exit code 1 and no reports
            import traceback
            traceback.print_exc()
        finally:
            os._exit(exit_code)
    os.close(write_fd)
    return pid, read_fd


def read_reports(read_fd: int, wanted: int) -> tuple[list[str], bool]:
    """Read report lines until ``wanted`` arrived or the pipe closed; True if it closed."""
    lines: list[str] = []
    buffer = b""
    deadline = time.monotonic() + REPORT_WAIT_S
    while len(lines) < wanted:
        ready, _, _ = select.select([read_fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"no report from the child within {REPORT_WAIT_S}s")
        chunk = os.read(read_fd, 4096)
        if not chunk:
            return lines, True
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        lines += [line.decode() for line in complete]
    return lines, False


def drain(read_fd: int) -> list[str]:
    data = b""
    while chunk := os.read(read_fd, 65536):
        data += chunk
    return [line for line in data.decode().split("\n") if line]


def check_log(log_dir: Path, flushed_reported: int) -> int:
    """Reopen the log: every reported-flushed record is there, and every record is right."""
    with SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES, index_interval_bytes=512) as log:
        assert log.end_offset() >= flushed_reported, (log.end_offset(), flushed_reported)
        expected_offset, last_epoch = log.start_offset(), 0
        for batch in log.iter_batches():
            assert batch.base_offset == expected_offset and batch.epoch >= last_epoch
            assert batch.records == tuple(record_for(o) for o in range(batch.base_offset, batch.next_offset))
            expected_offset, last_epoch = batch.next_offset, batch.epoch
        assert expected_offset == log.end_offset()
        return log.end_offset()


def test_sigkill_at_random_points_never_loses_a_flushed_batch(tmp_path: Path) -> None:
    rng = random.Random(20261121)
    log_dir = tmp_path / "log"
    flushed_reported = 0
    for iteration in range(CRASH_ITERATIONS):
        pid, read_fd = spawn_child(log_dir, epoch=iteration, seed=rng.randrange(1 << 30))
        try:
            lines, closed = read_reports(read_fd, rng.randint(1, 10))
            assert not closed, f"child exited early: {lines}"
            time.sleep(rng.random() * 0.003)  # land the kill anywhere, also mid-write or mid-fsync
        finally:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        lines += drain(read_fd)
        os.close(read_fd)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        for line in lines:
            kind, value = line.split()
            if kind == "flushed":
                flushed_reported = max(flushed_reported, int(value))
        end_offset = check_log(log_dir, flushed_reported)
        flushed_reported = end_offset  # what survived this crash is durable after reopening
    assert flushed_reported > CRASH_ITERATIONS  # the children made progress


@pytest.mark.parametrize(
    "failpoint",
    [
        "segment.before_write=crash@5",
        "segment.after_write=crash@5",
        "segment.before_fsync=crash@3",
        "segment.after_fsync=crash@3",
        "segment.after_roll=crash",
    ],
)
def test_crash_failpoints_leave_a_recoverable_log(tmp_path: Path, failpoint: str) -> None:
    log_dir = tmp_path / "log"
    flushed_reported = 0
    for round_number in range(3):  # crash, recover, crash again on the recovered log
        pid, read_fd = spawn_child(log_dir, epoch=round_number, seed=round_number, failpoints=failpoint)
        try:
            lines, closed = read_reports(read_fd, 1_000_000)
        finally:
            if not closed:
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            os.close(read_fd)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == FAILPOINT_CRASH_EXIT_CODE, lines
        for line in lines:
            kind, value = line.split()
            if kind == "flushed":
                flushed_reported = max(flushed_reported, int(value))
        flushed_reported = check_log(log_dir, flushed_reported)
    if failpoint.startswith("segment.after_roll"):
        assert len(list(log_dir.glob("*.log"))) >= 3  # each round rolled once before crashing


@pytest.mark.parametrize("operation", ["truncate_to", "reset_to_snapshot"])
def test_crash_between_segment_deletions_leaves_a_log_without_gaps(tmp_path: Path, operation: str) -> None:
    """Segments are deleted newest first: a crash after some deletions is a shorter log, not a gap."""
    log_dir = tmp_path / "log"
    with SegmentLog(log_dir, segment_bytes=2048) as log:
        offset = 0
        while log.segment_count() < 6:
            log.append(batch_at(offset, 1, 3))
            offset += 3
        log.flush()
        written = log.read(0, EVERYTHING)
        second_base = int(log.segment_paths()[1].stem)
    pid = os.fork()
    if pid == 0:
        try:
            deleted_logs = []
            real_unlink = Path.unlink

            def unlink_then_crash(path: Path, missing_ok: bool = False) -> None:
                real_unlink(path, missing_ok=missing_ok)
                if path.suffix == ".log":
                    deleted_logs.append(path)
                    if len(deleted_logs) == 2:
                        os._exit(FAILPOINT_CRASH_EXIT_CODE)

            Path.unlink = unlink_then_crash  # type: ignore[method-assign]
            child_log = SegmentLog(log_dir, segment_bytes=2048)
            if operation == "truncate_to":
                child_log.truncate_to(second_base + 1)
            else:
                from raft.types import SnapshotId
                child_log.reset_to_snapshot(SnapshotId(second_base + 1, 1))
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == FAILPOINT_CRASH_EXIT_CODE
    with SegmentLog(log_dir, segment_bytes=2048) as log:
        survived = log.read(0, EVERYTHING)
    assert 0 < len(survived) < len(written) and survived == written[: len(survived)]
