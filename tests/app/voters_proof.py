"""Dynamic voters with real processes under load (make test-voters; about a minute).

A --standalone node grows to 3 then 5 voters while chaos clients (tests/chaos/history.py)
read and write, shrinks back to 3 removing the leader among others, then a SIGKILLed voter
is replaced by a node with a new data directory that joins with --bootstrap-servers: added,
and the dead one removed; its id then comes back on an empty disk, an observer (new
directory id) until added again. A change while another is pending (a majority paused, so the
record cannot commit) is refused with 409 change-pending; the first one answers 504 or
200 and the set is whatever the log says. Afterwards every acknowledged write is checked by
the linearizability checker (tests/chaos/checker.py), with final reads from every node.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from tests.app.test_cli import _port_ranges, cluster_up  # (test_cli_cluster.py imports them too)
from tests.app.voters_cluster import (
    FAST,
    add,
    dynamic_cluster,
    joining_by_bootstrap,
    problem_type,
    remove,
    request_change,
    voter_ids,
    wait_every_node_sees,
)
from tests.chaos.checker import check_history
from tests.chaos.harness import final_reads
from tests.chaos.history import History, Workload, WorkloadConfig
from tests.cluster import Cluster

LOAD_BETWEEN_STEPS_S = 1.0  # let the clients write between two changes


def test_voters_grow_shrink_and_replace_a_dead_disk_under_load(tmp_path: Path) -> None:
    history = History()
    with dynamic_cluster(Cluster(tmp_path, voters=1, observers=6, settings=FAST)) as cluster:
        nodes = cluster.nodes
        replacement = nodes[7]
        replacement.kill()  # started by the cluster: it joins later, from a new data directory
        shutil.rmtree(replacement.data_dir)
        cluster.nodes = {node_id: node for node_id, node in nodes.items() if node_id != 7}
        cluster.wait_for_leader()

        def urls() -> dict[int, str]:
            return {node_id: node.url for node_id, node in cluster.nodes.items() if node.running() and not node.paused}
        prefix = "voters/"
        workload = Workload(urls, WorkloadConfig(keys=[f"{prefix}k{i}" for i in range(4)], process_count=4),
                            history, seed=853, prefix=prefix)
        workload.start()
        try:
            for grown in ({1, 2}, {1, 2, 3}, {1, 2, 3, 4}, {1, 2, 3, 4, 5}):
                node_id = max(grown)
                if node_id > 1:
                    assert voter_ids(add(cluster, nodes[node_id])) == grown
                time.sleep(LOAD_BETWEEN_STEPS_S)
            wait_every_node_sees(cluster, {1, 2, 3, 4, 5}, list(cluster.nodes.values()))
            assert voter_ids(remove(cluster, 1)) == {2, 3, 4, 5}  # the leader removes itself
            time.sleep(LOAD_BETWEEN_STEPS_S)
            assert voter_ids(remove(cluster, 5)) == {2, 3, 4}
            wait_every_node_sees(cluster, {2, 3, 4}, list(cluster.nodes.values()))

            # A voter's disk dies: SIGKILL it; a new node with a new data directory joins by
            # asking any node for the voters, is added, and the dead one removed.
            leader = cluster.wait_for_leader()
            dead = next(node for node_id, node in nodes.items() if node_id in (2, 3, 4) and node is not leader)
            dead_directory = (cluster.status(dead) or {})["directory_id"]
            dead.kill()
            cluster.nodes = {node_id: node for node_id, node in cluster.nodes.items() if node is not dead}
            joining_by_bootstrap(replacement, [nodes[6], leader])
            replacement.start()
            cluster.nodes[7] = replacement
            new_set = add(cluster, replacement)
            assert voter_ids(new_set) == {2, 3, 4, 7}
            assert {v["directory_id"] for v in new_set["voters"] if v["node_id"] == 7} != {dead_directory}
            assert voter_ids(remove(cluster, dead.node_id)) == {2, 3, 4, 7} - {dead.node_id}
            survivors = voter_ids(new_set) - {dead.node_id}
            wait_every_node_sees(cluster, survivors, list(cluster.nodes.values()))
            time.sleep(LOAD_BETWEEN_STEPS_S)

            # The dead node's id comes back on an empty disk: a new directory id, so an
            # observer (never a voter by its old entry) until added again.
            shutil.rmtree(dead.data_dir)
            joining_by_bootstrap(dead, [replacement])
            dead.start()
            cluster.nodes[dead.node_id] = dead
            cluster.wait_until(lambda: (cluster.status(dead) or {}).get("leader_id", -1) >= 0, what="it follows")
            reborn = cluster.status(dead) or {}
            assert reborn["voter"] is False and reborn["directory_id"] != dead_directory
            survivors = voter_ids(add(cluster, dead))
            assert survivors == {2, 3, 4, 7}
            wait_every_node_sees(cluster, survivors, list(cluster.nodes.values()))

            _second_change_while_one_is_pending(cluster, survivors)
            time.sleep(LOAD_BETWEEN_STEPS_S)
        finally:
            workload.stop()
        final_reads(SimpleNamespace(cluster=cluster), history, workload.config.keys, prefix)  # type: ignore[arg-type]
        history.write(tmp_path / "history.jsonl")
    report = check_history(history.records())
    assert report.ok, report.summary() + "\n" + "\n".join(report.anomalies[:20])
    assert not workload.errors, workload.errors[:5]
    acknowledged = sum(1 for r in history.records() if r["op"] in ("put", "cas", "create", "txn") and r["outcome"] == "ok")
    assert acknowledged > 50, f"only {acknowledged} acknowledged writes: the load did not run"
    print(f"{acknowledged} acknowledged writes, {report.summary()}")


def _second_change_while_one_is_pending(cluster: Cluster, voters: set[int]) -> None:
    """Pause every voter but the leader so an add cannot commit; while it is pending a second
    change is refused (409 change-pending); then resume: the first answers 200 or 504
    (indeterminate), and every node agrees on one set."""
    leader = cluster.wait_for_leader()
    paused = [cluster.nodes[node_id] for node_id in voters if node_id != leader.node_id]
    answers: list[httpx.Response | Exception] = []
    target = cluster.nodes[6]  # an observer that is caught up

    def first_change() -> None:
        try:
            answers.append(request_change(cluster, "POST", "/v1/admin/voters",
                                          {"id": 6, "raft_endpoint": f"127.0.0.1:{target.raft_port}"}, via=leader))
        except httpx.HTTPError as exc:
            answers.append(exc)
    for node in paused:
        node.pause()
    thread = threading.Thread(target=first_change)
    try:
        thread.start()

        def pending() -> bool:
            status = cluster.status(leader) or {}
            return bool((status.get("voter_set") or {}).get("pending_change"))
        cluster.wait_until(pending, timeout_s=5.0, what="the add is pending")
        second = request_change(cluster, "DELETE", f"/v1/admin/voters/{leader.node_id}", via=leader)
        assert (second.status_code, problem_type(second)) == (409, "change-pending"), second.text
    finally:
        for node in paused:
            node.resume()
        thread.join(30.0)
    first: Any = answers[0] if answers else None
    assert isinstance(first, httpx.Response) and (first.status_code, problem_type(first)) in (
        (200, ""), (504, "voter-change-indeterminate")), first
    print(f"the add pending while a majority was paused answered {first.status_code}")
    cluster.wait_for_leader()

    def one_set() -> bool:
        sets = [frozenset(voter_ids(s["voter_set"])) for s in (cluster.status(n) for n in cluster.nodes.values()) if s]
        pending_any = any(s["voter_set"]["pending_change"] for s in (cluster.status(n) for n in cluster.nodes.values()) if s)
        return len(set(sets)) == 1 and not pending_any and sets[0] in (frozenset(voters), frozenset(voters | {6}))
    cluster.wait_until(one_set, timeout_s=30.0, what="every node agrees on one voter set")


def test_cluster_up_dynamic_adds_its_voters_one_at_a_time(tmp_path: Path) -> None:
    """`cluster up --dynamic --voters 3 --observers 1`: node 1 standalone, nodes 2 and 3 added
    before the leader line; every node shows the set {1, 2, 3} and node 4 observes."""
    http_base, raft_base = _port_ranges(4)
    with cluster_up(["--dynamic", "--voters", "3", "--observers", "1", "--base-http-port", str(http_base),
                     "--base-raft-port", str(raft_base), "--data-dir", str(tmp_path / "data")],
                    {**os.environ, "METAKV_CLUSTER_ID": f"dynamic-{uuid.uuid4().hex[:12]}"}) as (_process, text, _run):
        assert "voters: added node 2" in text and "voters: added node 3" in text, text
        with httpx.Client(timeout=5.0) as http:
            statuses = [http.get(f"http://127.0.0.1:{http_base + index}/v1/status").json() for index in range(4)]
        for status in statuses:
            assert voter_ids(status["voter_set"]) == {1, 2, 3} and status["voter_set"]["kraft_version"] == 1
        assert [status["voter"] for status in statuses] == [True, True, True, False]
