"""Two holders of one lock never overlap, checked with fencing, through a leader SIGKILL and
a SIGSTOP of the holder that has the lock (tests/leases_client/fencing.py; the long run is
``make chaos-locks``)."""

from __future__ import annotations

from collections.abc import Callable

from tests.cluster import Cluster
from tests.leases_client.fencing import FAST, check, run_fencing


def test_lock_holders_never_interleave_and_a_paused_holder_is_fenced_off(
        cluster_factory: Callable[..., Cluster]) -> None:
    run = run_fencing(cluster_factory(voters=3, settings=FAST), holders_count=3, rounds=1, faults=1, writes=2)
    check(run)
    assert len([e for e in run.events if e["event"] == "acquired"]) >= 3 and len(run.stopped) == 1
