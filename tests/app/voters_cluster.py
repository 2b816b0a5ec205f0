"""A cluster of real ``metakv serve`` processes whose voters change (KIP-853): node 1 starts
``--standalone``, the others as its observers; helpers to change and read the voter set over
the HTTP API. Used by tests/app/test_voters_processes.py (make test) and
tests/app/voters_proof.py (make test-voters)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.cluster import Cluster, Node

FAST = {"election_timeout_ms": 500, "fetch_timeout_ms": 1000, "fetch_max_wait_ms": 200, "commit_timeout_ms": 3000,
        "cleaner_interval_ms": 0}
CHANGE_TIMEOUT_S = 30.0
RETRY_S = 0.1
RETRIED = ("not-caught-up", "leader-not-ready", "change-pending", "no-leader")  # a moment later they pass


def dynamic_cluster(cluster: Cluster) -> Cluster:
    """Turn a Cluster(voters=1, observers=N) not yet started into a formatted one: node 1
    ``--standalone`` instead of ``--voters``."""
    command = cluster.nodes[1].command
    at = command.index("--voters")
    command[at:at + 2] = ["--standalone"]
    return cluster


def joining_by_bootstrap(node: Node, servers: list[Node]) -> None:
    """A node not yet started joins with ``--bootstrap-servers`` instead of ``--voters``."""
    command = node.command
    at = command.index("--voters")
    command[at:at + 2] = ["--bootstrap-servers", ",".join(server.url for server in servers)]
    command.remove("--observer")


def problem_type(response: httpx.Response) -> str:
    try:
        return str(response.json().get("type", "")).rsplit(":", 1)[-1]
    except ValueError:
        return ""


def request_change(cluster: Cluster, method: str, path: str, body: dict[str, Any] | None = None,
                   via: Node | None = None) -> httpx.Response:
    """One voter change through ``via`` (default: the leader), following a 307 to the leader."""
    node = via or cluster.wait_for_leader()
    with httpx.Client(timeout=15.0, follow_redirects=True) as http:
        return http.request(method, f"{node.url}{path}", json=body)


def change(cluster: Cluster, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """A voter change that must happen: retried while the leader says not yet (not caught
    up, not ready, one pending, no leader); the new set."""
    deadline = time.monotonic() + CHANGE_TIMEOUT_S
    while True:
        try:
            response = request_change(cluster, method, path, body)
        except (httpx.HTTPError, AssertionError) as exc:  # a leader stepping down or none yet
            last = repr(exc)
        else:
            if response.status_code == 200:
                return dict(response.json())
            last = f"{response.status_code} {response.text[:300]}"
            if problem_type(response) not in RETRIED:
                raise AssertionError(f"{method} {path} {body}: {last}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{method} {path} {body} did not succeed within {CHANGE_TIMEOUT_S} s: {last}")
        time.sleep(RETRY_S)


def add(cluster: Cluster, node: Node) -> dict[str, Any]:
    return change(cluster, "POST", "/v1/admin/voters", {"id": node.node_id, "raft_endpoint": f"127.0.0.1:{node.raft_port}"})


def remove(cluster: Cluster, node_id: int) -> dict[str, Any]:
    return change(cluster, "DELETE", f"/v1/admin/voters/{node_id}")


def voter_ids(voter_set: dict[str, Any]) -> set[int]:
    return {voter["node_id"] for voter in voter_set["voters"]}


def wait_every_node_sees(cluster: Cluster, ids: set[int], nodes: list[Node]) -> None:
    """Each node's /v1/status shows the set ``ids`` in force with no pending change."""
    def agreed() -> bool:
        for node in nodes:
            status = cluster.status(node)
            if status is None or voter_ids(status["voter_set"]) != ids or status["voter_set"]["pending_change"]:
                return False
        return True
    cluster.wait_until(agreed, timeout_s=CHANGE_TIMEOUT_S, what=f"every node sees voters {sorted(ids)}")
