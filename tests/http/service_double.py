"""A single-node ``KVService`` for HTTP tests, built on the real StateMachine.

It is the runtime minus replication: ``propose`` wraps the command in a real log batch at the
next offset and applies it at once, so every answer the routes map comes from the real
state machine (versions, compares, history, horizon). Waits are real waits on a condition,
bounded by the caller's timeout, never sleeps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, BinaryIO

from prometheus_client import CollectorRegistry

from app.auth import AuthTokens
from app.http.settings import DEFAULT_MAX_VALUE_BYTES
from app.leases import DEFAULT_MAX_LEASE_TTL_S, LeaderHooks, LeaseManager, NodeLeases
from app.node_reads import NodeReads
from app.node_writes import NodeWrites
from app.service import (
    ApplyResult,
    CompactReport,
    Consistency,
    NewVoter,
    NodeHeaders,
    NodeStatus,
    NotReadyError,
    QuorumView,
    ResignReport,
    SnapshotReport,
    VersionWaitTimeoutError,
    VoterChangeRefusedError,
    VoterSetView,
)
from app.watch_hub import WATCH_QUEUE_EVENTS, WatchHub
from raft.types import Batch, SnapshotId
from storage.commands import Command, encode_command
from storage.snapshot_store import SnapshotStore
from storage.state_machine import StateMachine


class InProcessService(NodeReads, NodeWrites, NodeLeases):
    """One node that is always the leader of epoch 1 and always ready. Reads and the typed
    writes are the runtime's own (app/node_reads.py, app/node_writes.py)."""

    node_id = 1
    epoch = 1
    auth_tokens: AuthTokens | None = None
    compact: Callable[[], Awaitable[CompactReport]] | None = None  # this node does not compact

    def __init__(self, db_path: str, snapshot_dir: str, *, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 watch_queue_events: int = WATCH_QUEUE_EVENTS) -> None:
        self.state = StateMachine(db_path)
        self.watch_hub = WatchHub(self.changes, self.state.applied_version, queue_events=watch_queue_events)
        self.snapshot_dir = snapshot_dir
        self.metrics = CollectorRegistry()
        self.max_value_bytes = max_value_bytes
        self.max_lease_ttl_s = DEFAULT_MAX_LEASE_TTL_S
        # The lease calls as the leader answers them; no expiry loop (nothing is started).
        self.leases = LeaseManager(lambda: self.state, LeaderHooks(
            self.propose, lambda: self.epoch, self._confirm_leadership, self._applied),
            max_ttl_s=self.max_lease_ttl_s, min_ttl_s=1, metrics=self.metrics)
        self.proposals = 0
        self._waiting = 0  # requests parked in wait_readable right now
        self._waits_started = 0  # every such park so far
        self._changed: asyncio.Condition | None = None

    async def _confirm_leadership(self) -> int:
        return self.state.applied_version

    async def _applied(self, version: int) -> None:
        """Every committed version is applied at once here."""

    def _condition(self) -> asyncio.Condition:
        # Created lazily: the condition must belong to the loop that serves requests.
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def headers(self) -> NodeHeaders:
        return NodeHeaders(self.state.applied_version, self.node_id, self.node_id, self.epoch, 0)

    @property
    def waiting(self) -> int:
        """Requests parked in wait_readable or in a watch right now."""
        return self._waiting + self.watch_hub.waiting

    @property
    def waits_started(self) -> int:
        """Every park so far (a watcher that woke and parked again counts twice)."""
        return self._waits_started + self.watch_hub.waits_started

    def apply_now(self, command: Command) -> ApplyResult:
        """Commit ``command`` as the next log record and publish it to the watches, as the
        runtime's apply does (also outside any event loop: test setup)."""
        batch = Batch(base_offset=self.state.applied_version, epoch=self.epoch,
                      timestamp_ms=int(time.time() * 1000), control=False, records=(encode_command(command),))
        [result] = self.state.apply([batch])
        self.watch_hub.publish(self.state.applied_version, [result])
        return result

    async def propose(self, command: Command) -> ApplyResult:
        result = self.apply_now(command)
        self.proposals += 1
        condition = self._condition()
        async with condition:
            condition.notify_all()
        return result

    async def _wait_until(self, predicate: Any, timeout_ms: int) -> bool:
        condition = self._condition()
        self._waiting += 1
        self._waits_started += 1
        try:
            async with condition:
                try:
                    await asyncio.wait_for(condition.wait_for(predicate), timeout_ms / 1000)
                except TimeoutError:
                    return predicate()
            return True
        finally:
            self._waiting -= 1

    async def until_waiting(self, count: int = 1, max_steps: int = 10_000) -> None:
        """Tests: yield to the loop until ``count`` requests are parked (bounded by steps, not time)."""
        for _ in range(max_steps):
            if self.waiting >= count:
                return
            await asyncio.sleep(0)
        raise AssertionError(f"{count} waiting requests expected, {self.waiting} found")

    async def until_waits_started(self, count: int, max_steps: int = 10_000) -> None:
        """Tests: yield to the loop until ``count`` parks happened in all (bounded by steps)."""
        for _ in range(max_steps):
            if self.waits_started >= count:
                return
            await asyncio.sleep(0)
        raise AssertionError(f"{count} parks expected, {self.waits_started} happened")

    async def wait_readable(self, consistency: Consistency, min_version: int | None, wait_ms: int) -> None:
        if min_version is None or self.state.applied_version >= min_version:
            return
        if not await self._wait_until(lambda: self.state.applied_version >= min_version, wait_ms):
            raise VersionWaitTimeoutError(self.state.applied_version)

    def is_ready(self) -> bool:
        return True

    def status(self) -> NodeStatus:
        version = self.state.applied_version
        return {"node_id": self.node_id, "role": "leader", "voter": True, "epoch": self.epoch,
                "leader_id": self.node_id, "leader_url": "http://node1", "log_start_offset": 0,
                "log_end_offset": version, "flushed_offset": version, "high_watermark": version,
                "applied_version": version, "dirty_offset": 0, "tombstone_horizon": 0, "snapshot_id": None,
                "last_contact_ms": 0, "ready": True, "advertise_http": "http://node1"}

    def quorum(self) -> QuorumView:
        version = self.state.applied_version
        return {"epoch": self.epoch, "leader_id": self.node_id, "high_watermark": version,
                "voters": [{"node_id": self.node_id, "endpoint": "http://node1", "log_end_offset": version,
                            "lag": 0, "last_fetch_timestamp_ms": None, "last_caught_up_timestamp_ms": None}],
                "observers": []}

    async def take_snapshot(self) -> SnapshotReport:
        if self.state.applied_version == 0:  # as the runtime answers: nothing to snapshot yet
            raise NotReadyError("nothing applied yet: there is no state to snapshot")
        snapshot_id = self.state.create_snapshot(self.snapshot_dir, self.epoch)
        return {"snapshot_id": {"end_offset": snapshot_id.end_offset, "epoch": snapshot_id.epoch}}

    def open_snapshot(self, end_offset: int, epoch: int) -> BinaryIO:
        return open(SnapshotStore(self.snapshot_dir).path_for(SnapshotId(end_offset, epoch)), "rb")

    async def resign(self) -> ResignReport:
        return {"resigned": True, "epoch": self.epoch}

    # A static one-voter set, as a --voters node: every change is refused (tests/http/test_voters.py
    # swaps these for others).
    async def add_voter(self, voter: NewVoter) -> VoterSetView:
        raise VoterChangeRefusedError("kraft-version-0", "the voter set is static (--voters)")

    async def remove_voter(self, node_id: int, directory_id: str | None = None) -> VoterSetView:
        raise VoterChangeRefusedError("kraft-version-0", "the voter set is static (--voters)")

    def close(self) -> None:
        self.state.close()
