"""Leases at scale, metakv against etcd in the same run: keep-alive throughput, the leader's
CPU per keep-alive, and how late leases expire once their holders stop.

    python -m loadtest.bench_leases [--leases 10000] [--ttl-s 10] [--keyed 1000]
                                    [--keepalive-s 15] [--rounds 1] [--out results/bench_leases.json]

Each round starts a fresh 3-voter metakv cluster and a fresh 3-member etcd 3.4 cluster, one
after the other (the order alternates every round), and with one load generator (this
process, one asyncio loop, ``--concurrency`` requests in flight):
1. grants ``--leases`` leases of ``--ttl-s`` (metakv ``POST /v1/leases``; etcd's JSON gateway
   ``POST /v3/lease/grant``) and attaches one key to each of the first ``--keyed``;
2. keeps every lease alive for ``--keepalive-s``, closed loop, sweeping over all of them
   (metakv: ``POST /v1/leases/keepalive`` with ``--batch`` ids per request; etcd: the
   gateway's ``POST /v3/lease/keepalive``, one lease per request, as its JSON API has no
   batch form): leases kept alive per second, and the leader process's CPU seconds (Linux
   /proc) per thousand keep-alives;
3. stops, with a watch open on the keys' prefix (metakv SSE, etcd gateway watch): for each
   keyed lease, the time from its deadline (when its last acknowledged keep-alive was
   *sent*, plus the TTL: never earlier than the leader's real deadline) to its key's delete
   arriving at the watcher: the expiry latency distribution.
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

import httpx

from loadtest.bench_http import cpu_seconds
from loadtest.clusters import LocalCluster, start_etcd, start_metakv
from loadtest.stores import b64, parse_etcd_watch_message, prefix_end

KEY_PREFIX = "benchlease/"
EXPIRY_MARGIN_S = 30.0  # after the last deadline: how long to wait for the remaining deletes
WATCH_READY_S = 30.0
SETUP_KEEPERS = 8  # tasks keeping the granted leases alive while the rest are granted


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(fraction: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))], 3)
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": round(ordered[-1], 3),
            "mean": round(statistics.fmean(ordered), 3)}


class MetakvLeases:
    kind = "metakv"

    def __init__(self, http: httpx.AsyncClient, leader: str) -> None:
        self.http, self.leader = http, leader

    async def grant(self, ttl_s: int) -> int:
        response = await self.http.post(f"{self.leader}/v1/leases", json={"ttl_s": ttl_s})
        response.raise_for_status()
        return int(response.json()["id"])

    async def attach(self, key: str, lease_id: int) -> None:
        response = await self.http.put(f"{self.leader}/v1/kv/{key}", params={"lease": lease_id}, content=b"x")
        response.raise_for_status()

    async def keep_alive(self, lease_ids: list[int]) -> tuple[int, int]:
        """(acknowledged, not found)"""
        response = await self.http.post(f"{self.leader}/v1/leases/keepalive", json={"ids": lease_ids})
        response.raise_for_status()
        body = response.json()
        return len(body["leases"]), len(body["not_found"])

    async def watch_deletes(self, ready: asyncio.Event, seen: dict[str, float]) -> None:
        params = {"prefix": KEY_PREFIX, "timeout_ms": 600_000}
        async with httpx.AsyncClient(timeout=None) as client, client.stream(
                "GET", f"{self.leader}/v1/watch", params=params, headers={"accept": "text/event-stream"}) as response:
            async for line in response.aiter_lines():
                if line.startswith("retry:"):
                    ready.set()
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event.get("type") == "delete":
                        seen.setdefault(event["key"], time.monotonic())


class EtcdLeases:
    kind = "etcd"

    def __init__(self, http: httpx.AsyncClient, leader: str) -> None:
        self.http, self.leader = http, leader

    async def grant(self, ttl_s: int) -> int:
        response = await self.http.post(f"{self.leader}/v3/lease/grant", json={"TTL": ttl_s})
        response.raise_for_status()
        return int(response.json()["ID"])

    async def attach(self, key: str, lease_id: int) -> None:
        response = await self.http.post(f"{self.leader}/v3/kv/put",
                                        json={"key": b64(key), "value": b64("x"), "lease": str(lease_id)})
        response.raise_for_status()

    async def keep_alive(self, lease_ids: list[int]) -> tuple[int, int]:
        acknowledged = not_found = 0
        for lease_id in lease_ids:
            response = await self.http.post(f"{self.leader}/v3/lease/keepalive", json={"ID": str(lease_id)})
            response.raise_for_status()
            if int(response.json().get("result", {}).get("TTL", 0)) > 0:
                acknowledged += 1
            else:
                not_found += 1
        return acknowledged, not_found

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


Api = MetakvLeases | EtcdLeases


async def in_parallel(count: int, concurrency: int, job: Callable[[int], Awaitable[None]]) -> float:
    """Run ``job(0..count-1)`` with ``concurrency`` in flight; the seconds it took."""
    indexes = iter(range(count))
    started = time.monotonic()

    async def worker() -> None:
        for index in indexes:
            await job(index)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.monotonic() - started


async def bench_store(api_type: type[Api], cluster: LocalCluster, args: argparse.Namespace) -> dict[str, Any]:
    leader = cluster.leader()
    assert leader is not None and leader.pid is not None
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as http:
        api = api_type(http, leader.url)
        lease_ids: list[int] = [0] * args.leases
        per_request = args.batch if api.kind == "metakv" else 1
        granted: list[int] = []
        granting = asyncio.Event()
        granting.set()

        async def grant(index: int) -> None:
            lease_id = await api.grant(args.ttl_s)
            if index < args.keyed:
                await api.attach(f"{KEY_PREFIX}{index:06d}", lease_id)
            lease_ids[index] = lease_id
            granted.append(lease_id)

        async def keep_granted_alive(worker: int, workers: int) -> None:
            """While granting (which may take longer than a TTL): keep the granted ones alive."""
            while granting.is_set():
                ids = list(granted)
                for start in range(worker * per_request, len(ids), per_request * workers):
                    await api.keep_alive(ids[start:start + per_request])
                await asyncio.sleep(0.05)
        setup_keepers = [asyncio.create_task(keep_granted_alive(worker, SETUP_KEEPERS)) for worker in range(SETUP_KEEPERS)]
        grant_s = await in_parallel(args.leases, args.concurrency, grant)
        granting.clear()
        await asyncio.gather(*setup_keepers)

        # Keep-alive phase: sweep over every lease, closed loop; remember when each lease's
        # last acknowledged keep-alive was sent (its deadline is that plus the TTL).
        chunks = [lease_ids[start:start + per_request] for start in range(0, len(lease_ids), per_request)]
        sweep = itertools.cycle(range(len(chunks)))
        last_sent: dict[int, float] = {}
        totals = {"acknowledged": 0, "not_found": 0, "requests": 0}
        stop_at = time.monotonic() + args.keepalive_s

        async def keeper() -> None:
            while time.monotonic() < stop_at:
                chunk = chunks[next(sweep)]
                sent = time.monotonic()
                acknowledged, not_found = await api.keep_alive(chunk)
                totals["acknowledged"] += acknowledged
                totals["not_found"] += not_found
                totals["requests"] += 1
                for lease_id in chunk:
                    last_sent[lease_id] = sent
        cpu_before = cpu_seconds([leader.pid])
        phase_s = await in_parallel(args.concurrency, args.concurrency, lambda _: keeper())
        cpu_used = cpu_seconds([leader.pid]) - cpu_before

        # Expiry: the holders stopped; a watcher sees each keyed lease's key deleted.
        seen: dict[str, float] = {}
        ready = asyncio.Event()
        watcher = asyncio.create_task(api.watch_deletes(ready, seen))
        await asyncio.wait_for(ready.wait(), WATCH_READY_S)
        deadlines = {f"{KEY_PREFIX}{index:06d}": last_sent.get(lease_ids[index], stop_at) + args.ttl_s
                     for index in range(args.keyed)}
        give_up = max(deadlines.values(), default=time.monotonic()) + EXPIRY_MARGIN_S
        while len(seen) < len(deadlines) and time.monotonic() < give_up:
            await asyncio.sleep(0.1)
        watcher.cancel()
        latencies = [seen[key] - deadline for key, deadline in deadlines.items() if key in seen]
    acknowledged = totals["acknowledged"]
    return {
        "leases": args.leases, "ttl_s": args.ttl_s, "grants_per_s": round(args.leases / grant_s, 1),
        "keepalive_requests": totals["requests"], "keepalives_acknowledged": acknowledged,
        "keepalives_not_found": totals["not_found"],
        "keepalives_per_s": round(acknowledged / phase_s, 1),
        "sweeps_per_ttl": round(acknowledged / phase_s * args.ttl_s / args.leases, 2),
        "leader_cpu_s": round(cpu_used, 2),
        "leader_cpu_ms_per_1000_keepalives": round(1e6 * cpu_used / max(acknowledged, 1), 2),
        "expiry_latency_s": percentiles(latencies), "expired_seen": len(latencies), "keyed": args.keyed,
    }


STARTERS: dict[str, tuple[type[Api], Callable[[int], LocalCluster]]] = {
    "metakv": (MetakvLeases, start_metakv), "etcd": (EtcdLeases, start_etcd)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, default=10_000)
    parser.add_argument("--ttl-s", type=int, default=10)
    parser.add_argument("--keyed", type=int, default=1000, help="leases with a key attached (expiry is timed on them)")
    parser.add_argument("--keepalive-s", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1000, help="ids per metakv keep-alive request (at most 10000)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--stores", default="metakv,etcd", help="which to run (both for the ratios)")
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
    if len(stores) < 2:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds}))
        return 0
    ratios = {figure: round(statistics.median(r["metakv"][figure] / r["etcd"][figure] for r in rounds), 3)
              for figure in ("keepalives_per_s", "leader_cpu_ms_per_1000_keepalives")}
    ratios["expiry_latency_p50"] = round(statistics.median(
        r["metakv"]["expiry_latency_s"]["p50"] / r["etcd"]["expiry_latency_s"]["p50"] for r in rounds), 3)
    report = {"settings": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds, "ratio_metakv_to_etcd": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print("ratio metakv/etcd (keep-alives/s: higher is better; CPU and latency: lower is better)", json.dumps(ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
