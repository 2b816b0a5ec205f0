"""Byte caps on the answers a node builds (issue 21: "a list page or watch answer is built in
memory without a byte cap"): with 1 MiB values a list page and a watch answer end early,
say where to continue, and nothing is skipped; building one never holds every value."""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from app.http import HttpSettings, create_app
from tests.http.service_double import InProcessService

MIB = 1024 * 1024
VALUES = 24
CAP_BYTES = 4 * MIB  # the default max_answer_bytes
# A page holds at most the cap plus one value read ahead; rendered as base64 JSON once.
PAGE_PEAK_BOUND_BYTES = 32 * MIB


def value(index: int) -> bytes:
    return bytes([index]) * MIB


@pytest.fixture
async def client(service: InProcessService) -> AsyncIterator[httpx.AsyncClient]:
    """The app with the default answer cap over tests/http's service (values up to 1 MiB)."""
    assert service.max_value_bytes == MIB
    settings = HttpSettings(max_value_bytes=MIB, max_watch_timeout_ms=3000, sse_keepalive_ms=200)
    assert settings.max_answer_bytes == CAP_BYTES
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service, settings)),
                                 base_url="http://node1", timeout=30.0) as http:
        yield http


async def put_values(client: httpx.AsyncClient, first: int = 0, count: int = VALUES) -> None:
    for index in range(first, first + count):
        response = await client.put(f"/v1/kv/big/{index:03}", content=value(index))
        assert response.status_code == 200, response.text


@pytest.mark.anyio
async def test_a_list_of_1_mib_values_pages_by_bytes_and_follows_next_to_the_end(client: httpx.AsyncClient) -> None:
    await put_values(client)
    keys: list[str] = []
    after: str | None = None
    pages = 0
    while True:
        params: dict[str, Any] = {"prefix": "big/", "limit": 1000, **({"after": after} if after else {})}
        page = await client.get("/v1/kv", params=params)
        assert page.status_code == 200, page.text
        body = page.json()
        assert 1 <= len(body["items"]) <= CAP_BYTES // MIB  # the 4th value reaches the cap
        keys += [item["key"] for item in body["items"]]
        pages += 1
        after = body["next"]
        if after is None:
            break
        assert after == keys[-1]
    assert keys == [f"big/{index:03}" for index in range(VALUES)] and pages == VALUES // 4


@pytest.mark.anyio
async def test_building_a_list_page_holds_about_the_cap_not_every_value(client: httpx.AsyncClient) -> None:
    await put_values(client)
    tracemalloc.start()
    try:
        page = await client.get("/v1/kv", params={"prefix": "big/", "limit": 1000})
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert page.status_code == 200
    assert peak_bytes < PAGE_PEAK_BOUND_BYTES, f"{peak_bytes / MIB:.0f} MiB to build one page"
    assert page.json()["next"] is not None


@pytest.mark.anyio
async def test_a_long_poll_from_history_answers_by_bytes_and_continues_without_gaps(
        client: httpx.AsyncClient) -> None:
    await put_values(client)
    seen: list[str] = []
    since = 0
    while len(seen) < VALUES:
        answer = await client.get("/v1/watch", params={"prefix": "big/", "since": since, "timeout_ms": 0})
        assert answer.status_code == 200, answer.text
        events = answer.json()["events"]
        assert 1 <= len(events) <= CAP_BYTES // MIB
        seen += [event["key"] for event in events]
        since = answer.json()["version"]
    assert seen == [f"big/{index:03}" for index in range(VALUES)]


@pytest.mark.anyio
async def test_a_live_watch_answers_what_it_queued_by_bytes(service: InProcessService) -> None:
    """The path an open SSE stream reads: changes the hub queued while the stream wrote."""
    watch = service.watch("big/", service.state.applied_version, 1000, CAP_BYTES)
    try:
        assert (await watch.next(0.0)).events == []  # live in the hub from here on
        for index in range(VALUES):
            await service.put(f"big/{index:03}", value(index))
        seen: list[str] = []
        while len(seen) < VALUES:
            page = await watch.next(0.0)
            assert 1 <= len(page.events) <= CAP_BYTES // MIB
            seen += [event.key for event in page.events]
        assert seen == [f"big/{index:03}" for index in range(VALUES)]
    finally:
        watch.close()


@pytest.mark.anyio
async def test_a_list_at_an_older_version_pages_by_bytes_too(client: httpx.AsyncClient) -> None:
    await put_values(client)
    at_version = (await client.get("/v1/kv/big/000")).headers["x-metadata-version"]
    await client.delete("/v1/kv/big/001")  # absent now, present at at_version
    keys: list[str] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"prefix": "big/", "limit": 1000, "at_version": at_version,
                                  **({"after": after} if after else {})}
        body = (await client.get("/v1/kv", params=params)).json()
        assert 1 <= len(body["items"]) <= CAP_BYTES // MIB
        keys += [item["key"] for item in body["items"]]
        if (after := body["next"]) is None:
            break
    assert keys == [f"big/{index:03}" for index in range(VALUES)]
