"""Watch fan-out: write-to-event latency and events delivered per second with many watchers.

    python -m loadtest.bench_watch [--distinct 100] [--hot 10] [--rate 300] [--duration-s 10]
                                   [--writers 32] [--etcd] [--json PATH]

Starts a fresh 3-voter metakv cluster (and with ``--etcd`` a 3-member etcd 3.4 cluster after
it, in the same run) and opens ``--distinct`` watchers on distinct prefixes ``w/NNNN/`` plus
``--hot`` watchers on the one prefix ``hot/``, spread over the nodes round-robin, each a
long-lived stream (metakv: SSE on ``GET /v1/watch``; etcd: ``POST /v3/watch`` on its JSON
gateway), read by two watcher processes. Writes go to the leader, half under ``hot/`` and
half under one of the distinct prefixes, each value the writer's CLOCK_MONOTONIC time, so a
watcher process computes write-to-event latency per event (one clock on one machine).

After a 2 s warm-up at the fixed rate (not counted), two phases per store:
- **fixed rate**: ``--rate`` writes/s, open loop, for ``--duration-s``: the latency of every
  delivered event (p50, p99, max);
- **closed loop**: ``--writers`` concurrent writers for ``--duration-s``: events delivered
  per second over all watchers, and writes/s.
Each phase counts the events a watcher should have seen and the ones that arrived: the
difference (``missed``) must be 0. Figures are only meaningful as the ratio to etcd in the
same run: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import multiprocessing.connection
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.clusters import LocalCluster, start_etcd, start_metakv
from loadtest.stores import b64, parse_etcd_watch_message, prefix_end

WATCHER_PROCESSES = 2
HOT_PREFIX = "hot/"
DRAIN_S = 5.0  # after the last write: how long watchers may take to deliver the rest
CONNECT_TIMEOUT_S = 60.0
WARM_UP_S = 2.0


def distinct_prefix(index: int) -> str:
    return f"w/{index:04d}/"


# ---- watchers (in their own processes) ---------------------------------------------------------


async def _metakv_stream(url: str, prefix: str, since: int, ready: asyncio.Event, sink: list[tuple[float, float]],
                         stop: asyncio.Event) -> None:
    params = {"prefix": prefix, "since": since, "timeout_ms": 300_000}
    async with httpx.AsyncClient(timeout=None) as client, client.stream(
            "GET", f"{url}/v1/watch", params=params, headers={"accept": "text/event-stream"}) as response:
        async for line in response.aiter_lines():
            if line.startswith("retry:"):
                ready.set()
            elif line.startswith("data: "):
                now = time.monotonic()
                event = json.loads(line[6:])
                sink.append((now, float(event["value"])))
            if stop.is_set():
                return


async def _etcd_stream(url: str, prefix: str, since: int, ready: asyncio.Event, sink: list[tuple[float, float]],
                       stop: asyncio.Event) -> None:
    body = json.dumps({"create_request": {"key": b64(prefix), "range_end": b64(prefix_end(prefix.encode())),
                                          "start_revision": str(since + 1)}})
    async with httpx.AsyncClient(timeout=None) as client, client.stream(
            "POST", f"{url}/v3/watch", content=body, headers={"content-type": "application/json"}) as response:
        async for line in response.aiter_lines():
            if not line.strip():
                continue
            now = time.monotonic()
            batch = parse_etcd_watch_message(line.encode())
            if batch is None:
                ready.set()  # the "created" acknowledgement
                continue
            sink.extend((now, float(event.value or b"0")) for event in batch.events)
            if stop.is_set():
                return


def watcher_process(kind: str, streams: list[tuple[str, str]], since: int,
                    control: multiprocessing.connection.Connection) -> None:
    """Open ``streams`` ((url, prefix) each), say "ready", then on each "collect" send the
    (arrival, sent) times of the events received since the last collect; "stop" ends."""
    asyncio.run(_watch_all(kind, streams, since, control))


async def _watch_all(kind: str, streams: list[tuple[str, str]], since: int,
                     control: multiprocessing.connection.Connection) -> None:
    stream = _metakv_stream if kind == "metakv" else _etcd_stream
    sinks: list[list[tuple[float, float]]] = [[] for _ in streams]
    readies = [asyncio.Event() for _ in streams]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(stream(url, prefix, since, ready, sink, stop))
             for (url, prefix), ready, sink in zip(streams, readies, sinks, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(ready.wait() for ready in readies)), CONNECT_TIMEOUT_S)
    loop = asyncio.get_running_loop()
    control.send("ready")
    while True:
        command = await loop.run_in_executor(None, control.recv)
        if command == "stop":
            break
        collected = [list(sink) for sink in sinks]
        for sink in sinks:
            sink.clear()
        control.send(collected)
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# ---- writers -----------------------------------------------------------------------------------


class RawConnection:
    """One keep-alive HTTP/1.1 connection, a request at a time: the writers' client (httpx's
    pool spends its time matching hundreds of queued requests to connections, enough to
    make the load generator, not the stores, the bottleneck on a shared machine)."""

    def __init__(self, url: str) -> None:
        self.host, _, port = url.removeprefix("http://").partition(":")
        self.port = int(port)
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(self, method: str, path: str, body: bytes, content_type: str) -> int:
        if self._streams is None:
            self._streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._streams
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        status = int(head[9:12])
        if "transfer-encoding: chunked" in head:
            while True:
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                await reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            length = head.partition("content-length:")[2].partition("\r\n")[0].strip()
            await reader.readexactly(int(length or 0))
        return status

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


class Writes:
    """Writes to the leader, half under ``hot/``, half under a random distinct prefix; counts
    the events each should cause (one per watcher of its prefix). Each value is the time the
    request was sent."""

    def __init__(self, kind: str, leader_url: str, distinct: int, hot: int, seed: int) -> None:
        self.kind = kind
        self.leader_url = leader_url
        self.distinct = distinct
        self.hot = hot
        self.rng = random.Random(seed)
        self.done = 0
        self.failed = 0
        self.expected_events = 0
        self.sequence = 0

    async def one(self, connection: RawConnection) -> None:
        self.sequence += 1
        if self.rng.random() < 0.5:
            key, fanout = f"{HOT_PREFIX}{self.sequence % 1000}", self.hot
        else:
            key, fanout = f"{distinct_prefix(self.rng.randrange(self.distinct))}{self.sequence % 100}", 1
        value = f"{time.monotonic():.6f}"
        try:
            if self.kind == "metakv":
                status = await connection.request("PUT", f"/v1/kv/{key}", value.encode(), "text/plain")
            else:
                body = json.dumps({"key": b64(key), "value": b64(value)}).encode()
                status = await connection.request("POST", "/v3/kv/put", body, "application/json")
        except (OSError, asyncio.IncompleteReadError, ValueError):
            self.failed += 1
            connection.close()  # the next write opens a new one
            return
        if status == 200:
            self.done += 1
            self.expected_events += fanout
        else:
            self.failed += 1


async def fixed_rate(writes: Writes, rate: int, duration_s: float, connections: int = 64) -> float:
    """``rate`` writes/s for ``duration_s``, open loop: each due write goes out on the next
    free connection (its value is the time it is sent, so a busy client adds no latency)."""
    due: asyncio.Queue[int | None] = asyncio.Queue()
    pool = [RawConnection(writes.leader_url) for _ in range(connections)]

    async def sender(connection: RawConnection) -> None:
        while await due.get() is not None:
            await writes.one(connection)

    senders = [asyncio.create_task(sender(connection)) for connection in pool]
    started = time.monotonic()
    for index in range(int(rate * duration_s)):
        delay = started + index / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        due.put_nowait(index)
    for _ in pool:
        due.put_nowait(None)
    await asyncio.gather(*senders)
    for connection in pool:
        connection.close()
    return time.monotonic() - started


async def closed_loop(writes: Writes, writers: int, duration_s: float) -> float:
    pool = [RawConnection(writes.leader_url) for _ in range(writers)]
    started = time.monotonic()
    end = started + duration_s

    async def writer(connection: RawConnection) -> None:
        while time.monotonic() < end:
            await writes.one(connection)

    await asyncio.gather(*(writer(connection) for connection in pool))
    for connection in pool:
        connection.close()
    return time.monotonic() - started


# ---- one store ---------------------------------------------------------------------------------


def _percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _collect(controls: list[multiprocessing.connection.Connection]) -> list[tuple[float, float]]:
    events: list[tuple[float, float]] = []
    for control in controls:
        control.send("collect")
    for control in controls:
        for sink in control.recv():
            events.extend(sink)
    return events


def _phase(controls: list[multiprocessing.connection.Connection], writes: Writes, run: Any) -> dict[str, Any]:
    _collect(controls)  # forget what came before
    writes.done = writes.failed = writes.expected_events = 0
    started = time.monotonic()
    elapsed_s = asyncio.run(run)
    events: list[tuple[float, float]] = []
    deadline = time.monotonic() + DRAIN_S
    while True:  # until every expected event arrived, or the drain time passed
        events += _collect(controls)
        if len(events) >= writes.expected_events or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    latencies_ms = [(arrived - sent) * 1000 for arrived, sent in events]
    last_arrival = max((arrived for arrived, _ in events), default=started)
    return {
        "writes": writes.done, "write_errors": writes.failed, "writes_per_s": round(writes.done / elapsed_s, 1),
        "expected_events": writes.expected_events, "delivered_events": len(events),
        "missed": writes.expected_events - len(events),
        "events_per_s": round(len(events) / max(1e-9, last_arrival - started), 1),
        "latency_ms": {"p50": round(_percentile(latencies_ms, 0.5), 2), "p99": round(_percentile(latencies_ms, 0.99), 2),
                       "max": round(max(latencies_ms, default=float("nan")), 2),
                       "mean": round(statistics.fmean(latencies_ms), 2) if latencies_ms else None},
    }


def bench_store(cluster: LocalCluster, args: argparse.Namespace) -> dict[str, Any]:
    leader = cluster.leader()
    if leader is None:
        raise RuntimeError(f"{cluster.kind}: no leader")
    prefixes = [distinct_prefix(index) for index in range(args.distinct)] + [HOT_PREFIX] * args.hot
    endpoints = cluster.endpoints
    streams = [(endpoints[index % len(endpoints)], prefix) for index, prefix in enumerate(prefixes)]
    context = multiprocessing.get_context("spawn")
    controls: list[multiprocessing.connection.Connection] = []
    processes = []
    since = 0
    for index in range(WATCHER_PROCESSES):
        mine, theirs = context.Pipe()
        process = context.Process(target=watcher_process, args=(cluster.kind, streams[index::WATCHER_PROCESSES], since, theirs),
                                  daemon=True)
        process.start()
        controls.append(mine)
        processes.append(process)
    try:
        for control in controls:
            if not control.poll(CONNECT_TIMEOUT_S) or control.recv() != "ready":
                raise RuntimeError(f"{cluster.kind}: watchers did not connect")
        writes = Writes(cluster.kind, leader.url, args.distinct, args.hot, seed=19)
        _phase(controls, writes, fixed_rate(writes, args.rate, WARM_UP_S))  # connections, caches: not counted
        result = {
            "fixed_rate": _phase(controls, writes, fixed_rate(writes, args.rate, args.duration_s)),
            "closed_loop": _phase(controls, writes, closed_loop(writes, args.writers, args.duration_s)),
        }
        for control in controls:
            control.send("stop")
        return result
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--distinct", type=int, default=100, help="watchers on distinct prefixes")
    parser.add_argument("--hot", type=int, default=10, help="watchers on the one hot prefix")
    parser.add_argument("--rate", type=int, default=300, help="writes/s in the fixed-rate phase")
    parser.add_argument("--writers", type=int, default=32, help="concurrent writers in the closed-loop phase")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--etcd", action="store_true", help="also run etcd 3.4, in the same run")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"settings": {key: value for key, value in vars(args).items() if key != "json"}}
    starters = [("metakv", start_metakv)] + ([("etcd", start_etcd)] if args.etcd else [])
    for kind, start in starters:
        cluster = start(3)
        try:
            results[kind] = bench_store(cluster, args)
        finally:
            cluster.stop()
        print(kind, json.dumps(results[kind], indent=1), flush=True)
    if args.etcd:
        results["ratio_metakv_to_etcd"] = {
            phase: {
                "events_per_s": round(results["metakv"][phase]["events_per_s"] / results["etcd"][phase]["events_per_s"], 2),
                "latency_p50": round(results["metakv"][phase]["latency_ms"]["p50"] / results["etcd"][phase]["latency_ms"]["p50"], 2),
                "latency_p99": round(results["metakv"][phase]["latency_ms"]["p99"] / results["etcd"][phase]["latency_ms"]["p99"], 2),
            }
            for phase in ("fixed_rate", "closed_loop")
        }
        print("ratio metakv/etcd (events/s: higher is better; latency: lower is better)",
              json.dumps(results["ratio_metakv_to_etcd"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
