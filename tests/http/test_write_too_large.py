"""A write that cannot fit in one log batch (max_batch_bytes) is 413 on a real node: it can
never succeed, so it must not be the 503 that tells a client to retry."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from app.config import HostPort, NodeConfig
from app.http import HttpSettings, create_app
from app.runtime import NodeRuntime
from raft.node import Role
from tests.cluster import free_ports

MAX_VALUE_BYTES = 64 * 1024
MAX_BATCH_BYTES = MAX_VALUE_BYTES + 8192  # the smallest app/config.py accepts


async def scenario(tmp_path: Path) -> list[httpx.Response]:
    http_port, raft_port = free_ports(2)
    config = NodeConfig(
        node_id=1, data_dir=tmp_path / "node", listen_http=HostPort("127.0.0.1", http_port),
        listen_raft=HostPort("127.0.0.1", raft_port), voters={1: HostPort("127.0.0.1", raft_port)},
        advertise_http=f"http://127.0.0.1:{http_port}", election_timeout_ms=100,
        max_value_bytes=MAX_VALUE_BYTES, max_batch_bytes=MAX_BATCH_BYTES)
    runtime = NodeRuntime(config, seed=1)
    await runtime.start()
    try:
        deadline = time.monotonic() + 10
        while runtime.node.role != Role.LEADER:
            assert time.monotonic() < deadline, "the lone voter never became leader"
            await asyncio.sleep(0.01)
        settings = HttpSettings(max_value_bytes=MAX_VALUE_BYTES, max_txn_body_bytes=1024 * 1024)
        transport = httpx.ASGITransport(app=create_app(runtime, settings))
        async with httpx.AsyncClient(transport=transport, base_url="http://node1") as http:
            value = "v" * (MAX_VALUE_BYTES - 1024)  # each op alone fits; three together do not
            three = {"success": [{"op": "put", "key": f"big/{index}", "value": value} for index in range(3)]}
            return [
                await http.put("/v1/kv/big/one", content=value.encode()),
                await http.post("/v1/txn", json=three),
                await http.get("/v1/kv", params={"prefix": "big/"}),
            ]
    finally:
        await runtime.stop()


def test_a_txn_larger_than_one_log_batch_is_413_and_writes_nothing(tmp_path: Path) -> None:
    one, three, listed = asyncio.run(scenario(tmp_path))
    assert one.status_code == 200, one.text
    assert three.status_code == 413, three.text
    problem = three.json()
    assert problem["type"].endswith("write-too-large") and f"max_batch_bytes={MAX_BATCH_BYTES}" in problem["detail"]
    assert [item["key"] for item in listed.json()["items"]] == ["big/one"]
