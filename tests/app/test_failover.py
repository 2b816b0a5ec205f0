"""Leader failures with real processes: SIGKILL, SIGSTOP/SIGCONT, graceful stop, and a crash
of every node. The invariant throughout: no acknowledged write is ever lost."""

from __future__ import annotations

import json
from collections.abc import Callable

from tests.cluster import Cluster, SteadyWriter


def test_sigkill_leader_under_writes_loses_nothing_and_old_leader_catches_up(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(voters=3)
    old_leader = cluster.wait_for_leader()
    with SteadyWriter(cluster, "kill") as writer:
        writer.wait_for_acks(20)
        cluster.kill(old_leader)
        acked_before = writer.ack_count()
        new_leader = cluster.wait_for_leader(exclude=[old_leader.node_id])
        assert new_leader.node_id != old_leader.node_id
        writer.wait_for_acks(acked_before + 20)  # writes resume under the new leader
    assert writer.missing_on(new_leader, consistency="leader") == []
    cluster.restart(old_leader)
    cluster.wait_ready(old_leader)
    assert writer.missing_on(old_leader) == []  # caught up: min_version waits for it
    status = cluster.status(old_leader)
    assert status is not None and status["role"] == "follower"
    assert status["leader_id"] == new_leader.node_id


def test_paused_leader_does_not_keep_acting_as_leader_after_resuming(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(voters=3)
    old_leader = cluster.wait_for_leader()
    old_epoch = cluster.status(old_leader)["epoch"]
    with SteadyWriter(cluster, "pause") as writer:
        writer.wait_for_acks(10)
        old_leader.pause()
        try:
            new_leader = cluster.wait_for_leader(exclude=[old_leader.node_id])
            writer.wait_for_acks(writer.ack_count() + 10)
        finally:
            old_leader.resume()

        def deposed() -> bool:
            status = cluster.status(old_leader)
            return status is not None and status["role"] != "leader" and status["epoch"] > old_epoch

        cluster.wait_until(deposed, what="resumed old leader steps down")
        writer.wait_for_acks(writer.ack_count() + 10)
    # A write sent to the resumed node is redirected to the real leader and succeeds.
    response = cluster.client().put(f"{old_leader.url}/v1/kv/pause/after", content=b"x")
    assert response.status_code == 307
    assert response.headers["location"].startswith(cluster.wait_for_leader().url)
    assert writer.missing_on(new_leader, consistency="leader") == []
    assert writer.missing_on(old_leader) == []


def test_graceful_stop_of_leader_hands_over_without_an_election_timeout(
        cluster_factory: Callable[..., Cluster]) -> None:
    # Followers notice a silent leader only after fetch_timeout_ms (60 s here), longer than
    # the wait below: only the resignation (EndQuorumEpoch) can produce a new leader in time.
    # election_timeout_ms stays short so the first election (from Unattached) is quick.
    cluster = cluster_factory(voters=3, settings={"fetch_timeout_ms": 60_000, "election_backoff_max_ms": 200})
    old_leader = cluster.wait_for_leader()
    version = cluster.put("graceful/before", b"1").json()["version"]
    exit_code = old_leader.stop(timeout_s=20)
    assert exit_code == 0
    new_leader = cluster.wait_for_leader(timeout_s=20, exclude=[old_leader.node_id])
    assert new_leader.node_id != old_leader.node_id
    response = cluster.put("graceful/after", b"2", node=new_leader)
    assert response.status_code == 200
    assert response.json()["version"] > version
    assert "resign" in old_leader.log_tail().lower()


def test_acknowledged_writes_survive_sigkill_of_every_node(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(voters=3)
    cluster.wait_for_leader()
    with SteadyWriter(cluster, "durable") as writer:
        writer.wait_for_acks(50)
    for node in cluster.nodes.values():
        cluster.kill(node)
    for node in cluster.nodes.values():
        node.start()
    leader = cluster.wait_for_leader()
    assert writer.missing_on(leader, consistency="leader") == []


def test_sigterm_on_a_lone_leader_never_starts_another_election(
        cluster_factory: Callable[..., Cluster]) -> None:
    # A lone voter has nobody to hand over to. Before the fix, the resigned node's election
    # timer (100-200 ms here) fired during the shutdown grace period, it pre-voted itself,
    # became candidate (epoch + 1, persisted) and leader again on its way out.
    cluster = cluster_factory(voters=1, settings={"election_timeout_ms": 100, "shutdown_grace_ms": 3000})
    leader = cluster.wait_for_leader()
    epoch = cluster.status(leader)["epoch"]
    assert cluster.put("lone/key", b"1").status_code == 200
    assert leader.stop(timeout_s=20) == 0
    quorum_state = json.loads((leader.data_dir / "quorum-state").read_text())
    assert quorum_state["epoch"] == epoch, leader.log_tail()
    assert "role CANDIDATE" not in leader.log_tail().split("resigning", 1)[-1]
