"""Leases on three real voters (tests/cluster.py): a lease kept alive survives a leader
SIGKILL, a lease nobody keeps alive expires and its keys go with the reason, a revoke
deletes every attached key in one version, and a follower redirects lease calls."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.cluster import Cluster, Node

ELECTION_TIMEOUT_MS = 500
TTL_S = 2  # the minimum at this election timeout (3 election timeouts, rounded up)
KEEPALIVE_EVERY_S = 0.4
HOLD_AFTER_FAILOVER_S = 3 * TTL_S  # long enough that a lease nobody kept alive would be gone


def _call(cluster: Cluster, method: str, path: str, **kwargs: object) -> httpx.Response:
    """The request through the leader (following its redirects), trying every live node."""
    last: Exception | None = None
    for _attempt in range(50):
        for node in cluster.nodes.values():
            if not node.running():
                continue
            try:
                response = cluster.client().request(method, f"{node.url}{path}", follow_redirects=True,
                                                    timeout=3.0, **kwargs)  # type: ignore[arg-type]
            except httpx.HTTPError as exc:
                last = exc
                continue
            if response.status_code < 500:
                return response
            last = AssertionError(response.text)
        time.sleep(0.1)
    raise AssertionError(f"{method} {path}: no node answered: {last!r}")


def _grant(cluster: Cluster, lease_id: int, keys: list[str]) -> int:
    granted = _call(cluster, "POST", "/v1/leases", json={"ttl_s": TTL_S, "id": lease_id})
    assert granted.status_code == 201, granted.text
    assert granted.json()["ttl_s"] == TTL_S
    for key in keys:
        answer = _call(cluster, "PUT", f"/v1/kv/{key}?lease={lease_id}", content=b"held")
        assert answer.status_code == 200, answer.text
    return int(granted.json()["version"])


def _events(cluster: Cluster, prefix: str, since: int) -> list[dict[str, object]]:
    answer = _call(cluster, "GET", "/v1/watch", params={"prefix": prefix, "since": since, "wait_ms": 0,
                                                       "consistency": "linearizable"})
    assert answer.status_code == 200, answer.text
    return answer.json()["events"]


@contextmanager
def _keeping_alive(cluster: Cluster, lease_id: int) -> Iterator[list[str]]:
    """A thread keeping ``lease_id`` alive in batches through whichever node answers; yields
    the answers that said the lease was not found (there must be none)."""
    stop = threading.Event()
    lost: list[str] = []

    def run() -> None:
        with httpx.Client(timeout=1.0) as client:
            while not stop.wait(KEEPALIVE_EVERY_S):
                for node in list(cluster.nodes.values()):
                    if not node.running():
                        continue
                    try:
                        answer = client.post(f"{node.url}/v1/leases/keepalive", json={"ids": [lease_id]},
                                             follow_redirects=True)
                    except httpx.HTTPError:
                        continue
                    if answer.status_code == 200:
                        if answer.json()["not_found"]:
                            lost.append(answer.text)
                        break

    thread = threading.Thread(target=run, name=f"keepalive-{lease_id}", daemon=True)
    thread.start()
    try:
        yield lost
    finally:
        stop.set()
        thread.join(timeout=5)


def test_leases_across_failover_expiry_and_revoke(cluster_factory):
    cluster = cluster_factory(voters=3, settings={"election_timeout_ms": ELECTION_TIMEOUT_MS})
    leader = cluster.wait_for_leader()

    # A follower redirects lease calls to the leader, as writes.
    follower: Node = next(node for node in cluster.voters if node is not leader)
    redirected = cluster.client().post(f"{follower.url}/v1/leases", json={"ttl_s": TTL_S})
    assert redirected.status_code == 307 and redirected.headers["location"].startswith(leader.url)

    # Kept alive through a leader SIGKILL: never revoked, its keys stay.
    kept_since = _grant(cluster, 1, ["kept/a", "kept/b"])
    with _keeping_alive(cluster, 1) as lost:
        time.sleep(KEEPALIVE_EVERY_S * 2)
        cluster.kill(leader)
        new_leader = cluster.wait_for_leader(exclude=[leader.node_id])
        assert new_leader is not leader
        time.sleep(HOLD_AFTER_FAILOVER_S)
        assert lost == []
        info = _call(cluster, "GET", "/v1/leases/1", params={"keys": "true"})
        assert info.status_code == 200, info.text
        assert info.json()["keys"] == ["kept/a", "kept/b"]
        assert _events(cluster, "kept/", kept_since) == [
            {"type": "put", "key": key, "mod_version": version, "value": "aGVsZA==", "encoding": "base64",
             "content_type": "application/octet-stream"}
            for key, version in (("kept/a", kept_since + 1), ("kept/b", kept_since + 2))]

    # Its holder gone: it expires, its keys deleted in one version with the reason.
    sent_s = time.monotonic()
    expiring_since = _grant(cluster, 2, ["gone/a", "gone/b"])
    deletes: list[dict[str, object]] = []

    def expired() -> bool:
        deletes[:] = [event for event in _events(cluster, "gone/", expiring_since) if event["type"] == "delete"]
        return len(deletes) == 2

    cluster.wait_until(expired, 30, "the lease's keys deleted")
    expired_after_s = time.monotonic() - sent_s
    assert expired_after_s >= TTL_S  # never before its TTL (measured from before the grant was sent)
    print(f"lease expired {expired_after_s:.2f} s after its grant was sent (TTL {TTL_S} s)")
    assert {event["reason"] for event in deletes} == {"lease-expired"}
    assert len({event["mod_version"] for event in deletes}) == 1
    assert _call(cluster, "POST", "/v1/leases/2/keepalive").status_code == 404

    # A revoke: every attached key in one version, the lease kept alive until then.
    revoked_since = _grant(cluster, 3, ["rev/a", "rev/b", "rev/c"])
    revoked = _call(cluster, "DELETE", "/v1/leases/3")
    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["deleted_keys"] == 3
    events = _events(cluster, "rev/", revoked_since + 3)
    assert [(event["key"], event["mod_version"], event["reason"]) for event in events] == [
        (key, revoked.json()["version"], "lease-revoked") for key in ("rev/a", "rev/b", "rev/c")]
    listed = {lease["id"] for lease in _call(cluster, "GET", "/v1/leases").json()["leases"]}
    assert not listed & {2, 3}  # (1 expires too, now that nobody keeps it alive)
