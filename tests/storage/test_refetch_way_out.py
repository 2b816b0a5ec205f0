"""The way out printed for a log file that cannot be rebuilt works as printed: a voter whose
log-start-checkpoint is garbage refuses to start; after moving log/, snapshots/ and state.db
away (keeping quorum-state), it starts again and fetches everything from the leader."""

from __future__ import annotations

import asyncio
import re
import shlex
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from app.config import HostPort, NodeConfig
from app.http import create_app
from app.runtime import NodeRuntime
from raft.node import Role
from storage.log_checkpoints import LOG_START_CHECKPOINT_NAME
from storage.segment_files import CorruptLogError
from tests.cluster import free_ports
from tests.http.conftest import TEST_SETTINGS

WAIT_S = 20.0


async def until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def scenario(tmp_path: Path) -> None:
    ports = free_ports(4)
    voters = {1: HostPort("127.0.0.1", ports[0]), 2: HostPort("127.0.0.1", ports[1])}

    def runtime(node_id: int) -> NodeRuntime:
        http_port = ports[1 + node_id]
        return NodeRuntime(NodeConfig(
            node_id=node_id, data_dir=tmp_path / f"n{node_id}", listen_http=HostPort("127.0.0.1", http_port),
            listen_raft=voters[node_id], voters=voters, advertise_http=f"http://127.0.0.1:{http_port}",
            election_timeout_ms=300), seed=node_id, on_fatal=fatal.append)

    fatal: list[BaseException] = []
    first, second = runtime(1), runtime(2)
    await first.start()
    await second.start()
    try:
        await until(lambda: Role.LEADER in (first.node.role, second.node.role), "a leader")
        leader = first if first.node.role == Role.LEADER else second
        follower = second if leader is first else first
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(leader, TEST_SETTINGS)),
                                     base_url="http://leader") as http:
            for index in range(20):
                assert (await http.put(f"/v1/kv/k{index}", content=b"v%d" % index)).status_code in (200, 201)
        await until(lambda: follower.applied_version >= leader.applied_version, "the follower caught up")
        await follower.stop()
        data_dir = follower.data_dir
        (data_dir / "log" / LOG_START_CHECKPOINT_NAME).write_bytes(b"\x00garbage")

        broken = runtime(follower.node_id)
        with pytest.raises(CorruptLogError) as caught:
            await broken.start()
        message = str(caught.value)
        assert message.startswith(f"corrupt log file {data_dir / 'log' / LOG_START_CHECKPOINT_NAME} at byte 0: ")
        match = re.search(r"move (.+?)/log, (.+?)/snapshots and (.+?)/state\.db \(with any state\.db-wal and "
                          r"state\.db-shm\) away, keep (.+?)/quorum-state \(and identity\.json\), and restart", message)
        assert match is not None, message
        assert {shlex.split(group)[0] for group in match.groups()} == {str(data_dir)}
        # The way out, as printed.
        moved = data_dir.parent / "moved-away"
        moved.mkdir()
        for name in ("log", "snapshots", "state.db", "state.db-wal", "state.db-shm"):
            if (data_dir / name).exists():
                shutil.move(data_dir / name, moved / name)
        assert sorted(p.name for p in data_dir.iterdir()) == ["LOCK", "identity.json", "quorum-state"]

        restarted = runtime(follower.node_id)
        await restarted.start()
        try:
            await until(lambda: restarted.applied_version >= leader.applied_version, "the refetch from the leader")
            assert [restarted.state.get(f"k{index}")[1].value for index in range(20)] == [  # type: ignore[union-attr]
                b"v%d" % index for index in range(20)]
        finally:
            await restarted.stop()
        assert not fatal, fatal
    finally:
        await first.stop()
        await second.stop()


def test_the_printed_way_out_of_a_garbage_log_start_checkpoint_refetches_from_the_leader(tmp_path: Path) -> None:
    asyncio.run(asyncio.wait_for(scenario(tmp_path), 90))
