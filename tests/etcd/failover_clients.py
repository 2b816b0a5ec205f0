"""Two etcd clients from PyPI, aetcd (asyncio, over gRPC) and etcd3gw (over the JSON
gateway), each run a small application against one follower of a 3-voter metakv cluster
while the leader is SIGKILLed: a compare-and-swap counter and a watch of it. etcd clients
never follow redirects; the follower forwards.

Not named test_*.py: `make test-etcd` runs it (~15 s), `make test` does not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aetcd
import aetcd.exceptions
import pytest
import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import Etcd3Exception

from loadtest.local_cluster import Cluster

pytestmark = pytest.mark.anyio
INCREMENTS_EACH_SIDE = 6
CAS_ATTEMPTS = 60
RETRY_PAUSE_S = 0.2
CALL_TIMEOUT_S = 5
WATCH_WAIT_S = 20


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path / "metakv", 3, etcd=True)
    try:
        yield cluster.start()
    finally:
        print(cluster.logs())
        cluster.close()


async def increment(client: aetcd.Client) -> None:
    """One compare-and-swap increment, retried through the leader change."""
    for _attempt in range(CAS_ATTEMPTS):
        try:
            current = await client.get(b"counter")
            succeeded, _ = await client.transaction(
                compare=[client.transactions.mod(b"counter") == current.mod_revision],
                success=[client.transactions.put(b"counter", str(int(current.value) + 1).encode())], failure=[])
            if succeeded:
                return
        except aetcd.exceptions.ClientError:
            await asyncio.sleep(RETRY_PAUSE_S)  # no leader yet, or the outcome was unknown
    raise AssertionError("the counter could not be incremented")


def gateway_increment(client: Etcd3Client) -> None:
    """etcd3gw's compare-and-swap (replace: a txn comparing the value), retried likewise."""
    for _attempt in range(CAS_ATTEMPTS):
        try:
            current = client.get("gw-counter")[0]
            if client.replace("gw-counter", current, str(int(current) + 1)):
                return
        except (Etcd3Exception, requests.RequestException):
            time.sleep(RETRY_PAUSE_S)
    raise AssertionError("the gateway counter could not be incremented")


def gateway_values(events: Iterator[dict], final: int) -> list[int]:
    values: list[int] = []
    for event in events:
        values.append(int(event["kv"]["value"]))  # etcd3gw decodes the base64 itself
        if values[-1] == final:
            break
    return values


async def test_a_cas_counter_and_its_watch_survive_a_leader_sigkill(cluster: Cluster) -> None:
    leader = cluster.wait_for_leader()
    follower = next(node for node in cluster.voters if node.node_id != leader.node_id)
    async with aetcd.Client("127.0.0.1", follower.etcd_port, timeout=CALL_TIMEOUT_S) as client:
        gateway = Etcd3Client("127.0.0.1", follower.etcd_gateway_port, timeout=CALL_TIMEOUT_S)
        start = await client.put(b"counter", b"0")
        watch = await client.watch(b"counter", start_revision=start.header.revision + 1)
        # From the revision after the put: a watch "from now" on a follower that has not applied
        # the forwarded put yet would see it (the 0) too.
        gateway_start = await client.put(b"gw-counter", b"0")
        gateway_events, cancel_gateway_watch = gateway.watch("gw-counter",
                                                             start_revision=gateway_start.header.revision + 1)
        for side in range(2):
            if side:
                cluster.kill(leader)
            for _ in range(INCREMENTS_EACH_SIDE):
                await increment(client)
                await asyncio.to_thread(gateway_increment, gateway)
        gateway_final = int(gateway.get("gw-counter")[0])
        assert gateway_final >= 2 * INCREMENTS_EACH_SIDE
        seen_by_gateway = await asyncio.wait_for(
            asyncio.to_thread(gateway_values, gateway_events, gateway_final), WATCH_WAIT_S)
        cancel_gateway_watch()
        assert seen_by_gateway == list(range(1, gateway_final + 1))
        final = int((await client.get(b"counter")).value)
        # An increment whose outcome was unknown may have applied before its retry did
        assert final >= 2 * INCREMENTS_EACH_SIDE
        seen: list[int] = []

        async def collect() -> None:
            async for event in watch:
                seen.append(int(event.kv.value))
                if seen[-1] == final:
                    return
        await asyncio.wait_for(collect(), WATCH_WAIT_S)
        await watch.cancel()
        assert seen == list(range(1, final + 1))  # every value once, in order: no lost update
    assert cluster.wait_for_leader(exclude=[leader.node_id]).node_id != leader.node_id
