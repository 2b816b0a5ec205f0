"""Snapshot re-bootstrap in the core with the real on-disk snapshot store on both sides (in
the simulator, so the network can be tampered with): corrupt chunks are rejected and the
download starts over; a snapshot that vanished makes the fetcher fall back to fetching."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from raft.messages import Envelope, FetchSnapshotRequest, FetchSnapshotResponse
from raft.node import Role
from raft.types import SnapshotId
from storage.commands import encode_command, put
from storage.snapshot_store import SnapshotStore
from storage.state_machine import StateMachine
from tests.sim.cluster import Cluster

LEADER, OBSERVER = 1, 2


def _cluster_with_snapshot(tmp_path: Path) -> tuple[Cluster, SnapshotId, list[Envelope]]:
    """One voter with 30 committed puts replaced by a real snapshot; an empty observer."""
    cluster = Cluster(seed=7, voters=1, observers=1, config_overrides={"snapshot_chunk_bytes": 4096})
    for node_id in (LEADER, OBSERVER):
        node = cluster.nodes[node_id]
        cluster.crash(node_id)
        node.snapshots = SnapshotStore(str(tmp_path / f"snapshots{node_id}"))  # type: ignore[assignment]
        cluster.restart(node_id)
    cluster.partition({OBSERVER}, {LEADER})
    assert cluster.run_until(lambda: cluster.leader() is not None, 5_000)
    for index in range(30):
        cluster.propose((encode_command(put(f"key{index}", b"v%d" % index)),))
        cluster.run_for(20)
    leader = cluster.nodes[LEADER]
    assert cluster.run_until(lambda: leader.core.high_watermark == leader.log.end_offset(), 5_000)  # type: ignore[union-attr]
    state = StateMachine(str(tmp_path / "state.db"))
    state.apply(leader.log.read(0, 1 << 30))
    snapshot_id = state.create_snapshot(leader.snapshots)  # type: ignore[arg-type]
    state.close()
    assert snapshot_id.end_offset == leader.log.end_offset()
    leader.log.reset_to_snapshot(snapshot_id)  # the observer must now download it
    sent: list[Envelope] = []
    transmit = cluster._transmit

    def record(envelope: Envelope) -> None:
        sent.append(envelope)
        transmit(envelope)
    cluster._transmit = record  # type: ignore[method-assign]
    return cluster, snapshot_id, sent


def _tamper_first(cluster: Cluster, change: object) -> None:
    transmit = cluster._transmit
    done = []

    def tampered(envelope: Envelope) -> None:
        message = envelope.message
        if not done and isinstance(message, FetchSnapshotResponse) and message.chunk:
            done.append(True)
            envelope = dataclasses.replace(envelope, message=change(message))  # type: ignore[operator]
        transmit(envelope)
    cluster._transmit = tampered  # type: ignore[method-assign]


def _downloads_started(sent: list[Envelope]) -> int:
    return sum(1 for e in sent if isinstance(e.message, FetchSnapshotRequest) and e.message.position == 0)


def _installed(cluster: Cluster, snapshot_id: SnapshotId) -> bool:
    return cluster.nodes[OBSERVER].log.start_offset() == snapshot_id.end_offset


def test_clean_download_installs_the_snapshot(tmp_path: Path) -> None:
    cluster, snapshot_id, sent = _cluster_with_snapshot(tmp_path)
    cluster.heal()
    assert cluster.run_until(lambda: _installed(cluster, snapshot_id), 10_000)
    assert _downloads_started(sent) == 1
    assert cluster.nodes[OBSERVER].core.role == Role.FOLLOWER  # type: ignore[union-attr]


def test_bad_crc_chunk_is_rejected_and_the_download_restarts(tmp_path: Path) -> None:
    cluster, snapshot_id, sent = _cluster_with_snapshot(tmp_path)

    def flip(message: FetchSnapshotResponse) -> FetchSnapshotResponse:
        chunk = bytearray(message.chunk)
        chunk[len(chunk) // 2] ^= 0xFF
        return dataclasses.replace(message, chunk=bytes(chunk))
    _tamper_first(cluster, flip)
    cluster.heal()
    assert cluster.run_until(lambda: _installed(cluster, snapshot_id), 10_000)
    assert _downloads_started(sent) >= 2
    assert cluster.stats["snapshot_installs"] == 1


def test_wrong_size_is_rejected_and_the_download_restarts(tmp_path: Path) -> None:
    cluster, snapshot_id, sent = _cluster_with_snapshot(tmp_path)
    _tamper_first(cluster, lambda m: dataclasses.replace(m, size=m.size + 100))
    cluster.heal()
    assert cluster.run_until(lambda: _installed(cluster, snapshot_id), 10_000)
    assert _downloads_started(sent) >= 2


def test_chunk_of_another_snapshot_id_is_not_written(tmp_path: Path) -> None:
    cluster, snapshot_id, sent = _cluster_with_snapshot(tmp_path)
    other = SnapshotId(snapshot_id.end_offset + 1, snapshot_id.epoch)
    _tamper_first(cluster, lambda m: dataclasses.replace(m, snapshot_id=other))
    cluster.heal()
    assert cluster.run_until(lambda: _installed(cluster, snapshot_id), 10_000)
    observer_store = cluster.nodes[OBSERVER].snapshots
    assert observer_store.latest_id() == snapshot_id


def test_vanished_snapshot_falls_back_to_fetching(tmp_path: Path) -> None:
    cluster, snapshot_id, sent = _cluster_with_snapshot(tmp_path)
    leader = cluster.nodes[LEADER]
    Path(leader.snapshots.path_for(snapshot_id)).unlink()  # type: ignore[attr-defined]
    cluster.heal()
    cluster.run_for(1_000)  # SNAPSHOT_NOT_FOUND again and again: the observer keeps fetching
    observer = cluster.nodes[OBSERVER]
    assert observer.core is not None and observer.log.start_offset() == 0
    assert any(isinstance(e.message, FetchSnapshotResponse) and e.message.error.name == "SNAPSHOT_NOT_FOUND"
               for e in sent)
    fetches_before = len(sent)
    cluster.run_for(500)
    assert len(sent) > fetches_before  # still fetching, not wedged
