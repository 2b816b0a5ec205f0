"""etcd's Watch stream against an in-process node: several watches on one stream, start
revisions, ranges, prev_kv, filters, progress, cancel and the compacted answer."""

from __future__ import annotations

import asyncio

import pytest

from app.etcd.mapping import prefix_end
from app.etcd.protos import kv_pb2, rpc_pb2
from tests.etcd.conftest import Stubs
from tests.http.service_double import InProcessService

pytestmark = pytest.mark.anyio
W = rpc_pb2.WatchCreateRequest
WAIT_S = 10


class Stream:
    """One Watch call: send requests, read responses (bounded waits)."""

    def __init__(self, etcd: Stubs) -> None:
        self.requests: asyncio.Queue[rpc_pb2.WatchRequest | None] = asyncio.Queue()
        self.call = etcd.watch.Watch(self._requests())

    async def _requests(self):  # type: ignore[no-untyped-def]
        while (request := await self.requests.get()) is not None:
            yield request

    def create(self, **fields: object) -> None:
        self.requests.put_nowait(rpc_pb2.WatchRequest(create_request=W(**fields)))

    def cancel(self, watch_id: int) -> None:
        self.requests.put_nowait(rpc_pb2.WatchRequest(cancel_request=rpc_pb2.WatchCancelRequest(watch_id=watch_id)))

    async def next(self) -> rpc_pb2.WatchResponse:
        return await asyncio.wait_for(self.call.read(), WAIT_S)

    def close(self) -> None:
        self.requests.put_nowait(None)
        self.call.cancel()


async def put(etcd: Stubs, key: bytes, value: bytes) -> int:
    return (await etcd.kv.Put(rpc_pb2.PutRequest(key=key, value=value))).header.revision


async def test_watches_on_one_stream_from_a_revision_over_a_prefix_with_prev_kv(etcd: Stubs) -> None:
    first = await put(etcd, b"app/a", b"1")
    await put(etcd, b"other", b"x")
    await put(etcd, b"app/a", b"2")
    stream = Stream(etcd)
    try:
        stream.create(key=b"app/", range_end=prefix_end(b"app/"), start_revision=first, prev_kv=True)
        created = await stream.next()
        assert created.created and created.watch_id == 0
        history = await stream.next()
        assert [(e.type, e.kv.key, e.kv.value, e.kv.version) for e in history.events] == [
            (kv_pb2.Event.PUT, b"app/a", b"1", 1), (kv_pb2.Event.PUT, b"app/a", b"2", 2)]
        assert history.events[1].prev_kv.value == b"1"
        stream.create(key=b"other", filters=[W.NODELETE])
        assert (await stream.next()).watch_id == 1
        await put(etcd, b"other", b"y")
        await etcd.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"app/a"))
        seen = {}
        while len(seen) < 2:
            response = await stream.next()
            seen[response.watch_id] = [(e.type, e.kv.key) for e in response.events]
        assert seen == {1: [(kv_pb2.Event.PUT, b"other")], 0: [(kv_pb2.Event.DELETE, b"app/a")]}
        stream.cancel(0)
        assert (await stream.next()).canceled
        stream.requests.put_nowait(rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest()))
        progress = await stream.next()
        assert progress.watch_id == -1 and progress.header.revision >= first + 4 and not progress.events
    finally:
        stream.close()


async def test_a_start_revision_below_the_horizon_answers_compacted(etcd: Stubs, service: InProcessService) -> None:
    first = await put(etcd, b"k", b"1")
    await put(etcd, b"k", b"2")
    service.state.prune_history(first + 1)
    stream = Stream(etcd)
    try:
        stream.create(key=b"k", start_revision=first)
        assert (await stream.next()).created
        canceled = await stream.next()
        assert canceled.canceled and canceled.compact_revision == first + 1
        assert canceled.cancel_reason == "etcdserver: mvcc: required revision has been compacted"
    finally:
        stream.close()


async def test_a_taken_watch_id_is_refused_without_naming_the_live_watch(etcd: Stubs) -> None:
    """As etcd: the refusal carries watch_id -1. It carried the taken id, so a client read
    its live watch as canceled, though that watch kept sending events."""
    stream = Stream(etcd)
    try:
        stream.create(key=b"dup", watch_id=7)
        assert (await stream.next()).created
        stream.create(key=b"dup", watch_id=7)
        refused = await stream.next()
        assert (refused.watch_id, refused.created, refused.canceled, refused.cancel_reason) == (
            -1, True, True, "mvcc: duplicate watch ID provided on the WatchStream")
        revision = await put(etcd, b"dup", b"1")
        event = await stream.next()
        assert (event.watch_id, [e.kv.mod_revision for e in event.events]) == (7, [revision])
    finally:
        stream.close()
