"""The state machine and the cleaned log, across a lost SQLite tail (docs/compaction.md rule 9).

SQLite runs with relaxed sync, so a power loss may take back its newest versions. A replay
from such an older version through a cleaned prefix would miss the deletes whose tombstones
the cleaner dropped. So the cleaner cleans only below the version ``StateMachine.sync``
made durable, and a node whose state is older than its log's cleaned prefix either
rebuilds from offset 0 (tests/app/test_state_recovery.py) or, when the log starts at a
snapshot and cannot rebuild it, refuses to start with a message naming state.db.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.config import HostPort, NodeConfig
from app.runtime import NodeRuntime
from raft.types import Batch
from storage.cleaner import clean_prefix
from storage.commands import Command, Op, OpKind, encode_command
from storage.segment_log import SegmentLog
from storage.snapshot_store import SnapshotStore
from storage.state_machine import StateDatabaseError, StateMachine
from tests.cluster import free_ports


def _put(key: str, value: bytes) -> bytes:
    return encode_command(Command((), (Op(OpKind.PUT, key, value),)))


def _delete(key: str) -> bytes:
    return encode_command(Command((), (Op(OpKind.DELETE, key),)))


def _config(node_dir: Path) -> NodeConfig:
    http_port, raft_port, leader_raft_port = free_ports(3)
    return NodeConfig(
        node_id=1, data_dir=node_dir, listen_http=HostPort("127.0.0.1", http_port),
        listen_raft=HostPort("127.0.0.1", raft_port), voters={2: HostPort("127.0.0.1", leader_raft_port)},
        advertise_http=f"http://127.0.0.1:{http_port}", observer=True, cleaner_interval_ms=0,
    )


def _absent(keys, _version):  # noqa: ANN001, ANN202 (the cleaner's base_state: no key exists)
    return dict.fromkeys(keys)


def test_a_snapshot_based_log_cleaned_past_the_state_refuses_to_start(tmp_path: Path) -> None:
    """The log starts at a snapshot holding key k; k's delete above it was cleaned away
    (its tombstone dropped). With state.db gone, snapshot + cleaned log would bring k back."""
    node_dir = tmp_path / "node"
    (node_dir / "log").mkdir(parents=True)
    with StateMachine(str(tmp_path / "source.db")) as source:
        source.apply([Batch(0, 1, 0, False, (_put("k", b"v0"), _put("k", b"v1"), _put("k", b"v2")))])
        snapshot_id = source.create_snapshot(SnapshotStore(node_dir / "snapshots"))
    log = SegmentLog(node_dir / "log")
    log.reset_to_snapshot(snapshot_id)
    log.append(Batch(3, 1, 0, False, (_delete("k"),)))
    log.append(Batch(4, 1, 0, False, (_put("other", b"x"),)))
    log.flush()
    result = clean_prefix(log.read(3, 1 << 20), 5, 5, start_offset=3, base_state=_absent)
    assert result.tombstones_dropped == 1
    log.replace_prefix(result.batches, result.clean_end)
    log.close()

    runtime = NodeRuntime(_config(node_dir), seed=1)
    with pytest.raises(StateDatabaseError) as raised:
        asyncio.run(runtime.start())
    message = str(raised.value)
    assert str(node_dir / "state.db") in message and "cleaned prefix [3, 5)" in message, message
    # Startup closed what it opened: the log opens again at once.
    SegmentLog(node_dir / "log").close()


def test_a_state_older_than_a_copied_cleaned_prefix_still_starts(tmp_path: Path) -> None:
    """A replica that copied the leader's cleaned prefix (allow_gaps_below) may replay it from
    any version: the leader kept every tombstone at and above the offset the copy started
    from. Only this replica's own cleaning (cleaner_end) bounds the replay."""
    node_dir = tmp_path / "node"
    (node_dir / "log").mkdir(parents=True)
    with StateMachine(str(tmp_path / "source.db")) as source:
        source.apply([Batch(0, 1, 0, False, (_put("k", b"v0"), _put("k", b"v1"), _put("k", b"v2")))])
        snapshot_id = source.create_snapshot(SnapshotStore(node_dir / "snapshots"))
    log = SegmentLog(node_dir / "log")
    log.reset_to_snapshot(snapshot_id)
    log.allow_gaps_below(6)
    log.append(Batch(4, 1, 0, False, (_delete("k"),)))  # offset 3 was cleaned away by the leader
    log.append(Batch(5, 1, 0, False, (_put("other", b"x"),)))
    log.flush()
    assert (log.cleaned_end(), log.cleaner_end()) == (6, 0)
    log.close()

    async def scenario() -> int:
        runtime = NodeRuntime(_config(node_dir), seed=1)
        await runtime.start()
        try:
            return runtime.applied_version
        finally:
            await runtime.stop()

    assert asyncio.run(scenario()) == 3  # the snapshot, loaded; the log replays once a leader commits it


def test_the_cleaner_stops_at_the_version_sqlite_made_durable(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    node_dir = tmp_path / "node"
    (node_dir / "log").mkdir(parents=True)
    log = SegmentLog(node_dir / "log")
    batches = [Batch(offset, 1, 0, False, (_put(f"k{offset % 3}", b"%d" % offset),)) for offset in range(10)]
    for batch in batches:
        log.append(batch)
    log.flush()
    log.close()
    with StateMachine(str(node_dir / "state.db")) as state:
        state.apply(batches)
        assert state.sync() == 10  # every applied version is durable once sync returns

    async def scenario() -> dict:
        runtime = NodeRuntime(_config(node_dir), seed=1)
        await runtime.start()
        try:
            assert runtime.applied_version == 10
            monkeypatch.setattr(runtime.state, "sync", lambda: 6)  # a checkpoint not yet reached 10
            return await asyncio.get_running_loop().run_in_executor(
                None, runtime._clean_blocking, 10, 10, True)
        finally:
            await runtime.stop()

    report = asyncio.run(scenario())
    assert report["cleaned"] and report["cleaned_end"] == 6, report
