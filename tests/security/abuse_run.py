"""The issue's abuse at full scale against one real node (`make abuse`; tests/security/test_abuse.py
runs each at a small scale in `make test`): 5,000 idle connections, 1,000 SSE watchers that
never read while values are written, 1,000 slowloris clients dripping a header byte at a time,
a 1 GiB announced Content-Length and deeply nested txn JSON, all at once. Throughout, an
ordinary client's GET must keep succeeding; the node's RSS is sampled and must stay bounded.

Each attack comes from its own loopback address (127.0.0.x), so each stays under the
per-client connection cap and the node holds them all: the caps are not what saves it here.
Prints the figures and writes them as JSON (--out); exits 1 when a check fails.

    python -m tests.security.abuse_run --out results/abuse.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from tests.cluster import Cluster

IDLE_CONNECTIONS = 5000
SILENT_WATCHERS = 1000
SLOWLORIS_CLIENTS = 1000
ANNOUNCED_BODY_BYTES = 1024 ** 3
NESTING_DEPTH = 100_000
PER_ADDRESS = 500  # connections per source address, under the per-client cap (1,000)
EVENT_VALUES = 200
EVENT_VALUE = b"e" * (64 * 1024)  # 12.5 MiB of events every silent watcher is sent
SLOWLORIS_DRIP_S = 0.5
# Longer than the header timeout (10 s), which closes the slowloris and idle connections; the
# run then lasts until the write-stall timeout (30 s) dropped every watcher, or DROP_WAIT_S.
ATTACK_S = 20.0
DROP_WAIT_S = 180.0
# Measured: ~55 MiB for the 6,000 idle and slowloris connections, ~260 MiB for the 1,000 silent
# watchers until the write-stall timeout drops them (bounded per watcher, not per event: twice
# the events cost the same).
RSS_GROWTH_BOUND_MIB = 512
SAMPLE_S = 0.2


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS line")


def open_descriptors(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


async def connect_from(source: str, port: int, receive_buffer: int | None = None) -> socket.socket:
    """A non-blocking connection from the loopback address ``source``."""
    conn = socket.socket()
    conn.setblocking(False)
    if receive_buffer is not None:  # before connect: the window the node may fill
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    conn.bind((source, 0))
    await asyncio.get_running_loop().sock_connect(conn, ("127.0.0.1", port))
    return conn


def source_address(group: int, index: int) -> str:
    """Group ``group``'s ``index``-th connection's source: 127.<group>.<n>.1, PER_ADDRESS each."""
    return f"127.{group}.{index // PER_ADDRESS}.1"


async def open_many(count: int, group: int, port: int, receive_buffer: int | None = None) -> list[socket.socket]:
    opened: list[socket.socket] = []
    for start in range(0, count, 200):  # batches: the listen backlog takes them in turn
        opened += await asyncio.gather(*(connect_from(source_address(group, index), port, receive_buffer)
                                         for index in range(start, min(count, start + 200))))
    return opened


async def slowloris(conn: socket.socket, stop_at_s: float) -> str:
    """Drip a never-ending header; what the node answered before it closed the connection."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError):
        await loop.sock_sendall(conn, b"GET /v1/kv/k HTTP/1.1\r\nHost: metakv\r\nX-Slow: ")
        while time.monotonic() < stop_at_s:
            await loop.sock_sendall(conn, b"a")
            await asyncio.sleep(SLOWLORIS_DRIP_S)
            with contextlib.suppress(BlockingIOError):
                answer = conn.recv(65536)
                return answer.split(b"\r\n", 1)[0].decode("latin-1") or "closed"
    return "closed" if time.monotonic() < stop_at_s else "still open"


def announced_body(port: int) -> list[str]:
    """A PUT and a txn announcing 1 GiB and sending none of it: the status lines."""
    answers = []
    for method, target in (("PUT", "/v1/kv/big"), ("POST", "/v1/txn")):
        with socket.create_connection(("127.0.0.1", port), timeout=30.0, source_address=("127.0.0.2", 0)) as conn:
            conn.sendall(f"{method} {target} HTTP/1.1\r\nHost: metakv\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {ANNOUNCED_BODY_BYTES}\r\n\r\n".encode())
            answers.append(conn.recv(65536).split(b"\r\n", 1)[0].decode("latin-1"))
    return answers


async def run(out: Path | None) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process holds ~7,000 sockets
    figures: dict[str, Any] = {"descriptor_limit": hard}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="metakv-abuse-") as root:
        cluster = Cluster(Path(root), voters=1)
        held: list[socket.socket] = []
        try:
            cluster.start()
            node = cluster.wait_for_leader()
            assert node.pid is not None
            pid, port = node.pid, node.http_port
            loop = asyncio.get_running_loop()
            async with httpx.AsyncClient(timeout=30.0) as client:
                version = int((await client.put(f"{node.url}/v1/kv/k", content=b"v")).headers["x-metadata-version"])
                figures["rss_before_mib"] = round(rss_mib(pid), 1)
                samples: list[float] = []
                gets: list[tuple[int, float]] = []  # (status, seconds) of the ordinary client's GETs
                attack_over = asyncio.Event()

                async def sample() -> None:
                    while not attack_over.is_set():
                        samples.append(rss_mib(pid))
                        await asyncio.sleep(SAMPLE_S)

                async def ordinary_gets() -> None:
                    while not attack_over.is_set():
                        started_s = time.perf_counter()
                        try:
                            response = await client.get(f"{node.url}/v1/kv/k")
                            ok = response.status_code == 200 and response.content == b"v"
                            gets.append((response.status_code if ok else -response.status_code,
                                         time.perf_counter() - started_s))
                        except httpx.HTTPError:
                            gets.append((0, time.perf_counter() - started_s))
                        await asyncio.sleep(0.1)

                sampler, getter = asyncio.create_task(sample()), asyncio.create_task(ordinary_gets())
                stop_at_s = time.monotonic() + ATTACK_S
                started_s = time.monotonic()
                # 1,000 SSE watchers that never read, with small windows, then the events.
                watchers = await open_many(SILENT_WATCHERS, 3, port, receive_buffer=4096)
                request = (f"GET /v1/watch?prefix=ev/&since={version}&timeout_ms=300000 HTTP/1.1\r\n"
                           "Host: metakv\r\nAccept: text/event-stream\r\n\r\n").encode()
                await asyncio.gather(*(loop.sock_sendall(conn, request) for conn in watchers))
                held += watchers
                progress(started_s, f"{len(watchers)} silent watchers open")
                # 5,000 idle connections that send nothing.
                held += await open_many(IDLE_CONNECTIONS, 1, port)
                progress(started_s, f"{IDLE_CONNECTIONS} idle connections open")
                figures["node_descriptors_at_peak"] = open_descriptors(pid)
                # 1,000 slowloris clients, and the two single shots.
                lorises = await open_many(SLOWLORIS_CLIENTS, 4, port)
                held += lorises
                loris_tasks = [asyncio.create_task(slowloris(conn, stop_at_s)) for conn in lorises]
                figures["announced_1_gib_answers"] = await asyncio.to_thread(announced_body, port)
                nested = b'{"compare": ' + b"[" * NESTING_DEPTH + b"]" * NESTING_DEPTH + b"}"
                figures["nested_json_status"] = (await client.post(f"{node.url}/v1/txn", content=nested)).status_code
                progress(started_s, "slowloris started, 1 GiB Content-Length and nested JSON sent")
                for index in range(EVENT_VALUES):
                    written = await client.put(f"{node.url}/v1/kv/ev/{index}", content=EVENT_VALUE)
                    if written.status_code != 200:
                        failures.append(f"a put during the attack answered {written.status_code}")
                        break
                figures["puts_done_after_s"] = round(time.monotonic() - started_s, 1)
                progress(started_s, f"{EVENT_VALUES} values written")
                loris_answers = await asyncio.gather(*loris_tasks)
                await asyncio.sleep(max(0.0, stop_at_s - time.monotonic()))
                drop_deadline_s = time.monotonic() + DROP_WAIT_S
                while (dropped := await write_stalls(client, node.url)) < SILENT_WATCHERS \
                        and time.monotonic() < drop_deadline_s:
                    progress(started_s, f"watchers dropped so far: {dropped:.0f}")
                    await asyncio.sleep(1.0)
                figures["watchers_dropped_after_s"] = round(time.monotonic() - started_s, 1)
                attack_over.set()
                await asyncio.gather(sampler, getter)
                figures["rss_peak_mib"] = round(max(samples), 1)
                figures["rss_growth_mib"] = round(max(samples) - figures["rss_before_mib"], 1)
                figures["slowloris_outcomes"] = {answer: loris_answers.count(answer) for answer in set(loris_answers)}
                figures["ordinary_gets"] = len(gets)
                figures["ordinary_gets_failed"] = sum(1 for status, _ in gets if status != 200)
                latencies = sorted(seconds for _, seconds in gets)
                figures["ordinary_get_p50_ms"] = round(latencies[len(latencies) // 2] * 1000, 1)
                figures["ordinary_get_max_ms"] = round(latencies[-1] * 1000, 1)
                metrics = (await client.get(f"{node.url}/metrics")).text
                figures["connections_closed"] = {
                    line.split('reason="')[1].split('"')[0]: float(line.split()[-1])
                    for line in metrics.splitlines() if line.startswith("metakv_http_connections_closed_total{")}
                figures["watchers_open_after"] = next(
                    float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("metakv_http_watchers "))
                after = await client.get(f"{node.url}/v1/kv/k")
                figures["get_after_attack"] = after.status_code
                figures["rss_after_mib"] = round(rss_mib(pid), 1)
            figures["node_running"] = node.running()
        finally:
            for conn in held:
                conn.close()
            cluster.close()
    check(failures, figures["ordinary_gets"] > 0 and figures["ordinary_gets_failed"] == 0,
          "an ordinary GET failed during the attack")
    check(failures, figures["get_after_attack"] == 200 and figures["node_running"], "the node stopped serving")
    check(failures, figures["rss_growth_mib"] < RSS_GROWTH_BOUND_MIB,
          f"RSS grew by {figures['rss_growth_mib']} MiB (bound {RSS_GROWTH_BOUND_MIB})")
    check(failures, all(answer.startswith("HTTP/1.1 413 ") for answer in figures["announced_1_gib_answers"]),
          "a 1 GiB Content-Length was not refused 413 at once")
    check(failures, figures["nested_json_status"] == 422, "deeply nested JSON was not a 422")
    check(failures, "still open" not in figures["slowloris_outcomes"], "a slowloris client outlived the attack")
    check(failures, figures["connections_closed"].get("write_stall", 0) >= SILENT_WATCHERS
          and figures["watchers_open_after"] == 0, "the watchers that never read were not all dropped")
    figures["failures"] = failures
    text = json.dumps(figures, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return 1 if failures else 0


async def write_stalls(client: httpx.AsyncClient, url: str) -> float:
    """Connections dropped for not reading, so far (-1 when /metrics did not answer)."""
    prefix = 'metakv_http_connections_closed_total{reason="write_stall"} '
    try:
        text = (await client.get(f"{url}/metrics")).text
    except httpx.HTTPError:
        return -1.0
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    return 0.0


def progress(started_s: float, what: str) -> None:
    print(f"[{time.monotonic() - started_s:6.1f} s] {what}", file=sys.stderr, flush=True)


def check(failures: list[str], ok: bool, message: str) -> None:
    if not ok:
        failures.append(message)


def main(argv: list[str] | None = None, runner: Callable[[Path | None], Awaitable[int]] = run) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    return asyncio.run(runner(args.out))


if __name__ == "__main__":
    sys.exit(main())
