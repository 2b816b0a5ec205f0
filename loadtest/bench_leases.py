"""Leases at scale, metakv against etcd in the same run: keep-alive throughput, the leader's
CPU per keep-alive, and how late leases expire once their holders stop.

    python -m loadtest.bench_leases [--leases 10000] [--ttl-s 10] [--keyed 1000] [--keepalive-s 15]
                                    [--stores metakv,etcd-grpc,etcd] [--rounds 1] [--out results/bench_leases.json]

Each round starts a fresh 3-voter metakv cluster and a fresh 3-member etcd 3.4 cluster per
etcd store, one after the other (the order reverses every round), and with one load
generator (this process, one asyncio loop, ``--concurrency`` requests in flight):
1. grants ``--leases`` leases of ``--ttl-s`` (metakv ``POST /v1/leases``; etcd's JSON gateway
   ``POST /v3/lease/grant``), attaching one key to each of the first ``--keyed``, while
   keeping the granted ones alive (granting may take longer than a TTL; grants pause while
   the oldest acknowledgement is older than a quarter of the TTL: under etcd 3.4's grants
   its renewals are as slow as its grants, ~50/s here), then renews every
   lease once and prints how many were still alive (all of them, or the run is not a fair
   comparison: ``alive_at_measure_start`` in the results);
2. keeps every lease alive for ``--keepalive-s``, closed loop, sweeping over all of them:
   metakv ``POST /v1/leases/keepalive`` with ``--batch`` ids per request; ``etcd`` the
   gateway's ``POST /v3/lease/keepalive``, one lease per request (its JSON API has no batch
   form, and on this machine it cannot keep 10,000 leases alive); ``etcd-grpc`` etcd's own
   ``LeaseKeepAlive`` gRPC stream, ``--batch`` ids per stream (what etcd's clients use):
   leases kept alive per second, and the leader process's CPU seconds (Linux /proc) per
   thousand keep-alives;
3. stops; a watch open on the keys' prefix from the start (metakv: the client's watch;
   etcd: the gateway's watch stream) gives, for each keyed lease whose deadline falls after
   the stop, the time from that deadline (when its last acknowledged keep-alive was *sent*,
   plus the TTL: never earlier than the leader's real deadline) to its key's delete arriving
   at the watcher: the expiry latency distribution, an upper bound; measured from when that
   keep-alive's answer came, a lower bound (``expiry_latency_from_answer_s``: with 64
   requests in flight a keep-alive waits at the leader). Keyed leases the generator could not
   keep alive (their deadline passed before the stop) are counted, not timed.
Figures only mean something as metakv/etcd ratios from one run: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aetcd
import aetcd.exceptions
import aetcd.rpc
import httpx

from loadtest.bench_http import cpu_seconds
from loadtest.clusters import LocalCluster, start_etcd, start_metakv
from loadtest.stores import b64, parse_etcd_watch_message, prefix_end
from metakv import AsyncClient

KEY_PREFIX = "benchlease/"
EXPIRY_MARGIN_S = 30.0  # after the last deadline: how long to wait for the remaining deletes
WATCH_READY_S = 30.0
GRANT_PAUSE_AGE = 0.25  # of the TTL: grants wait while a granted lease's last acknowledgement is older


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(fraction: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))], 3)
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": round(ordered[-1], 3),
            "mean": round(statistics.fmean(ordered), 3)}


class LeaseApi:
    """One store's lease calls, sent to its leader."""

    kind = ""
    # While granting: tasks keeping the granted leases alive, and ids per keep-alive (None: --batch).
    setup_keepers = 8
    setup_batch: int | None = None

    def __init__(self, http: httpx.AsyncClient, leader: str) -> None:
        self.http, self.leader = http, leader

    async def call(self, method: str, path: str, **options: Any) -> Any:
        response = await self.http.request(method, f"{self.leader}{path}", **options)
        response.raise_for_status()
        return response.json()


class MetakvLeases(LeaseApi):
    kind = "metakv"

    async def grant(self, ttl_s: int) -> int:
        return int((await self.call("POST", "/v1/leases", json={"ttl_s": ttl_s}))["id"])

    async def attach(self, key: str, lease_id: int) -> None:
        await self.call("PUT", f"/v1/kv/{key}", params={"lease": lease_id}, content=b"x")

    async def keep_alive(self, lease_ids: list[int]) -> tuple[list[int], int]:
        """(the ids acknowledged, how many were not found)"""
        body = await self.call("POST", "/v1/leases/keepalive", json={"ids": lease_ids})
        return [int(item["id"]) for item in body["leases"]], len(body["not_found"])

    async def watch_deletes(self, ready: asyncio.Event, seen: dict[str, float]) -> None:
        """Through the client's watch (long-polls, each answered as soon as events exist)."""
        async with AsyncClient(self.leader) as kv:
            start = (await kv.list(KEY_PREFIX, limit=1, keys_only=True)).version
            ready.set()
            async for event in kv.watch(KEY_PREFIX, since=start):
                if event.type == "delete":
                    seen.setdefault(event.key, time.monotonic())


class EtcdLeases(LeaseApi):
    kind = "etcd"

    async def grant(self, ttl_s: int) -> int:
        return int((await self.call("POST", "/v3/lease/grant", json={"TTL": ttl_s}))["ID"])

    async def attach(self, key: str, lease_id: int) -> None:
        await self.call("POST", "/v3/kv/put", json={"key": b64(key), "value": b64("x"), "lease": str(lease_id)})

    async def keep_alive(self, lease_ids: list[int]) -> tuple[list[int], int]:
        acknowledged: list[int] = []
        for lease_id in lease_ids:
            body = await self.call("POST", "/v3/lease/keepalive", json={"ID": str(lease_id)})
            if int(body.get("result", {}).get("TTL", 0)) > 0:
                acknowledged.append(lease_id)
        return acknowledged, len(lease_ids) - len(acknowledged)

    async def watch_deletes(self, ready: asyncio.Event, seen: dict[str, float]) -> None:
        body = {"create_request": {"key": b64(KEY_PREFIX), "range_end": b64(prefix_end(KEY_PREFIX.encode()))}}
        async with httpx.AsyncClient(timeout=None) as client, client.stream(
                "POST", f"{self.leader}/v3/watch", json=body) as response:
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                batch = parse_etcd_watch_message(line.encode())
                if batch is None:
                    ready.set()  # the "created" acknowledgement
                    continue
                now = time.monotonic()
                for event in batch.events:
                    if event.kind == "delete":
                        seen.setdefault(event.key, now)


class EtcdGrpcLeases(EtcdLeases):
    """etcd's keep-alives as its own clients send them: LeaseKeepAlive, a gRPC stream, one
    stream per batch of ids (aetcd's stubs); the rest through the gateway as ``EtcdLeases``."""

    kind = "etcd-grpc"
    # etcd 3.4 renews a stream's ids one after another; under the grants' load each waited
    # ~40 ms (one stream of 500 ids took 19 s, longer than the TTL): many short streams.
    setup_keepers = 128
    setup_batch = 20

    def __init__(self, http: httpx.AsyncClient, leader: str) -> None:
        super().__init__(http, leader)
        address = httpx.URL(leader)
        self.grpc = aetcd.Client(host=address.host, port=address.port or 2379, timeout=30)

    async def keep_alive(self, lease_ids: list[int]) -> tuple[list[int], int]:
        await self.grpc.connect()
        acknowledged: list[int] = []
        answered = 0
        stream = self.grpc.leasestub.LeaseKeepAlive([aetcd.rpc.LeaseKeepAliveRequest(ID=i) for i in lease_ids])
        async for reply in stream:
            answered += 1
            if reply.TTL > 0:
                acknowledged.append(int(reply.ID))
            if answered == len(lease_ids):
                stream.cancel()
                break
        return acknowledged, len(lease_ids) - len(acknowledged)


async def in_parallel(count: int, concurrency: int, job: Callable[[int], Awaitable[None]]) -> float:
    """Run ``job(0..count-1)`` with ``concurrency`` in flight; the seconds it took."""
    indexes = iter(range(count))
    started = time.monotonic()

    async def worker() -> None:
        for index in indexes:
            await job(index)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.monotonic() - started


async def bench_store(api_type: type[LeaseApi], cluster: LocalCluster, args: argparse.Namespace) -> dict[str, Any]:
    leader = cluster.leader()
    assert leader is not None and leader.pid is not None
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    # Keep-alives get a pool of their own: queued behind slow grants they would let leases expire.
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as http, \
            httpx.AsyncClient(timeout=30.0, limits=limits) as keep_http:
        api, keep_api = api_type(http, leader.url), api_type(keep_http, leader.url)
        per_request = 1 if api.kind == "etcd" else args.batch
        # The watcher runs throughout: a lease the generator could not keep alive expires
        # during the run, and is counted apart from those expiring after the stop.
        seen: dict[str, float] = {}
        ready = asyncio.Event()
        watcher = asyncio.create_task(api.watch_deletes(ready, seen))
        await asyncio.wait_for(ready.wait(), WATCH_READY_S)
        lease_ids: list[int] = [0] * args.leases
        # When the latest acknowledged grant/keep-alive of each lease was sent, and when its
        # answer came: the leader's deadline lies between the two plus the TTL.
        last_acked_send: dict[int, float] = {}
        last_acked_answer: dict[int, float] = {}

        def acknowledged_at(lease_id: int, sent: float, answered: float) -> None:
            """Calls on one lease overlap (the keepers sweep together): keep the latest."""
            last_acked_send[lease_id] = max(sent, last_acked_send.get(lease_id, sent))
            last_acked_answer[lease_id] = max(answered, last_acked_answer.get(lease_id, answered))
        totals: dict[str, Any] = {"acknowledged": 0, "not_found": 0, "requests": 0, "errors": 0, "attach_failed": 0,
                                  "grant_failed": 0, "last_error": None}
        attach_failed: set[str] = set()

        async def keep_alive(ids: list[int], count: bool) -> list[int]:
            """The ids acknowledged (none on an error)."""
            sent = time.monotonic()
            try:
                acknowledged, not_found = await keep_api.keep_alive(ids)
            except (httpx.HTTPError, aetcd.exceptions.ClientError) as exc:
                # E.g. a pooled connection the server closed as it was reused: counted, not fatal.
                totals["errors"] += 1
                totals["last_error"] = f"{type(exc).__name__}: {exc}"
                return []
            answered = time.monotonic()
            for lease_id in acknowledged:
                acknowledged_at(lease_id, sent, answered)
            if count:
                totals["acknowledged"] += len(acknowledged)
                totals["not_found"] += not_found
                totals["requests"] += 1
            return acknowledged

        async def grant(index: int) -> None:
            await may_grant.wait()
            sent = time.monotonic()
            try:
                lease_id = await api.grant(args.ttl_s)
            except httpx.HTTPError as exc:  # an unknown outcome: this lease is left out
                totals["grant_failed"] += 1
                totals["last_error"] = f"{type(exc).__name__}: {exc}"
                attach_failed.add(f"{KEY_PREFIX}{index:06d}")
                return
            acknowledged_at(lease_id, sent, time.monotonic())
            lease_ids[index] = lease_id
            granted.append(lease_id)
            if index < args.keyed:
                try:
                    await api.attach(f"{KEY_PREFIX}{index:06d}", lease_id)
                except httpx.HTTPError as exc:  # e.g. the lease expired already: not timed
                    totals["attach_failed"] += 1
                    totals["last_error"] = f"{type(exc).__name__}: {exc}"
                    attach_failed.add(f"{KEY_PREFIX}{index:06d}")

        granted: list[int] = []  # in the order granted
        granting = True
        setup_batch = 1 if api.kind == "etcd" else api.setup_batch or args.batch
        cursor = 0  # the keepers' next position in ``granted``: they sweep it together

        async def keep_granted_alive() -> None:
            """While granting (which may take longer than a TTL): keep the granted ones alive."""
            nonlocal cursor
            while granting:
                if cursor >= len(granted):
                    cursor = 0
                    await asyncio.sleep(0.05)
                    continue
                ids = granted[cursor:cursor + setup_batch]
                cursor += setup_batch
                await keep_alive(ids, count=False)
        may_grant = asyncio.Event()
        may_grant.set()
        grant_paused_s = 0.0

        async def pace_grants() -> None:
            """Pause the grants while the keepers fall behind, so no lease ends before measuring."""
            nonlocal grant_paused_s
            while granting:
                oldest = min((last_acked_send[lease_id] for lease_id in granted), default=time.monotonic())
                if time.monotonic() - oldest > GRANT_PAUSE_AGE * args.ttl_s:
                    may_grant.clear()
                    grant_paused_s += 0.1
                else:
                    may_grant.set()
                await asyncio.sleep(0.1)
        setup_keepers = [asyncio.create_task(keep_granted_alive()) for _ in range(api.setup_keepers)]
        pacer = asyncio.create_task(pace_grants())
        grant_s = await in_parallel(args.leases, args.concurrency, grant)
        granting = False
        await asyncio.gather(pacer, *setup_keepers)

        # Before measuring: renew every lease once; those not acknowledged had ended already.
        chunks = [granted[start:start + per_request] for start in range(0, len(granted), per_request)]
        alive: set[int] = set()

        async def renew_chunk(index: int) -> None:
            alive.update(await keep_alive(chunks[index], count=False))
        await in_parallel(len(chunks), args.concurrency, renew_chunk)
        print(f"{api.kind}: {len(alive)} of {len(granted)} granted leases alive at the start of the measured phase"
              + ("" if len(alive) == len(granted) else " (NOT all: its figures are not comparable)"), flush=True)

        # Keep-alive phase: sweep over every lease, closed loop.
        sweep = itertools.cycle(range(len(chunks)))
        stop_at = time.monotonic() + args.keepalive_s

        async def keeper() -> None:
            while time.monotonic() < stop_at:
                await keep_alive(chunks[next(sweep)], count=True)
        cpu_before = cpu_seconds([leader.pid])
        phase_s = await in_parallel(args.concurrency, args.concurrency, lambda _: keeper())
        cpu_used = cpu_seconds([leader.pid]) - cpu_before
        stopped_at = time.monotonic()

        # Expiry: the holders stopped; wait for every keyed lease's key to be deleted.
        deadlines = {f"{KEY_PREFIX}{index:06d}": last_acked_send[lease_ids[index]] + args.ttl_s
                     for index in range(args.keyed) if f"{KEY_PREFIX}{index:06d}" not in attach_failed}
        give_up = max(deadlines.values(), default=stopped_at) + EXPIRY_MARGIN_S
        while len(seen) < len(deadlines) and time.monotonic() < give_up:
            await asyncio.sleep(0.1)
        watcher.cancel()
    after_stop = [seen[key] - deadline for key, deadline in deadlines.items() if key in seen and deadline >= stopped_at]
    # The same from the answer of the last keep-alive: a lower bound, where after_stop's is an upper one.
    after_answer = [seen[key] - last_acked_answer[lease_ids[int(key[len(KEY_PREFIX):])]] - args.ttl_s
                    for key, deadline in deadlines.items() if key in seen and deadline >= stopped_at]
    processed = totals["acknowledged"] + totals["not_found"]
    return {
        "leases": args.leases, "granted": len(granted), "alive_at_measure_start": len(alive), "ttl_s": args.ttl_s, "grants_per_s": round(args.leases / grant_s, 1),
        "grants_paused_s": round(grant_paused_s, 1),
        "keepalive_requests": totals["requests"], "keepalives_acknowledged": totals["acknowledged"],
        "keepalives_not_found": totals["not_found"],
        "keepalives_per_s": round(totals["acknowledged"] / phase_s, 1),
        "sweeps_per_ttl": round(totals["acknowledged"] / phase_s * args.ttl_s / args.leases, 2),
        "leader_cpu_s": round(cpu_used, 2),
        "leader_cpu_ms_per_1000_keepalives": round(1e6 * cpu_used / max(processed, 1), 2),
        "expiry_latency_s": percentiles(after_stop), "expiry_latency_from_answer_s": percentiles(after_answer),
        "expired_after_stop": len(after_stop),
        "keyed_expired_before_stop": len([key for key, deadline in deadlines.items() if deadline < stopped_at]),
        "keyed_never_seen_deleted": len([key for key in deadlines if key not in seen]), "keyed": args.keyed,
        "keepalive_errors": totals["errors"], "attach_failed": totals["attach_failed"],
        "grant_failed": totals["grant_failed"], "last_error": totals["last_error"],
    }


STARTERS: dict[str, tuple[type[LeaseApi], Callable[[int], LocalCluster]]] = {
    "metakv": (MetakvLeases, start_metakv), "etcd": (EtcdLeases, start_etcd),
    "etcd-grpc": (EtcdGrpcLeases, start_etcd)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, default=10_000)
    parser.add_argument("--ttl-s", type=int, default=10)
    parser.add_argument("--keyed", type=int, default=1000, help="leases with a key attached (expiry is timed on them)")
    parser.add_argument("--keepalive-s", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1000,
                        help="ids per metakv keep-alive request (at most 10000) and per etcd-grpc stream")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--stores", default="metakv,etcd-grpc",
                        help="of metakv, etcd (JSON gateway, one lease per request), etcd-grpc (LeaseKeepAlive stream)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_leases.json"))
    args = parser.parse_args(argv)
    if not (0 < args.keyed <= args.leases and 0 < args.batch <= 10_000):
        parser.error("--keyed must be in [1, --leases] and --batch in [1, 10000]")
    stores = [kind for kind in STARTERS if kind in args.stores.split(",")]
    rounds: list[dict[str, Any]] = []
    for index in range(args.rounds):
        kinds = stores if index % 2 == 0 else stores[::-1]
        results: dict[str, Any] = {}
        for kind in kinds:
            api_type, start = STARTERS[kind]
            cluster = start(3)
            try:
                results[kind] = asyncio.run(bench_store(api_type, cluster, args))
            finally:
                cluster.stop()
            print(kind, json.dumps(results[kind]), flush=True)
        rounds.append(results)
    report: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds}
    if "metakv" in stores:
        report["ratio_metakv_to"] = {kind: ratios(rounds, kind) for kind in stores if kind != "metakv"}
        for kind, figures in report["ratio_metakv_to"].items():
            print(f"ratio metakv/{kind} (keep-alives/s: higher is better; CPU and latency: lower is better)",
                  json.dumps(figures), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


def ratios(rounds: list[dict[str, Any]], other: str) -> dict[str, float | None]:
    """metakv's figures over ``other``'s, the median over rounds (None where ``other``'s is 0)."""
    def ratio(mine: float | None, theirs: float | None) -> float | None:
        return mine / theirs if mine is not None and theirs else None

    figures: dict[str, list[float | None]] = {
        figure: [ratio(r["metakv"][figure], r[other][figure]) for r in rounds]
        for figure in ("keepalives_per_s", "leader_cpu_ms_per_1000_keepalives")}
    for figure in ("p50", "p99"):
        figures[f"expiry_latency_{figure}"] = [
            ratio(r["metakv"]["expiry_latency_s"].get(figure), r[other]["expiry_latency_s"].get(figure))
            for r in rounds]
    return {name: round(statistics.median(usable), 3) if (usable := [v for v in values if v is not None]) else None
            for name, values in figures.items()}


if __name__ == "__main__":
    raise SystemExit(main())
