"""Dynamic voters with real processes, the short version (make test-voters runs
tests/app/voters_proof.py: growth to 5 under load, shrink, disk replacement, checked
histories). A --standalone node refuses what it must, adds an observer through `metakv
voters add` on a follower, and hands over by removing itself; every node shows the set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli import main
from tests.app.voters_cluster import (
    FAST,
    dynamic_cluster,
    problem_type,
    request_change,
    wait_every_node_sees,
)
from tests.cluster import Cluster


def test_a_standalone_node_refuses_bad_changes_adds_an_observer_and_hands_over(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with dynamic_cluster(Cluster(tmp_path, voters=1, observers=1, settings=FAST)) as cluster:
        first, second = cluster.nodes[1], cluster.nodes[2]
        assert cluster.wait_for_leader() is first
        status = cluster.status(first)
        assert status is not None and status["voter_set"]["kraft_version"] == 1
        assert status["voter_set"]["voters"] == [{"node_id": 1, "directory_id": status["directory_id"],
                                                  "raft_endpoint": f"127.0.0.1:{first.raft_port}", "http_url": first.url}]

        refusals = [  # each a problem document, and the set stays {1}
            (request_change(cluster, "DELETE", "/v1/admin/voters/1"), 409, "last-voter"),
            (request_change(cluster, "DELETE", "/v1/admin/voters/7"), 404, "unknown-voter"),
            (request_change(cluster, "POST", "/v1/admin/voters", {"id": 9, "directory_id": "0" * 32,
                                                                  "raft_endpoint": "127.0.0.1:1"}), 409, "not-caught-up"),
            (request_change(cluster, "POST", "/v1/admin/voters", {"id": "2"}), 422, "invalid-body"),
        ]
        for response, status_code, kind in refusals:
            assert (response.status_code, problem_type(response)) == (status_code, kind), response.text
            assert response.headers["content-type"] == "application/problem+json"

        def second_caught_up() -> bool:
            quorum = cluster.client().get(f"{first.url}/v1/quorum").json()
            return any(o["node_id"] == 2 and o["caught_up"] for o in quorum["observers"])
        cluster.wait_until(second_caught_up, what="node 2 caught up")
        capsys.readouterr()
        assert main(["voters", "add", "2", "--endpoints", second.url]) == 0  # a follower: 307 to the leader
        added = json.loads(capsys.readouterr().out)
        second_status = cluster.status(second)
        assert second_status is not None
        assert {"node_id": 2, "directory_id": second_status["directory_id"], "raft_endpoint":
                f"127.0.0.1:{second.raft_port}", "http_url": second.url} in added["voters"]
        wait_every_node_sees(cluster, {1, 2}, [first, second])
        assert main(["voters", "add", "2", "--endpoints", second.url]) == 1  # already a voter
        assert "Voter change refused: nothing changed: replica 2 is a voter already" in capsys.readouterr().err

        response = request_change(cluster, "DELETE", "/v1/admin/voters/1", via=second)  # the leader removes itself
        assert response.status_code == 200, response.text
        assert cluster.wait_for_leader(exclude=[1]) is second
        wait_every_node_sees(cluster, {2}, [first, second])
        assert cluster.put("after/handover", b"v", node=second).status_code == 200
        cluster.wait_until(lambda: (cluster.status(first) or {}).get("leader_id") == 2, what="node 1 follows node 2")
        assert (cluster.status(first) or {}).get("voter") is False  # an observer now
