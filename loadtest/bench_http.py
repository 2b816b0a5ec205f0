"""HTTP benchmark of a 3-voter metakv cluster on this machine; prints figures and writes JSON.

    python -m loadtest.bench_http [--duration-s 10] [--failover-trials 10] [--etcd [--rounds 3]]
                                  [--out results/bench_http.json]
                                  [--profile-dir results/profile [--profile-gil]]

What it measures (the same load the etcd comparison in issue 4 used):
- committed writes/s and p50/p99 latency at 1, 16 and 64 concurrent clients: each client is
  one keep-alive connection to the leader doing PUTs of 256-byte values back to back;
- local reads/s at 64 clients (GETs spread over the three voters, consistency=local);
- p50/p99 at a fixed 500 writes/s (open loop: latency counts from each request's scheduled
  start, so a stall is not hidden by the clients waiting);
- failover unavailability: SIGKILL the leader, then time until a client retrying against all
  nodes gets its next write acknowledged; over N trials (the old leader restarts in between).

The load generators cost little CPU next to the servers, which share the machine's two
cores with them: the closed-loop phases run wrk (Debian's package; one process per target
node, one thread, raw keep-alive requests cycled from a Lua table, the latency histogram
written by the script's ``done``), the fixed-rate phase an open-loop asyncio generator on
uvloop with httptools. The gevent + geventhttpclient generator used before took ~0.45 of a
core at 64 writers, which the servers then lacked. With ``--profile-dir`` it runs py-spy on
the leader during the 64-client write phase and prints where the leader's time goes (self
time per function, and per request).

With ``--etcd`` an etcd 3.4 cluster (Debian's etcd-server, 3 members on loopback, fsync on,
through its v3 JSON gateway) runs next to metakv's, and each phase (failover excepted) runs
against metakv and etcd back to back, ``--rounds`` times, the first store swapping every
round: on a shared two-core machine whose speed drifts by tens of percent over minutes, a
figure and its counterpart measured seconds apart make a ratio to trust. It prints metakv ÷
etcd per round, the median, and how many rounds meet the issue's targets expressed as
ratios to the etcd figures the issue gives (``TARGET_RATIOS``).

A benchmark never fails on a figure; it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httptools
import httpx
import uvloop
from geventhttpclient import URL, HTTPClient

from loadtest.clusters import LocalCluster, start_etcd
from loadtest.local_cluster import Cluster, Node
from loadtest.stores import b64, prefix_end

VALUE_BYTES = 256
WARMUP_S = 1.0
FIXED_RATE_WRITES_PER_S = 500
FAILOVER_WRITE_TIMEOUT_S = 1.0
READ_KEYS = 1000
SEED_VISIBLE_TIMEOUT_S = 10.0


def percentile(samples: list[float], fraction: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, int(round(fraction * (len(ordered) - 1)))))
    return ordered[index]


def summarise(latencies_s: list[float], errors: int, elapsed_s: float) -> dict[str, Any]:
    return {
        "requests": len(latencies_s),
        "errors": errors,
        "per_s": round(len(latencies_s) / elapsed_s, 1) if elapsed_s > 0 else 0.0,
        "latency_ms_p50": round(percentile(latencies_s, 0.50) * 1000, 3),
        "latency_ms_p99": round(percentile(latencies_s, 0.99) * 1000, 3),
        "latency_ms_mean": round(statistics.fmean(latencies_s) * 1000, 3) if latencies_s else None,
    }


def _client(url: str) -> HTTPClient:
    return HTTPClient.from_url(URL(url), concurrency=1, connection_timeout=5, network_timeout=10)


def _raw_request(method: str, path: str, content_type: str | None = None, body: bytes = b"") -> bytes:
    """One HTTP/1.1 keep-alive request as bytes, for wrk to send as it is."""
    head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


class MetakvRequests:
    """The benchmark's requests in metakv's API: PUT /v1/kv/<key>, GET (consistency=local)."""

    name = "metakv"

    def write(self, client: HTTPClient, key: str, value: bytes) -> Any:
        return client.put(f"/v1/kv/{key}", body=value, headers={"Content-Type": "application/octet-stream"})

    def read(self, client: HTTPClient, key: str) -> Any:
        return client.get(f"/v1/kv/{key}")

    def holds(self, client: HTTPClient, key: str) -> bool:
        response = self.read(client, key)
        response.read()
        return bool(response.status_code == 200)

    def raw_write(self, key: str, value: bytes) -> bytes:
        return _raw_request("PUT", f"/v1/kv/{key}", "application/octet-stream", value)

    def raw_read(self, key: str) -> bytes:
        return _raw_request("GET", f"/v1/kv/{key}")

    def raw_delete(self, key: str) -> bytes:
        return _raw_request("DELETE", f"/v1/kv/{key}")

    def raw_list(self, prefix: str, limit: int) -> bytes:
        return _raw_request("GET", f"/v1/kv?prefix={prefix}&limit={limit}")


class EtcdRequests:
    """The same requests in etcd 3.4's v3 JSON gateway (base64 key and value): put, and a
    serializable range, which a member answers from its own state like metakv's local read."""

    name = "etcd"

    def write(self, client: HTTPClient, key: str, value: bytes) -> Any:
        body = json.dumps({"key": b64(key), "value": b64(value)}).encode()
        return client.post("/v3/kv/put", body=body, headers={"Content-Type": "application/json"})

    def read(self, client: HTTPClient, key: str) -> Any:
        body = json.dumps({"key": b64(key), "serializable": True}).encode()
        return client.post("/v3/kv/range", body=body, headers={"Content-Type": "application/json"})

    def holds(self, client: HTTPClient, key: str) -> bool:
        response = self.read(client, key)
        return response.status_code == 200 and b'"kvs"' in response.read()

    def raw_write(self, key: str, value: bytes) -> bytes:
        body = json.dumps({"key": b64(key), "value": b64(value)}).encode()
        return _raw_request("POST", "/v3/kv/put", "application/json", body)

    def raw_read(self, key: str) -> bytes:
        body = json.dumps({"key": b64(key), "serializable": True}).encode()
        return _raw_request("POST", "/v3/kv/range", "application/json", body)

    def raw_delete(self, key: str) -> bytes:
        body = json.dumps({"key": b64(key)}).encode()
        return _raw_request("POST", "/v3/kv/deleterange", "application/json", body)

    def raw_list(self, prefix: str, limit: int) -> bytes:
        body = json.dumps({"key": b64(prefix), "range_end": b64(prefix_end(prefix.encode())), "limit": limit,
                           "serializable": True}).encode()
        return _raw_request("POST", "/v3/kv/range", "application/json", body)


METAKV = MetakvRequests()
ETCD = EtcdRequests()


WRK_SCRIPT = """\
local requests = {
%(requests)s
}
local counter = 0
request = function()
  local index = counter %% #requests + 1
  counter = counter + 1
  return requests[index]
end
done = function(summary, latency, requests_)
  local f = io.open(%(out)s, "w")
  local e = summary.errors
  f:write(string.format("%%d %%d %%d %%d %%d %%d %%d\\n", summary.requests, e.status, e.connect, e.read,
                        e.write, e.timeout, summary.duration))
  for i = 1, #latency do
    local value_us, count = latency(i)
    f:write(string.format("%%d %%d\\n", value_us, count))
  end
  f:close()
end
"""


def _lua_string(data: bytes) -> str:
    """A Lua string literal holding exactly these bytes (decimal escapes, no quoting rules to get wrong)."""
    return '"' + "".join(chr(b) if 32 <= b < 127 and b not in (34, 92) else f"\\{b:03d}" for b in data) + '"'


def _wrk_requests(requests: MetakvRequests | EtcdRequests, request: str, client_base: int) -> list[bytes]:
    """The raw HTTP requests one wrk process cycles through: 1000 writes of distinct keys, or
    reads of the seeded keys (so every read finds its key)."""
    value = os.urandom(VALUE_BYTES // 2).hex().encode()
    if request == "write":
        return [requests.raw_write(f"bench/w{client_base}/k{i}", value) for i in range(1000)]
    return [requests.raw_read(f"bench/read/k{(client_base * 7919 + i) % READ_KEYS}") for i in range(READ_KEYS)]


def closed_loop(urls: list[str], clients: int, duration_s: float, request: str,
                requests: MetakvRequests | EtcdRequests = METAKV,
                table: Callable[[int], list[bytes]] | None = None) -> dict[str, Any]:
    """``clients`` keep-alive connections spread over ``urls``, each requesting back to back,
    driven by wrk (one wrk process per URL, one thread each): "write" PUTs a 256-byte value,
    "read" GETs a seeded key; ``table(i)``, when given, builds wrk process i's requests instead.
    A warm-up run of WARMUP_S comes first and is not measured.
    wrk records a latency for every answer, so the figures include answers with an error
    status; those are also counted in ``errors`` (a run with errors is not a clean figure).

    Why wrk and not a Python generator: on two cores the generator shares the CPU with the
    three servers; gevent + geventhttpclient took ~0.45 of a core at 64 writers, wrk ~0.06.
    Both stores get the same generator, so the comparison stays fair."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("bench_http needs wrk (apt-get install wrk; `make bench-http` installs it)")
    with tempfile.TemporaryDirectory(prefix="metakv-wrk-") as tmp:
        runs = []
        for index, url in enumerate(urls):
            connections = clients // len(urls) + (1 if index < clients % len(urls) else 0)
            if connections == 0:
                continue
            out = Path(tmp) / f"wrk-{index}.txt"
            script = Path(tmp) / f"wrk-{index}.lua"
            raws = table(index) if table is not None else _wrk_requests(requests, request, index)
            lines = ",\n".join("  " + _lua_string(raw) for raw in raws)
            script.write_text(WRK_SCRIPT % {"requests": lines, "out": _lua_string(str(out).encode())})
            runs.append((url, connections, script, out))

        def run(seconds: float) -> list[tuple[Path, subprocess.Popen[bytes]]]:
            return [(out, subprocess.Popen(
                [wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "10s", "-s", str(script), url],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)) for url, connections, script, out in runs]

        def wait(procs: list[tuple[Path, subprocess.Popen[bytes]]]) -> list[list[int]]:
            results = []
            for out, proc in procs:
                _, stderr = proc.communicate(timeout=duration_s + 60)
                if proc.returncode != 0 or not out.exists():
                    raise RuntimeError(f"wrk failed ({proc.returncode}): {stderr.decode(errors='replace').strip()}")
                results.append([[int(x) for x in line.split()] for line in out.read_text().splitlines()])
                out.unlink()
            return results

        warm = wait(run(WARMUP_S))
        measured_runs = wait(run(duration_s))
    latencies: list[float] = []
    errors = collections.Counter[str]()
    requests_total = 0
    elapsed_s = 0.0
    for lines in warm + measured_runs:
        requests_total += lines[0][0]
    for lines in measured_runs:
        _answered, status, connect, read, write, timeout, duration_us = lines[0]
        elapsed_s = max(elapsed_s, duration_us / 1e6)
        for kind, n in (("status>=400", status), ("connect", connect), ("read", read), ("write", write),
                        ("timeout", timeout)):
            if n:
                errors[kind] += n
        for value_us, n in lines[1:]:
            latencies.extend([value_us / 1e6] * n)
    result = summarise(latencies, errors["status>=400"] + errors["timeout"], elapsed_s)
    result["clients"] = clients
    result["requests_total"] = requests_total
    result["error_kinds"] = dict(errors)
    return result


class OpenLoopConnection(asyncio.Protocol):
    """One keep-alive connection of the open-loop generator: one request at a time, the
    response parsed by httptools (uvicorn's C parser), its latency counted from when the
    request was due."""

    def __init__(self, done: Callable[[OpenLoopConnection, int, float], None]) -> None:
        self._done = done
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.due = 0.0
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True

    def send(self, raw: bytes, due: float) -> None:
        self.due = due
        assert self.transport is not None
        self.transport.write(raw)

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        self._done(self, self._parser.get_status_code(), time.perf_counter() - self.due)


def fixed_rate(url: str, rate_per_s: int, duration_s: float, connections: int = 256,
               requests: MetakvRequests | EtcdRequests = METAKV, raws: list[bytes] | None = None) -> dict[str, Any]:
    """Open loop: request i is due at start + i / rate; latency counts from when it was due,
    so a stall is not hidden by the generator waiting. Request i is ``raws[i % len(raws)]``
    (default: PUTs of 1000 keys); only a 200 counts as answered. ``connections`` keep-alive connections
    are opened (and used once) before the clock starts; a request finding none free counts
    as an error. The generator is asyncio on uvloop with raw requests and httptools, a few
    tens of microseconds per request (gevent + geventhttpclient took ~0.5 ms of CPU per
    request, a quarter of a core at 500 writes/s on the machine the servers share)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_fixed_rate(url, rate_per_s, duration_s, connections, requests, raws))


async def _fixed_rate(url: str, rate_per_s: int, duration_s: float, connections: int,
                      requests: MetakvRequests | EtcdRequests, raws: list[bytes] | None) -> dict[str, Any]:
    host, _, port = url.removeprefix("http://").rstrip("/").partition(":")
    loop = asyncio.get_running_loop()
    value = os.urandom(VALUE_BYTES // 2).hex().encode()
    if raws is None:
        raws = [requests.raw_write(f"bench/rate/k{i}", value) for i in range(1000)]
    free: collections.deque[OpenLoopConnection] = collections.deque()
    latencies: list[float] = []
    errors = collections.Counter[str]()
    measuring = [False]
    outstanding = [0]
    all_done = asyncio.Event()

    def done(connection: OpenLoopConnection, status: int, latency_s: float) -> None:
        free.append(connection)
        outstanding[0] -= 1
        if measuring[0]:
            if status == 200:
                latencies.append(latency_s)
            else:
                errors[str(status)] += 1
        if outstanding[0] == 0:
            all_done.set()

    opened = [await loop.create_connection(lambda: OpenLoopConnection(done), host, int(port))
              for _ in range(connections)]
    # Warm every connection with one read (the server's accept and first parse are not part
    # of a write's latency), then wait for all of them.
    for _, connection in opened:
        outstanding[0] += 1
        connection.send(requests.raw_read("bench/warm"), time.perf_counter())
    await asyncio.wait_for(all_done.wait(), SEED_VISIBLE_TIMEOUT_S)
    all_done.clear()
    measuring[0] = True
    total = int(rate_per_s * duration_s)
    start = time.perf_counter() + WARMUP_S
    sequence = 0
    while sequence < total:
        now = time.perf_counter()
        due = start + sequence / rate_per_s
        if due > now:
            await asyncio.sleep(due - now)
            continue
        while sequence < total and start + sequence / rate_per_s <= now:  # everything due by now
            if free:
                connection = free.popleft()
                if connection.lost:
                    errors["connection-lost"] += 1
                else:
                    outstanding[0] += 1
                    connection.send(raws[sequence % len(raws)], start + sequence / rate_per_s)
            else:
                errors["no-free-connection"] += 1
            sequence += 1
    if outstanding[0]:
        all_done.clear()  # set whenever nothing was outstanding during the run
        try:
            await asyncio.wait_for(all_done.wait(), 30.0)
        except TimeoutError:
            errors["unanswered"] += outstanding[0]
    for transport, _ in opened:
        transport.close()
    result = summarise(latencies, sum(errors.values()), duration_s)
    result["target_per_s"] = rate_per_s
    result["error_kinds"] = dict(errors)
    return result


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by these processes (Linux /proc)."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks_per_s
    return total


def measured(cluster: Cluster | LocalCluster, phase: Any) -> dict[str, Any]:
    """Run ``phase()`` and add what it cost the servers: CPU ms per request (independent of
    how busy the shared machine is) and the machine's load average meanwhile."""
    pids = {node.node_id: node.pid for node in cluster.nodes.values() if node.pid is not None}
    cpu_before = {node_id: cpu_seconds([pid]) for node_id, pid in pids.items()}
    result: dict[str, Any] = phase()
    cpu_used = {node_id: cpu_seconds([pid]) - cpu_before[node_id] for node_id, pid in pids.items()}
    requests = result.get("requests_total", result.get("requests", 0))
    result["servers_cpu_ms_per_request"] = round(sum(cpu_used.values()) * 1000 / requests, 3) if requests else None
    result["cpu_ms_per_request_by_node"] = {
        str(node_id): round(used * 1000 / requests, 3) if requests else None for node_id, used in cpu_used.items()}
    result["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    return result


def failover_trials(cluster: Cluster, trials: int) -> dict[str, Any]:
    """SIGKILL the leader; time until a retrying client's next write is acknowledged."""
    unavailable_s: list[float] = []
    with httpx.Client(timeout=FAILOVER_WRITE_TIMEOUT_S) as client:
        for trial in range(trials):
            leader = cluster.wait_for_leader()
            for node in cluster.nodes.values():
                cluster.wait_ready(node)
            killed_at = time.perf_counter()
            cluster.kill(leader)
            turn = 0
            while True:
                nodes = [n for n in cluster.nodes.values() if n.running()]
                node = nodes[turn % len(nodes)]
                turn += 1
                try:
                    response = client.put(f"{node.url}/v1/kv/bench/failover/{trial}", content=b"x" * VALUE_BYTES,
                                          follow_redirects=True)
                    if response.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.005)
            unavailable_s.append(time.perf_counter() - killed_at)
            print(f"  failover trial {trial + 1}/{trials}: {unavailable_s[-1] * 1000:.0f} ms", flush=True)
            leader.start()
            cluster.wait_ready(leader)
    return {
        "trials": trials,
        "unavailable_ms": [round(s * 1000, 1) for s in unavailable_s],
        "unavailable_ms_p50": round(percentile(unavailable_s, 0.5) * 1000, 1),
        "unavailable_ms_p99": round(percentile(unavailable_s, 0.99) * 1000, 1),
        "unavailable_ms_max": round(max(unavailable_s) * 1000, 1) if unavailable_s else None,
    }


PROFILE_RATE_HZ = 250  # py-spy samples per second


def start_profile(node: Node, duration_s: float, out_path: Path, gil_only: bool = False) -> subprocess.Popen[bytes] | None:
    """py-spy on ``node`` for ``duration_s``, its collapsed stacks written to ``out_path``."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("py-spy not found; skipping the profile", flush=True)
        return None
    out_path.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [py_spy, "record", "--pid", str(node.pid), "--duration", str(max(1, int(duration_s))),
         "--rate", str(PROFILE_RATE_HZ), "--format", "raw", "--nonblocking", *(["--gil"] if gil_only else []),
         "--output", str(out_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def summarise_profile(path: Path, requests: int, top: int = 25) -> dict[str, Any]:
    """Self time per function (leaf frame) and inclusive time of the main layers, from
    py-spy's collapsed stacks; per request = samples / requests served meanwhile (in ms:
    samples / PROFILE_RATE_HZ / requests)."""
    self_samples: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    layers = {
        "http (app/http/)": "app/http/", "runtime (app/runtime.py)": "app/runtime.py",
        "raft core (raft/)": "raft/", "transport (app/transport.py)": "app/transport.py",
        "segment log (storage/segment_log.py)": "segment_log.py",
        "state machine (storage/state_*.py)": "storage/state_",
        "uvicorn/httptools": "uvicorn/", "fastapi/starlette": "starlette/", "sqlalchemy": "sqlalchemy/",
        "msgpack": "msgpack", "idle (event loop select)": "select",
    }
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        self_samples[frames[-1]] += count
        for name, needle in layers.items():
            if any(needle in frame for frame in frames):
                inclusive[name] += count
    def ms_per_request(count: int) -> float | None:
        return round(count * 1000 / PROFILE_RATE_HZ / requests, 4) if requests else None

    return {
        "samples": total,
        "requests_during_profile": requests,
        "sampled_ms_per_request": ms_per_request(total),
        "top_self": [{"frame": frame, "share": round(count / total, 4), "ms_per_request": ms_per_request(count)}
                     for frame, count in self_samples.most_common(top)],
        "layers_inclusive_share": {name: round(count / total, 4) for name, count in inclusive.most_common()},
    }


def _print_writes(store: str, clients: int, w: dict[str, Any]) -> None:
    print(f"{store} writes, {clients:2d} clients: {w['per_s']:8.1f}/s  p50 {w['latency_ms_p50']:.2f} ms  "
          f"p99 {w['latency_ms_p99']:.2f} ms  errors {w['errors']}  "
          f"servers' CPU {w['servers_cpu_ms_per_request']} ms/request  "
          f"load {w['load_average_1m_after']}", flush=True)


@dataclass
class Store:
    """One store under load: its cluster, where writes go, where local reads go."""

    cluster: Cluster | LocalCluster
    leader_url: str
    urls: list[str]
    requests: MetakvRequests | EtcdRequests


def run_phases(cluster: Cluster | LocalCluster, leader_url: str, urls: list[str],
               requests: MetakvRequests | EtcdRequests, duration_s: float,
               on_64_writers: Any = None) -> dict[str, Any]:
    """The load phases both stores get: writes at 1/16/64 clients, local reads at 64 clients
    over every node, and the fixed 500 writes/s."""
    store = Store(cluster, leader_url, urls, requests)
    results: dict[str, Any] = {"writes": {}}
    for name in PHASES:
        hook = on_64_writers() if name == "writes_64" and on_64_writers is not None else None
        if name == "local_reads_64_clients":
            seed_reads(store)
        figures = run_phase(store, name, duration_s)
        if hook is not None:
            hook(figures)
        _store_phase(results, name, figures)
    return results


# The phases in the order they run; a phase's figures land in the results under its name
# (writes_N under results["writes"]["N"]).
PHASES = ("writes_1", "writes_16", "writes_64", "local_reads_64_clients", "fixed_rate_500_writes_per_s")


def _store_phase(results: dict[str, Any], name: str, figures: dict[str, Any]) -> None:
    if name.startswith("writes_"):
        results.setdefault("writes", {})[name.removeprefix("writes_")] = figures
    else:
        results[name] = figures


def run_phase(store: Store, name: str, duration_s: float) -> dict[str, Any]:
    """Run one phase against ``store``, print its line and return its figures."""
    requests = store.requests
    if name.startswith("writes_"):
        clients = int(name.removeprefix("writes_"))
        figures = measured(store.cluster, lambda: closed_loop([store.leader_url], clients, duration_s, "write", requests))
        _print_writes(requests.name, clients, figures)
        return figures
    if name == "local_reads_64_clients":
        reads = measured(store.cluster, lambda: closed_loop(store.urls, 64, duration_s, "read", requests))
        print(f"{requests.name} local reads, 64 clients over {len(store.urls)} nodes: {reads['per_s']:8.1f}/s  "
              f"p50 {reads['latency_ms_p50']:.2f} ms  p99 {reads['latency_ms_p99']:.2f} ms  errors {reads['errors']}  "
              f"servers' CPU {reads['servers_cpu_ms_per_request']} ms/request", flush=True)
        return reads
    if name == "fixed_rate_500_writes_per_s":
        fixed = measured(store.cluster, lambda: fixed_rate(
            store.leader_url, FIXED_RATE_WRITES_PER_S, duration_s, requests=requests))
        print(f"{requests.name} fixed 500 writes/s: achieved {fixed['per_s']:.1f}/s  p50 {fixed['latency_ms_p50']:.2f} ms  "
              f"p99 {fixed['latency_ms_p99']:.2f} ms  errors {fixed['errors']}", flush=True)
        return fixed
    raise ValueError(f"unknown phase {name!r}")


def seed_reads(store: Store) -> None:
    """Write the keys the read phase reads and wait (bounded) until every node serves them."""
    requests, leader_url, urls = store.requests, store.leader_url, store.urls
    seed = _client(leader_url)
    for key in range(READ_KEYS):
        requests.write(seed, f"bench/read/k{key}", b"r" * VALUE_BYTES).read()
    seed.close()
    for url in urls:  # every node serves the seeded keys before reads are timed (bounded wait)
        probe = _client(url)
        deadline = time.monotonic() + SEED_VISIBLE_TIMEOUT_S
        while not requests.holds(probe, f"bench/read/k{READ_KEYS - 1}") and time.monotonic() < deadline:
            time.sleep(0.05)
        probe.close()


def etcd_store(cluster: LocalCluster) -> Store:
    """etcd (Debian's etcd-server, 3 members on loopback, fsync on) once it has a leader."""
    deadline = time.monotonic() + 30
    leader = cluster.leader()
    while leader is None and time.monotonic() < deadline:
        time.sleep(0.1)
        leader = cluster.leader()
    if leader is None:
        raise RuntimeError("etcd elected no leader within 30 s")
    return Store(cluster, leader.url, cluster.endpoints, ETCD)


def interleaved_rounds(stores: dict[str, Store], rounds: int, duration_s: float,
                       run: Callable[[Store, str, float], dict[str, Any]] = run_phase) -> list[dict[str, Any]]:
    """Each phase runs against every store back to back, ``rounds`` times, the stores' order
    swapped every round: a figure and its counterpart are measured seconds apart, so the
    shared machine's drift (its speed changes by tens of percent over minutes) falls on
    both alike instead of on whichever store ran second."""
    names = list(stores)
    results: list[dict[str, Any]] = []
    for round_index in range(rounds):
        print(f"round {round_index + 1}/{rounds}", flush=True)
        order = names if round_index % 2 == 0 else names[::-1]
        figures: dict[str, Any] = {name: {} for name in names}
        for phase in PHASES:
            for name in order:
                _store_phase(figures[name], phase, run(stores[name], phase, duration_s))
        results.append(figures)
    return results


# The issue's first targets against the etcd figures it gives for the same load on this
# machine (6,000 writes/s at 64 clients, 1.0 ms p50 with one client, 3.8 ms p99 at 500
# writes/s), as ratios: what to hold a ratio measured in one run against when etcd itself
# runs slower or faster than it did then.
TARGET_RATIOS = {
    "writes_64_clients_per_s": (">=", round(3000 / 6000, 3)),
    "writes_1_clients_p50": ("<=", round(2.0 / 1.0, 3)),
    "fixed_rate_500_p99": ("<=", round(10.0 / 3.8, 3)),
}


def median_ratios(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: metakv ÷ etcd in every round, their median, and the issue's target ratio."""
    per_round = [comparison(figures["metakv"], figures["etcd"]) for figures in rounds]
    summary: dict[str, Any] = {}
    for name in per_round[0]:
        values = [ratios[name] for ratios in per_round if ratios[name] is not None]
        entry: dict[str, Any] = {"median": round(statistics.median(values), 3) if values else None,
                                 "rounds": values}
        if name in TARGET_RATIOS:
            sense, target = TARGET_RATIOS[name]
            entry["target"] = f"{sense} {target}"
            entry["rounds_meeting_target"] = sum(
                1 for value in values if (value >= target if sense == ">=" else value <= target))
        summary[name] = entry
    return summary


def compare_with_etcd(metakv: Store, rounds: int, duration_s: float,
                      on_64_writers: Any = None) -> dict[str, Any]:
    """Start etcd next to the running metakv cluster, run the phases interleaved, print
    the ratios; metakv's figures of the last round become the top-level figures.
    ``on_64_writers`` (the profiler) watches metakv's first 64-writer phase."""
    profiled = [False]

    def run(store: Store, phase: str, phase_duration_s: float) -> dict[str, Any]:
        hook = None
        if store is metakv and phase == "writes_64" and on_64_writers is not None and not profiled[0]:
            profiled[0] = True
            hook = on_64_writers()
        figures = run_phase(store, phase, phase_duration_s)
        if hook is not None:
            hook(figures)
        return figures

    etcd_cluster = start_etcd(3)
    try:
        stores = {"metakv": metakv, "etcd": etcd_store(etcd_cluster)}
        for store in stores.values():
            seed_reads(store)
        per_round = interleaved_rounds(stores, rounds, duration_s, run)
        version = etcd_cluster.version()
    finally:
        etcd_cluster.stop()
    ratios = median_ratios(per_round)
    print(f"metakv ÷ etcd over {rounds} interleaved rounds (throughput: above 1 favours metakv; "
          "latency: below 1 does), median [each round]:", flush=True)
    for name, entry in ratios.items():
        target = (f"   target {entry['target']} (the issue's figures as ratios): met in "
                  f"{entry['rounds_meeting_target']} of {len(entry['rounds'])} rounds") if "target" in entry else ""
        print(f"  {name:34s} {entry['median']}  {entry['rounds']}{target}", flush=True)
    return {**per_round[-1]["metakv"], "rounds": per_round, "etcd": {"version": version},
            "metakv_over_etcd": ratios}


def comparison(metakv: dict[str, Any], etcd: dict[str, Any]) -> dict[str, Any]:
    """metakv ÷ etcd for each figure, measured in one run (above 1 favours metakv for
    throughput, below 1 for latency)."""
    rows: dict[str, Any] = {}
    for clients in ("1", "16", "64"):
        m, e = metakv["writes"][clients], etcd["writes"][clients]
        rows[f"writes_{clients}_clients_per_s"] = _ratio(m["per_s"], e["per_s"])
        rows[f"writes_{clients}_clients_p50"] = _ratio(m["latency_ms_p50"], e["latency_ms_p50"])
        rows[f"writes_{clients}_clients_p99"] = _ratio(m["latency_ms_p99"], e["latency_ms_p99"])
    rows["local_reads_64_clients_per_s"] = _ratio(
        metakv["local_reads_64_clients"]["per_s"], etcd["local_reads_64_clients"]["per_s"])
    rows["fixed_rate_500_p99"] = _ratio(
        metakv["fixed_rate_500_writes_per_s"]["latency_ms_p99"], etcd["fixed_rate_500_writes_per_s"]["latency_ms_p99"])
    return rows


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_http", description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=10.0, help="measured seconds per phase")
    parser.add_argument("--failover-trials", type=int, default=10)
    parser.add_argument("--etcd", action="store_true",
                        help="run each phase against metakv and a 3-member etcd on this machine, interleaved, "
                             "and print metakv ÷ etcd per round and its median")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --etcd: how many times each phase runs against each store")
    parser.add_argument("--out", type=Path, default=Path("results/bench_http.json"))
    parser.add_argument("--profile-dir", type=Path, default=None, help="run py-spy on the leader (64 clients)")
    parser.add_argument("--profile-gil", action="store_true",
                        help="sample only the thread holding the GIL: the loop's CPU time, without idle waits and the fsync thread")
    parser.add_argument("--keep-data", action="store_true", help="keep the nodes' data directories")
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="metakv-bench-"))
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "value_bytes": VALUE_BYTES, "duration_s": args.duration_s,
        "command": "python -m loadtest.bench_http " + " ".join(argv if argv is not None else sys.argv[1:]),
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
    }
    cluster = Cluster(root, voters=3, observers=0)
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        for node in cluster.nodes.values():
            cluster.wait_ready(node)
        print(f"cluster up, leader node {leader.node_id} at {leader.url}", flush=True)

        def profile_64_writers() -> Any:
            if args.profile_dir is None:
                return None
            profiler = start_profile(leader, args.duration_s, args.profile_dir / f"leader-node{leader.node_id}.txt",
                                     args.profile_gil)

            def done(phase: dict[str, Any]) -> None:
                if profiler is None:
                    return
                profiler.wait(timeout=60)
                profile_path = args.profile_dir / f"leader-node{leader.node_id}.txt"
                if profile_path.exists():
                    results["profile_leader_64_writers"] = summarise_profile(profile_path, phase["requests"])
            return done

        urls = [node.url for node in cluster.nodes.values()]
        if args.etcd:
            results.update(compare_with_etcd(Store(cluster, leader.url, urls, METAKV), args.rounds,
                                             args.duration_s, profile_64_writers))
        else:
            results.update(run_phases(cluster, leader.url, urls, METAKV, args.duration_s, profile_64_writers))
        if args.failover_trials > 0:
            failover = failover_trials(cluster, args.failover_trials)
            results["failover"] = failover
            print(f"failover over {failover['trials']} trials: p50 {failover['unavailable_ms_p50']} ms  "
                  f"p99 {failover['unavailable_ms_p99']} ms  max {failover['unavailable_ms_max']} ms", flush=True)
        if "profile_leader_64_writers" in results:
            profile = results["profile_leader_64_writers"]
            print("leader profile, 64 writers (share of samples):", flush=True)
            for name, share in profile["layers_inclusive_share"].items():
                print(f"  {share * 100:5.1f}%  {name}", flush=True)
            for entry in profile["top_self"][:12]:
                print(f"  self {entry['share'] * 100:5.1f}%  {entry['frame']}", flush=True)
    finally:
        cluster.close()
        if not args.keep_data:
            shutil.rmtree(root, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    sys.exit(main())
