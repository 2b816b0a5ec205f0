"""A follower reached over https never redirects to an http leader URL (the bearer token and
the data would cross the network in the clear): it answers 503 instead. Over http, and from
https to https, the 307 is unchanged."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from app.http import create_app
from app.service import NotLeaderError
from tests.http.conftest import TEST_SETTINGS
from tests.http.test_errors_and_cluster import FaultyService


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def follower(tmp_path: Path) -> AsyncIterator[FaultyService]:
    node = FaultyService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"))
    try:
        yield node
    finally:
        node.close()


async def put_through(node: FaultyService, base_url: str, leader_url: str) -> httpx.Response:
    node.faults["propose"] = NotLeaderError(leader_url, leader_id=2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(node, TEST_SETTINGS)),
                                 base_url=base_url) as client:
        return await client.put("/v1/kv/k", content=b"v")


@pytest.mark.anyio
async def test_https_is_never_redirected_to_http(follower: FaultyService) -> None:
    refused = await put_through(follower, "https://node1", "http://node2:8002")
    assert refused.status_code == 503 and "location" not in refused.headers
    assert "plain http URL" in refused.json()["detail"]
    kept = await put_through(follower, "https://node1", "https://node2:8002")
    assert kept.status_code == 307 and kept.headers["location"] == "https://node2:8002/v1/kv/k"
    plain = await put_through(follower, "http://node1", "http://node2:8002")
    assert plain.status_code == 307 and plain.headers["location"] == "http://node2:8002/v1/kv/k"
