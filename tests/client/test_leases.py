"""The client's leases against a scripted leader (httpx.MockTransport): keep-alives batched
through the batch endpoint to the leader, a lease the cluster reports gone ending for its
holder (event, callback, exception on next use), and the requests a lease adds to writes."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest

from metakv import AsyncClient, Client, InvalidRequest, Lease, LeaseLost, LeaseNotFound, RetryPolicy
from metakv.leases import KeepAliveSchedule, LeaseCore

A, B = "http://a:1", "http://b:2"
QUICK = RetryPolicy(deadline_s=1.0, backoff_base_s=0.001, backoff_max_s=0.002, retry_after_max_s=0.01)
WAIT_S = 10.0


class LeaseNode:
    """b leads and knows the leases it granted until ``forget``; a redirects lease calls to b."""

    def __init__(self) -> None:
        self.leases: dict[int, int] = {}
        self.batches: list[list[int]] = []
        self.seen: list[httpx.Request] = []
        self.next_id = 100
        self.guard = threading.Lock()

    def forget(self, lease_id: int) -> None:
        with self.guard:
            self.leases.pop(lease_id)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        headers = {"X-Node-Id": "2" if request.url.host == "b" else "1", "X-Raft-Leader": "2"}
        path = request.url.path
        if request.url.host != "b":
            return httpx.Response(307, headers={**headers, "Location": f"{B}{request.url.raw_path.decode()}"})
        body: Any = json.loads(request.content) if request.method == "POST" else None
        with self.guard:
            if path == "/v1/leases" and request.method == "POST":
                self.next_id += 1
                self.leases[self.next_id] = max(1, body["ttl_s"])
                return httpx.Response(201, headers=headers, json={"id": self.next_id, "ttl_s": self.leases[self.next_id],
                                                                  "version": 9})
            if path == "/v1/leases/keepalive":
                self.batches.append(list(body["ids"]))
                return httpx.Response(200, headers=headers, json={
                    "leases": [{"id": i, "ttl_s": self.leases[i]} for i in body["ids"] if i in self.leases],
                    "not_found": [i for i in body["ids"] if i not in self.leases]})
            if request.method == "DELETE":
                found = self.leases.pop(int(path.rsplit("/", 1)[1]), None)
                if found is None:
                    return httpx.Response(404, headers=headers, json={
                        "type": "urn:metakv:problem:lease-not-found", "title": "Lease not found", "status": 404})
                return httpx.Response(200, headers=headers, json={"id": 1, "version": 10, "deleted_keys": 2})
            if request.method == "PUT":
                if int(request.url.params["lease"]) not in self.leases:
                    return httpx.Response(404, headers=headers, json={
                        "type": "urn:metakv:problem:lease-not-found", "title": "Lease not found", "status": 404})
                return httpx.Response(200, headers=headers, json={"key": "k", "version": 11, "created": True})
        return httpx.Response(500)

    def ids_kept_alive(self) -> set[int]:
        return {lease_id for batch in self.batches for lease_id in batch}


def wait_for(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_leases_are_kept_alive_together_at_the_leader_and_one_reported_gone_ends_for_its_users() -> None:
    node = LeaseNode()
    ended: list[int] = []
    with Client(f"{A},{B}", transport=httpx.MockTransport(node), retry=QUICK) as kv:
        granted_at = time.monotonic()
        first, second = kv.lease(1), kv.lease(1)
        first.on_lost(lambda lease: ended.append(lease.id))
        wait_for(lambda: time.monotonic() > granted_at + 2.5, "2.5 TTLs")
        assert first.alive and second.alive
        assert len(node.batches) >= 5
        assert all(sorted(batch) == [first.id, second.id] for batch in node.batches)  # one request per round
        assert all(r.url.host == "b" for r in node.seen if r.url.path == "/v1/leases/keepalive")

        node.forget(first.id)
        assert first.done.wait(WAIT_S)
        assert ended == [first.id] and "not found" in (first.lost_reason or "")
        with pytest.raises(LeaseLost):
            kv.put("k", "v", lease=first)
        assert second.alive and kv.put("k", "v", lease=second).version == 11
        assert "lease=" + str(second.id) in str(node.seen[-1].url)

        kept = len(node.batches)
        assert second.revoke() == 2
        assert second.done.is_set() and not second.alive
        time.sleep(0.5)
        assert all(second.id not in batch for batch in node.batches[kept + 1:])  # no keep-alive after a revoke
        with pytest.raises(LeaseNotFound):
            kv.put("k", "v", lease=second.id)  # by id: the cluster's answer


def test_a_lease_with_no_keep_alive_acknowledged_for_a_ttl_is_lost_even_if_never_reported() -> None:
    """The cluster unreachable: the holder cannot know whether it expired, so it is lost."""
    lease = LeaseCore(5, ttl_s=2, granted_version=1, sent_at=0.0, clock=lambda: 1.9)
    assert lease.alive
    late = LeaseCore(5, ttl_s=2, granted_version=1, sent_at=0.0, clock=lambda: 2.0)
    assert not late.alive
    with pytest.raises(LeaseLost, match="whole TTL"):
        late.check()


@pytest.mark.parametrize("ttl", [0, -1, 1.5, True, "3"])
def test_a_bad_ttl_is_refused_before_sending(ttl: Any) -> None:
    node = LeaseNode()
    with Client(B, transport=httpx.MockTransport(node), retry=QUICK) as kv, pytest.raises(InvalidRequest):
        kv.lease(ttl)
    assert node.seen == []


def test_the_async_client_keeps_leases_alive_in_a_task_and_ends_them() -> None:
    node = LeaseNode()

    async def scenario() -> None:
        async with AsyncClient(f"{A},{B}", transport=httpx.MockTransport(node), retry=QUICK) as kv:
            async with await kv.lease(1) as lease:
                for _ in range(200):
                    if len(node.batches) >= 3:
                        break
                    await asyncio.sleep(0.02)
                assert lease.alive and node.ids_kept_alive() == {lease.id}
                node.forget(lease.id)
                await asyncio.wait_for(lease.done.wait(), WAIT_S)
                with pytest.raises(LeaseLost):
                    await kv.put("k", "v", lease=lease)

    asyncio.run(scenario())


def test_closing_the_client_ends_its_leases_for_their_holders() -> None:
    node = LeaseNode()
    kv = Client(B, transport=httpx.MockTransport(node), retry=QUICK)
    lease: Lease = kv.lease(30)
    kv.close()
    assert lease.done.is_set() and "closed" in (lease.lost_reason or "")


def test_a_keep_alive_acknowledged_after_the_holders_deadline_does_not_bring_the_lease_back() -> None:
    """Past its deadline ``alive`` is False and the holder must stop; an answer arriving then
    (sent before the deadline, slow to come back) must not make it alive again unannounced."""
    now = [0.0]
    lease = LeaseCore(5, ttl_s=2, granted_version=1, sent_at=0.0, clock=lambda: now[0])
    ended: list[int] = []
    lease.on_lost(lambda lost: ended.append(lost.id))
    now[0] = 2.5
    assert not lease.alive
    lease.acknowledged(2, sent_at=1.9)
    assert not lease.alive and ended == [5] and "whole TTL" in (lease.lost_reason or "")
    with pytest.raises(LeaseLost):
        lease.check()


def test_a_keep_alive_gives_up_by_the_deadline_of_the_leases_it_carries() -> None:
    """With the cluster unreachable, a keep-alive still trying past a lease's deadline would
    hold back its end (done, on_lost) while the cluster may have expired it already."""
    now = [0.0]
    schedule = KeepAliveSchedule(clock=lambda: now[0])
    lease = LeaseCore(5, ttl_s=9, granted_version=1, sent_at=0.0, clock=lambda: now[0])
    schedule.add(lease)
    now[0] = 8.8  # the earlier keep-alives failed: 0.2 s left
    request = next(schedule.round_plan())
    assert request.deadline_s is not None and request.deadline_s <= 0.2 + 1e-9
    assert request.timeout_s is not None and request.timeout_s <= 0.2 + 1e-9


def test_a_failing_on_lost_callback_does_not_stop_the_other_leases_keep_alives() -> None:
    """Callbacks run in the keeper: one raising must not end keep-alives for every lease."""
    node = LeaseNode()
    with Client(B, transport=httpx.MockTransport(node), retry=QUICK) as kv:
        failing, other = kv.lease(1), kv.lease(1)

        def broken(_lease: LeaseCore) -> None:
            raise RuntimeError("a bug in the holder's callback")

        failing.on_lost(broken)
        node.forget(failing.id)
        assert failing.done.wait(WAIT_S)
        batches = len(node.batches)
        wait_for(lambda: len(node.batches) >= batches + 3, "keep-alives after the failing callback")
        assert other.alive and all(batch == [other.id] for batch in node.batches[batches + 1:])


class MalformedOnce(LeaseNode):
    """Answers the first keep-alive with a body missing its members (another server behind
    the URL, a proxy's page), then as a leader."""

    def __init__(self) -> None:
        super().__init__()
        self.malformed = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/leases/keepalive" and not self.malformed:
            self.malformed += 1
            return httpx.Response(200, headers={"X-Node-Id": "2", "X-Raft-Leader": "2"}, json={})
        return super().__call__(request)


def test_a_malformed_keep_alive_answer_is_retried_not_the_end_of_the_keeper() -> None:
    node = MalformedOnce()
    with Client(B, transport=httpx.MockTransport(node), retry=QUICK) as kv:
        lease = kv.lease(1)
        wait_for(lambda: len(node.batches) >= 3, "keep-alives after the malformed answer")
        assert node.malformed == 1 and lease.alive
