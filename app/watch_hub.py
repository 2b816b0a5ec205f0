"""Watch events from apply to the watchers that want them, as etcd's watchable store does.

The runtime hands every applied call's results to the hub once (``publish``). The hub
turns each change into the event a watch answers (what storage's ``changes`` reads back
from history), looks up the watchers of every prefix of its key (watchers are grouped by
prefix, and a key is looked up once per distinct prefix length, not once per watcher) and
appends it to each one's bounded queue, waking it. A watcher reads SQLite only to catch up:
when it starts behind the applied version, and after its queue overflowed (it is then
lagging: the queue is dropped and it reads from the last version it answered, then joins
again). A catch-up read below the history horizon raises HistoryCompactedError, as a
watch always did.

Everything runs on the node's event loop: apply and ``publish`` happen in one callback, and
a catch-up read joins the live watchers in the same step that found it reached the hub's
version, so no change is lost or delivered twice at the switch.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable, Iterable

from app.service import ApplyResult, ChangePage, Entry, Event, OpKind
from raft.types import check

# Events a watcher may hold unanswered before it is dropped to catching up from SQLite
# (what a slow SSE client costs in memory: the events are shared between watchers).
WATCH_QUEUE_EVENTS = 10_000

ReadChanges = Callable[[str, int, int], ChangePage]  # KVService.changes


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Watcher:
    """A watch of one prefix from one version (app.service.ChangeWatch): ``next`` answers
    the changes after the ones it answered last. Open it with ``WatchHub.open``; close it
    when done (it leaves the hub)."""

    __slots__ = ("_hub", "_limit", "_live", "_position", "_queue", "_since", "_waiter", "prefix")

    def __init__(self, hub: WatchHub, prefix: str, since: int, limit: int, first: ChangePage) -> None:
        self._hub = hub
        self.prefix = prefix
        self._limit = limit
        self._since = since  # every change up to here was answered (or is not wanted)
        self._queue: list[Event] = list(first.events)
        # Not live: ``_queue`` holds every change under the prefix in (_since, _position].
        # Live: it holds those in (_since, hub.version] and the hub appends the newer ones;
        # ``_position`` is then the version below which it takes none (a watch may ask
        # from a version this node has not applied yet).
        self._position = max(since, first.version)
        self._live = False
        self._waiter: asyncio.Future[None] | None = None

    @property
    def stopped(self) -> bool:
        """The node stopped serving watches (shutting down): ``next`` no longer waits."""
        return self._hub.closed

    async def next(self, deadline_s: float) -> ChangePage:
        """The changes after those answered so far (up to about the limit, all of the last
        version's), waiting for one until ``deadline_s`` (time.monotonic()); with none, the
        version every change under the prefix is known up to. Raises HistoryCompactedError
        when a catch-up read finds the history horizon above what was answered."""
        hub = self._hub
        while True:
            if self._queue:
                return self._answer()
            if not self._live:
                if self._position >= hub.version:
                    hub.join(self)
                else:
                    self._catch_up()
                    continue
            version = hub.version
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0 or hub.closed:
                self._since = max(self._since, version)
                return ChangePage(version, [])
            await self._wait(remaining_s)

    def close(self) -> None:
        if self._live:
            self._hub.leave(self)
        waiter = self._waiter
        if waiter is not None:
            _wake(waiter)

    def _catch_up(self) -> None:
        """One page from SQLite after ``_position`` (the events are all new: the queue was
        empty, and nothing above ``_position`` was queued)."""
        hub = self._hub
        hub.catch_up_reads += 1
        page = hub.read_changes(self.prefix, self._position, self._limit)
        # The hub publishes after apply commits, so the state is never behind it: a page
        # without events reached the hub's version (else this loop would spin).
        check(bool(page.events) or page.version >= hub.version,
              f"watch catch-up read at {page.version}, below the published version {hub.version}")
        self._queue = list(page.events)
        self._position = max(self._position, page.version)

    def _answer(self) -> ChangePage:
        queue = self._queue
        limit = self._limit
        if len(queue) <= limit:
            self._queue = []
            version = self._hub.version if self._live else self._position
            events = queue
        else:  # a page of ``limit``, and the rest of its last version's events
            end = limit
            version = queue[end - 1].mod_version
            while end < len(queue) and queue[end].mod_version == version:
                end += 1
            events = queue[:end]
            del queue[:end]
        self._since = version
        return ChangePage(version, events)

    async def _wait(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _wake, waiter)
        hub = self._hub
        hub.waiting += 1
        hub.waits_started += 1
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
            hub.waiting -= 1

    # ---- what the hub does to a watcher

    def _joined(self, version: int) -> None:
        self._live = True
        self._position = max(self._position, version)

    def _push(self, event: Event) -> bool:
        """Queue ``event``; False when the queue overflowed (the watcher is lagging now)."""
        if event.mod_version <= self._position:
            return True  # below what it already holds (it asked from a version not applied yet)
        queue = self._queue
        queue.append(event)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            _wake(waiter)
        hub = self._hub
        if len(queue) <= hub.queue_events:
            return True
        hub.overflows += 1
        self._lag()
        return False

    def _lag(self) -> None:
        """Drop what is queued: the next read catches up from SQLite after what it answered."""
        self._live = False
        self._queue = []
        self._position = self._since
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            _wake(waiter)


class WatchHub:
    """Every open watch of a node, fed by its apply path (module docstring)."""

    def __init__(self, read_changes: ReadChanges, version: int, *, queue_events: int = WATCH_QUEUE_EVENTS) -> None:
        self.read_changes = read_changes
        self.version = version  # every change up to here was published
        self.queue_events = queue_events
        self.closed = False
        self._groups: dict[str, dict[Watcher, None]] = {}  # live watchers by prefix
        self._lengths: list[int] = []  # the distinct lengths of those prefixes, ascending
        self._length_counts: dict[int, int] = {}  # prefix length -> how many groups have it
        self.waiting = 0  # watchers waiting for a change right now
        self.waits_started = 0  # every wait so far
        self.overflows = 0  # watchers whose queue overflowed, so far
        self.catch_up_reads = 0  # reads of history by watchers that were behind, so far

    def open(self, prefix: str, since: int, limit: int) -> Watcher:
        """A watch of the changes under ``prefix`` newer than ``since``. Its first page is
        read here, so a ``since`` below the horizon raises HistoryCompactedError at once."""
        return Watcher(self, prefix, since, limit, self.read_changes(prefix, since, limit))

    def publish(self, version: int, results: Iterable[ApplyResult]) -> None:
        """The applied state moved to ``version`` through the records of ``results``."""
        if self._groups:
            self._deliver(results)
        self.version = version

    def reset(self, version: int) -> None:
        """The applied state moved to ``version`` without its changes (a snapshot was
        installed): every live watcher catches up from SQLite."""
        for group in list(self._groups.values()):
            for watcher in list(group):
                self.leave(watcher)
                watcher._lag()
        self.version = version

    def close(self) -> None:
        """The node is stopping: waiting watchers answer now and no longer wait."""
        self.closed = True
        for group in self._groups.values():
            for watcher in group:
                waiter = watcher._waiter
                if waiter is not None:
                    _wake(waiter)

    def join(self, watcher: Watcher) -> None:
        group = self._groups.get(watcher.prefix)
        if group is None:
            group = self._groups[watcher.prefix] = {}
            length = len(watcher.prefix)
            count = self._length_counts.get(length, 0)
            self._length_counts[length] = count + 1
            if not count:
                bisect.insort(self._lengths, length)
        group[watcher] = None
        watcher._joined(self.version)

    def leave(self, watcher: Watcher) -> None:
        prefix = watcher.prefix
        group = self._groups.get(prefix)
        if group is None or watcher not in group:
            return
        del group[watcher]
        if not group:
            del self._groups[prefix]
            length = len(prefix)
            count = self._length_counts.pop(length) - 1
            if count:
                self._length_counts[length] = count
            else:
                self._lengths.remove(length)

    def _deliver(self, results: Iterable[ApplyResult]) -> None:
        groups = self._groups
        lengths = self._lengths
        lagging: list[Watcher] = []
        for result in results:
            if result.error is not None:
                continue
            for op in result.ops:
                kind = op.kind
                if not (kind is OpKind.PUT or (kind is OpKind.DELETE and op.deleted)):
                    continue  # a txn's read, or the delete of a missing key: no change
                key = op.key
                if key[:1] == "\x00":  # internal (a lease): storage.commands.is_internal_key
                    continue
                key_length = len(key)
                event: Event | None = None
                for length in lengths:
                    if length > key_length:
                        break
                    group = groups.get(key[:length])
                    if group is None:
                        continue
                    if event is None:
                        event = _event(result.version, kind, key, op.entry, op.reason)
                    for watcher in group:
                        if watcher._live and not watcher._push(event):
                            lagging.append(watcher)
        for watcher in lagging:
            self.leave(watcher)


def _event(version: int, kind: OpKind, key: str, entry: Entry | None, reason: str | None) -> Event:
    """The event a watch answers for one change: what storage's ``changes`` reads back
    from the change's history row."""
    if kind is OpKind.PUT and entry is not None:
        return Event("put", key, entry.mod_version, entry.value, entry.content_type)
    return Event("delete", key, version, None, None, reason)
