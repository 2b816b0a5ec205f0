"""Locks and leader elections on leases, with the semantics of etcd's concurrency package.

    with kv.lease(ttl_s=10) as lease, Lock(kv, "jobs/nightly", lease) as lock:
        kv.put("jobs/nightly/state", "running", if_version=...)   # fence with lock.version

Each contender writes ``PREFIX/NAME/<lease id>`` (create-if-absent, attached to its
lease) and so takes a place in line: its key's create_version. The holder is the key with
the lowest create_version; every other contender watches only the deletion of the key just
before its own (no thundering herd), then looks again. ``lock.version`` (the holder key's
create_version) grows with every new holder: write it with your guarded writes and refuse
writes carrying a lower one, and a holder that was paused past its lease (so lost the
lock without knowing) cannot overwrite its successor's work.

An election is the same line: the leader is the first key, its value what the leader
proclaims; ``observe`` follows the leader as it changes. The decision code is written once,
as plans (metakv/core.py) the sync and the async flavours both drive.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, TypeVar

from metakv.core import ClientCore, Plan
from metakv.errors import (
    Conflict,
    Indeterminate,
    InvalidRequest,
    MetakvError,
    raised_unless_failing,
)
from metakv.leases import LeaseCore
from metakv.protocol import WatchCursor, value_bytes
from metakv.results import KeyValue
from metakv.txn import TxnBuilder

if TYPE_CHECKING:
    from metakv.aio import AsyncClient, AsyncLease
    from metakv.client import Client, Lease

LOCK_PREFIX = "locks/"
ELECTION_PREFIX = "elections/"
WAIT_POLL_MS = 1000  # a waiter's long-poll: how often it re-checks its lease and deadline
ResultT = TypeVar("ResultT")


class NotAcquired(MetakvError):
    """The lock (or leadership) was not obtained within the ``timeout_s`` given."""


class NotLeader(MetakvError):
    """``proclaim`` or ``resign`` by a candidate that is not (or no longer) the leader."""


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or "\x00" in name:
        raise InvalidRequest("Invalid name", f"a lock or election name is a non-empty string, not {name!r}")
    return name


def by_place(items: list[KeyValue]) -> list[KeyValue]:
    """Contenders in line order: by the create_version of their keys."""
    return sorted(items, key=lambda kv: kv.create_version)


class LineCore:
    """One contender's place in the line of ``prefix`` (a lock's or an election's)."""

    def __init__(self, client: ClientCore, prefix: str, name: str, lease: LeaseCore | None) -> None:
        self.client = client
        self.prefix = f"{prefix}{_check_name(name)}/"
        self._lease = lease
        self.key = f"{self.prefix}{lease.id}" if lease is not None else ""
        self.own: KeyValue | None = None  # our key once it is first in line

    @property
    def lease(self) -> LeaseCore:
        if self._lease is None:
            raise InvalidRequest("No lease", "only an observer may leave the lease out: contending needs one")
        return self._lease

    @property
    def held(self) -> bool:
        return self.own is not None and self._lease is not None and self._lease.alive

    @property
    def version(self) -> int:
        """The fencing token: our key's create_version while we are first (0: not first)."""
        return self.own.create_version if self.own is not None else 0

    def _enter_plan(self, value: bytes | str) -> Plan[KeyValue]:
        """Write our key if absent (with the lease); else find it (a retry, or this lease
        contending again): our place in line. Safe to send again after an unknown outcome,
        so it is: a first apply turns the retry into the read."""
        builder = TxnBuilder().when_version(self.key, 0).then_put(self.key, value, lease=self.lease)
        request = builder.else_get(self.key).request()
        while True:
            self.lease.check()
            try:
                result = yield from self.client.txn_plan(request)
            except Indeterminate:
                continue
            if result.succeeded:  # created by this txn: created and last written at its version
                body, media_type = value_bytes(value, None)
                return KeyValue(self.key, body, media_type or "", result.version, result.version, self.lease.id)
            existing: KeyValue = result.results[0]["kv"]
            return existing

    def wait_first_plan(self, value: bytes | str, timeout_s: float | None) -> Plan[KeyValue]:
        """Take a place in line and wait until it is the first; our key as it stands then."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        mine = yield from self._enter_plan(value)
        while True:
            self.lease.check()
            listing = yield from self.client.list_plan(self.prefix, None, False, "local", None, None)
            ahead = [kv for kv in by_place(listing.items) if kv.create_version < mine.create_version]
            if not ahead:
                current = next((kv for kv in listing.items if kv.key == self.key), None)
                if current is None:  # our key is gone: the lease ended under us
                    self.lease.check()
                    raise Conflict("Lost its place", f"{self.key} was deleted while waiting", current_version=0)
                self.own = current
                return current
            predecessor = ahead[-1].key
            cursor = WatchCursor(predecessor, listing.version, WAIT_POLL_MS)
            while True:
                self.lease.check()
                if deadline is not None and time.monotonic() >= deadline:  # the caller leaves the line
                    raise NotAcquired("Not acquired", f"{self.prefix}: still waiting after {timeout_s:g} s")
                events = cursor.accept((yield cursor.request()))
                if any(event.key == predecessor and event.type == "delete" for event in events):
                    break

    def leave_plan(self) -> Plan[None]:
        """Delete our key: the next in line goes ahead."""
        self.own = None
        yield from self.client.delete_plan(self.key, None)

    def run_in_line(self, client: Client, plan: Plan[ResultT]) -> ResultT:
        """Run a plan that takes a place in line; if it fails (a timeout, an error, Ctrl-C),
        leave the line, as etcd's Lock and Campaign do: a key left behind by a lease that
        lives on would hold the lock for nobody, and everyone behind it would wait."""
        try:
            return client.run(plan)
        except BaseException:
            if self._lease is not None:
                with contextlib.suppress(MetakvError):  # unreachable: the lease ends it later
                    client.run(self.leave_plan())
            raise

    async def run_in_line_async(self, client: AsyncClient, plan: Plan[ResultT]) -> ResultT:
        """``run_in_line`` for ``AsyncClient`` (a cancelled wait leaves the line too)."""
        try:
            return await client.run(plan)
        except BaseException:
            if self._lease is not None:
                with contextlib.suppress(MetakvError):
                    await client.run(self.leave_plan())
            raise


# ---------------------------------------------------------------------------- locks


class LineHandle:
    """What a lock or an election shows of its place in line, in either flavour."""

    _line: LineCore

    @property
    def key(self) -> str:
        """Our key in the line (``PREFIX/NAME/<lease id>``)."""
        return self._line.key

    @property
    def version(self) -> int:
        """The fencing token: our key's create_version while first in line (0: not first)."""
        return self._line.version

    @property
    def held(self) -> bool:
        """First in line, not left, and the lease still alive (as far as this client knows)."""
        return self._line.held


class Lock(LineHandle):
    """A lock held under ``lease`` (a ``Lease`` of ``client``): ``acquire`` waits for it,
    ``release`` gives it up; it is also lost when the lease ends. ``version`` is the
    fencing token. ``with Lock(...) as lock`` acquires and releases."""

    def __init__(self, client: Client, name: str, lease: Lease, *, prefix: str = LOCK_PREFIX) -> None:
        self._client = client
        self._line = LineCore(client, prefix, name, lease)

    def acquire(self, timeout_s: float | None = None) -> int:
        """Wait until held (``NotAcquired`` after ``timeout_s``); the fencing token."""
        self._line.run_in_line(self._client, self._line.wait_first_plan(b"", timeout_s))
        return self.version

    def release(self) -> None:
        self._client.run(self._line.leave_plan())

    def __enter__(self) -> Lock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        with raised_unless_failing(exc_type):
            self.release()


class AsyncLock(LineHandle):
    """``Lock`` for ``AsyncClient``: ``await acquire()``, ``async with``."""

    def __init__(self, client: AsyncClient, name: str, lease: AsyncLease, *, prefix: str = LOCK_PREFIX) -> None:
        self._client = client
        self._line = LineCore(client, prefix, name, lease)

    async def acquire(self, timeout_s: float | None = None) -> int:
        await self._line.run_in_line_async(self._client, self._line.wait_first_plan(b"", timeout_s))
        return self.version

    async def release(self) -> None:
        await self._client.run(self._line.leave_plan())

    async def __aenter__(self) -> AsyncLock:
        await self.acquire()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        with raised_unless_failing(exc_type):
            await self.release()


# ---------------------------------------------------------------------------- elections


class ElectionCore(LineCore):
    """The plans of an election: ``LineCore`` plus proclaim, the leader, the next leader."""

    def campaign_plan(self, value: bytes | str, timeout_s: float | None) -> Plan[KeyValue]:
        leader = yield from self.wait_first_plan(value, timeout_s)
        if leader.value != (value.encode() if isinstance(value, str) else value):
            # Our key was there already (this lease campaigned before) with another value.
            leader = yield from self.proclaim_plan(value)
        return leader

    def proclaim_plan(self, value: bytes | str) -> Plan[KeyValue]:
        """Change the leader's value; only the leader may (``NotLeader``)."""
        own = self.own
        if own is None:
            raise NotLeader("Not the leader", f"{self.prefix}: campaign first")
        self.lease.check()
        try:
            written = yield from self.client.put_plan(self.key, value, None, own.mod_version, lease=self.lease)
        except Conflict:
            self.own = None
            raise NotLeader("Not the leader", f"{self.key} changed or went away: leadership lost") from None
        encoded = value.encode() if isinstance(value, str) else bytes(value)
        self.own = KeyValue(self.key, encoded, own.content_type, written.version, own.create_version, self.lease.id)
        return self.own

    def leader_plan(self) -> Plan[KeyValue | None]:
        listing = yield from self.client.list_plan(self.prefix, None, False, "local", None, None)
        ordered = by_place(listing.items)
        return ordered[0] if ordered else None

    def next_leader_plan(self, last: KeyValue | None) -> Plan[KeyValue]:
        """The leader once it differs from ``last`` (another key, or a new value)."""
        while True:
            listing = yield from self.client.list_plan(self.prefix, None, False, "local", None, None)
            ordered = by_place(listing.items)
            leader = ordered[0] if ordered else None
            if leader is not None and (last is None or (leader.key, leader.mod_version)
                                       != (last.key, last.mod_version)):
                return leader
            cursor = WatchCursor(self.prefix, listing.version, WAIT_POLL_MS)
            while True:
                events = cursor.accept((yield cursor.request()))
                if leader is None and any(event.type == "put" for event in events):
                    break
                if leader is not None and any(event.key == leader.key for event in events):
                    break


class Election(LineHandle):
    """A leader election among the holders of ``name``: ``campaign`` waits to be leader,
    ``proclaim`` changes the value, ``resign`` steps down; ``leader()`` and ``observe()``
    work for anyone (an observer passes no lease). Leadership also ends with the lease;
    ``held`` says whether we lead, ``version`` is a fencing token as ``Lock.version``."""

    def __init__(self, client: Client, name: str, lease: Lease | None = None, *,
                 prefix: str = ELECTION_PREFIX) -> None:
        self._client = client
        self._line = ElectionCore(client, prefix, name, lease)

    def campaign(self, value: bytes | str, timeout_s: float | None = None) -> KeyValue:
        return self._line.run_in_line(self._client, self._line.campaign_plan(value, timeout_s))

    def proclaim(self, value: bytes | str) -> KeyValue:
        return self._client.run(self._line.proclaim_plan(value))

    def resign(self) -> None:
        self._client.run(self._line.leave_plan())

    def leader(self) -> KeyValue | None:
        """The current leader's key and value, or None when nobody leads."""
        return self._client.run(self._line.leader_plan())

    def observe(self) -> Iterator[KeyValue]:
        """The leader now (once there is one), then each new leader or value, forever."""
        last: KeyValue | None = None
        while True:
            last = self._client.run(self._line.next_leader_plan(last))
            yield last


class AsyncElection(LineHandle):
    """``Election`` for ``AsyncClient``."""

    def __init__(self, client: AsyncClient, name: str, lease: AsyncLease | None = None, *,
                 prefix: str = ELECTION_PREFIX) -> None:
        self._client = client
        self._line = ElectionCore(client, prefix, name, lease)

    async def campaign(self, value: bytes | str, timeout_s: float | None = None) -> KeyValue:
        return await self._line.run_in_line_async(self._client, self._line.campaign_plan(value, timeout_s))

    async def proclaim(self, value: bytes | str) -> KeyValue:
        return await self._client.run(self._line.proclaim_plan(value))

    async def resign(self) -> None:
        await self._client.run(self._line.leave_plan())

    async def leader(self) -> KeyValue | None:
        return await self._client.run(self._line.leader_plan())

    async def observe(self) -> AsyncIterator[KeyValue]:
        last: KeyValue | None = None
        while True:
            last = await self._client.run(self._line.next_leader_plan(last))
            yield last
