"""What the Python client (metakv/) costs: per request against raw httpx, and writes/s at 64
async clients against the HTTP benchmark's own load generator, on one 3-voter cluster.

    python -m loadtest.bench_client [--requests 2000] [--duration-s 5] [--rounds 3]
                                    [--out results/bench_client.json]

- Overhead per request: one sequential caller, one keep-alive connection to the leader,
  ``--requests`` GETs of one key (consistency=local), then as many PUTs of fresh keys, with a
  raw ``httpx.Client`` and with ``metakv.Client`` (read-your-writes on, so its GETs carry
  ``min_version``). Figures: wall time and this process's CPU time per request.
- Writes/s at 64 clients for ``--duration-s``: wrk with 64 connections to the leader
  (``loadtest.bench_http.closed_loop``, the harness's figure), 64 asyncio tasks sharing one
  ``metakv.AsyncClient``, and 64 tasks sharing one raw ``httpx.AsyncClient`` (what any Python
  caller pays before the client adds anything).

Each round runs every variant back to back, the order rotating between rounds; ratios are
taken within a round and their median is reported (the machine's speed drifts over minutes).
A benchmark never fails on a figure; it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench_http import closed_loop
from loadtest.local_cluster import Cluster
from metakv import AsyncClient, Client

VALUE = b"v" * 256  # the HTTP benchmark's value size
CLIENTS = 64
READ_KEY = "bench/client/read"


def per_request(run: Callable[[int], None], requests: int) -> dict[str, float]:
    """Wall and CPU microseconds per request of ``run(i)`` over ``requests`` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for index in range(requests):
        run(index)
    return {"wall_us": (time.perf_counter() - wall) / requests * 1e6,
            "cpu_us": (time.process_time() - cpu) / requests * 1e6}


def sequential_round(url: str, requests: int, round_index: int) -> dict[str, dict[str, float]]:
    """GET and PUT per-request costs, raw httpx and metakv.Client, in a rotating order."""
    figures: dict[str, dict[str, float]] = {}
    with httpx.Client(base_url=url, timeout=10.0) as raw, Client(url, timeout_s=10.0) as kv:
        kv.put(READ_KEY, VALUE)
        raw.get(f"/v1/kv/{READ_KEY}")  # both connections open before anything is timed
        variants: dict[str, Callable[[int], Any]] = {
            "get_raw": lambda i: raw.get(f"/v1/kv/{READ_KEY}").raise_for_status(),
            "get_client": lambda i: kv.get(READ_KEY),
            "put_raw": lambda i: raw.put(f"/v1/kv/bench/client/raw{round_index}/{i}", content=VALUE).raise_for_status(),
            "put_client": lambda i: kv.put(f"bench/client/lib{round_index}/{i}", VALUE),
        }
        names = list(variants)
        for name in names[round_index % 2::2] + names[1 - round_index % 2::2]:
            figures[name] = per_request(variants[name], requests)
    return figures


async def closed_writers(write: Callable[[str], Awaitable[Any]], duration_s: float, tag: str) -> dict[str, float]:
    """CLIENTS tasks writing fresh keys back to back for ``duration_s``: writes/s."""
    deadline = time.perf_counter() + duration_s
    done = [0]

    async def writer(task: int) -> None:
        for sequence in itertools.count():
            if time.perf_counter() >= deadline:
                return
            await write(f"bench/client/{tag}/{task}/{sequence}")
            done[0] += 1
    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(writer(task) for task in range(CLIENTS)))
    elapsed_s = time.perf_counter() - started
    return {"writes_per_s": done[0] / elapsed_s, "generator_cpu_share": (time.process_time() - cpu) / elapsed_s}


async def async_client_writes(urls: list[str], duration_s: float, tag: str) -> dict[str, float]:
    async with AsyncClient(urls, max_connections=CLIENTS) as kv:
        return await closed_writers(lambda key: kv.put(key, VALUE), duration_s, tag)


async def raw_async_writes(url: str, duration_s: float, tag: str) -> dict[str, float]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=10.0, limits=limits) as raw:
        async def put(key: str) -> None:
            (await raw.put(f"/v1/kv/{key}", content=VALUE)).raise_for_status()
        return await closed_writers(put, duration_s, tag)


def wrk_writes(url: str, duration_s: float) -> dict[str, Any]:
    figures = closed_loop([url], CLIENTS, duration_s, "write")
    return {"writes_per_s": figures["per_s"], "errors": figures["errors"]}


def throughput_round(leader_url: str, urls: list[str], duration_s: float, round_index: int) -> dict[str, Any]:
    variants: dict[str, Callable[[], dict[str, Any]]] = {
        "wrk": lambda: wrk_writes(leader_url, duration_s),
        "async_client": lambda: asyncio.run(async_client_writes(urls, duration_s, f"lib{round_index}")),
        "async_raw": lambda: asyncio.run(raw_async_writes(leader_url, duration_s, f"raw{round_index}")),
    }
    names = list(variants)
    order = names[round_index % 3:] + names[:round_index % 3]
    figures = {name: variants[name]() for name in order}
    return {"order": order, "writes_per_s": {name: figures[name]["writes_per_s"] for name in names},
            "generator_cpu_share": {name: figures[name].get("generator_cpu_share") for name in names},
            "wrk_errors": figures["wrk"].get("errors")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="sequential requests per variant and round")
    parser.add_argument("--duration-s", type=float, default=5.0, help="each 64-client phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/bench_client.json"))
    args = parser.parse_args(argv)
    if args.requests < 1 or args.duration_s <= 0 or args.rounds < 1:
        print("bench_client: --requests, --duration-s and --rounds must be positive", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="metakv-bench-client-") as root, Cluster(Path(root), voters=3) as cluster:
        leader = cluster.wait_for_leader()
        urls = [leader.url, *(node.url for node in cluster.voters if node is not leader)]
        sequential = [sequential_round(leader.url, args.requests, index) for index in range(args.rounds)]
        throughput = [throughput_round(leader.url, urls, args.duration_s, index) for index in range(args.rounds)]
    summary = {
        "get_wall_us": {kind: statistics.median(r[f"get_{kind}"]["wall_us"] for r in sequential) for kind in ("raw", "client")},
        "put_wall_us": {kind: statistics.median(r[f"put_{kind}"]["wall_us"] for r in sequential) for kind in ("raw", "client")},
        "get_cpu_us": {kind: statistics.median(r[f"get_{kind}"]["cpu_us"] for r in sequential) for kind in ("raw", "client")},
        "put_cpu_us": {kind: statistics.median(r[f"put_{kind}"]["cpu_us"] for r in sequential) for kind in ("raw", "client")},
        "ratios_median": {
            "get_wall_client_over_raw": statistics.median(r["get_client"]["wall_us"] / r["get_raw"]["wall_us"] for r in sequential),
            "put_wall_client_over_raw": statistics.median(r["put_client"]["wall_us"] / r["put_raw"]["wall_us"] for r in sequential),
            "get_cpu_client_over_raw": statistics.median(r["get_client"]["cpu_us"] / r["get_raw"]["cpu_us"] for r in sequential),
            "put_cpu_client_over_raw": statistics.median(r["put_client"]["cpu_us"] / r["put_raw"]["cpu_us"] for r in sequential),
            "writes64_async_client_over_wrk": statistics.median(
                r["writes_per_s"]["async_client"] / r["writes_per_s"]["wrk"] for r in throughput),
            "writes64_async_client_over_async_raw": statistics.median(
                r["writes_per_s"]["async_client"] / r["writes_per_s"]["async_raw"] for r in throughput),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "sequential": sequential,
                                    "throughput": throughput, "summary": summary}, indent=2))
    for name in ("get", "put"):
        wall, cpu = summary[f"{name}_wall_us"], summary[f"{name}_cpu_us"]
        print(f"{name.upper()} per request: raw httpx {wall['raw']:.0f} us wall / {cpu['raw']:.0f} us CPU, "
              f"metakv.Client {wall['client']:.0f} us wall / {cpu['client']:.0f} us CPU")
    for index, r in enumerate(throughput):
        print(f"round {index + 1} writes/s at {CLIENTS}: " + ", ".join(
            f"{name} {value:.0f}" for name, value in r["writes_per_s"].items()))
    for name, value in summary["ratios_median"].items():
        print(f"{name}: {value:.2f}")
    print(f"figures: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
