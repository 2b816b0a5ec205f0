"""etcd's Watch stream: several watches on one bidirectional stream, each a metakv watch
(``KVService.watch``) of the range's common prefix, filtered to the range.

- start_revision N watches from N inclusive (metakv's ``since`` N-1); 0: from now.
- A start below the history horizon answers etcd's compacted cancel (compact_revision =
  the oldest readable version), as does a watch the horizon passes later.
- progress_notify: an empty response with the revision every PROGRESS_INTERVAL_S of
  quiet; a WatchProgressRequest answers at once (watch_id -1, as etcd).
- Event kvs carry create_revision and version read at the event's revision (a read per put
  event); prev_kv, when asked, the key's state just before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from types import TracebackType

from app.etcd.errors import EtcdError
from app.etcd.mapping import EtcdMapping, KeyRange, key_value, text_key
from app.etcd.protos import kv_pb2, rpc_pb2
from app.service import Entry, Event, HistoryCompactedError, ServiceError

PROGRESS_INTERVAL_S = 5.0
WATCH_PAGE_EVENTS = 1000
PROGRESS_WATCH_ID = -1  # etcd answers a WatchProgressRequest with this watch id
NO_WATCH_ID = -1  # etcd's watch id for a create it refused
DUPLICATE_WATCH_ID = "mvcc: duplicate watch ID provided on the WatchStream"  # etcd's mvcc.ErrWatcherDuplicateID
COMPACTED_REASON = "etcdserver: mvcc: required revision has been compacted"
_END = object()


class WatchStream:
    """One Watch call: ``serve`` reads the client's requests and yields the responses."""

    def __init__(self, mapping: EtcdMapping,
                 permitted: Callable[[rpc_pb2.WatchCreateRequest], bool] | None = None) -> None:
        self.mapping = mapping
        self.permitted = permitted  # with auth on: may the stream's token read this watch's keys
        self.service = mapping.service
        self._responses: asyncio.Queue[object] = asyncio.Queue()
        self._watches: dict[int, asyncio.Task[None]] = {}
        self._next_id = 0
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> WatchStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        tasks = [*self._watches.values(), *([self._reader] if self._reader else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def serve(self, requests: AsyncIterator[rpc_pb2.WatchRequest]) -> AsyncIterator[rpc_pb2.WatchResponse]:
        self._reader = asyncio.ensure_future(self._read(requests))
        while True:
            response = await self._responses.get()
            if response is _END:
                return
            yield response  # type: ignore[misc]

    async def _read(self, requests: AsyncIterator[rpc_pb2.WatchRequest]) -> None:
        try:
            async for request in requests:
                kind = request.WhichOneof("request_union")
                if kind == "create_request":
                    self._create(request.create_request)
                elif kind == "cancel_request":
                    self._cancel(request.cancel_request.watch_id)
                elif kind == "progress_request":
                    self._send(rpc_pb2.WatchResponse(header=self.mapping.header(), watch_id=PROGRESS_WATCH_ID))
        finally:
            # the client closed its side: etcd ends the stream once the watches are gone
            self._responses.put_nowait(_END)

    def _send(self, response: rpc_pb2.WatchResponse) -> None:
        self._responses.put_nowait(response)

    def _create(self, create: rpc_pb2.WatchCreateRequest) -> None:
        watch_id = create.watch_id if create.watch_id > 0 else self._next_id
        if watch_id in self._watches:
            # as etcd: watch_id -1, so the client does not take its live watch for canceled
            self._send(rpc_pb2.WatchResponse(header=self.mapping.header(), watch_id=NO_WATCH_ID, created=True,
                                             canceled=True, cancel_reason=DUPLICATE_WATCH_ID))
            return
        self._next_id = max(self._next_id, watch_id) + 1
        if self.permitted is not None and not self.permitted(create):
            self._send(rpc_pb2.WatchResponse(header=self.mapping.header(), watch_id=watch_id, created=True,
                                             canceled=True, cancel_reason="etcdserver: permission denied"))
            return
        try:
            keys = KeyRange.of(create.key, create.range_end)
            prefix = text_key(keys.start) if keys.single else keys.list_prefix()
        except EtcdError as exc:
            self._send(rpc_pb2.WatchResponse(header=self.mapping.header(), watch_id=watch_id, created=True,
                                             canceled=True, cancel_reason=exc.message))
            return
        self._send(rpc_pb2.WatchResponse(header=self.mapping.header(), watch_id=watch_id, created=True))
        self._watches[watch_id] = asyncio.ensure_future(self._run(watch_id, create, keys, prefix))

    def _cancel(self, watch_id: int) -> None:
        task = self._watches.pop(watch_id, None)
        if task is not None:
            task.cancel()
        self._send(rpc_pb2.WatchResponse(header=self.mapping.header(), watch_id=watch_id, canceled=True))

    async def _run(self, watch_id: int, create: rpc_pb2.WatchCreateRequest, keys: KeyRange, prefix: str) -> None:
        since = (create.start_revision - 1 if create.start_revision > 0
                 else self.service.headers().metadata_version)
        skip = {kv_pb2.Event.PUT for f in create.filters if f == rpc_pb2.WatchCreateRequest.NOPUT}
        skip |= {kv_pb2.Event.DELETE for f in create.filters if f == rpc_pb2.WatchCreateRequest.NODELETE}
        try:
            watch = self.service.watch(prefix, since, WATCH_PAGE_EVENTS)
        except HistoryCompactedError as exc:
            self._compacted(watch_id, exc.oldest_version)
            return
        try:
            while not watch.stopped:
                page = await watch.next(time.monotonic() + PROGRESS_INTERVAL_S)
                events = [self._event(event, create.prev_kv) for event in page.events
                          if keys.holds(event.key.encode())]
                events = [event for event in events if event.type not in skip]
                if events:
                    self._send(rpc_pb2.WatchResponse(header=self.mapping.header(page.version),
                                                     watch_id=watch_id, events=events))
                elif create.progress_notify and not page.events:
                    self._send(rpc_pb2.WatchResponse(header=self.mapping.header(page.version), watch_id=watch_id))
        except HistoryCompactedError as exc:
            self._compacted(watch_id, exc.oldest_version)
        finally:
            watch.close()

    def _compacted(self, watch_id: int, oldest_version: int) -> None:
        self._watches.pop(watch_id, None)
        self._send(rpc_pb2.WatchResponse(header=self.mapping.header(), watch_id=watch_id, canceled=True,
                                         compact_revision=oldest_version, cancel_reason=COMPACTED_REASON))

    def _entry_at(self, key: str, version: int) -> Entry | None:
        try:
            return self.service.get(key, at_version=version).entry
        except ServiceError:
            return None  # no longer readable (the horizon passed it): the field stays unset

    def _event(self, event: Event, prev_kv: bool) -> kv_pb2.Event:
        kind = str(getattr(event.type, "value", event.type))
        if kind == "put":
            entry = self._entry_at(event.key, event.mod_version)
            kv = (key_value(entry) if entry is not None else
                  kv_pb2.KeyValue(key=event.key.encode(), mod_revision=event.mod_version, value=event.value or b""))
            answer = kv_pb2.Event(type=kv_pb2.Event.PUT, kv=kv)
        else:
            answer = kv_pb2.Event(type=kv_pb2.Event.DELETE,
                                  kv=kv_pb2.KeyValue(key=event.key.encode(), mod_revision=event.mod_version))
        if prev_kv:
            previous = self._entry_at(event.key, event.mod_version - 1)
            if previous is not None:
                answer.prev_kv.CopyFrom(key_value(previous))
        return answer
