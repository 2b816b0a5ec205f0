"""Running out of file descriptors never passes for a failed fsync (issue 21, audit item 2).

Idle connections can take every descriptor the node may open; the next log flush then fails
to dup the segment's descriptor. That wrote nothing, so the flush is retried (a warning and
``metakv_flush_deferrals_total``) instead of the node exiting 70 as after a failed fsync.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

import storage.segment_log as segment_log_module
from app.process_setup import raise_descriptor_limit
from raft.types import SnapshotId
from storage.descriptors import FlushDeferredError
from storage.failpoints import Failpoints
from storage.segment_log import SegmentLog
from tests.cluster import Cluster
from tests.storage.helpers import make_batch

EVERYTHING = 1 << 40
DESCRIPTOR_LIMIT = 128  # soft and hard: the node cannot raise it, so idle connections exhaust it
IDLE_CONNECTIONS = 300
EXHAUSTION_WAIT_S = 20.0


def fails_once(call: Callable[..., object]) -> Callable[..., object]:
    """``call``, except that its first use raises EMFILE as a process out of descriptors sees."""
    calls = []

    def wrapped(*args: object) -> object:
        calls.append(args)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return call(*args)
    return wrapped


def test_no_descriptor_for_the_dup_defers_the_flush_and_the_log_stays_writable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with SegmentLog(tmp_path / "log") as log:
        log.append(make_batch(0, 1, 3))
        monkeypatch.setattr(segment_log_module.os, "dup", fails_once(os.dup))
        with pytest.raises(FlushDeferredError, match="no file descriptor"):
            log.flush()
        assert not log.failed() and log.flushed_offset() == 0
        log.append(make_batch(log.end_offset(), 1, 2))  # still writable
        assert log.flush() == log.end_offset() == 5
        assert len(log.read(0, EVERYTHING)) == 2


def test_no_descriptor_to_open_the_directory_keeps_it_to_sync_next_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[object] = []

    def fsync_directory(directory: object) -> None:
        synced.append(directory)
    with SegmentLog(tmp_path / "log", segment_bytes=1024) as log:
        while log.segment_count() < 4:
            log.append(make_batch(log.end_offset(), 1, 4))
        log.flush()
        log.record_snapshot(SnapshotId(log.end_offset() - 1, 1))
        log.delete_before(log.end_offset() - 1)  # deleted segments: the directory needs a sync
        log.append(make_batch(log.end_offset(), 1, 1))
        end = log.end_offset()
        monkeypatch.setattr(segment_log_module, "fsync_directory", fails_once(fsync_directory))
        with pytest.raises(FlushDeferredError):
            log.flush()
        assert not log.failed() and log.flushed_offset() < end
        assert log.flush() == end and synced == [tmp_path / "log"]


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one() -> None:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
        assert raise_descriptor_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def deferrals(client: httpx.Client, url: str) -> float:
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith("metakv_flush_deferrals_total "):
            return float(line.split()[1])
    raise AssertionError("no metakv_flush_deferrals_total metric")


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
def test_idle_raft_connections_exhausting_descriptors_do_not_kill_the_node(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "cluster", voters=1)
    node = cluster.nodes[1]
    # The handshake cap (--max-raft-handshakes, 64) would close the flood at accept: lifted
    # here so that the idle connections do exhaust the descriptors this test is about.
    node.command = ["sh", "-c", f'ulimit -n {DESCRIPTOR_LIMIT} && exec "$@"', "sh", *node.command,
                    "--max-raft-handshakes", "100000"]
    idle: list[socket.socket] = []
    try:
        cluster.start()
        cluster.wait_for_leader()
        writes, metrics = httpx.Client(timeout=30.0), httpx.Client(timeout=10.0)  # connected before the flood
        assert writes.put(f"{node.url}/v1/kv/before", content=b"1").status_code == 200
        assert deferrals(metrics, node.url) == 0
        for _ in range(IDLE_CONNECTIONS):
            conn = socket.socket()
            conn.settimeout(0.2)
            with contextlib.suppress(OSError):  # the listen backlog fills up: enough
                conn.connect(node.raft_address)
            idle.append(conn)
        deadline = time.monotonic() + EXHAUSTION_WAIT_S
        while open_descriptors(node.pid) < DESCRIPTOR_LIMIT and time.monotonic() < deadline:
            time.sleep(0.05)
        assert open_descriptors(node.pid) >= DESCRIPTOR_LIMIT, "the idle connections did not exhaust descriptors"
        response = writes.put(f"{node.url}/v1/kv/during", content=b"2")
        assert response.status_code == 200, response.text
        assert deferrals(metrics, node.url) >= 1  # the flush did run out of descriptors
        for conn in idle:
            conn.close()
        idle.clear()
        assert node.running()
        assert writes.put(f"{node.url}/v1/kv/after", content=b"3").status_code == 200
        assert writes.get(f"{node.url}/v1/kv/during").content == b"2"
        assert "the log flushes again" in node.log_tail()
    finally:
        for conn in idle:
            conn.close()
        print(node.log_tail())
        cluster.close()


def test_no_descriptor_to_roll_keeps_appending_and_rolls_once_descriptors_are_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failpoints = Failpoints("segment.before_create=emfile")
    clock = [1000.0]
    monkeypatch.setattr(segment_log_module.time, "monotonic", lambda: clock[0])
    with SegmentLog(tmp_path / "log", segment_bytes=1024, failpoints=failpoints) as log:
        for _ in range(20):  # ~20 KiB: many rolls' worth, none possible
            log.append(make_batch(log.end_offset(), 1, 4))
        assert not log.failed() and log.segment_count() == 1 and log.roll_deferrals == 1
        assert log.flush() == log.end_offset()
        failpoints.disarm("segment.before_create")
        log.append(make_batch(log.end_offset(), 1, 4))
        assert log.segment_count() == 1  # retried no sooner than ROLL_RETRY_S
        clock[0] += segment_log_module.ROLL_RETRY_S
        log.append(make_batch(log.end_offset(), 1, 4))
        assert log.segment_count() == 2 and not log.failed()
        end = log.flush()
    with SegmentLog(tmp_path / "log", segment_bytes=1024) as reopened:
        assert reopened.end_offset() == end == 22 * 4
        assert len(reopened.read(0, EVERYTHING)) == 22


def test_no_descriptor_for_the_sealed_index_leaves_it_to_recovery(tmp_path: Path) -> None:
    with SegmentLog(tmp_path / "log", segment_bytes=1024, failpoints=Failpoints("segment.after_roll=emfile")) as log:
        while log.segment_count() < 3:
            log.append(make_batch(log.end_offset(), 1, 4))
        assert not log.failed()
        end = log.flush()  # syncs the directory the rolls left dirty
    with SegmentLog(tmp_path / "log", segment_bytes=1024) as reopened:  # rebuilds the indexes
        assert reopened.end_offset() == end
        assert sum(len(batch.records) for batch in reopened.read(0, EVERYTHING)) == end


def test_a_node_whose_log_cannot_roll_for_lack_of_descriptors_keeps_serving(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "cluster", voters=1, settings={"segment_bytes": 4096},
                      env={"METAKV_FAILPOINTS": "segment.before_create=emfile@2"})
    node = cluster.nodes[1]
    try:
        cluster.start()
        cluster.wait_for_leader()
        with httpx.Client(timeout=30.0) as client:
            for index in range(40):  # ~40 KiB of values: ten segments' worth
                response = client.put(f"{node.url}/v1/kv/k{index}", content=b"v" * 1024)
                assert response.status_code == 200, response.text
            assert node.running()
            assert client.get(f"{node.url}/v1/kv/k39").content == b"v" * 1024
        assert "no file descriptor left to roll the log" in node.log_tail()
    finally:
        print(node.log_tail())
        cluster.close()
