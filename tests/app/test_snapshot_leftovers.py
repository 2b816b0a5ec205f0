"""A crash while a snapshot was being made or downloaded leaves its temporary file behind;
the next start removes it and keeps every complete snapshot."""

from __future__ import annotations

import asyncio
from pathlib import Path

from app.config import HostPort, NodeConfig
from app.runtime import NodeRuntime
from raft.types import Batch
from storage.commands import Command, Op, OpKind, encode_command
from storage.snapshot_store import PARTIAL_SUFFIX, TEMP_SUFFIX, SnapshotStore
from storage.state_machine import StateMachine
from tests.cluster import free_ports


def test_startup_removes_a_crashed_snapshot_copy_and_keeps_complete_snapshots(tmp_path: Path) -> None:
    node_dir = tmp_path / "node"
    snapshot_dir = node_dir / "snapshots"
    store = SnapshotStore(str(snapshot_dir))
    with StateMachine(str(tmp_path / "source.db")) as source:
        source.apply([Batch(0, 1, 0, False, (encode_command(Command((), (Op(OpKind.PUT, "k", b"v"),))),))])
        complete = store.path_for(source.create_snapshot(store))
    copy_in_progress = snapshot_dir / f"0123456789abcdef{TEMP_SUFFIX}"  # VACUUM INTO cut short
    download_in_progress = snapshot_dir / f"00000000000000000009-0000000001.snapshot{PARTIAL_SUFFIX}"
    copy_in_progress.write_bytes(b"half a database")
    download_in_progress.write_bytes(b"half a snapshot")
    http_port, raft_port, leader_raft_port = free_ports(3)
    config = NodeConfig(
        node_id=1, data_dir=node_dir, listen_http=HostPort("127.0.0.1", http_port),
        listen_raft=HostPort("127.0.0.1", raft_port), voters={2: HostPort("127.0.0.1", leader_raft_port)},
        advertise_http=f"http://127.0.0.1:{http_port}", observer=True, cleaner_interval_ms=0,
    )

    async def start_and_stop() -> None:
        runtime = NodeRuntime(config, seed=1)
        await runtime.start()
        await runtime.stop()

    asyncio.run(start_and_stop())
    assert sorted(path.name for path in snapshot_dir.iterdir()) == [Path(complete).name]
