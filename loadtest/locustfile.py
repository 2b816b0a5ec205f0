"""Locust scenarios for metadata workloads, run against metakv or etcd.

Run one scenario by naming its user class (``python -m loadtest run`` does this for you)::

    locust -f loadtest/locustfile.py --headless -u 8 -t 30s --host http://127.0.0.1:8001 \\
        --store metakv --endpoints http://127.0.0.1:8001,http://127.0.0.1:8002 ReadHeavy

Every scenario runs unchanged against either store through ``loadtest.stores``; keys live
under ``<run-id>/<scenario>/`` so runs sharing a cluster never see each other's keys (with the
default run id, a fresh one per test start, for the web UI).
Options added here (also settable as LOADTEST_* environment variables, and shown in the web
UI) are listed in ``add_arguments``.
"""

from __future__ import annotations

import csv
import functools
import http.client
import itertools
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TextIO
from urllib.parse import urlsplit

import gevent
from locust import FastHttpUser, constant_throughput, events, task
from locust.env import Environment
from locust.exception import RescheduleTask
from locust.runners import MasterRunner, WorkerRunner

from loadtest.checks import RunLedger, WatchVerifier
from loadtest.stores import (
    EtcdStore,
    LocustHttp,
    MetakvStore,
    OperationFailed,
    PlainHttp,
    Store,
    make_store,
    parse_etcd_watch_message,
    wait_until,
)

SMALL_VALUE_BYTES = 128
LARGE_VALUE_BYTES = 64 * 1024
HOT_KEYS = 10  # hot_keys: this many keys ...
HOT_SHARE = 0.9  # ... receive this share of the traffic
CAS_COUNTERS = 4  # cas_contention: every user races on these few keys
CHURN_KEYS_PER_USER = 50  # churn: each user's live key set hovers around this size
CHURN_DELETED_KEPT = 20  # churn: recently deleted keys remembered to read back as 404
WATCH_KEYS_PER_USER = 20  # watchers: each writer cycles over this many keys
WATCH_POLL_TIMEOUT_MS = 2000  # metakv long-poll timeout
WATCH_FINAL_WAIT_S = 15.0  # at the end, how long watchers may take to catch up
LARGE_KEYS = 32  # large_values: shared keys holding 64 KiB each
LIST_DIRECTORIES = 20  # list_prefix: this many prefixes ...
LIST_KEYS_PER_DIRECTORY = 50  # ... each preloaded with this many keys
LIST_LIMIT = 100
SAMPLES_FLUSH_ROWS = 2000
FAILURE_BACKOFF_S = 0.1  # a user pauses this long after a failed request, as a client would  # raw samples are written in chunks of this many rows

_FILLER = (b"metakv-loadtest-" * (LARGE_VALUE_BYTES // 16 + 1))[:LARGE_VALUE_BYTES]
_user_numbers = itertools.count()
LEDGER = RunLedger()
DEFAULT_RUN_ID = "loadtest"


@dataclass
class RunState:
    """Set when a test starts (by the master in distributed runs, sent to the workers)."""

    key_root: str = DEFAULT_RUN_ID  # keys live under <key_root>/<scenario>/
    preload_version: int = 0  # users' reads start from here, so they see the preload


RUN = RunState()


def scenario_prefix(scenario: str) -> str:
    return f"{RUN.key_root}/{scenario}/"


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    parser.add_argument("--store", choices=["metakv", "etcd"], default="metakv", env_var="LOADTEST_STORE",
                       help="API the target speaks", include_in_web_ui=True)
    parser.add_argument("--endpoints", default="", env_var="LOADTEST_ENDPOINTS",
                       help="comma-separated node URLs (default: --host)", include_in_web_ui=True)
    parser.add_argument("--churn", type=float, default=0.5, env_var="LOADTEST_CHURN",
                       help="churn: share of operations that create or delete keys", include_in_web_ui=True)
    parser.add_argument("--target-rate", type=float, default=0.0, env_var="LOADTEST_TARGET_RATE",
                       help="task iterations per second over all users; 0 = closed loop", include_in_web_ui=True)
    parser.add_argument("--seed", type=int, default=1, env_var="LOADTEST_SEED", include_in_web_ui=True)
    parser.add_argument("--run-id", default="loadtest", env_var="LOADTEST_RUN_ID",
                       help="key prefix of this run", include_in_web_ui=True)
    parser.add_argument("--key-count", type=int, default=1000, env_var="LOADTEST_KEY_COUNT",
                       help="keys preloaded by read_heavy, write_heavy and hot_keys", include_in_web_ui=True)
    parser.add_argument("--checks-out", default="", env_var="LOADTEST_CHECKS_OUT",
                       help="write the end-of-run checks as JSON here", include_in_web_ui=False)
    parser.add_argument("--load-seconds", type=float, default=0.0, env_var="LOADTEST_LOAD_SECONDS",
                        help="headless: quit this many seconds after the preload (0: Locust's own --run-time)",
                        include_in_web_ui=False)
    parser.add_argument("--started-out", default="", env_var="LOADTEST_STARTED_OUT",
                       help="write the time the load started (after preloading) here", include_in_web_ui=False)
    parser.add_argument("--samples-out", default="", env_var="LOADTEST_SAMPLES_OUT",
                       help="write every request (time, name, ms, ok) as CSV here", include_in_web_ui=False)


def operation(weight: int = 1) -> Callable[[Callable[[Any], None]], Any]:
    """A Locust task whose failed requests (already recorded as failures) end the iteration
    quietly instead of logging a traceback per failure, after FAILURE_BACKOFF_S: without
    it a user whose node just died would spin on connection errors (both stores alike)."""

    def decorate(function: Callable[[Any], None]) -> Any:
        @functools.wraps(function)
        def run(self: Any) -> None:
            try:
                function(self)
            except OperationFailed as error:
                gevent.sleep(FAILURE_BACKOFF_S)
                raise RescheduleTask() from error

        return task(weight)(run)

    return decorate


def endpoint_list(environment: Environment) -> list[str]:
    options = environment.parsed_options
    raw = getattr(options, "endpoints", "") if options else ""
    endpoints = [part.strip().rstrip("/") for part in raw.split(",") if part.strip()]
    return endpoints or [str(environment.host).rstrip("/")]


def value_of(tag: str, size: int) -> bytes:
    """An ASCII value of ``size`` bytes that starts with ``tag`` (so each write is distinct)."""
    head = tag.encode()[:size]
    return head + _FILLER[: size - len(head)]


def record(environment: Environment, name: str, response_time_ms: float, error: str | None) -> None:
    environment.events.request.fire(
        request_type="CHECK" if name.startswith("check") else "WATCH",
        name=name,
        response_time=response_time_ms,
        response_length=0,
        exception=None if error is None else RuntimeError(error),
        context={},
    )


class MetadataUser(FastHttpUser):
    """What every scenario shares: its store adapter, a seeded random source, pacing and the
    session version used to read its own writes."""

    abstract = True
    scenario: ClassVar[str] = ""
    read_own_writes: ClassVar[bool] = True
    concurrency = 4  # watchers share the session between the task loop and the watch loop
    network_timeout = 30.0
    connection_timeout = 5.0

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.user_number = next(_user_numbers)
        worker_index = getattr(self.environment.runner, "worker_index", 0)
        self.user_id = f"w{worker_index}u{self.user_number}"
        self.rng = random.Random(f"{options.seed}/{self.scenario}/{self.user_id}")
        self.store: Store = make_store(
            options.store, LocustHttp(self.client), endpoint_list(self.environment), home_index=self.user_number
        )
        self.prefix = scenario_prefix(self.scenario)
        # Start at the preload's version, so even the first read on a follower sees the
        # preloaded keys (the preload is this run's own write).
        self.session_version = max(RUN.preload_version, LEDGER.newest_version)
        self.writes = 0
        self.pacer = None
        if options.target_rate > 0:
            # --users of a headless run; in the web UI the count typed at start
            users = max(1, options.num_users or getattr(self.environment.runner, "target_user_count", 0) or 1)
            self.pacer = constant_throughput(options.target_rate / users)

    def wait_time(self) -> float:
        return self.pacer(self) if self.pacer is not None else 0.0

    @classmethod
    def prepare(cls, store: Store, options: Any) -> int:
        """Preload what the scenario reads; runs once before users start, outside the stats.
        Returns the version of the preload (0: nothing written)."""
        return 0

    def min_version(self) -> int:
        return self.session_version if self.read_own_writes else 0

    def wrote(self, version: int) -> int:
        self.session_version = max(self.session_version, version)
        LEDGER.newest_version = max(LEDGER.newest_version, version)
        self.writes += 1
        return version

    def tag(self) -> str:
        return f"{self.user_id}:{self.writes}:"

    def check_failed(self, name: str, text: str) -> None:
        LEDGER.checks.problem(f"{self.user_id}: {text}")
        record(self.environment, name, 0.0, text)


def preloaded_key(prefix: str, index: int) -> str:
    return f"{prefix}k{index:05d}"


class _PreloadedKeys(MetadataUser):
    abstract = True

    @classmethod
    def prepare(cls, store: Store, options: Any) -> int:
        prefix = scenario_prefix(cls.scenario)
        return store.put_many(
            (preloaded_key(prefix, index), value_of(f"preload:{index}:", SMALL_VALUE_BYTES))
            for index in range(options.key_count)
        )

    def random_key(self) -> str:
        return preloaded_key(self.prefix, self.rng.randrange(self.environment.parsed_options.key_count))


class ReadHeavy(_PreloadedKeys):
    """95% reads, 5% writes over preloaded keys; reads see the session's own writes."""

    scenario = "read_heavy"

    @operation(95)
    def get(self) -> None:
        self.store.get(self.random_key(), name="get", min_version=self.min_version())

    @operation(5)
    def put(self) -> None:
        self.wrote(self.store.put(self.random_key(), value_of(self.tag(), SMALL_VALUE_BYTES), name="put"))


class WriteHeavy(_PreloadedKeys):
    """90% writes, 10% reads over preloaded keys."""

    scenario = "write_heavy"

    @operation(90)
    def put(self) -> None:
        self.wrote(self.store.put(self.random_key(), value_of(self.tag(), SMALL_VALUE_BYTES), name="put"))

    @operation(10)
    def get(self) -> None:
        self.store.get(self.random_key(), name="get", min_version=self.min_version())


class HotKeys(_PreloadedKeys):
    """80% reads, 20% writes; HOT_SHARE of all operations hit the first HOT_KEYS keys."""

    scenario = "hot_keys"

    def random_key(self) -> str:
        if self.rng.random() < HOT_SHARE:
            return preloaded_key(self.prefix, self.rng.randrange(HOT_KEYS))
        return super().random_key()

    @operation(80)
    def get(self) -> None:
        self.store.get(self.random_key(), name="get", min_version=self.min_version())

    @operation(20)
    def put(self) -> None:
        self.wrote(self.store.put(self.random_key(), value_of(self.tag(), SMALL_VALUE_BYTES), name="put"))


class Churn(MetadataUser):
    """Creates, updates, deletes and reads over a key set that turns over.

    Each user owns its keys (``<prefix><user>/``), so it knows what every read must show:
    the value it last wrote, or 404 for a key it deleted. ``--churn X`` is the share of
    operations that create or delete a key; the rest are updates and reads, half each. The
    live set is pulled toward CHURN_KEYS_PER_USER, so creates and deletes balance.
    """

    scenario = "churn"

    def on_start(self) -> None:
        super().on_start()
        self.own_prefix = f"{self.prefix}{self.user_id}/"
        self.live: dict[str, bytes | None] = {}  # key -> value last written (None: unknown)
        self.deleted: deque[str] = deque(maxlen=CHURN_DELETED_KEPT)
        self.next_key = 0

    @operation()
    def step(self) -> None:
        churn = self.environment.parsed_options.churn
        if not self.live or self.rng.random() < churn:
            target = CHURN_KEYS_PER_USER
            create_share = min(1.0, max(0.0, 0.5 + (target - len(self.live)) / (2 * target)))
            if not self.live or self.rng.random() < create_share:
                self.create()
            else:
                self.delete()
        elif self.rng.random() < 0.5:
            self.update()
        else:
            self.read()

    def create(self) -> None:
        key = f"{self.own_prefix}k{self.next_key:07d}"
        self.next_key += 1
        value = value_of(self.tag(), SMALL_VALUE_BYTES)
        self.live[key] = None  # unknown until acknowledged
        version = self.store.create(key, value, name="create")
        if version is None:
            self.check_failed("check: create", f"create of new key {key} found it existing")
            return
        self.wrote(version)
        self.live[key] = value

    def update(self) -> None:
        key = self.rng.choice(list(self.live))
        value = value_of(self.tag(), SMALL_VALUE_BYTES)
        self.live[key] = None
        self.wrote(self.store.put(key, value, name="update"))
        self.live[key] = value

    def delete(self) -> None:
        key = self.rng.choice(list(self.live))
        del self.live[key]  # unknown state if the delete fails: never read again
        outcome = self.store.delete(key, name="delete")
        self.wrote(outcome.version)
        if not outcome.existed:
            self.check_failed("check: delete", f"delete of live key {key} found nothing")
        self.deleted.append(key)

    def read(self) -> None:
        if self.deleted and self.rng.random() < 0.1:
            key = self.rng.choice(self.deleted)
            expected: bytes | None = None
            known = True
        else:
            key = self.rng.choice(list(self.live))
            expected = self.live[key]
            known = expected is not None
        entry = self.store.get(key, name="get", min_version=self.min_version())
        if not known:
            return
        LEDGER.checks.read_own_writes_checked += 1
        seen = None if entry is None else entry.value
        if seen != expected:
            LEDGER.checks.read_own_writes_violated += 1
            shown = "404" if seen is None else repr(seen[:24])
            wanted = "404" if expected is None else repr(expected[:24])
            self.check_failed(
                "check: read own write",
                f"{key} at min_version {self.session_version}: got {shown}, wrote {wanted}",
            )


class CasContention(MetadataUser):
    """Every user increments the same CAS_COUNTERS counters with read + compare-and-set.
    A 412 / failed compare is a lost race: a success under the name "cas: lost race"."""

    scenario = "cas_contention"

    @classmethod
    def prepare(cls, store: Store, options: Any) -> int:
        prefix = scenario_prefix(cls.scenario)
        return store.put_many((counter_key(prefix, index), b"0") for index in range(CAS_COUNTERS))

    @operation()
    def increment(self) -> None:
        key = counter_key(self.prefix, self.rng.randrange(CAS_COUNTERS))
        entry = self.store.get(key, name="cas read", min_version=self.min_version())
        if entry is None:
            self.check_failed("check: cas counter", f"counter {key} is missing")
            return
        new_value = str(int(entry.value) + 1).encode()
        LEDGER.cas.undecided[key] += 1
        outcome = self.store.cas(key, entry.mod_version, new_value, name="cas")
        LEDGER.cas.undecided[key] -= 1
        if outcome.won:
            LEDGER.cas.wins[key] += 1
            self.wrote(outcome.version)
        else:
            LEDGER.cas.lost += 1


def counter_key(prefix: str, index: int) -> str:
    return f"{prefix}counter{index}"


class Watchers(MetadataUser):
    """Each user writes (puts, some deletes) under its own prefix while its watcher watches
    that prefix; the WatchVerifier checks every acknowledged change arrives, in order.
    "watch delivery" is the time from sending a write to its event reaching the watcher."""

    scenario = "watchers"

    def on_start(self) -> None:
        super().on_start()
        self.own_prefix = f"{self.prefix}{self.user_id}/"
        self.verifier = WatchVerifier(self.user_id, lambda *row: record(self.environment, *row))
        LEDGER.watchers.append(self.verifier)
        self.watch_loop: gevent.Greenlet | None = None

    @operation()
    def write(self) -> None:
        key = f"{self.own_prefix}k{self.rng.randrange(WATCH_KEYS_PER_USER):03d}"
        sent_at_s = time.time()
        if self.rng.random() < 0.1:
            outcome = self.store.delete(key, name="delete")
            version, changed = outcome.version, outcome.existed
        else:
            version = self.store.put(key, value_of(self.tag(), SMALL_VALUE_BYTES), name="put")
            changed = True
        self.wrote(version)
        if changed:  # deleting an absent key changes nothing and produces no event
            self.verifier.on_ack(version, sent_at_s)
        if self.watch_loop is None:
            self.watch_loop = gevent.spawn(self.watch_forever, version - 1)
            WATCH_LOOPS.append(self.watch_loop)

    def watch_forever(self, since_version: int) -> None:
        if isinstance(self.store, MetakvStore):
            self.long_poll_forever(self.store, since_version)
        elif isinstance(self.store, EtcdStore):
            self.stream_forever(self.store, since_version)

    def long_poll_forever(self, store: MetakvStore, since_version: int) -> None:
        while True:
            try:
                batch = store.watch(self.own_prefix, since_version, WATCH_POLL_TIMEOUT_MS, name="watch poll")
            except OperationFailed:
                gevent.sleep(0.1)
                continue
            self.verifier.on_batch(batch)
            newest = max([since_version, batch.covered_version] + [e.mod_version for e in batch.events])
            since_version = newest

    def stream_forever(self, store: EtcdStore, since_version: int) -> None:
        """etcd's gateway streams newline-delimited JSON messages on one long response; the
        stream is re-opened from the last seen revision if the member goes away."""
        while True:
            base = store.home
            parts = urlsplit(base)
            connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=3600)
            started = time.perf_counter()
            try:
                connection.request("POST", "/v3/watch", body=store.watch_request(self.own_prefix, since_version),
                                   headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                record(self.environment, "watch open", (time.perf_counter() - started) * 1000.0,
                       None if response.status == 200 else f"HTTP {response.status}")
                while response.status == 200:
                    line = response.readline()
                    if not line:
                        break
                    batch = parse_etcd_watch_message(line)
                    if batch is not None:
                        self.verifier.on_batch(batch)
                        since_version = max(since_version, self.verifier.last_event_version)
            except (OSError, http.client.HTTPException, OperationFailed) as error:
                record(self.environment, "watch open", (time.perf_counter() - started) * 1000.0, str(error))
                store.home_index = (store.home_index + 1) % len(store.endpoints)
            finally:
                connection.close()
            gevent.sleep(0.1)


WATCH_LOOPS: list[gevent.Greenlet] = []


class LargeValues(MetadataUser):
    """Half writes, half reads of 64 KiB values over LARGE_KEYS shared keys."""

    scenario = "large_values"

    @classmethod
    def prepare(cls, store: Store, options: Any) -> int:
        prefix = scenario_prefix(cls.scenario)
        return store.put_many((large_key(prefix, index), value_of(f"preload:{index}:", LARGE_VALUE_BYTES))
                       for index in range(LARGE_KEYS))

    @operation()
    def put(self) -> None:
        key = large_key(self.prefix, self.rng.randrange(LARGE_KEYS))
        self.wrote(self.store.put(key, value_of(self.tag(), LARGE_VALUE_BYTES), name="put 64KiB"))

    @operation()
    def get(self) -> None:
        key = large_key(self.prefix, self.rng.randrange(LARGE_KEYS))
        entry = self.store.get(key, name="get 64KiB", min_version=self.min_version())
        LEDGER.checks.large_values_checked += 1
        size = -1 if entry is None else len(entry.value)
        if size != LARGE_VALUE_BYTES:
            LEDGER.checks.large_values_wrong_size += 1
            self.check_failed("check: large value", f"{key}: {size} bytes, expected {LARGE_VALUE_BYTES}")


def large_key(prefix: str, index: int) -> str:
    return f"{prefix}blob{index:02d}"


class ListPrefix(MetadataUser):
    """90% list-by-prefix (values included, up to LIST_LIMIT), 10% puts adding keys."""

    scenario = "list_prefix"

    @classmethod
    def prepare(cls, store: Store, options: Any) -> int:
        prefix = scenario_prefix(cls.scenario)
        return store.put_many(
            (f"{prefix}d{directory:02d}/k{index:03d}", value_of(f"preload:{directory}:{index}:", SMALL_VALUE_BYTES))
            for directory in range(LIST_DIRECTORIES)
            for index in range(LIST_KEYS_PER_DIRECTORY)
        )

    @operation(90)
    def list(self) -> None:
        directory = f"{self.prefix}d{self.rng.randrange(LIST_DIRECTORIES):02d}/"
        entries = self.store.list_prefix(directory, limit=LIST_LIMIT, name="list prefix",
                                         min_version=self.min_version())
        LEDGER.checks.list_checked += 1
        outside = [entry.key for entry in entries if not entry.key.startswith(directory)]
        if len(entries) < LIST_KEYS_PER_DIRECTORY or outside:
            LEDGER.checks.list_short += 1
            self.check_failed("check: list prefix", f"{directory}: {len(entries)} entries, outside: {outside[:3]}")

    @operation(10)
    def put(self) -> None:
        key = f"{self.prefix}d{self.rng.randrange(LIST_DIRECTORIES):02d}/x{self.user_id}-{self.writes}"
        self.wrote(self.store.put(key, value_of(self.tag(), SMALL_VALUE_BYTES), name="put"))


class _Samples:
    """Every request as one CSV row, for latency-over-time plots (Locust's own history
    keeps a 10-second moving window, too coarse around a failover)."""

    def __init__(self) -> None:
        self.file: TextIO | None = None
        self.writer: Any = None
        self.rows: list[tuple[float, str, str, float, int]] = []

    def open(self, path: str) -> None:
        self.file = open(path, "w", newline="")  # noqa: SIM115 - closed at quitting
        self.writer = csv.writer(self.file)
        self.writer.writerow(["start_time_s", "request_type", "name", "response_time_ms", "ok"])

    def add(self, start_time_s: float, request_type: str, name: str, response_time_ms: float, ok: bool) -> None:
        if self.file is None:
            return
        self.rows.append((round(start_time_s, 4), request_type, name, round(response_time_ms, 3), int(ok)))
        if len(self.rows) >= SAMPLES_FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.writer is not None and self.rows:
            self.writer.writerows(self.rows)
            self.rows.clear()

    def close(self) -> None:
        self.flush()
        if self.file is not None:
            self.file.close()
            self.file = None


SAMPLES = _Samples()


PRELOAD_MESSAGE = "metakv-loadtest-run-state"


def _on_preload_message(environment: Environment, msg: Any, **_: Any) -> None:
    """Workers learn the key root and the preload's version from the master."""
    RUN.key_root = str(msg.data["key_root"])
    RUN.preload_version = int(msg.data["preload_version"])


@events.init.add_listener
def on_init(environment: Environment, **_: Any) -> None:
    options = environment.parsed_options
    if options is None:
        return
    random.seed(options.seed)  # Locust picks tasks with the global random source
    if isinstance(environment.runner, WorkerRunner):
        environment.runner.register_message(PRELOAD_MESSAGE, _on_preload_message)
    if options.samples_out and not isinstance(environment.runner, MasterRunner):
        SAMPLES.open(options.samples_out)


@events.request.add_listener
def on_request(request_type: str, name: str, response_time: float, exception: Any, **kwargs: Any) -> None:
    start_time_s = kwargs.get("start_time") or (time.time() - response_time / 1000.0)
    SAMPLES.add(start_time_s, request_type, name, response_time, exception is None)


@events.test_start.add_listener
def on_test_start(environment: Environment, **_: Any) -> None:
    """Preload on the master (or the only process), before any user starts."""
    LEDGER.reset()  # the web UI starts many tests in one process
    if isinstance(environment.runner, WorkerRunner):
        return
    options = environment.parsed_options
    RUN.key_root = options.run_id
    if options.run_id == DEFAULT_RUN_ID:
        RUN.key_root = f"{DEFAULT_RUN_ID}-{time.strftime('%Y%m%dT%H%M%S')}-{random.randrange(1 << 16):04x}"
    store = make_store(options.store, PlainHttp(), endpoint_list(environment))
    RUN.preload_version = 0
    for user_class in environment.user_classes:
        if issubclass(user_class, MetadataUser):
            RUN.preload_version = max(RUN.preload_version, user_class.prepare(store, options))
    if isinstance(environment.runner, MasterRunner):
        environment.runner.send_message(
            PRELOAD_MESSAGE, {"key_root": RUN.key_root, "preload_version": RUN.preload_version}
        )
    if options.started_out:
        Path(options.started_out).write_text(f"{time.time():.6f}\n")
    if options.load_seconds > 0:
        # Timed from here, after the preload, so every run gets the same seconds of load
        # however long preloading took (Locust's --run-time also counts the preload).
        gevent.spawn_later(options.load_seconds, environment.runner.quit)


@events.test_stop.add_listener
def on_test_stop(environment: Environment, **_: Any) -> None:
    """After the users stopped: let watchers catch up, read the CAS counters back, write
    the checks file."""
    if isinstance(environment.runner, MasterRunner):
        return
    options = environment.parsed_options
    if LEDGER.watchers:
        wait_until(lambda: all(watcher.caught_up() for watcher in LEDGER.watchers), WATCH_FINAL_WAIT_S)
        for loop in WATCH_LOOPS:
            loop.kill(block=True, timeout=5)
        WATCH_LOOPS.clear()
        for watcher in LEDGER.watchers:
            watcher.finish()
    if any(issubclass(cls, CasContention) for cls in environment.user_classes):
        store = make_store(options.store, PlainHttp(), endpoint_list(environment))
        prefix = scenario_prefix(CasContention.scenario)
        final = {}
        for index in range(CAS_COUNTERS):
            key = counter_key(prefix, index)
            entry = store.get(key, name="cas final", min_version=max(LEDGER.newest_version, RUN.preload_version))
            final[key] = int(entry.value) if entry is not None else 0
        LEDGER.cas_final = LEDGER.cas.verdict(final)
        if not LEDGER.cas_final["ok"]:
            record(environment, "check: cas counters", 0.0, "a counter differs from the won races")
    if options.checks_out:
        LEDGER.write(Path(options.checks_out))


@events.quitting.add_listener
def on_quitting(environment: Environment, **_: Any) -> None:
    SAMPLES.close()
