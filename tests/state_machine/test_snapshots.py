"""Snapshots: create/load round trip, chunked transfer, corruption rejected, retention."""

from __future__ import annotations

import os
import sqlite3
import threading

import pytest

from raft.snapshots import CorruptSnapshotError, SnapshotNotFoundError
from raft.types import SnapshotId
from storage.commands import delete, put
from storage.snapshot_store import (
    TRAILER_BYTES,
    SnapshotStore,
    extract_database,
    verify_snapshot_file,
)
from storage.state_machine import StateMachine, VersionCompactedError
from storage.state_schema import SCHEMA_VERSION, read_database_meta
from tests.state_machine.helpers import (
    control_batch,
    data_batch,
    dump_tables,
    write_schema_1_database,
)


def _fill(state: StateMachine, records: int = 40, epoch: int = 2) -> None:
    commands = []
    for i in range(records):
        commands.append(put(f"k{i % 9}", b"value-%d" % i, "text/plain"))
        if i % 7 == 3:
            commands.append(delete(f"k{(i + 4) % 9}"))
    state.apply([control_batch(0, epoch), data_batch(1, commands, epoch)])


def _transfer(source: SnapshotStore, target: SnapshotStore, snapshot_id: SnapshotId,
              chunk_bytes: int = 1000) -> None:
    size = source.size_bytes(snapshot_id)
    target.begin_download(snapshot_id, size)
    position = 0
    while position < size:
        chunk = source.read_chunk(snapshot_id, position, chunk_bytes)
        target.write_chunk(snapshot_id, position, chunk)
        position += len(chunk)
    target.finish_download(snapshot_id)


@pytest.fixture()
def source(tmp_path):
    # key_heads written every call: the tests compare the live tables with a snapshot's.
    state = StateMachine(str(tmp_path / "source.db"), heads_flush_records=1)
    _fill(state)
    state.prune_history(10)
    yield state
    state.close()


def test_create_and_load_round_trip(source, tmp_path):
    snapshot_dir = str(tmp_path / "snapshots")
    snapshot_id = source.create_snapshot(snapshot_dir, epoch=2)
    assert snapshot_id == SnapshotId(source.applied_version, 2)
    path = SnapshotStore(snapshot_dir).path_for(snapshot_id)
    assert os.path.basename(path) == f"{snapshot_id.end_offset:020d}-0000000002.snapshot"
    assert verify_snapshot_file(path) == os.path.getsize(path) - TRAILER_BYTES
    with StateMachine(str(tmp_path / "target.db")) as target:
        target.apply([data_batch(0, [put("stale", b"gone")])])
        target.load_snapshot(path)
        assert dump_tables(target.db_path) == dump_tables(source.db_path)
        assert (target.applied_version, target.applied_epoch, target.oldest_version) == (
            source.applied_version, 2, 10)
        assert target.get("stale")[1] is None
        assert target.list("", at_version=10) == source.list("", at_version=10)
        with pytest.raises(VersionCompactedError):
            target.get("k1", at_version=9)
        # Applying continues from the snapshot's end offset.
        target.apply([data_batch(snapshot_id.end_offset, [put("after", b"1")], epoch=3)])
        assert target.get("after")[1].mod_version == snapshot_id.end_offset + 1


def test_chunked_transfer_publishes_a_loadable_copy(source, tmp_path):
    leader = SnapshotStore(str(tmp_path / "leader"))
    snapshot_id = source.create_snapshot(leader)
    follower = SnapshotStore(str(tmp_path / "follower"))
    _transfer(leader, follower, snapshot_id, chunk_bytes=777)
    assert follower.latest_id() == snapshot_id
    with open(leader.path_for(snapshot_id), "rb") as a, open(follower.path_for(snapshot_id), "rb") as b:
        assert a.read() == b.read()
    with StateMachine(str(tmp_path / "follower.db")) as target:
        target.load_snapshot(follower.path_for(snapshot_id))
        assert dump_tables(target.db_path) == dump_tables(source.db_path)


def _download(target: SnapshotStore, snapshot_id: SnapshotId, data: bytes, size: int | None = None) -> None:
    target.begin_download(snapshot_id, len(data) if size is None else size)
    for position in range(0, len(data), 4096):
        target.write_chunk(snapshot_id, position, data[position:position + 4096])
    target.finish_download(snapshot_id)


def _leftovers(store: SnapshotStore) -> list[str]:
    return sorted(os.listdir(store.snapshot_dir))


@pytest.mark.parametrize("where", ["database", "trailer-magic", "trailer-length"])
def test_corrupt_download_is_rejected_and_discarded(source, tmp_path, where):
    leader = SnapshotStore(str(tmp_path / "leader"))
    snapshot_id = source.create_snapshot(leader)
    data = bytearray(open(leader.path_for(snapshot_id), "rb").read())
    flip_at = {"database": len(data) // 2, "trailer-magic": len(data) - TRAILER_BYTES,
               "trailer-length": len(data) - 1}[where]
    data[flip_at] ^= 0x01
    follower = SnapshotStore(str(tmp_path / "follower"))
    with pytest.raises(CorruptSnapshotError):
        _download(follower, snapshot_id, bytes(data))
    assert follower.latest_id() is None and _leftovers(follower) == []


def test_short_download_and_oversized_chunk_are_rejected(source, tmp_path):
    leader = SnapshotStore(str(tmp_path / "leader"))
    snapshot_id = source.create_snapshot(leader)
    data = open(leader.path_for(snapshot_id), "rb").read()
    follower = SnapshotStore(str(tmp_path / "follower"))
    with pytest.raises(CorruptSnapshotError, match="received"):
        _download(follower, snapshot_id, data[:-100], size=len(data))
    assert _leftovers(follower) == []
    follower.begin_download(snapshot_id, 10)
    with pytest.raises(CorruptSnapshotError):
        follower.write_chunk(snapshot_id, 0, data[:11])
    assert _leftovers(follower) == []


def test_valid_bytes_under_the_wrong_id_are_rejected(source, tmp_path):
    leader = SnapshotStore(str(tmp_path / "leader"))
    snapshot_id = source.create_snapshot(leader)
    data = open(leader.path_for(snapshot_id), "rb").read()
    follower = SnapshotStore(str(tmp_path / "follower"))
    wrong = SnapshotId(snapshot_id.end_offset + 5, snapshot_id.epoch)
    with pytest.raises(CorruptSnapshotError, match="not SnapshotId"):
        _download(follower, wrong, data)
    assert _leftovers(follower) == []


def test_write_chunk_position_and_state_checks(source, tmp_path):
    leader = SnapshotStore(str(tmp_path / "leader"))
    snapshot_id = source.create_snapshot(leader)
    follower = SnapshotStore(str(tmp_path / "follower"))
    with pytest.raises(ValueError):
        follower.write_chunk(snapshot_id, 0, b"x")
    follower.begin_download(snapshot_id, 100)
    follower.write_chunk(snapshot_id, 0, b"x" * 10)
    with pytest.raises(ValueError, match="expected 10"):
        follower.write_chunk(snapshot_id, 5, b"x")
    # begin_download restarts from nothing.
    follower.begin_download(snapshot_id, 100)
    follower.write_chunk(snapshot_id, 0, b"y" * 10)


def test_read_chunk_errors(source, tmp_path):
    store = SnapshotStore(str(tmp_path / "snapshots"))
    snapshot_id = source.create_snapshot(store)
    size = store.size_bytes(snapshot_id)
    assert store.read_chunk(snapshot_id, size, 10) == b""
    with pytest.raises(ValueError):
        store.read_chunk(snapshot_id, size + 1, 10)
    with pytest.raises(SnapshotNotFoundError):
        store.read_chunk(SnapshotId(1, 1), 0, 10)
    with pytest.raises(SnapshotNotFoundError):
        store.size_bytes(SnapshotId(1, 1))


def test_keeps_the_newest_snapshots(tmp_path):
    store = SnapshotStore(str(tmp_path / "snapshots"), keep_snapshots=3)
    with StateMachine(str(tmp_path / "state.db")) as state:
        ids = []
        for offset in range(5):
            state.apply([data_batch(offset, [put("k", b"%d" % offset)])])
            ids.append(state.create_snapshot(store))
    assert store.list_ids() == ids[-3:]
    assert store.latest_id() == ids[-1]


def test_load_of_a_corrupt_file_names_it_and_changes_nothing(source, tmp_path):
    store = SnapshotStore(str(tmp_path / "snapshots"))
    snapshot_id = source.create_snapshot(store)
    path = store.path_for(snapshot_id)
    data = bytearray(open(path, "rb").read())
    data[100] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with StateMachine(str(tmp_path / "target.db")) as target:
        target.apply([data_batch(0, [put("kept", b"1")])])
        before = dump_tables(target.db_path)
        with pytest.raises(CorruptSnapshotError, match=f"{path}.*CRC32C"):
            target.load_snapshot(path)
        assert dump_tables(target.db_path) == before
        assert [name for name in os.listdir(tmp_path) if "snapshot-load" in name] == []
    truncated = tmp_path / "short.snapshot"
    truncated.write_bytes(b"MKVSNAP1")
    with pytest.raises(CorruptSnapshotError, match="shorter than"):
        verify_snapshot_file(str(truncated))


def test_load_of_an_older_schema_snapshot_names_it_and_changes_nothing(tmp_path):
    store = SnapshotStore(str(tmp_path / "snapshots"))
    old_database = store.new_temp_path()
    write_schema_1_database(old_database)
    store.publish_database(old_database, SnapshotId(1, 1))
    path = store.path_for(SnapshotId(1, 1))
    with StateMachine(str(tmp_path / "target.db")) as target:
        target.apply([data_batch(0, [put("kept", b"1")])])
        before = dump_tables(target.db_path)
        with pytest.raises(CorruptSnapshotError, match=f"{path}: schema version 1, this code reads {SCHEMA_VERSION}"):
            target.load_snapshot(path)
        assert dump_tables(target.db_path) == before


def test_a_schema_2_snapshot_from_a_peer_not_yet_upgraded_loads(source, tmp_path):
    """During a rolling upgrade a leader still on schema 2 sends its snapshot: it loads,
    upgraded in the copy, and reads as the state it holds."""
    store = SnapshotStore(str(tmp_path / "snapshots"))
    schema_2 = store.new_temp_path()
    source.create_snapshot(str(tmp_path / "made"))
    made = SnapshotStore(str(tmp_path / "made"))
    snapshot_id = made.latest_id()
    extract_database(made.path_for(snapshot_id), schema_2)
    with sqlite3.connect(schema_2) as connection:
        connection.execute("ALTER TABLE meta DROP COLUMN heads_version")
        connection.execute("UPDATE meta SET schema_version = 2")
    store.publish_database(schema_2, snapshot_id)
    with StateMachine(str(tmp_path / "target.db")) as target:
        target.load_snapshot(store.path_for(snapshot_id))
        assert target.applied_version == source.applied_version
        assert target.list("")[1] == source.list("")[1]
        assert target.get("k1", at_version=12) == source.get("k1", at_version=12)
        target.apply([data_batch(target.applied_version, [put("k1", b"new")])])
        assert target.get("k1")[1].create_version == source.get("k1")[1].create_version
    assert read_database_meta(target.db_path).schema_version == SCHEMA_VERSION


def test_create_snapshot_refuses_version_zero_and_a_wrong_epoch(tmp_path):
    store = SnapshotStore(str(tmp_path / "snapshots"))
    with StateMachine(str(tmp_path / "state.db")) as state:
        with pytest.raises(ValueError, match="nothing applied"):
            state.create_snapshot(store)
        state.apply([data_batch(0, [put("k", b"1")], epoch=4)])
        with pytest.raises(ValueError, match="epoch 4"):
            state.create_snapshot(store, epoch=5)
    assert _leftovers(store) == []


def test_snapshot_taken_during_apply_holds_exactly_its_version(tmp_path):
    """The id names the version inside the copy even while another thread applies."""
    store = SnapshotStore(str(tmp_path / "snapshots"), keep_snapshots=10)
    with StateMachine(str(tmp_path / "state.db")) as state:
        state.apply([data_batch(0, [put("k", b"0")])])
        stop = threading.Event()

        def writer():
            offset = 1
            while not stop.is_set() and offset < 2000:
                state.apply([data_batch(offset, [put("k", b"%d" % offset), put("n", b"x")])])
                offset += 2

        thread = threading.Thread(target=writer)
        thread.start()
        try:
            ids = [state.create_snapshot(store) for _ in range(4)]
        finally:
            stop.set()
            thread.join()
        for snapshot_id in ids:
            with StateMachine(str(tmp_path / f"load-{snapshot_id.end_offset}.db")) as loaded:
                loaded.load_snapshot(store.path_for(snapshot_id))
                assert loaded.applied_version == snapshot_id.end_offset
                assert loaded.get("k")[1] == state.get("k", at_version=snapshot_id.end_offset)[1]
