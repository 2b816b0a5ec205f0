"""The leader's lease manager (app/leases.py) on a real state machine, with the leadership
and the clock under the test's control: one confirmation per keep-alive batch, every
countdown restarted from the full TTL by a new leader, expiry as a revoke with its reason,
and followers refusing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from app.leases import LeaderHooks, LeaseManager
from app.service import LeaseNotFoundError, NotLeaderError
from tests.http.service_double import InProcessService

pytestmark = pytest.mark.anyio


class Leadership:
    """The node's side as the manager sees it: an epoch (None: a follower), a clock, and the
    leadership confirmations counted."""

    def __init__(self, service: InProcessService) -> None:
        self.service = service
        self.epoch: int | None = 1
        self.now = 1000.0
        self.confirmations = 0

    async def confirm(self) -> int:
        self.confirmations += 1
        if self.epoch is None:
            raise NotLeaderError(None)
        return self.service.state.applied_version

    async def applied(self, _version: int) -> None:
        """Every committed version is applied at once here."""


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[InProcessService, LeaseManager, Leadership]]:
    service = InProcessService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"))
    leadership = Leadership(service)
    manager = LeaseManager(lambda: service.state, LeaderHooks(
        service.propose, lambda: leadership.epoch, leadership.confirm, leadership.applied),
        max_ttl_s=100, min_ttl_s=2, metrics=CollectorRegistry(), clock=lambda: leadership.now)
    service.leases = manager
    try:
        yield service, manager, leadership
    finally:
        service.close()


async def test_a_batch_of_keep_alives_costs_one_leadership_confirmation(node):
    _service, manager, leadership = node
    ids = [(await manager.grant(30)).id for _ in range(200)]
    before = leadership.confirmations
    report = await manager.keep_alive([*ids, 12345])
    assert leadership.confirmations == before + 1
    assert len(report.kept) == 200 and report.not_found == [12345]


async def test_a_ttl_below_the_minimum_is_raised_and_out_of_bounds_refused(node):
    _service, manager, _leadership = node
    assert (await manager.grant(1)).ttl_s == 2
    for ttl_s in (0, -1, 101):
        with pytest.raises(Exception, match="ttl_s must be between 1 and 100"):
            await manager.grant(ttl_s)


async def test_a_new_leader_restarts_every_countdown_from_the_full_ttl(node):
    _service, manager, leadership = node
    lease = await manager.grant(10)
    leadership.now += 9
    assert (await manager.info(lease.id, False)).remaining_s == pytest.approx(1)
    leadership.epoch = 2  # another term: this node leads again, with no memory of deadlines
    assert (await manager.info(lease.id, False)).remaining_s == pytest.approx(10)


async def test_expiry_deletes_the_lease_and_its_keys_with_the_reason(node):
    service, manager, leadership = node
    expiring, kept = await manager.grant(5), await manager.grant(5)
    await service.put("svc/a", b"1", lease=expiring.id)
    await service.put("svc/b", b"2", lease=kept.id)
    since = service.state.applied_version
    manager.start()
    try:
        leadership.now += 4
        await manager.keep_alive([kept.id])
        leadership.now += 2  # past the first lease's deadline only
        for _ in range(200):
            if service.get("svc/a").entry is None:
                break
            await asyncio.sleep(0.01)
        events = service.changes("svc/", since, 100).events
        assert [(event.key, event.type, event.reason) for event in events] == [("svc/a", "delete", "lease-expired")]
        assert service.get("svc/b").entry is not None
        with pytest.raises(LeaseNotFoundError):
            await manager.info(expiring.id, False)
        assert (await manager.keep_alive([expiring.id])).not_found == [expiring.id]
    finally:
        await manager.stop()


async def test_a_follower_answers_no_lease_call_but_the_list(node):
    _service, manager, leadership = node
    lease = await manager.grant(30)
    leadership.epoch = None
    for call in (manager.keep_alive([lease.id]), manager.revoke(lease.id), manager.info(lease.id, False),
                 manager.grant(30)):
        with pytest.raises(NotLeaderError):
            await call
    assert manager.list().leases == [(lease.id, 30)]


async def test_a_keep_alive_after_the_deadline_does_not_revive_a_lease_whose_expiry_lags(node):
    """Expiry runs behind the deadlines when many leases end at once (docs/leases.md): a
    lease past its deadline has expired, as in etcd, so a late keep-alive is not_found."""
    _service, manager, leadership = node
    late = await manager.grant(5)
    leadership.now += 1
    on_time = await manager.grant(5)
    leadership.now += 4  # the first one's deadline; the expiry loop is not running: no revoke yet
    report = await manager.keep_alive([late.id, on_time.id])
    assert report.kept == [(on_time.id, 5)] and report.not_found == [late.id]


async def test_stopping_ends_the_expiries_in_flight(tmp_path):
    """An expiry whose command has not committed when the node stops must not outlive the
    manager (and propose into a stopped node, or be collected mid-flight)."""
    service = InProcessService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"))
    leadership = Leadership(service)
    stalled = asyncio.Event()

    async def propose(command):
        if stalled.is_set():
            await asyncio.Event().wait()  # no quorum: never commits
        return await service.propose(command)

    manager = LeaseManager(lambda: service.state, LeaderHooks(
        propose, lambda: leadership.epoch, leadership.confirm, leadership.applied),
        max_ttl_s=100, min_ttl_s=2, metrics=CollectorRegistry(), clock=lambda: leadership.now)
    try:
        await manager.grant(5)
        stalled.set()
        manager.start()
        leadership.now += 6

        def expiring() -> list[asyncio.Task]:
            return [task for task in asyncio.all_tasks()
                    if not task.done() and getattr(task.get_coro(), "__name__", "") == "_expire"]

        for _ in range(200):
            if expiring():
                break
            await asyncio.sleep(0.01)
        assert len(expiring()) == 1
        await manager.stop()
        assert expiring() == []
    finally:
        service.close()


async def test_an_expiry_left_from_an_earlier_term_does_not_shorten_the_new_countdown(tmp_path):
    """The node loses the leadership while an expiry waits for its commit, then leads again:
    the new term restarts the lease's full TTL, so the old expiry's failure must neither
    refuse its keep-alives nor put its deadline a retry (1 s) away."""
    service = InProcessService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"))
    leadership = Leadership(service)
    old_commit: asyncio.Future = asyncio.get_running_loop().create_future()
    proposed = asyncio.Event()

    async def propose(command):
        if lease is not None:  # the first term's revoke: no quorum
            proposed.set()
            return await old_commit
        return await service.propose(command)

    lease = None
    manager = LeaseManager(lambda: service.state, LeaderHooks(
        propose, lambda: leadership.epoch, leadership.confirm, leadership.applied),
        max_ttl_s=100, min_ttl_s=2, metrics=CollectorRegistry(), clock=lambda: leadership.now)
    try:
        lease = await manager.grant(5)
        manager.start()
        leadership.now += 6
        await asyncio.wait_for(proposed.wait(), 10)
        leadership.epoch = 2  # led again, by this node
        assert (await manager.info(lease.id, False)).remaining_s == pytest.approx(5)
        assert (await manager.keep_alive([lease.id])).kept == [(lease.id, 5)]
        old_commit.set_exception(NotLeaderError(None))  # the first term's revoke fails at last
        await asyncio.sleep(0.1)
        assert (await manager.info(lease.id, False)).remaining_s == pytest.approx(5)
    finally:
        await manager.stop()
        service.close()
