"""Test helpers around the local cluster launcher (``loadtest/local_cluster.py``).

``Cluster`` and ``Node`` (real ``metakv serve`` processes on loopback) live in the packaged
``loadtest.local_cluster`` so the benchmarks can use them too; they are re-exported here for
the tests. This module adds ``SteadyWriter`` and the ``cluster_factory`` fixture:

    from tests.cluster import cluster_factory  # noqa: F401   (in a conftest.py)

    def test_x(cluster_factory):
        cluster = cluster_factory(voters=3)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.local_cluster import (
    DEFAULT_WAIT_S,
    POLL_INTERVAL_S,
    STOP_TIMEOUT_S,
    Cluster,
    Node,
    free_ports,
)

__all__ = ["REPO_ROOT", "Cluster", "Node", "SteadyWriter", "cluster_factory", "free_ports"]

REPO_ROOT = Path(__file__).resolve().parent.parent


class SteadyWriter:
    """A background thread writing ``<prefix>/<n>`` = ``n`` one after another through any
    running node (following redirects, moving on to the next node on errors) and recording
    every acknowledged write. Used to check that no acknowledged write is ever lost.

        with SteadyWriter(cluster, "load") as writer:
            writer.wait_for_acks(20)
            ...
        writer.acked  # {key: (value, version)}
    """

    def __init__(self, cluster: Cluster, prefix: str, request_timeout_s: float = 5.0) -> None:
        self.cluster = cluster
        self.prefix = prefix
        self.request_timeout_s = request_timeout_s
        self.acked: dict[str, tuple[bytes, int]] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"writer-{prefix}", daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> SteadyWriter:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=STOP_TIMEOUT_S + self.request_timeout_s)

    def ack_count(self) -> int:
        with self._lock:
            return len(self.acked)

    def wait_for_acks(self, count: int, timeout_s: float = DEFAULT_WAIT_S) -> None:
        """Block until ``count`` writes in total were acknowledged."""
        self.cluster.wait_until(lambda: self.ack_count() >= count, timeout_s,
                                f"{count} acknowledged writes (have {self.ack_count()}, errors {self.errors[-3:]})")

    def _run(self) -> None:
        sequence = 0
        turn = 0
        with httpx.Client(timeout=self.request_timeout_s) as client:
            while not self._stop.is_set():
                nodes = [node for node in self.cluster.nodes.values() if node.running() and not node.paused]
                if not nodes:
                    time.sleep(POLL_INTERVAL_S)
                    continue
                node = nodes[turn % len(nodes)]
                key = f"{self.prefix}/{sequence:06d}"
                value = str(sequence).encode()
                try:
                    response = client.put(f"{node.url}/v1/kv/{key}", content=value, follow_redirects=True)
                except httpx.HTTPError as exc:
                    self.errors.append(f"node {node.node_id}: {type(exc).__name__}")
                    turn += 1
                    time.sleep(POLL_INTERVAL_S)
                    continue
                if response.status_code == 200:
                    with self._lock:
                        self.acked[key] = (value, int(response.json()["version"]))
                else:
                    self.errors.append(f"node {node.node_id}: {response.status_code}")
                    turn += 1
                    time.sleep(POLL_INTERVAL_S)
                sequence += 1  # a new key every time: an unacknowledged one is never retried

    def max_version(self) -> int:
        with self._lock:
            return max((version for _, version in self.acked.values()), default=0)

    def missing_on(self, node: Node, consistency: str = "local") -> list[str]:
        """Acknowledged keys whose value ``node`` does not serve (after reaching max_version)."""
        target = self.max_version()
        client = self.cluster.client()
        missing = []
        with self._lock:
            acked = dict(self.acked)
        for key, (value, _version) in sorted(acked.items()):
            response = client.get(f"{node.url}/v1/kv/{key}",
                                  params={"consistency": consistency, "min_version": target, "wait_ms": 20000},
                                  timeout=30.0)
            if response.status_code != 200 or response.content != value:
                missing.append(f"{key}: {response.status_code} {response.content[:40]!r}")
        return missing


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """``cluster_factory(voters=3, observers=0, **kwargs)`` starts a Cluster under tmp_path;
    every cluster made is closed (its processes killed) at teardown. On a failed test the
    nodes' log tails are printed (pytest shows them with the failure)."""
    clusters: list[Cluster] = []

    def make(voters: int = 3, observers: int = 0, **kwargs: Any) -> Cluster:
        cluster = Cluster(tmp_path / f"cluster{len(clusters)}", voters, observers, **kwargs)
        clusters.append(cluster)
        return cluster.start()

    try:
        yield make
    finally:
        for cluster in clusters:
            print(cluster.logs())
            cluster.close()
