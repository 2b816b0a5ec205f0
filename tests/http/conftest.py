"""Fixtures: the real HTTP app over an in-process single-node service on the real StateMachine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from app.http import HttpSettings, create_app
from tests.http.service_double import InProcessService

TEST_SETTINGS = HttpSettings(max_value_bytes=4096, max_txn_body_bytes=64 * 1024, max_wait_ms=2000,
                             max_watch_timeout_ms=2000, sse_keepalive_ms=200, watch_events_max=5)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def service(tmp_path: Path) -> Iterator[InProcessService]:
    node = InProcessService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"))
    try:
        yield node
    finally:
        node.close()


@pytest.fixture
async def client(service: InProcessService) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(service, TEST_SETTINGS)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://node1") as http:
        yield http
