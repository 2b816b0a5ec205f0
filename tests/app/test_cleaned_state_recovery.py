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
from app.service import NotReadyError
from raft.types import Batch
from storage.cleaner import clean_prefix
from storage.commands import Command, Op, OpKind, encode_command
from storage.segment_log import SegmentLog
from storage.snapshot_store import SnapshotStore
from storage.state_machine import SnapshotRejectedError, StateDatabaseError, StateMachine
from tests.cluster import free_ports


def _put(key: str, value: bytes) -> bytes:
    return encode_command(Command((), (Op(OpKind.PUT, key, value),)))


def _delete(key: str) -> bytes:
    return encode_command(Command((), (Op(OpKind.DELETE, key),)))


def _config(node_dir: Path, **settings: object) -> NodeConfig:
    http_port, raft_port, leader_raft_port = free_ports(3)
    return NodeConfig(
        node_id=1, data_dir=node_dir, listen_http=HostPort("127.0.0.1", http_port),
        listen_raft=HostPort("127.0.0.1", raft_port), voters={2: HostPort("127.0.0.1", leader_raft_port)},
        advertise_http=f"http://127.0.0.1:{http_port}", observer=True, cleaner_interval_ms=0,
        **settings,  # type: ignore[arg-type]
    )


def _absent(keys, _version):  # noqa: ANN001, ANN202 (the cleaner's base_state: no key exists)
    return dict.fromkeys(keys)


def _log_from_a_snapshot(tmp_path: Path) -> tuple[Path, SegmentLog]:
    """A node directory, no state.db, whose log was reset to a snapshot at version 3 that
    holds key k (written three times)."""
    node_dir = tmp_path / "node"
    (node_dir / "log").mkdir(parents=True)
    with StateMachine(str(tmp_path / "source.db")) as source:
        source.apply([Batch(0, 1, 0, False, (_put("k", b"v0"), _put("k", b"v1"), _put("k", b"v2")))])
        snapshot_id = source.create_snapshot(SnapshotStore(node_dir / "snapshots"))
    log = SegmentLog(node_dir / "log")
    log.reset_to_snapshot(snapshot_id)
    return node_dir, log


def _snapshot_based_cleaned_log(tmp_path: Path) -> Path:
    """The log from a snapshot, then k's delete at offset 3, cleaned away by this replica's
    own cleaner (tombstone dropped)."""
    node_dir, log = _log_from_a_snapshot(tmp_path)
    log.append(Batch(3, 1, 0, False, (_delete("k"),)))
    log.append(Batch(4, 1, 0, False, (_put("other", b"x"),)))
    log.flush()
    result = clean_prefix(log.read(3, 1 << 20), 5, 5, start_offset=3, base_state=_absent)
    assert result.tombstones_dropped == 1
    log.replace_prefix(result.batches, result.clean_end)
    log.close()
    return node_dir


def test_a_snapshot_based_log_cleaned_past_the_state_refuses_to_start(tmp_path: Path) -> None:
    """With state.db gone, snapshot + cleaned log would bring k back."""
    node_dir = _snapshot_based_cleaned_log(tmp_path)
    runtime = NodeRuntime(_config(node_dir), seed=1)
    with pytest.raises(StateDatabaseError) as raised:
        asyncio.run(runtime.start())
    message = str(raised.value)
    assert str(node_dir / "state.db") in message and "cleaned prefix [3, 5)" in message, message
    # Startup closed what it opened: the log opens again at once.
    SegmentLog(node_dir / "log").close()


def test_a_snapshot_past_the_cleaned_prefix_replaces_a_state_behind_it(tmp_path: Path) -> None:
    """The same log, but a snapshot at version 5 (past the cleaned prefix) is on disk: the
    node loads it instead of refusing to start."""
    node_dir = _snapshot_based_cleaned_log(tmp_path)
    with StateMachine(str(tmp_path / "later.db")) as later:
        later.apply([Batch(0, 1, 0, False, (_put("k", b"v0"), _put("k", b"v1"), _put("k", b"v2"))),
                     Batch(3, 1, 0, False, (_delete("k"),)), Batch(4, 1, 0, False, (_put("other", b"x"),))])
        later.create_snapshot(SnapshotStore(node_dir / "snapshots"))

    async def scenario() -> tuple[int, object, object]:
        runtime = NodeRuntime(_config(node_dir), seed=1)
        await runtime.start()
        try:
            return runtime.applied_version, runtime.state.get("k")[1], runtime.state.get("other")[1]
        finally:
            await runtime.stop()

    applied, k, other = asyncio.run(scenario())
    assert applied == 5 and k is None and other is not None and other.value == b"x"  # type: ignore[attr-defined]


def test_an_empty_log_with_a_state_above_0_starts_over_from_0(tmp_path: Path) -> None:
    """The log is gone (or a power loss took all of it) but state.db is at version 3: the
    leader will answer the fetch from 0 with its whole cleaned log, whose dropped tombstones
    a replay from version 3 would miss. The node starts over from an empty state."""
    node_dir = tmp_path / "node"
    (node_dir / "log").mkdir(parents=True)
    with StateMachine(str(node_dir / "state.db")) as state:
        state.apply([Batch(0, 1, 0, False, (_put("k", b"v0"), _put("k", b"v1"), _put("k", b"v2")))])

    async def scenario() -> tuple[int, object]:
        runtime = NodeRuntime(_config(node_dir), seed=1)
        await runtime.start()
        try:
            return runtime.applied_version, runtime.state.get("k")[1]
        finally:
            await runtime.stop()

    assert asyncio.run(scenario()) == (0, None)


def test_a_state_older_than_a_copied_cleaned_prefix_still_starts(tmp_path: Path) -> None:
    """A replica that copied the leader's cleaned prefix (allow_gaps_below) may replay it from
    any version: the leader kept every tombstone at and above the offset the copy started
    from. Only this replica's own cleaning (cleaner_end) bounds the replay."""
    node_dir, log = _log_from_a_snapshot(tmp_path)
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
            # Not a real version until a leader is heard: no snapshot of it either (a
            # snapshot of a state inside a cleaned prefix would be handed on as real).
            with pytest.raises(NotReadyError):
                await runtime.take_snapshot()
            return runtime.applied_version
        finally:
            await runtime.stop()

    assert asyncio.run(scenario()) == 3  # the snapshot, loaded; the log replays once a leader commits it


def _log_and_state_at_10(tmp_path: Path) -> Path:
    """A node directory whose log holds offsets 0..9 (puts over three keys), all applied."""
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
    return node_dir


def test_no_snapshot_is_taken_of_a_state_that_is_no_version(tmp_path: Path) -> None:
    """Until a leader is heard this state is no real version (rule 7): neither the periodic
    snapshot nor a snapshot started anyway (the copy is checked too) publishes it."""
    node_dir = _log_and_state_at_10(tmp_path)

    async def scenario() -> None:
        runtime = NodeRuntime(_config(node_dir, snapshot_every_records=5), seed=1)
        await runtime.start()
        try:
            assert runtime.applied_version == 10 and not runtime.is_ready()
            runtime.maintenance.maybe_snapshot()  # 10 applied records since the last snapshot: due
            assert not runtime.maintenance.snapshot_running
            with pytest.raises(SnapshotRejectedError):
                await runtime.maintenance.start_snapshot()
            with pytest.raises(NotReadyError):
                await runtime.take_snapshot()
        finally:
            await runtime.stop()

    asyncio.run(scenario())
    assert SnapshotStore(node_dir / "snapshots").list_ids() == []


def test_the_cleaner_stops_at_the_version_sqlite_made_durable(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    node_dir = _log_and_state_at_10(tmp_path)

    async def scenario() -> dict:
        runtime = NodeRuntime(_config(node_dir), seed=1)
        await runtime.start()
        try:
            assert runtime.applied_version == 10
            monkeypatch.setattr(runtime.state, "sync", lambda: 6)  # a checkpoint not yet reached 10
            return await asyncio.get_running_loop().run_in_executor(
                None, runtime.maintenance.clean_blocking, 10, 10, True)
        finally:
            await runtime.stop()

    report = asyncio.run(scenario())
    assert report["cleaned"] and report["cleaned_end"] == 6, report
