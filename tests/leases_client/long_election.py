"""Elections across a leader failover: candidates (threads, each with its own client and
lease) campaign, lead for a while, resign and campaign again, while an observer follows the
leader and the cluster's leader is SIGKILLed. Exactly one leader at a time: each leader's
fenced writes (its election version) never interleave with another's, and the observer sees
leaders one after another in campaign order, each once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from metakv import Client, KeyValue, MetakvError
from metakv.concurrency import Election
from tests.cluster import Cluster
from tests.leases_client.fencing import FAST, PATIENT, guard_history
from tests.leases_client.holder import GUARD_KEY, fenced_write

CANDIDATES = 3
TERMS = 2  # each candidate leads this many times
WAIT_S = 90.0
LEASE_TTL_S = 5  # outlasts a failover: a candidate's lease is not lost to it
STOP_KEY = "elections/svc/~stop"


def test_exactly_one_leader_at_a_time_across_a_leader_failover(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(voters=3, settings=FAST)
    cluster.wait_for_leader()
    urls = [node.url for node in cluster.voters]
    observed: list[KeyValue] = []
    written: list[str] = []
    failures: list[BaseException] = []
    done = threading.Event()

    def candidate(number: int) -> None:
        with Client(urls, retry=PATIENT) as kv:
            for term in range(TERMS):
                with kv.lease(LEASE_TTL_S) as lease:
                    election = Election(kv, "svc", lease)
                    election.campaign(f"c{number} t{term}")
                    for step in range(2):
                        text = f"c{number} t{term} s{step}"
                        if fenced_write(kv, election.version, text):
                            written.append(text)
                        time.sleep(0.2)
                    election.resign()

    def observer() -> None:
        with Client(urls, retry=PATIENT) as kv:
            for leader in Election(kv, "svc").observe():
                observed.append(leader)
                if done.is_set():
                    return

    def guarded(body: Callable[[int], None], number: int) -> Callable[[], None]:
        def run() -> None:
            try:
                body(number)
            except (MetakvError, AssertionError) as exc:
                failures.append(exc)
        return run

    with Client(urls, retry=PATIENT) as kv:
        start = kv.put(GUARD_KEY, "0 start").version
        watching = threading.Thread(target=observer, daemon=True)
        watching.start()
        threads = [threading.Thread(target=guarded(candidate, n), daemon=True) for n in range(CANDIDATES)]
        for thread in threads:
            thread.start()
        cluster.wait_until(lambda: len(written) >= 2, WAIT_S, "a leader's first writes")
        cluster.kill(cluster.wait_for_leader())
        for thread in threads:
            thread.join(WAIT_S)
            assert not thread.is_alive(), "a candidate is stuck"
        assert failures == []
        done.set()
        kv.put(STOP_KEY, "stop")  # a last "leader" the observer sees, then stops
        watching.join(WAIT_S)
        assert not watching.is_alive() and observed[-1].key == STOP_KEY
        history = guard_history(kv, start - 1)

    tokens = [int(value.split()[0]) for value in history]
    assert tokens == sorted(tokens), f"two leaders interleaved: {history}"
    assert set(written) <= {value.split(" ", 1)[1] for value in history[1:]}
    assert len({value.split()[0] for value in history[1:]}) == CANDIDATES * TERMS  # every term led, once
    places = [leader.create_version for leader in observed[:-1]]
    assert places == sorted(places) and len(set(places)) == len(places), observed  # one after another
    assert len(places) >= 2  # it followed the changes (two quick ones in a row may show as one)
