"""The scale benchmark's load, in either store's API: key names, growth (every new key written
once), and the measured phases (churn closed loop and at a fixed rate, point reads, prefix
lists). Requests are bench_http's raw requests; the closed loops are its wrk runs, the fixed
rate its open-loop generator, so both stores get exactly the generators bench_http uses.

Churn keeps the store at its size: a plan (one per stage, the same for both stores) deletes
a fifth of its requests' keys and puts each back REPUT_GAP requests later, and its gets and
updates never name a key it deletes, so every get finds its key and the number of live keys
stays within a few hundred of the stage's (``repair`` restores it exactly afterwards).
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import uvloop

from loadtest.bench_http import (
    FIXED_RATE_WRITES_PER_S,
    VALUE_BYTES,
    EtcdRequests,
    MetakvRequests,
    OpenLoopConnection,
    Store,
    closed_loop,
    fixed_rate,
    measured,
)

KEY_PREFIX = "scale/k"
KEY_DIGITS = 7  # keys scale/k0000000 ... scale/k9999999
LIST_LIMIT = 100
# A prefix two digits shorter than a key names exactly LIST_LIMIT keys.
LIST_PREFIX_DIGITS = KEY_DIGITS - 2
CLIENTS = 64
CHURN_TABLE_MAX = 10_000  # requests wrk cycles through (a Lua table of raw requests)
READ_TABLE = 5_000
# A deleted key is put back this many requests later: far more than the clients in flight,
# so the put is not sent before the delete was answered.
REPUT_GAP = 1_000
# The churn mix in blocks of ten requests: 5 puts (two put back keys deleted REPUT_GAP
# earlier, three update other keys), 3 gets, 2 deletes: 50 % put / 30 % get / 20 % delete.
BLOCK = ("reput", "get", "delete", "reput", "get", "put", "delete", "put", "get", "put")
GROWTH_RETRIES = 5  # a write answered with an error is sent again, at most this often
GROWTH_TIMEOUT_MIN_S = 120.0


def key_name(index: int) -> str:
    return f"{KEY_PREFIX}{index:0{KEY_DIGITS}d}"


def value() -> bytes:
    """A 256-byte ASCII value (etcd's gateway takes it base64-encoded, metakv as it is)."""
    return os.urandom(VALUE_BYTES // 2).hex().encode()


@dataclass(frozen=True)
class ChurnPlan:
    """The churn requests of one stage, as (operation, key index), cycled by the generators;
    ``deleted`` holds every key the plan deletes (and puts back)."""

    ops: list[tuple[str, int]]
    deleted: frozenset[int]


def churn_plan(live_keys: int, rng: random.Random, table_max: int = CHURN_TABLE_MAX) -> ChurnPlan:
    """Churn over the whole keyspace [0, live_keys): deleted keys are drawn from all of it
    (a quarter of it at most), gets and updates from the rest."""
    blocks = max(1, min(table_max, live_keys // 4 * 5) // len(BLOCK))
    deletes_per_block = BLOCK.count("delete")
    deleted = rng.sample(range(live_keys), blocks * deletes_per_block)
    excluded = frozenset(deleted)
    gap_blocks = max(1, min(REPUT_GAP // len(BLOCK), blocks // 2))

    def other_key() -> int:
        while True:
            index = rng.randrange(live_keys)
            if index not in excluded:
                return index

    ops: list[tuple[str, int]] = []
    for block in range(blocks):
        # This block's reputs bring back the keys deleted gap_blocks earlier (cyclically).
        back = (block - gap_blocks) % blocks
        reputs = iter(deleted[back * deletes_per_block:(back + 1) * deletes_per_block])
        deletes = iter(deleted[block * deletes_per_block:(block + 1) * deletes_per_block])
        for slot in BLOCK:
            if slot == "reput":
                ops.append(("put", next(reputs)))
            elif slot == "delete":
                ops.append(("delete", next(deletes)))
            else:
                ops.append((slot, other_key()))
    return ChurnPlan(ops, excluded)


def raw_ops(requests: MetakvRequests | EtcdRequests, ops: list[tuple[str, int]]) -> list[bytes]:
    data = value()
    builders = {"put": lambda key: requests.raw_write(key, data), "get": requests.raw_read,
                "delete": requests.raw_delete}
    return [builders[op](key_name(index)) for op, index in ops]


def churn_closed(store: Store, plan: ChurnPlan, duration_s: float) -> dict[str, Any]:
    """Churn by CLIENTS connections to the leader, back to back (wrk)."""
    raws = raw_ops(store.requests, plan.ops)
    return measured(store.cluster, lambda: closed_loop(
        [store.leader_url], CLIENTS, duration_s, "churn", store.requests, table=lambda _: raws))


def churn_fixed_rate(store: Store, plan: ChurnPlan, duration_s: float) -> dict[str, Any]:
    """The same churn at FIXED_RATE_WRITES_PER_S requests/s, open loop (latency from each
    request's scheduled start)."""
    raws = raw_ops(store.requests, plan.ops)
    return measured(store.cluster, lambda: fixed_rate(
        store.leader_url, FIXED_RATE_WRITES_PER_S, duration_s, requests=store.requests, raws=raws))


def point_reads(store: Store, live_keys: int, duration_s: float, rng: random.Random) -> dict[str, Any]:
    """One client reading random live keys from the leader (metakv local read, etcd
    serializable range)."""
    raws = [store.requests.raw_read(key_name(rng.randrange(live_keys))) for _ in range(READ_TABLE)]
    return closed_loop([store.leader_url], 1, duration_s, "read", store.requests, table=lambda _: raws)


def prefix_lists(store: Store, live_keys: int, duration_s: float, rng: random.Random) -> dict[str, Any]:
    """One client listing random prefixes of exactly LIST_LIMIT keys, with limit LIST_LIMIT."""
    prefixes = max(1, live_keys // LIST_LIMIT)
    raws = [store.requests.raw_list(f"{KEY_PREFIX}{rng.randrange(prefixes):0{LIST_PREFIX_DIGITS}d}", LIST_LIMIT)
            for _ in range(READ_TABLE)]
    return closed_loop([store.leader_url], 1, duration_s, "list", store.requests, table=lambda _: raws)


def grow(store: Store, first: int, end: int) -> dict[str, Any]:
    """Write keys [first, end) once each, CLIENTS at a time, to the leader."""
    data = value()
    raws = [store.requests.raw_write(key_name(index), data) for index in range(first, end)]
    return write_each_once(store.leader_url, raws)


def repair(store: Store, plan: ChurnPlan) -> dict[str, Any]:
    """Put back every key the plan deletes: churn stopped mid-plan leaves some deleted."""
    data = value()
    return write_each_once(store.leader_url, [store.requests.raw_write(key_name(index), data)
                                              for index in sorted(plan.deleted)])


def write_each_once(url: str, raws: list[bytes], clients: int = CLIENTS) -> dict[str, Any]:
    """Send every request of ``raws`` once over ``clients`` keep-alive connections, each
    sending its next request as soon as its last is answered; a request answered with
    anything but 200 is sent again (GROWTH_RETRIES times at most, then it counts as failed).
    The closed loop of bench_http is wrk, which runs for a duration, not a request count."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_write_each_once(url, raws, clients))


async def _write_each_once(url: str, raws: list[bytes], clients: int) -> dict[str, Any]:
    host, _, port = url.removeprefix("http://").rstrip("/").partition(":")
    loop = asyncio.get_running_loop()
    queue = collections.deque(range(len(raws)))
    sent_as: dict[OpenLoopConnection, int] = {}
    attempts: collections.Counter[int] = collections.Counter()
    statuses: collections.Counter[str] = collections.Counter()
    outstanding = [len(raws)]
    failed = [0]
    finished = asyncio.Event()

    def send_next(connection: OpenLoopConnection) -> None:
        if queue:
            index = queue.popleft()
            sent_as[connection] = index
            connection.send(raws[index], time.perf_counter())

    def done(connection: OpenLoopConnection, status: int, _latency_s: float) -> None:
        index = sent_as.pop(connection)
        if status == 200:
            outstanding[0] -= 1
        else:
            statuses[str(status)] += 1
            attempts[index] += 1
            if attempts[index] > GROWTH_RETRIES:
                outstanding[0] -= 1
                failed[0] += 1
            else:
                queue.append(index)
        if outstanding[0] == 0:
            finished.set()
        else:
            send_next(connection)

    if not raws:
        return {"requests": 0, "seconds": 0.0, "per_s": 0.0, "error_statuses": {}, "failed": 0}
    opened = [await loop.create_connection(lambda: OpenLoopConnection(done), host, int(port))
              for _ in range(min(clients, len(raws)))]
    started = time.perf_counter()
    for _, connection in opened:
        send_next(connection)
    timeout_s = max(GROWTH_TIMEOUT_MIN_S, len(raws) / 100)
    try:
        await asyncio.wait_for(finished.wait(), timeout_s)
    except TimeoutError:
        raise RuntimeError(f"{url}: {outstanding[0]} of {len(raws)} writes unanswered after {timeout_s:.0f} s "
                           f"(error statuses {dict(statuses)})") from None
    finally:
        for transport, _ in opened:
            transport.close()
    seconds = time.perf_counter() - started
    return {"requests": len(raws), "seconds": round(seconds, 3), "per_s": round(len(raws) / seconds, 1),
            "error_statuses": dict(statuses), "failed": failed[0]}
