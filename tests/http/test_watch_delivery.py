"""Every watch sees each committed change under its prefix exactly once, in order, across
its switches between catching up from history and being fed by apply (app/watch_hub.py).

Many writers run at once (puts, deletes, deletes of missing keys, multi-key txns, and
bursts larger than a watch's queue); watches start at various versions (0, behind, at and
ahead of the applied one) as long-polls, SSE streams that reconnect with Last-Event-ID, and
slow readers of the service's watch that fall behind. What each one saw is compared with
the history the state machine committed.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from app.http import create_app
from app.service import Event
from storage.commands import delete, put
from tests.http.conftest import TEST_SETTINGS
from tests.http.service_double import InProcessService

pytestmark = pytest.mark.anyio

# Nested prefixes, and prefixes as long as a key and longer (a key is looked up once per
# distinct prefix length).
PREFIXES = ("", "p0/", "p1/", "p1/a", "p1/a1", "p1/a1/", "p2/b")
QUEUE_EVENTS = 8  # small, so bursts and slow readers overflow watches' queues
Seen = list[tuple[str, str, int]]  # (type, key, mod_version)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[InProcessService]:
    service = InProcessService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"),
                               watch_queue_events=QUEUE_EVENTS)
    try:
        yield service
    finally:
        service.close()


def _key(rng: random.Random) -> str:
    return f"p{rng.randrange(4)}/{rng.choice('ab')}{rng.randrange(6)}{rng.choice(['', '', '/x'])}"


async def _writer(client: httpx.AsyncClient, node: InProcessService, rng: random.Random, operations: int) -> None:
    for _ in range(operations):
        choice = rng.random()
        if choice < 0.5:
            await client.put(f"/v1/kv/{_key(rng)}", content=b"v%d" % rng.randrange(100))
        elif choice < 0.7:
            await client.delete(f"/v1/kv/{_key(rng)}")  # sometimes missing: no change
        elif choice < 0.9:  # several changes in one version; either branch may run
            ops = [{"op": op, "key": _key(rng), **({"value": "t"} if op == "put" else {})}
                   for op in rng.choices(["put", "delete", "get"], k=3)]
            compare = [{"key": _key(rng), "exists": rng.random() < 0.5}]
            response = await client.post("/v1/txn", json={"compare": compare, "success": ops, "failure": ops[::-1]})
            assert response.status_code == 200, response.text
        else:  # a burst committed in one go: more changes than a watch may queue
            for _ in range(QUEUE_EVENTS * 2):
                key = _key(rng)
                node.apply_now(put(key, b"burst") if rng.random() < 0.7 else delete(key))
        await asyncio.sleep(0)


def _as_seen(events: list[dict[str, object]]) -> Seen:
    return [(str(e["type"]), str(e["key"]), int(e["mod_version"])) for e in events]  # type: ignore[call-overload]


async def _long_poll(client: httpx.AsyncClient, prefix: str, since: int, done: asyncio.Event,
                     final: list[int]) -> Seen:
    seen: Seen = []
    while not (done.is_set() and since >= final[0]):
        body = (await client.get("/v1/watch", params={"prefix": prefix, "since": since, "timeout_ms": 50})).json()
        seen += _as_seen(body["events"])
        since = max(since, body["version"]) if not body["events"] else body["version"]
    return seen


async def _sse(client: httpx.AsyncClient, prefix: str, since: int, done: asyncio.Event, final: list[int]) -> Seen:
    """An EventSource: streams of 100 ms, each resumed from the last id the previous sent."""
    seen: Seen = []
    last_id = str(since)
    while not (done.is_set() and int(last_id) >= final[0]):
        response = await client.get("/v1/watch", params={"prefix": prefix, "timeout_ms": 100},
                                    headers={"accept": "text/event-stream", "last-event-id": last_id})
        assert response.status_code == 200, response.text
        for block in response.text.split("\n\n"):
            for line in block.splitlines():
                if line.startswith("id: "):
                    last_id = line[4:]
                elif line.startswith("data: "):
                    assert not block.startswith("event: error"), block
                    seen += _as_seen([json.loads(line[6:])])
    return seen


async def _slow_reader(node: InProcessService, prefix: str, since: int, done: asyncio.Event,
                       final: list[int]) -> Seen:
    """The service's watch read with pauses, so the writers overflow its queue."""
    seen: Seen = []
    watch = node.watch(prefix, since, TEST_SETTINGS.watch_events_max)
    loop = asyncio.get_running_loop()
    try:
        version = since
        while not (done.is_set() and version >= final[0]):
            page = await watch.next(loop.time() + 0.05)
            seen += [(e.type, e.key, e.mod_version) for e in page.events]
            version = max(version, page.version)
            await asyncio.sleep(0.01)
    finally:
        watch.close()
    return seen


def _expected(history: list[Event], prefix: str, since: int) -> Seen:
    return [(e.type, e.key, e.mod_version) for e in history if e.key.startswith(prefix) and e.mod_version > since]


async def test_every_watch_sees_each_committed_change_once_in_order(node: InProcessService) -> None:
    rng = random.Random(19)
    done = asyncio.Event()
    final = [0]
    transport = httpx.ASGITransport(app=create_app(node, TEST_SETTINGS))
    async with httpx.AsyncClient(transport=transport, base_url="http://node1", timeout=30) as client:
        writers = [asyncio.create_task(_writer(client, node, random.Random(rng.random()), 40)) for _ in range(6)]
        watches: list[tuple[str, int, asyncio.Task[Seen]]] = []
        kinds = (_long_poll, _sse)
        for round_index in range(8):  # watches start while the writers run, at various versions
            applied = node.state.applied_version
            for prefix in PREFIXES:
                since = rng.choice([0, max(0, applied - rng.randrange(1, 40)), applied, applied + 25])
                kind = kinds[(round_index + len(watches)) % 2]
                watches.append((prefix, since, asyncio.create_task(kind(client, prefix, since, done, final))))
            prefix = rng.choice(PREFIXES)
            watches.append((prefix, applied, asyncio.create_task(_slow_reader(node, prefix, applied, done, final))))
            await asyncio.sleep(0.02)
        await asyncio.gather(*writers)
        final[0] = node.state.applied_version
        done.set()
        results = await asyncio.wait_for(asyncio.gather(*(task for _, _, task in watches)), 60)
    history = node.state.changes("", 0, limit=100_000)[1]
    assert node.state.changes("", 0, limit=100_000)[0] == final[0]
    for (prefix, since, _task), seen in zip(watches, results, strict=True):
        assert seen == _expected(history, prefix, since), (prefix, since)
    hub = node.watch_hub
    assert hub.waits_started > 0 and hub.overflows > 0 and hub.catch_up_reads > hub.overflows
    assert sum(map(len, results)) > 1000  # the watches did see a lot of changes
