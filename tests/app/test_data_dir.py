"""One process per data directory, one node of one cluster per data directory, and a state
that the log no longer covers on a lone voter (storage/data_dir.py, NodeRuntime.start)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from app.config import HostPort, NodeConfig
from app.runtime import NodeRuntime
from raft.types import Batch
from storage.commands import Command, Op, OpKind, encode_command
from storage.data_dir import DataDirError
from storage.segment_log import SegmentLog
from storage.state_machine import StateDatabaseError, StateMachine
from tests.cluster import free_ports


def _config(data_dir: Path, node_id: int = 1, cluster_id: str = "test-cluster", lone_voter: bool = False) -> NodeConfig:
    http_port, raft_port, other_port = free_ports(3)
    voters = {node_id: HostPort("127.0.0.1", raft_port)}
    if not lone_voter:
        voters[node_id + 1] = HostPort("127.0.0.1", other_port)
    return NodeConfig(node_id=node_id, data_dir=data_dir, listen_http=HostPort("127.0.0.1", http_port),
                      listen_raft=HostPort("127.0.0.1", raft_port), voters=voters,
                      advertise_http=f"http://127.0.0.1:{http_port}", cluster_id=cluster_id, cleaner_interval_ms=0)


async def _start_stop(config: NodeConfig, wait_for_version: int = 0) -> int:
    runtime = NodeRuntime(config, seed=1)
    await runtime.start()
    try:
        for _ in range(200):  # bounded: a lone voter elects itself and replays within a few seconds
            if runtime.applied_version >= wait_for_version:
                break
            await asyncio.sleep(0.05)
        return runtime.applied_version
    finally:
        await runtime.stop()


def test_a_second_process_on_a_data_directory_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    async def scenario() -> None:
        first = NodeRuntime(_config(tmp_path), seed=1)
        await first.start()
        try:
            with pytest.raises(DataDirError) as refused:
                await NodeRuntime(_config(tmp_path), seed=2).start()
            assert f"in use by another process (pid {os.getpid()})" in str(refused.value)
        finally:
            await first.stop()
        await _start_stop(_config(tmp_path))  # the lock went with the first: the directory is free

    asyncio.run(scenario())


def test_a_data_directory_refuses_another_node_or_cluster(tmp_path: Path) -> None:
    asyncio.run(_start_stop(_config(tmp_path, node_id=1, cluster_id="a")))
    for node_id, cluster_id in ((2, "a"), (1, "b")):
        with pytest.raises(DataDirError) as refused:
            asyncio.run(_start_stop(_config(tmp_path, node_id=node_id, cluster_id=cluster_id)))
        assert f"belongs to node 1 of cluster 'a', not node {node_id} of cluster '{cluster_id}'" in str(refused.value)
    asyncio.run(_start_stop(_config(tmp_path, node_id=1, cluster_id="a")))  # its own node still starts


def test_a_garbage_identity_file_is_named_with_its_byte_offset(tmp_path: Path) -> None:
    (tmp_path / "identity.json").write_text('{"cluster_id": "a", "node_id": ')
    with pytest.raises(DataDirError) as refused:
        asyncio.run(_start_stop(_config(tmp_path)))
    assert str(tmp_path / "identity.json") in str(refused.value) and "at byte 31" in str(refused.value)


def _state_ahead_of_the_log(data_dir: Path) -> None:
    """A log of offsets 0..4 and a state.db that applied 0..7: three committed records the
    log lost (a corrupt tail cut at startup, or a repair)."""
    (data_dir / "log").mkdir(parents=True)
    batches = [Batch(offset, 1, 0, False, (encode_command(Command((), (Op(OpKind.PUT, f"k{offset}", b"v"),))),))
               for offset in range(8)]
    log = SegmentLog(data_dir / "log")
    for batch in batches[:5]:
        log.append(batch)
    log.flush()
    log.close()
    with StateMachine(str(data_dir / "state.db")) as state:
        state.apply(batches)


def test_a_lone_voter_whose_log_lost_applied_records_refuses_to_start(tmp_path: Path) -> None:
    """It would append other records at offsets 5..7, which its state already applied."""
    _state_ahead_of_the_log(tmp_path)
    with pytest.raises(StateDatabaseError) as refused:
        asyncio.run(_start_stop(_config(tmp_path, lone_voter=True)))
    message = str(refused.value)
    assert str(tmp_path / "state.db") in message and "state at version 8 but the log ends at 5" in message
    assert "move state.db away" in message
    (tmp_path / "state.db").rename(tmp_path / "state.db.lost")  # the way out the message names
    for name in ("state.db-wal", "state.db-shm"):
        if (tmp_path / name).exists():
            (tmp_path / name).rename(tmp_path / f"{name}.lost")
    assert asyncio.run(_start_stop(_config(tmp_path, lone_voter=True), wait_for_version=5)) >= 5


def test_a_voter_with_peers_keeps_a_state_ahead_of_its_log(tmp_path: Path) -> None:
    """Committed records a crash took from the log's unflushed tail: the leader sends them again."""
    _state_ahead_of_the_log(tmp_path)
    assert asyncio.run(_start_stop(_config(tmp_path))) == 8


def test_a_start_that_fails_late_releases_the_directory(tmp_path: Path) -> None:
    """The raft port is taken: start fails after storage was opened and locked. The files and
    the lock are released, so a later start in this process (the port free again) works."""
    import socket

    config = _config(tmp_path)
    holder = socket.socket()
    holder.bind((config.listen_raft.host, config.listen_raft.port))
    holder.listen()
    try:
        with pytest.raises(OSError):
            asyncio.run(_start_stop(config))
    finally:
        holder.close()
    asyncio.run(_start_stop(config))
