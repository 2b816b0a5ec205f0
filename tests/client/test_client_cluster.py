"""The client against real clusters under faults: a leader SIGKILLed mid-stream of writes, a
watch across a leader change and a compaction, read-your-writes on a lagging observer."""

from __future__ import annotations

import threading
from collections.abc import Callable

from metakv import Client, Compacted, Event, Indeterminate, RetryPolicy
from tests.cluster import Cluster

FAST = {"election_timeout_ms": 500, "fetch_timeout_ms": 1000, "fetch_max_wait_ms": 200}
PATIENT = RetryPolicy(deadline_s=30.0)  # outlasts an election on a loaded machine
WAIT_S = 60.0


def _urls(cluster: Cluster) -> list[str]:
    return [node.url for node in cluster.voters]


def _add_one(value: bytes | None) -> str:
    return str(int(value or b"0") + 1)


def test_a_leader_sigkill_mid_stream_loses_no_acknowledged_write_and_duplicates_none(
        cluster_factory: Callable[..., Cluster]) -> None:
    """Unconditional puts of fresh keys: each is acknowledged once (its key then holds that
    version, written once: mod_version == create_version) or raised as Indeterminate; never
    re-sent into a second apply. A cas_loop counter: conditional, so re-sent after an unknown
    outcome; its final count lies between the increments acknowledged and those plus the
    unknown ones."""
    cluster = cluster_factory(voters=3, settings=FAST)
    leader = cluster.wait_for_leader()
    acked: dict[str, int] = {}
    unknown: set[str] = set()
    counter = {"acked": 0, "unknown": 0}
    stop = threading.Event()
    failures: list[BaseException] = []

    def writer(worker: int) -> None:
        with Client(_urls(cluster), retry=PATIENT) as kv:
            sequence = 0
            while not stop.is_set():
                key = f"load/{worker}/{sequence:05d}"
                try:
                    acked[key] = kv.put(key, f"{worker}-{sequence}").version
                except Indeterminate:
                    unknown.add(key)
                sequence += 1

    def incrementer() -> None:
        with Client(_urls(cluster), retry=PATIENT) as kv:
            while not stop.is_set():
                try:
                    kv.cas_loop("counter", _add_one)
                    counter["acked"] += 1
                except Indeterminate:
                    counter["unknown"] += 1

    def guarded(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # surfaced by the test, not lost in the thread
                failures.append(exc)
        return run

    threads = [threading.Thread(target=guarded(lambda w=w: writer(w))) for w in range(3)]
    threads.append(threading.Thread(target=guarded(incrementer)))
    for thread in threads:
        thread.start()
    try:
        cluster.wait_until(lambda: len(acked) >= 60 and counter["acked"] >= 5, WAIT_S, "writes before the kill")
        cluster.kill(leader)
        before = len(acked)
        cluster.wait_until(lambda: len(acked) >= before + 60 or bool(failures), WAIT_S, "writes after the kill")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=WAIT_S)
    assert not failures, failures
    with Client(_urls(cluster), retry=PATIENT) as kv:
        items = {item.key: item for item in kv.list("load/", consistency="leader").items}
        final = kv.get("counter", consistency="linearizable")
    written_twice = [key for key, item in items.items() if item.mod_version != item.create_version]
    assert not written_twice
    lost = [key for key, version in acked.items() if key not in items or items[key].mod_version != version]
    assert not lost
    assert set(items) <= set(acked) | unknown
    assert final is not None
    assert counter["acked"] <= int(final.value) <= counter["acked"] + counter["unknown"]


def _collect(kv: Client, prefix: str, since: int, last_key: str, into: list[Event],
             failures: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            for event in kv.watch(prefix, since=since, poll_timeout_ms=1000):
                into.append(event)
                if event.key == last_key:
                    return
        except BaseException as exc:
            failures.append(exc)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_watch_across_a_leader_change_and_a_compaction(cluster_factory: Callable[..., Cluster]) -> None:
    """Across a SIGKILLed leader (the watch's own node may be it) every acknowledged write
    arrives exactly once, in version order; a watch that fell below a compaction's horizon
    raises Compacted(oldest_version), and re-listing then watching from the list's version
    continues with nothing missed."""
    settings = {**FAST, "min_compaction_lag_ms": 0, "cleaner_min_dirty_ratio": 0, "cleaner_interval_ms": 0}
    cluster = cluster_factory(voters=3, settings=settings)
    leader = cluster.wait_for_leader()
    urls = [leader.url, *(node.url for node in cluster.voters if node is not leader)]  # the watch reads the leader
    events: list[Event] = []
    failures: list[BaseException] = []
    acked: dict[int, str] = {}
    with Client(urls, retry=PATIENT) as kv, Client(urls, retry=PATIENT) as watcher:
        start = kv.put("other", "x").version
        thread = _collect(watcher, "w/", start, "w/end", events, failures)
        for index in range(60):
            if index == 20:
                cluster.kill(leader)
            try:
                acked[kv.put(f"w/{index:03d}", str(index)).version] = f"w/{index:03d}"
            except Indeterminate:
                pass
        acked[kv.put("w/end", "end").version] = "w/end"
        thread.join(timeout=WAIT_S)
        assert not failures, failures
        versions = [event.mod_version for event in events]
        assert versions == sorted(set(versions))  # in order, none twice
        assert set(acked) <= set(versions)  # every acknowledged write delivered
        assert all(event.key.startswith("w/") and event.type == "put" for event in events)

    # A compaction passes a watch that is not reading: its next poll is below the horizon.
    # The dirty offset waits for every voter, so the killed one comes back first; only the
    # leader compacts (cleaner_interval_ms 0), so the watch reads from it.
    cluster.restart(leader)
    new_leader = cluster.wait_for_leader()
    with Client(_urls(cluster), retry=PATIENT) as kv, Client([new_leader.url], retry=PATIENT) as watcher:
        stale = watcher.watch("c/", since=kv.put("c/0", "0").version, poll_timeout_ms=500)
        position = kv.put("c/1", "1").version
        assert next(stale).key == "c/1"
        for index in range(30):
            kv.put("c/hot", str(index))

        def compacted_past_the_watch() -> bool:
            report = cluster.client().post(f"{new_leader.url}/v1/admin/compact", timeout=30.0)
            return report.status_code == 200 and report.json()["cleaned_end"] > position
        cluster.wait_until(compacted_past_the_watch, WAIT_S, "a compaction past the watch's position")
        try:
            missed = next(stale)
            raise AssertionError(f"the stale watch went on below the horizon: {missed}")
        except Compacted as exc:
            oldest = exc.oldest_version
        assert oldest > position

        listing = watcher.list("c/")  # the recipe: re-list, then watch from the list's version
        assert {item.key: item.text for item in listing.items} == {"c/0": "0", "c/1": "1", "c/hot": "29"}
        resumed = watcher.watch("c/", since=listing.version, poll_timeout_ms=500)
        written = kv.put("c/2", "2").version
        event = next(resumed)
        assert (event.key, event.mod_version) == ("c/2", written)


def test_read_your_writes_holds_on_a_lagging_observer(cluster_factory: Callable[..., Cluster]) -> None:
    """Reads go to an observer whose every fsync sleeps 300 ms: with the session's
    min_version each read returns the client's own write; without it, reads are stale."""
    cluster = cluster_factory(voters=3, observers=1, settings=FAST)
    observer = cluster.observers[0]
    observer.env["METAKV_FAILPOINTS"] = "segment.before_fsync=sleep(300)"
    cluster.restart(observer)
    cluster.wait_ready(observer)
    endpoints = [observer.url, *_urls(cluster)]  # reads stay on the observer; writes find the leader

    def stale_reads(client: Client) -> int:
        stale = 0
        for index in range(8):
            written = client.put(f"ryw/{index}", f"value-{index}")
            read = client.get(f"ryw/{index}")
            assert client.endpoints.for_read() == observer.url
            if read is None or read.mod_version != written.version:
                stale += 1
        return stale

    with Client(endpoints, retry=PATIENT) as session:
        assert stale_reads(session) == 0
    with Client(endpoints, retry=PATIENT, read_your_writes=False) as no_session:
        assert stale_reads(no_session) > 0  # the observer does lag: the guarantee is not free


