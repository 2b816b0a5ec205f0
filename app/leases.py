"""Leases on the leader: deadlines in memory, expiry and revoke as log records (docs/leases.md).

The state machine holds what every replica must agree on: which leases exist (an internal
key each, storage/state_leases.py) and which keys are attached to which lease. When a lease
ends is the leader's alone to decide, on its own clock:

- Deadlines live in this process's memory only: a keep-alive writes no log record. A node
  that becomes leader restarts every lease's countdown from its full TTL (as etcd does), so
  a failover never ends a lease early; it loads the leases once it has applied everything
  earlier leaders committed (a leadership confirmation, then its applied version reaching
  the offset it names).
- A keep-alive is answered only by a leader that confirmed its leadership with a quorum
  round, one round per request however many leases it names (the batch form).
- Expiry and revoke are one command: delete the lease's key and every attached key,
  guarded by compares on the mod_version of each (the lease key's changes whenever a key
  is attached, storage/evaluator.py), so it applies only if the attached set is still the
  one read; otherwise the state is read again and the command rebuilt.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from app.service import (
    MAX_LEASE_ID,
    ApplyResult,
    Compare,
    CompareKind,
    KeysCheck,
    LeaseExistsError,
    LeaseGrant,
    LeaseInfo,
    LeaseKeepAlive,
    LeaseList,
    LeaseNotFoundError,
    LeaseRevoke,
    LeaseTtlError,
    Op,
    OpKind,
    WriteRejectedError,
)
from storage.commands import LEASE_EXPIRED, LEASE_REVOKED, Command, lease_key
from storage.evaluator import LEASE_NOT_FOUND
from storage.state_leases import LeaseState, encode_ttl
from storage.state_machine import StateMachine

logger = logging.getLogger("metakv.leases")

DEFAULT_MAX_LEASE_TTL_S = 86_400
# The shortest TTL granted, in election timeouts: a lease must outlive a leader change (a
# shorter one is raised to it and the answer says so, as etcd's minimum TTL).
MIN_TTL_ELECTION_TIMEOUTS = 3
EXPIRY_TICK_S = 0.05  # how often the leader looks for leases past their deadline
EXPIRY_RETRY_S = 1.0  # an expiry whose command failed (no quorum, say) is tried again this much later
EXPIRIES_AT_ONCE = 64  # revoke commands of expired leases in flight at once
REVOKE_ATTEMPTS = 10  # a revoke rebuilt this often (keys kept being attached) gives up
GRANT_ID_ATTEMPTS = 5  # generated ids that collided before a grant gives up


def min_ttl_s(election_timeout_ms: int) -> int:
    return max(1, math.ceil(MIN_TTL_ELECTION_TIMEOUTS * election_timeout_ms / 1000))


def lease_not_found(result: ApplyResult) -> int | None:
    """The lease a write named that did not exist when it applied, else None."""
    if result.error is not None and result.error.startswith(LEASE_NOT_FOUND):
        return int(result.error[len(LEASE_NOT_FOUND):])
    return None


def revoke_command(lease: LeaseState, reason: str) -> Command:
    """Delete the lease's key and every attached key, only if none changed since ``lease``
    was read (so no key was attached or detached meanwhile)."""
    key = lease_key(lease.id)
    compares = (Compare(key, CompareKind.MOD_VERSION, lease.mod_version),
                *(Compare(attached, CompareKind.MOD_VERSION, version) for attached, version in lease.keys))
    deletes = (Op(OpKind.DELETE, key, b"", reason),
               *(Op(OpKind.DELETE, attached, b"", reason) for attached, _version in lease.keys))
    return Command(compares, deletes)


@dataclass(frozen=True, slots=True)
class LeaderHooks:
    """What the manager needs of its node: propose a command (replicated and applied, its
    result), whether this node leads and in which epoch, a leadership confirmation (a
    quorum round; the version to have applied before reading), and a wait for a version."""

    propose: Callable[[Command], Awaitable[ApplyResult]]
    leading_epoch: Callable[[], int | None]  # the epoch this node leads, None: not the leader
    confirm_leadership: Callable[[], Awaitable[int]]  # raises NotLeaderError
    wait_applied: Callable[[int], Awaitable[None]]


class LeaseManager:
    """The lease calls of KVService for one node, and the leader's expiry loop."""

    def __init__(self, state: Callable[[], StateMachine], hooks: LeaderHooks, *, max_ttl_s: int,
                 min_ttl_s: int, metrics: CollectorRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        self._state = state
        self._hooks = hooks
        self.max_ttl_s = max_ttl_s
        self.min_ttl_s = min(min_ttl_s, max_ttl_s)
        self._clock = clock
        self._epoch: int | None = None  # the epoch whose leases ``_deadlines`` holds
        self._loading: asyncio.Task[None] | None = None
        self._deadlines: dict[int, float] = {}
        self._ttls: dict[int, int] = {}
        self._queue: list[tuple[float, int]] = []  # (deadline, id); stale entries skipped
        self._expiring: set[int] = set()
        self._task: asyncio.Task[None] | None = None
        self._expiries_running: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references
        self._expiries = Counter("metakv_lease_expiries", "Leases this node ended as their leader because "
                                 "no keep-alive came within their TTL", registry=metrics)
        self._keepalives = Counter("metakv_lease_keepalives", "Leases kept alive (each lease of a batch counts)",
                                   registry=metrics)
        self._revokes = Counter("metakv_lease_revokes", "Leases revoked by a client", registry=metrics)
        live = Gauge("metakv_leases", "Leases in this node's applied state", registry=metrics)
        live.set_function(self._live_count)

    def _live_count(self) -> int:
        try:
            return self._state().lease_count()
        except AttributeError:  # scraped before the node opened its state
            return 0

    # ---- leadership ------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._expire_loop(), name="lease-expiry")

    async def stop(self) -> None:
        """End the expiry loop, a load, and every expiry in flight (its command may still
        commit: a new leader finds the lease gone, or expires it again)."""
        for task in (self._task, self._loading, *self._expiries_running):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # stopping: nothing to report
                    await task

    async def _leading(self) -> int:
        """This node's epoch as the leader with every lease's deadline loaded (restarted from
        its full TTL); raises NotLeaderError (via the confirmation) on a follower."""
        epoch = self._hooks.leading_epoch()
        if epoch is not None and epoch == self._epoch:
            return epoch
        if self._loading is None or self._loading.done():
            self._loading = asyncio.get_running_loop().create_task(self._load())
        await asyncio.shield(self._loading)
        epoch = self._hooks.leading_epoch()
        if epoch is None or epoch != self._epoch:
            await self._hooks.confirm_leadership()  # raises NotLeaderError
            raise WriteRejectedError("leadership changed while the leases were loaded; retry")
        return epoch

    async def _load(self) -> None:
        epoch = self._hooks.leading_epoch()
        version = await self._hooks.confirm_leadership()
        await self._hooks.wait_applied(version)
        if self._hooks.leading_epoch() != epoch:
            return
        _version, leases = self._state().leases()
        now = self._clock()
        self._deadlines.clear()
        self._ttls.clear()
        self._queue.clear()
        self._expiring.clear()  # an earlier term's expiries in flight no longer decide anything here
        for lease_id, ttl_s, _granted in leases:
            self._track(lease_id, ttl_s, now)
        self._epoch = epoch
        logger.info("leader of epoch %s: %d leases, each restarted from its full TTL", epoch, len(leases))

    def _track(self, lease_id: int, ttl_s: int, now: float) -> None:
        deadline = now + ttl_s
        self._deadlines[lease_id] = deadline
        self._ttls[lease_id] = ttl_s
        heapq.heappush(self._queue, (deadline, lease_id))

    def _forget(self, lease_id: int) -> None:
        self._deadlines.pop(lease_id, None)
        self._ttls.pop(lease_id, None)

    # ---- KVService -------------------------------------------------------------------

    def check_ttl(self, ttl_s: int) -> int:
        """The TTL a grant gets: raised to the minimum; LeaseTtlError when <= 0 or above
        the maximum."""
        if ttl_s <= 0 or ttl_s > self.max_ttl_s:
            raise LeaseTtlError(f"ttl_s must be between 1 and {self.max_ttl_s} (this node's --max-lease-ttl-s); "
                                f"got {ttl_s}")
        return max(ttl_s, self.min_ttl_s)

    async def grant(self, ttl_s: int, lease_id: int | None = None) -> LeaseGrant:
        ttl_s = self.check_ttl(ttl_s)
        await self._leading()
        for _attempt in range(GRANT_ID_ATTEMPTS if lease_id is None else 1):
            chosen = lease_id if lease_id is not None else random.randint(1, MAX_LEASE_ID)
            key = lease_key(chosen)
            result = await self._hooks.propose(Command(
                (Compare(key, CompareKind.EXISTS, False),), (Op(OpKind.PUT, key, encode_ttl(ttl_s)),)))
            if result.succeeded:
                if self._epoch == self._hooks.leading_epoch():
                    self._track(chosen, ttl_s, self._clock())
                return LeaseGrant(chosen, ttl_s, result.version)
        raise LeaseExistsError(f"lease {lease_id} exists" if lease_id is not None
                               else "every generated lease id was taken; retry")

    async def keep_alive(self, lease_ids: list[int]) -> LeaseKeepAlive:
        """Restart the countdown of each lease; one leadership confirmation for the batch. A
        lease whose deadline had passed when the request arrived has expired, as in etcd,
        even if its revoke is not proposed yet (a mass expiry lags): it is not revived."""
        arrived = self._clock()
        await self._leading()
        await self._hooks.confirm_leadership()
        now = self._clock()
        kept: list[tuple[int, int]] = []
        missing: list[int] = []
        for lease_id in lease_ids:
            ttl_s = self._ttls.get(lease_id)
            deadline = self._deadlines.get(lease_id)
            if ttl_s is None or deadline is None or deadline <= arrived or lease_id in self._expiring:
                missing.append(lease_id)
                continue
            deadline = now + ttl_s
            self._deadlines[lease_id] = deadline
            heapq.heappush(self._queue, (deadline, lease_id))
            kept.append((lease_id, ttl_s))
        self._keepalives.inc(len(kept))
        return LeaseKeepAlive(kept, missing)

    async def revoke(self, lease_id: int, authorize: KeysCheck | None = None) -> LeaseRevoke:
        await self._leading()
        revoked = await self._revoke(lease_id, LEASE_REVOKED, authorize)
        self._revokes.inc()
        return revoked

    async def info(self, lease_id: int, with_keys: bool, authorize: KeysCheck | None = None) -> LeaseInfo:
        await self._leading()
        lease = self._state().lease(lease_id)
        deadline = self._deadlines.get(lease_id)
        if lease is None or deadline is None or lease_id in self._expiring:
            raise LeaseNotFoundError(lease_id)
        keys = [key for key, _version in lease.keys] if with_keys else None
        if keys is not None and authorize is not None:
            authorize(keys)
        return LeaseInfo(lease_id, lease.ttl_s, max(0.0, deadline - self._clock()), lease.granted_version, keys)

    def list(self) -> LeaseList:
        version, leases = self._state().leases()
        return LeaseList(version, [(lease_id, ttl_s) for lease_id, ttl_s, _granted in leases])

    # ---- revoke and expiry -----------------------------------------------------------

    async def _revoke(self, lease_id: int, reason: str, authorize: KeysCheck | None = None) -> LeaseRevoke:
        """Propose the revoke command until it applies (keys attached or detached since it
        was read make it fail: read again). ``authorize`` checks each read's keys: the
        command's compares make those exactly the keys it deletes."""
        for _attempt in range(REVOKE_ATTEMPTS):
            lease = self._state().lease(lease_id)
            if lease is None:
                self._forget(lease_id)
                raise LeaseNotFoundError(lease_id)
            if authorize is not None:
                authorize([key for key, _version in lease.keys])
            result = await self._hooks.propose(revoke_command(lease, reason))
            if result.succeeded:
                self._forget(lease_id)
                return LeaseRevoke(lease_id, result.version, len(lease.keys))
        raise WriteRejectedError(f"lease {lease_id}: keys kept being attached while it was revoked; retry")

    async def _expire_loop(self) -> None:
        limit = asyncio.Semaphore(EXPIRIES_AT_ONCE)
        while True:
            await asyncio.sleep(EXPIRY_TICK_S)
            if self._epoch is None or self._hooks.leading_epoch() != self._epoch:
                if self._hooks.leading_epoch() is not None:
                    try:
                        await self._leading()  # a new leader loads at once, not on the first call
                    except Exception as exc:  # not the leader after all, or no quorum yet
                        logger.debug("lease load deferred: %r", exc)
                continue
            now, epoch = self._clock(), self._epoch
            queue = self._queue
            while queue and queue[0][0] <= now:
                deadline, lease_id = heapq.heappop(queue)
                if self._deadlines.get(lease_id) != deadline or lease_id in self._expiring:
                    continue  # kept alive since (a newer entry is queued), or gone
                self._expiring.add(lease_id)
                await limit.acquire()
                if self._epoch != epoch:  # a new term reloaded meanwhile: its countdowns decide
                    limit.release()
                    break
                task = asyncio.get_running_loop().create_task(self._expire(lease_id, limit, epoch))
                self._expiries_running.add(task)
                task.add_done_callback(self._expiries_running.discard)

    async def _expire(self, lease_id: int, limit: asyncio.Semaphore, epoch: int) -> None:
        """End a lease that passed its deadline in ``epoch``; only that term's state is touched."""
        try:
            await self._revoke(lease_id, LEASE_EXPIRED)
            self._expiries.inc()
        except LeaseNotFoundError:
            pass  # revoked meanwhile
        except Exception as exc:  # e.g. leadership lost: a new leader restarts its countdown
            retried = lease_id in self._deadlines and self._epoch == epoch == self._hooks.leading_epoch()
            logger.warning("lease %d: expiry not applied (%r); %s", lease_id, exc,
                           "retried" if retried else "left to the next leader's countdown")
            if retried:
                retry_at = self._clock() + EXPIRY_RETRY_S
                self._deadlines[lease_id] = retry_at
                heapq.heappush(self._queue, (retry_at, lease_id))
        finally:
            if self._epoch == epoch:  # a new term cleared it, and may be expiring it itself
                self._expiring.discard(lease_id)
            limit.release()


class NodeLeases:
    """The lease calls of KVService, answered by the node's LeaseManager (``self.leases``);
    the runtime and its in-process test twin both inherit them."""

    leases: LeaseManager

    async def grant_lease(self, ttl_s: int, lease_id: int | None = None) -> LeaseGrant:
        return await self.leases.grant(ttl_s, lease_id)

    async def keep_alive_leases(self, lease_ids: list[int]) -> LeaseKeepAlive:
        return await self.leases.keep_alive(lease_ids)

    async def revoke_lease(self, lease_id: int, authorize: KeysCheck | None = None) -> LeaseRevoke:
        return await self.leases.revoke(lease_id, authorize)

    async def lease_info(self, lease_id: int, with_keys: bool = False, authorize: KeysCheck | None = None) -> LeaseInfo:
        return await self.leases.info(lease_id, with_keys, authorize)

    def list_leases(self) -> LeaseList:
        return self.leases.list()
