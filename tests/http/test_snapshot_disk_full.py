"""POST /v1/admin/snapshot on a real single-voter node whose disk fails during the copy:
a problem document (507 disk full, 503 + Retry-After other I/O errors), never a 500, and
nothing half-written left in the snapshot directory."""

from __future__ import annotations

import asyncio
import errno
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from app.config import HostPort, NodeConfig
from app.http import create_app
from app.runtime import NodeRuntime
from raft.node import Role
from storage.snapshot_store import SnapshotStore
from tests.cluster import free_ports
from tests.http.conftest import TEST_SETTINGS

WAIT_S = 10.0


def partly_written_then(error: BaseException) -> Callable[..., str]:
    """A publish_database that writes part of its trailer into the temp copy, then fails."""
    def publish_database(self: SnapshotStore, database_path: str, snapshot_id: object) -> str:
        with open(database_path, "ab") as handle:
            handle.write(b"MKVSNAP1\x00\x00")
        raise error
    return publish_database


class FailingReader:
    """The state machine's read connection, with VACUUM INTO failing as SQLite reports it."""

    def __init__(self, error: sqlite3.Error) -> None:
        self.error = error

    def exec_driver_sql(self, statement: str, parameters: Any = None) -> None:
        raise sa.exc.OperationalError(statement, parameters, self.error)


async def scenario(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    http_port, raft_port = free_ports(2)
    config = NodeConfig(
        node_id=1, data_dir=tmp_path / "node", listen_http=HostPort("127.0.0.1", http_port),
        listen_raft=HostPort("127.0.0.1", raft_port), voters={1: HostPort("127.0.0.1", raft_port)},
        advertise_http=f"http://127.0.0.1:{http_port}", election_timeout_ms=100)
    fatal: list[BaseException] = []
    runtime = NodeRuntime(config, seed=1, on_fatal=fatal.append)
    await runtime.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while runtime.node.role != Role.LEADER:
            assert time.monotonic() < deadline, "the lone voter never became leader"
            await asyncio.sleep(0.01)
        transport = httpx.ASGITransport(app=create_app(runtime, TEST_SETTINGS))
        async with httpx.AsyncClient(transport=transport, base_url="http://node1") as http:
            assert (await http.put("/v1/kv/a", content=b"1")).status_code in (200, 201)
            snapshots_dir = runtime.snapshots_dir

            def assert_nothing_published() -> None:
                assert sorted(p.name for p in snapshots_dir.iterdir()) == []
                assert runtime.snapshots.latest_id() is None

            cases = [  # (object, attribute, replacement, status, the detail's text)
                (SnapshotStore, "publish_database", partly_written_then(OSError(errno.ENOSPC, "No space left on device")),
                 507, f"the snapshot failed, the disk holding {snapshots_dir} is full "
                      "(No space left on device); free space and retry"),
                (runtime.state, "_reader", lambda: FailingReader(sqlite3.OperationalError("database or disk is full")),
                 507, "(database or disk is full)"),
                (SnapshotStore, "publish_database", partly_written_then(OSError(errno.EIO, "Input/output error")),
                 503, "the snapshot failed on an I/O error (Input/output error); retry"),
            ]
            for target, attribute, replacement, status, detail in cases:
                with monkeypatch.context() as patch:
                    patch.setattr(target, attribute, replacement)
                    response = await http.post("/v1/admin/snapshot")
                assert response.status_code == status, response.text
                assert response.headers["content-type"] == "application/problem+json"
                problem = response.json()
                assert problem["status"] == status and detail in problem["detail"], problem
                if status == 507:
                    assert problem["title"] == "Insufficient storage"
                else:
                    assert response.headers["retry-after"] == "1"
                assert_nothing_published()

            # Space freed: the same request succeeds.
            response = await http.post("/v1/admin/snapshot")
            assert response.status_code == 200
            assert response.json()["snapshot_id"]["end_offset"] >= 1
            assert runtime.snapshots.latest_id() is not None
        assert not fatal, fatal
    finally:
        await runtime.stop()


def test_a_snapshot_on_a_full_or_failing_disk_answers_a_problem_document(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(asyncio.wait_for(scenario(tmp_path, monkeypatch), 60))
