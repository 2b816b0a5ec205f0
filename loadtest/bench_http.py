"""HTTP benchmark of a 3-voter metakv cluster on this machine; prints figures and writes JSON.

    python -m loadtest.bench_http [--duration-s 10] [--failover-trials 10] [--etcd]
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

The load generator is gevent + geventhttpclient (from the Locust dependency): one greenlet per
client, a C HTTP parser, so the generator costs little CPU next to the servers. With
``--profile-dir`` it runs py-spy on the leader during the 64-client write phase and prints
where the leader's time goes (self time per function, and per request).

With ``--etcd`` the same phases (failover excepted) then run against etcd 3.4 (Debian's
etcd-server, 3 members on loopback, fsync on) through its v3 JSON gateway, with the same
generator, and the figures are printed as metakv ÷ etcd: on a shared two-core machine the
absolute figures move with the load, the ratio from one run is the comparison to trust.

A benchmark never fails on a figure; it reports.
"""

from __future__ import annotations

import argparse
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
from pathlib import Path
from typing import Any

import gevent
import gevent.pool
import httpx
from geventhttpclient import URL, HTTPClient

from loadtest.clusters import LocalCluster, start_etcd
from loadtest.stores import _b64
from tests.cluster import Cluster, Node

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


class EtcdRequests:
    """The same requests in etcd 3.4's v3 JSON gateway (base64 key and value): put, and a
    serializable range, which a member answers from its own state like metakv's local read."""

    name = "etcd"

    def write(self, client: HTTPClient, key: str, value: bytes) -> Any:
        body = json.dumps({"key": _b64(key), "value": _b64(value)}).encode()
        return client.post("/v3/kv/put", body=body, headers={"Content-Type": "application/json"})

    def read(self, client: HTTPClient, key: str) -> Any:
        body = json.dumps({"key": _b64(key), "serializable": True}).encode()
        return client.post("/v3/kv/range", body=body, headers={"Content-Type": "application/json"})

    def holds(self, client: HTTPClient, key: str) -> bool:
        response = self.read(client, key)
        return response.status_code == 200 and b'"kvs"' in response.read()


METAKV = MetakvRequests()
ETCD = EtcdRequests()


def closed_loop(urls: list[str], clients: int, duration_s: float, request: str,
                requests: MetakvRequests | EtcdRequests = METAKV) -> dict[str, Any]:
    """``clients`` greenlets, each with its own keep-alive connection, requesting back to back.
    ``request`` is "write" (PUT a 256-byte value) or "read" (GET an existing key)."""
    value = os.urandom(VALUE_BYTES // 2).hex().encode()
    latencies: list[float] = []
    errors = collections.Counter[str]()
    measure_from = time.perf_counter() + WARMUP_S
    stop_at = measure_from + duration_s
    sent = [0]  # every request, warm-up included (the servers' CPU covers them all)

    def worker(index: int) -> None:
        client = _client(urls[index % len(urls)])
        sequence = 0
        try:
            while True:
                started = time.perf_counter()
                if started >= stop_at:
                    return
                if request == "write":
                    response = requests.write(client, f"bench/c{index}/k{sequence % 1000}", value)
                else:
                    response = requests.read(client, f"bench/read/k{(index * 7919 + sequence) % READ_KEYS}")
                response.read()
                finished = time.perf_counter()
                sequence += 1
                sent[0] += 1
                if response.status_code != 200:
                    errors[str(response.status_code)] += 1
                elif started >= measure_from:
                    latencies.append(finished - started)
        except Exception as exc:  # a broken connection ends this client; counted
            errors[type(exc).__name__] += 1
        finally:
            client.close()

    pool = gevent.pool.Pool(clients)
    for index in range(clients):
        pool.spawn(worker, index)
    pool.join()
    result = summarise(latencies, sum(errors.values()), duration_s)
    result["clients"] = clients
    result["requests_total"] = sent[0]
    result["error_kinds"] = dict(errors)
    return result


def fixed_rate(url: str, rate_per_s: int, duration_s: float, connections: int = 256,
               requests: MetakvRequests | EtcdRequests = METAKV) -> dict[str, Any]:
    """Open loop: request i is due at start + i / rate; latency counts from when it was due."""
    value = os.urandom(VALUE_BYTES // 2).hex().encode()
    clients: collections.deque[HTTPClient] = collections.deque(_client(url) for _ in range(connections))
    # Open every keep-alive connection before the clock starts, as the closed-loop phases'
    # clients have theirs open by the end of their warm-up: a TCP connect and the server's
    # accept are not part of a write's latency.
    warm = gevent.pool.Group()
    for client in clients:
        warm.spawn(lambda c=client: requests.read(c, "bench/warm").read())
    warm.join()
    latencies: list[float] = []
    errors = collections.Counter[str]()
    start = time.perf_counter() + WARMUP_S
    total = int(rate_per_s * duration_s)

    def one(sequence: int, due: float) -> None:
        if not clients:
            errors["no-free-connection"] += 1
            return
        client = clients.popleft()
        try:
            response = requests.write(client, f"bench/rate/k{sequence % 1000}", value)
            response.read()
            if response.status_code == 200:
                latencies.append(time.perf_counter() - due)
            else:
                errors[str(response.status_code)] += 1
        except Exception as exc:
            errors[type(exc).__name__] += 1
        finally:
            clients.append(client)

    group = gevent.pool.Group()
    for sequence in range(total):
        due = start + sequence / rate_per_s
        delay = due - time.perf_counter()
        if delay > 0:
            gevent.sleep(delay)
        group.spawn(one, sequence, due)
    group.join()
    for client in clients:
        client.close()
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
    if isinstance(cluster, LocalCluster):
        pids = {node.node_id: node.process.pid for node in cluster.nodes}
    else:
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


def start_profile(node: Node, duration_s: float, out_dir: Path, gil_only: bool = False) -> subprocess.Popen[bytes] | None:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("py-spy not found; skipping the profile", flush=True)
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [py_spy, "record", "--pid", str(node.pid), "--duration", str(int(duration_s)), "--rate", "250",
         "--format", "raw", "--nonblocking", *(["--gil"] if gil_only else []),
         "--output", str(out_dir / f"leader-node{node.node_id}.txt")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def summarise_profile(path: Path, requests: int, top: int = 25) -> dict[str, Any]:
    """Self time per function (leaf frame) and inclusive time of the main layers, from
    py-spy's collapsed stacks; per request = samples / requests served meanwhile."""
    self_samples: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    layers = {
        "http (app/http.py)": "app/http.py", "runtime (app/runtime.py)": "app/runtime.py",
        "raft core (raft/)": "raft/", "transport (app/transport.py)": "app/transport.py",
        "segment log (storage/segment_log.py)": "segment_log.py",
        "state machine (storage/state_machine.py)": "state_machine.py",
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
    return {
        "samples": total,
        "requests_during_profile": requests,
        "top_self": [{"frame": frame, "share": round(count / total, 4)} for frame, count in self_samples.most_common(top)],
        "layers_inclusive_share": {name: round(count / total, 4) for name, count in inclusive.most_common()},
    }


def _print_writes(store: str, clients: int, w: dict[str, Any]) -> None:
    print(f"{store} writes, {clients:2d} clients: {w['per_s']:8.1f}/s  p50 {w['latency_ms_p50']:.2f} ms  "
          f"p99 {w['latency_ms_p99']:.2f} ms  errors {w['errors']}  "
          f"servers' CPU {w['servers_cpu_ms_per_request']} ms/request  "
          f"load {w['load_average_1m_after']}", flush=True)


def run_phases(cluster: Cluster | LocalCluster, leader_url: str, urls: list[str],
               requests: MetakvRequests | EtcdRequests, duration_s: float,
               on_64_writers: Any = None) -> dict[str, Any]:
    """The load phases both stores get: writes at 1/16/64 clients, local reads at 64 clients
    over every node, and the fixed 500 writes/s."""
    results: dict[str, Any] = {}
    writes = {}
    for clients in (1, 16, 64):
        hook = on_64_writers() if clients == 64 and on_64_writers is not None else None
        writes[str(clients)] = measured(
            cluster, lambda c=clients: closed_loop([leader_url], c, duration_s, "write", requests))
        if hook is not None:
            hook(writes[str(clients)])
        _print_writes(requests.name, clients, writes[str(clients)])
    results["writes"] = writes
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
    reads = measured(cluster, lambda: closed_loop(urls, 64, duration_s, "read", requests))
    results["local_reads_64_clients"] = reads
    print(f"{requests.name} local reads, 64 clients over {len(urls)} nodes: {reads['per_s']:8.1f}/s  "
          f"p50 {reads['latency_ms_p50']:.2f} ms  p99 {reads['latency_ms_p99']:.2f} ms  errors {reads['errors']}  "
          f"servers' CPU {reads['servers_cpu_ms_per_request']} ms/request", flush=True)
    fixed = measured(cluster, lambda: fixed_rate(leader_url, FIXED_RATE_WRITES_PER_S, duration_s, requests=requests))
    results["fixed_rate_500_writes_per_s"] = fixed
    print(f"{requests.name} fixed 500 writes/s: achieved {fixed['per_s']:.1f}/s  p50 {fixed['latency_ms_p50']:.2f} ms  "
          f"p99 {fixed['latency_ms_p99']:.2f} ms  errors {fixed['errors']}", flush=True)
    return results


def etcd_phases(duration_s: float) -> dict[str, Any]:
    """The same phases against etcd (Debian's etcd-server, 3 members on loopback, fsync on)."""
    cluster = start_etcd(3)
    try:
        deadline = time.monotonic() + 30
        leader = cluster.leader()
        while leader is None and time.monotonic() < deadline:
            time.sleep(0.1)
            leader = cluster.leader()
        if leader is None:
            raise RuntimeError("etcd elected no leader within 30 s")
        results = run_phases(cluster, leader.http_url, cluster.endpoints, ETCD, duration_s)
        results["version"] = cluster.version()
        return results
    finally:
        cluster.stop()


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
                        help="then run the same phases against a 3-member etcd on this machine and print metakv ÷ etcd")
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
            profiler = start_profile(leader, args.duration_s, args.profile_dir, args.profile_gil)

            def done(phase: dict[str, Any]) -> None:
                if profiler is None:
                    return
                profiler.wait(timeout=60)
                profile_path = args.profile_dir / f"leader-node{leader.node_id}.txt"
                if profile_path.exists():
                    results["profile_leader_64_writers"] = summarise_profile(profile_path, phase["requests"])
            return done

        urls = [node.url for node in cluster.nodes.values()]
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
    if args.etcd:
        results["etcd"] = etcd_phases(args.duration_s)
        results["metakv_over_etcd"] = comparison(results, results["etcd"])
        print("metakv ÷ etcd, same run (throughput: above 1 favours metakv; latency: below 1 does):", flush=True)
        for name, ratio in results["metakv_over_etcd"].items():
            print(f"  {name:34s} {ratio}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    sys.exit(main())
