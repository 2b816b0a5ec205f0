"""Readiness of a node runtime around a snapshot install, driven by real raft messages.

The core resets the log to a downloaded snapshot while it handles the last chunk; the
runtime loads the snapshot into SQLite on its next drive, one event-loop turn later. A read
served in between must not see the old state as a real version: the log already ends at
the snapshot, past the dirty offset learned, while the state is still the old one.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from app.config import HostPort, NodeConfig
from app.runtime import NodeRuntime
from raft.messages import NO_EPOCH, Envelope, FetchResponse, FetchSnapshotResponse
from raft.node import Role
from raft.types import Batch, ErrorCode
from storage.commands import Command, Op, OpKind, encode_command
from storage.state_machine import StateMachine
from tests.cluster import free_ports

LEADER_ID = 2
WAIT_S = 10.0


async def _until(predicate, what: str) -> None:  # noqa: ANN001 (a test helper)
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _leader_snapshot(directory: Path) -> tuple[object, bytes]:
    """A snapshot the leader would send: key "k" written at versions 1..3."""
    records = tuple(encode_command(Command((), (Op(OpKind.PUT, "k", b"v%d" % index),))) for index in range(3))
    with StateMachine(str(directory / "leader.db")) as state:
        state.apply([Batch(0, 1, 0, False, records)])
        snapshot_id = state.create_snapshot(str(directory / "leader-snapshots"), epoch=1)
    path = next((directory / "leader-snapshots").glob("*"))
    return snapshot_id, path.read_bytes()


async def _scenario(tmp_path: Path) -> None:
    snapshot_id, data = _leader_snapshot(tmp_path)
    http_port, raft_port, leader_raft_port = free_ports(3)
    config = NodeConfig(
        node_id=1, data_dir=tmp_path / "observer", listen_http=HostPort("127.0.0.1", http_port),
        listen_raft=HostPort("127.0.0.1", raft_port), voters={LEADER_ID: HostPort("127.0.0.1", leader_raft_port)},
        advertise_http=f"http://127.0.0.1:{http_port}", observer=True,
    )
    fatal: list[BaseException] = []
    runtime = NodeRuntime(config, seed=1, on_fatal=fatal.append)
    await runtime.start()
    try:
        end = snapshot_id.end_offset  # type: ignore[attr-defined]
        # The leader (never started: its messages are injected) answers the observer's first
        # fetch with the snapshot to download; dirty offset and horizon at its end.
        runtime._on_message(Envelope(LEADER_ID, 1, FetchResponse(
            ErrorCode.NONE, 1, LEADER_ID, "http://leader", 0, end, end, end, end, (), NO_EPOCH, -1, snapshot_id,
            fetch_epoch=0)))
        await _until(lambda: runtime.node.role == Role.FOLLOWER, "the observer following the leader")
        assert not runtime.is_ready()
        runtime._on_message(Envelope(LEADER_ID, 1, FetchSnapshotResponse(
            ErrorCode.NONE, 1, LEADER_ID, snapshot_id, len(data), 0, data)))  # type: ignore[arg-type]
        # The core has reset the log to the snapshot; the runtime has not loaded it yet.
        assert runtime.log.start_offset() == end and runtime.applied_version == 0
        assert not runtime.is_ready(), "the empty state was ready before the snapshot was loaded"
        assert runtime.status()["ready"] is False
        await _until(lambda: runtime.applied_version == end, "the snapshot loaded")
        assert runtime.is_ready()
        assert runtime.state.get("k")[1].value == b"v2"  # type: ignore[union-attr]
        assert not fatal, fatal
    finally:
        await runtime.stop()


def test_a_node_is_not_ready_between_the_log_reset_to_a_snapshot_and_its_install(tmp_path: Path) -> None:
    asyncio.run(_scenario(tmp_path))
