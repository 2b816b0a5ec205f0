"""`metakv lock` when its lease is lost or it is sent SIGTERM, and `metakv elect`, as a user
runs them against a real 3-voter cluster. Not in make test (its time budget): ``make
chaos-locks`` runs it."""

from __future__ import annotations

import signal
from collections.abc import Callable

from metakv import Client
from tests.cluster import Cluster
from tests.leases_client.fencing import FAST
from tests.leases_client.test_cli import cli, finished, read_json_line


def test_lock_stops_the_command_when_its_lease_is_lost_and_releases_on_sigterm(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(voters=3, settings=FAST)
    cluster.wait_for_leader()
    with Client([node.url for node in cluster.voters]) as kv:
        lost = cli(cluster, "lock", "lost", "--ttl", "3", "--", "sh", "-c", "echo running; exec sleep 60")
        assert lost.stdout is not None and lost.stdout.readline() == "running\n"
        held = kv.list("locks/lost/").items
        assert len(held) == 1 and held[0].lease > 0
        kv.revoke(held[0].lease)  # from outside: the holder must notice and stop its command
        code, _, err = finished(lost)
        assert code == 1 and "lock lost" in err

        stopped = cli(cluster, "lock", "term", "--", "sh", "-c", "echo running; exec sleep 60")
        assert stopped.stdout is not None and stopped.stdout.readline() == "running\n"
        stopped.send_signal(signal.SIGTERM)
        code, _, _ = finished(stopped)
        assert code == 128 + signal.SIGTERM
        assert kv.list("locks/term/").items == []


def test_elect_prints_the_leader_and_a_listener_sees_each_one(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(voters=3, settings=FAST)
    cluster.wait_for_leader()
    first = cli(cluster, "elect", "svc", "one", "--ttl", "3")
    assert read_json_line(first.stdout)["value"] == "one"
    second = cli(cluster, "elect", "svc", "two", "--ttl", "3")
    listener = cli(cluster, "elect", "svc", "--listen")
    try:
        assert read_json_line(listener.stdout)["value"] == "one"
        first.send_signal(signal.SIGINT)  # resigns
        assert finished(first)[0] == 0
        assert read_json_line(second.stdout)["value"] == "two"
        assert read_json_line(listener.stdout)["value"] == "two"
    finally:
        for process in (first, second, listener):
            if process.poll() is None:
                process.kill()
                process.communicate()
