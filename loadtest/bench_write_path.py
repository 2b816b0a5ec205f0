"""Where one write's time goes, hop by hop: 3 voters on loopback, one client, one PUT at a time.

    python -m loadtest.bench_write_path [--writes 800] [--no-trace] [--etcd] [--out results/bench_write_path.json]

Each node runs ``metakv serve`` with trace points added from outside (this module patches the
runtime, transport, segment log and uvicorn protocol methods in the node process before
serving; nothing in app/ carries tracing code): every point appends (time.perf_counter(),
name) to a list in memory, and SIGUSR1 dumps it. perf_counter is CLOCK_MONOTONIC on Linux,
shared by all processes, so the client's send/receive times and every node's points line up.
For each write the analysis follows the commit path: client send -> leader HTTP in -> propose
-> records written to a follower -> follower receives -> its flush starts -> fsync runs ->
flush answer on its loop -> its next Fetch (the acknowledgement) written -> leader receives ->
apply -> HTTP response written -> client receives; the follower counted is the one whose
acknowledgement reached the leader first. It prints the median and mean of each hop, the
leader's own flush, and the servers' CPU per write. It also counts, per write and node, the
codec work one record costs on the way (``CODEC_COUNTS``: log reads that went to disk, batches
decoded from disk, batches encoded for the log, raft messages encoded and decoded, commands
encoded): a count does not drift with the machine's load as times do. The trace points cost
a few percent; ``--no-trace`` runs the same load without them (latency and CPU only).

The client is a raw blocking socket with TCP_NODELAY (no HTTP library in the measured time),
writing a 256-byte value per PUT back to back over one keep-alive connection (like the
1-client phase of loadtest.bench_http). A benchmark never fails on a figure; it reports.

Each node's flush as its runtime sees it (``metakv_fsync_latency_seconds``: from handing the
fsync to the flush thread until the event loop handles its answer) is read from /metrics
around the measured writes. With ``--etcd``, a 3-member etcd 3.4 (Debian's etcd-server, fsync
on) is started after the metakv cluster stopped and measured with the same client (one
put at a time through its v3 JSON gateway): its p50 gives the ratio, and its members' WAL
fdatasync (``etcd_disk_wal_fsync_duration_seconds``) sits next to metakv's fsync.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

TRACE_ENV = "METAKV_BENCH_TRACE_OUT"
WARMUP_WRITES = 50
VALUE_BYTES = 256
FLUSH_HISTOGRAM = "metakv_fsync_latency_seconds"
ETCD_WAL_FSYNC_HISTOGRAM = "etcd_disk_wal_fsync_duration_seconds"
HOPS = ("http_in", "propose", "leader_sends_records", "follower_receives", "follower_flush_asked",
        "follower_fsync_starts", "follower_fsync_ends", "follower_flush_answered", "follower_sends_fetch",
        "leader_receives_fetch", "leader_apply_starts", "leader_apply_ends", "leader_http_out", "client_receives")
# Counted calls (name in the trace -> what one call is): the copies and codec passes of a record.
CODEC_COUNTS = {
    "disk_read": "a pread of a segment file (a log read not answered from memory)",
    "batch_decode": "a batch decoded from segment bytes (CRC + msgpack)",
    "batch_encode": "a batch encoded for a segment file (msgpack + CRC)",
    "message_encode": "a raft message encoded for the transport",
    "message_decode": "a raft message decoded from the transport",
    "command_encode": "a command encoded into a log record",
}


# --------------------------------------------------------------------------- node side


def serve_traced(argv: list[str]) -> int:
    """``metakv serve`` with trace points (runs inside each node process)."""
    events: list[tuple[float, str, int]] = []
    clock = time.perf_counter

    def dump(*_: object) -> None:
        path = Path(os.environ[TRACE_ENV])
        path.with_suffix(".tmp").write_text(json.dumps(events))
        path.with_suffix(".tmp").replace(path)  # the reader sees the whole file or none
    signal.signal(signal.SIGUSR1, dump)

    import asyncio.streams

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    import app.http.uvicorn_protocol as http_protocol
    import app.runtime as runtime
    import app.transport as transport
    import storage.segment_log as segment_log

    def around(cls: Any, name: str, label: str) -> None:
        original = getattr(cls, name)

        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            events.append((clock(), label + ">", 0))
            try:
                return original(self, *args, **kwargs)
            finally:
                events.append((clock(), label + "<", 0))
        setattr(cls, name, traced)

    def before(cls: Any, name: str, label: str, size_of: Any = None) -> None:
        original = getattr(cls, name)

        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            events.append((clock(), label, size_of(self, *args) if size_of else 0))
            return original(self, *args, **kwargs)
        setattr(cls, name, traced)

    def count(owner: Any, name: str, label: str) -> None:
        """Count calls of ``owner.name`` (a module's imported name or a class's method)."""
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            events.append((clock(), "count:" + label, 0))
            return original(*args, **kwargs)
        setattr(owner, name, counted)

    import storage.batch_codec as batch_codec
    count(segment_log, "read_exact", "disk_read")
    count(segment_log, "decode_batch", "batch_decode")
    count(batch_codec.BatchEncoder, "parts", "batch_encode")
    count(transport, "encode_message", "message_encode")
    count(transport, "decode_message", "message_decode")
    count(runtime, "encode_command", "command_encode")
    before(HttpToolsProtocol, "data_received", "http_in")
    before(http_protocol.CoalescingTransport, "_flush", "http_out", lambda self: len(self._pending))
    original_propose = runtime.NodeRuntime.propose

    async def propose(self: Any, command: Any) -> Any:
        events.append((clock(), "propose", 0))
        return await original_propose(self, command)
    runtime.NodeRuntime.propose = propose  # type: ignore[method-assign]
    around(runtime.NodeRuntime, "_apply_committed", "apply")
    around(runtime.NodeRuntime, "_on_flush_done", "flush_answer")
    around(runtime.NodeRuntime, "_maybe_start_flush", "flush_ask")
    around(segment_log.SegmentLog, "flush", "fsync")
    before(transport.RaftTransport, "_deliver", "raft_in", lambda self, connection, payload: len(payload))
    before(asyncio.streams.StreamWriter, "write", "raft_out", lambda self, data: len(data))

    from app.cli import main as cli_main
    return cli_main(argv)


# --------------------------------------------------------------------------- client side


def metakv_put(sock: socket.socket, key: str, value: bytes) -> None:
    _request(sock, "PUT", f"/v1/kv/{key}", "application/octet-stream", value)


def etcd_put(sock: socket.socket, key: str, value: bytes) -> None:
    body = json.dumps({"key": base64.b64encode(key.encode()).decode(),
                       "value": base64.b64encode(value).decode()}).encode()
    _request(sock, "POST", "/v3/kv/put", "application/json", body)


def _request(sock: socket.socket, method: str, path: str, content_type: str, body: bytes) -> None:
    """One request on a keep-alive connection; returns when the whole 200 answer is read."""
    head = (f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    buffer = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the leader closed the connection")
        buffer += chunk
        head_end = buffer.find(b"\r\n\r\n")
        if head_end < 0:
            continue
        headers = buffer[:head_end].split(b"\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in headers if line.lower().startswith(b"content-length:"))
        if len(buffer) - head_end - 4 >= length:
            if not headers[0].startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"write failed: {headers[0]!r}")
            return


def one_client_writes(port: int, put: Callable[[socket.socket, str, bytes], None], writes: int,
                      pids: dict[int, int]) -> tuple[list[tuple[float, float]], dict[int, tuple[float, float]]]:
    """``writes`` puts one at a time after the warm-up: (send, receive) times, CPU s per node."""
    value = b"v" * VALUE_BYTES
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for index in range(WARMUP_WRITES):
            put(sock, f"bench/path/k{index % 100}", value)
        cpu_before = {node_id: _cpu_seconds(pid) for node_id, pid in pids.items()}
        marks = []
        for index in range(writes):
            sent = time.perf_counter()
            put(sock, f"bench/path/k{index % 100}", value)
            marks.append((sent, time.perf_counter()))
        cpu_after = {node_id: _cpu_seconds(pid) for node_id, pid in pids.items()}
    return marks, {node_id: (cpu_after[node_id][0] - cpu_before[node_id][0],
                             cpu_after[node_id][1] - cpu_before[node_id][1]) for node_id in pids}


def latency_figures(marks: list[tuple[float, float]]) -> dict[str, float]:
    latencies_ms = sorted((end - start) * 1000 for start, end in marks)
    return {"latency_ms_p50": round(statistics.median(latencies_ms), 3),
            "latency_ms_p90": round(latencies_ms[int(0.9 * (len(latencies_ms) - 1))], 3),
            "latency_ms_mean": round(statistics.fmean(latencies_ms), 3)}


def histogram_totals(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of an unlabelled Prometheus histogram on ``url``/metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    totals = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(name + suffix + " "):
                totals[suffix] = float(line.split()[1])
    return totals.get("_sum", 0.0), totals.get("_count", 0.0)


def mean_ms_between(before: tuple[float, float], after: tuple[float, float]) -> dict[str, float]:
    count = after[1] - before[1]
    return {"count": count, "mean_ms": round((after[0] - before[0]) * 1000 / count, 3) if count else 0.0}


def measure_etcd(writes: int) -> dict[str, Any]:
    """The same client against a fresh 3-member etcd: latency, CPU, each member's WAL fsync."""
    from loadtest.clusters import start_etcd

    with start_etcd(3) as etcd:  # returns once a leader is known
        leader = etcd.leader()
        if leader is None:
            raise RuntimeError("the etcd cluster lost its leader right after starting")
        pids = {node.node_id: node.pid for node in etcd.nodes.values() if node.pid is not None}
        before = {node.node_id: histogram_totals(node.url, ETCD_WAL_FSYNC_HISTOGRAM) for node in etcd.nodes.values()}
        marks, cpu = one_client_writes(leader.http_port, etcd_put, writes, pids)
        after = {node.node_id: histogram_totals(node.url, ETCD_WAL_FSYNC_HISTOGRAM) for node in etcd.nodes.values()}
        return {**latency_figures(marks), "version": etcd.version(),
                "cpu_ms_per_write": cpu_table(cpu, leader.node_id, writes),
                "wal_fdatasync": {("leader" if node_id == leader.node_id else f"follower {node_id}"):
                                  mean_ms_between(before[node_id], after[node_id]) for node_id in before}}


def cpu_table(cpu: dict[int, tuple[float, float]], leader_id: int, writes: int) -> dict[str, dict[str, float]]:
    return {("leader" if node_id == leader_id else f"follower {node_id}"): {
        "user": round(user * 1000 / writes, 3), "system": round(system * 1000 / writes, 3)}
        for node_id, (user, system) in cpu.items()}


def print_cpu(store: str, table: dict[str, dict[str, float]]) -> None:
    print(f"{store} servers' CPU ms per write (user + system): "
          + ", ".join(f"{name} {cpu['user']} + {cpu['system']}" for name, cpu in table.items()))


def _cpu_seconds(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def _first(events: list[tuple[float, str, int]], name: str, after: float, until: float,
           size_test: Any = None) -> float | None:
    for at, event, size in events:
        if at >= after and event == name and (size_test is None or size_test(size)):
            return at if at <= until else None
    return None


def follow_writes(marks: list[tuple[float, float]], leader_id: int,
                  traces: dict[int, list[tuple[float, str, int]]]) -> list[dict[str, float]]:
    """Per write, the time of each hop of the commit path (see the module docstring)."""
    leader = traces[leader_id]
    followers = {node_id: events for node_id, events in traces.items() if node_id != leader_id}
    records = lambda size: size > 300  # noqa: E731 - a Fetch answer holding the 256-byte value
    small = lambda size: size < 100  # noqa: E731 - a Fetch (acknowledgement)
    rows = []
    for sent, received in marks:
        row = {"client_sends": sent, "client_receives": received}
        http_in = _first(leader, "http_in", sent - 0.001, received)
        propose = _first(leader, "propose", sent - 0.001, received)
        if http_in is None or propose is None:
            continue
        row.update(http_in=http_in, propose=propose)
        best: dict[str, float] | None = None
        for events in followers.values():
            out = _first(leader, "raft_out", propose, received, records)
            got = _first(events, "raft_in", propose, received, records)
            if out is None or got is None:
                continue
            asked = _first(events, "flush_ask>", got, received)
            fsync_start = _first(events, "fsync>", got, received)
            fsync_end = _first(events, "fsync<", got, received)
            answered = _first(events, "flush_answer>", got, received)
            if None in (asked, fsync_start, fsync_end, answered):
                continue
            fetch_out = _first(events, "raft_out", answered, received, small)  # type: ignore[arg-type]
            ack = _first(leader, "raft_in", fetch_out, received, small) if fetch_out else None
            if fetch_out is None or ack is None:
                continue
            if best is None or ack < best["leader_receives_fetch"]:
                best = {"leader_sends_records": out, "follower_receives": got, "follower_flush_asked": asked,
                        "follower_fsync_starts": fsync_start, "follower_fsync_ends": fsync_end,
                        "follower_flush_answered": answered, "follower_sends_fetch": fetch_out,
                        "leader_receives_fetch": ack}  # type: ignore[dict-item]
        if best is None:
            continue
        row.update(best)
        apply_start = _first(leader, "apply>", row["leader_receives_fetch"], received)
        apply_end = _first(leader, "apply<", row["leader_receives_fetch"], received)
        http_out = _first(leader, "http_out", apply_end or row["leader_receives_fetch"], received)
        if None in (apply_start, apply_end, http_out):
            continue
        row.update(leader_apply_starts=apply_start, leader_apply_ends=apply_end, leader_http_out=http_out)  # type: ignore[arg-type]
        own_ask = _first(leader, "flush_ask>", propose, received)
        own_start = _first(leader, "fsync>", propose, received)
        own_end = _first(leader, "fsync<", propose, received)
        own_answer = _first(leader, "flush_answer>", propose, received)
        if None not in (own_ask, own_start, own_end, own_answer):
            row.update(leader_flush_asked=own_ask, leader_fsync_starts=own_start, leader_fsync_ends=own_end,  # type: ignore[arg-type]
                       leader_flush_answered=own_answer)
        rows.append(row)
    return rows


def codec_counts(marks: list[tuple[float, float]], leader_id: int,
                 traces: dict[int, list[tuple[float, str, int]]]) -> dict[str, dict[str, float]]:
    """Per node, the counted calls (CODEC_COUNTS) made while the measured writes ran, per write."""
    start, end = marks[0][0], marks[-1][1]
    counts: dict[str, dict[str, float]] = {}
    for node_id, events in sorted(traces.items()):
        calls = {name: 0 for name in CODEC_COUNTS}
        for at, event, _size in events:
            if start <= at <= end and event.startswith("count:"):
                calls[event[len("count:"):]] += 1
        counts["leader" if node_id == leader_id else f"follower {node_id}"] = {
            name: round(value / len(marks), 2) for name, value in calls.items()}
    return counts


def hop_table(rows: list[dict[str, float]]) -> list[dict[str, Any]]:
    table = []
    previous = "client_sends"
    for hop in HOPS:
        deltas = [(row[hop] - row[previous]) * 1000 for row in rows if hop in row and previous in row]
        if deltas:
            table.append({"from": previous, "to": hop, "ms_p50": round(statistics.median(deltas), 3),
                          "ms_mean": round(statistics.fmean(deltas), 3)})
        previous = hop
    for start, end in (("propose", "leader_flush_asked"), ("leader_flush_asked", "leader_fsync_starts"),
                       ("leader_fsync_starts", "leader_fsync_ends"), ("leader_fsync_ends", "leader_flush_answered"),
                       ("propose", "leader_flush_answered")):
        deltas = [(row[end] - row[start]) * 1000 for row in rows if start in row and end in row]
        if deltas:
            table.append({"from": start, "to": end, "ms_p50": round(statistics.median(deltas), 3),
                          "ms_mean": round(statistics.fmean(deltas), 3), "leader_own_flush": True})
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_write_path", description=__doc__.split("\n")[0])
    parser.add_argument("--writes", type=int, default=800, help="measured writes (after 50 warm-up writes)")
    parser.add_argument("--no-trace", action="store_true", help="no trace points: latency and CPU only")
    parser.add_argument("--etcd", action="store_true", help="then measure a 3-member etcd with the same client")
    parser.add_argument("--out", type=Path, default=Path("results/bench_write_path.json"))
    args = parser.parse_args(argv)

    from loadtest.local_cluster import Cluster

    root = Path(tempfile.mkdtemp(prefix="metakv-write-path-"))
    cluster = Cluster(root, voters=3)
    if not args.no_trace:
        for node in cluster.nodes.values():
            node.command = [sys.executable, "-m", "loadtest.bench_write_path", "--serve-traced", *node.command[3:]]
            node.env[TRACE_ENV] = str(root / f"trace-{node.node_id}.json")
    results: dict[str, Any] = {"command": "python -m loadtest.bench_write_path " + " ".join(argv or sys.argv[1:]),
                               "traced": not args.no_trace, "value_bytes": VALUE_BYTES}
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        for node in cluster.nodes.values():
            cluster.wait_ready(node)
        pids = {node.node_id: node.pid for node in cluster.nodes.values() if node.pid is not None}
        flush_before = {node.node_id: histogram_totals(node.url, FLUSH_HISTOGRAM) for node in cluster.nodes.values()}
        marks, cpu = one_client_writes(leader.http_port, metakv_put, args.writes, pids)
        flush_after = {node.node_id: histogram_totals(node.url, FLUSH_HISTOGRAM) for node in cluster.nodes.values()}
        results.update(latency_figures(marks))
        results["cpu_ms_per_write"] = cpu_table(cpu, leader.node_id, args.writes)
        results["flush_seen_by_loop"] = {
            ("leader" if node_id == leader.node_id else f"follower {node_id}"):
            mean_ms_between(flush_before[node_id], flush_after[node_id]) for node_id in flush_before}
        results["load_average_1m"] = round(os.getloadavg()[0], 2)
        print(f"one client, {args.writes} writes{'' if args.no_trace else ' (traced)'}: p50 {results['latency_ms_p50']} ms  "
              f"p90 {results['latency_ms_p90']} ms  mean {results['latency_ms_mean']} ms  load {results['load_average_1m']}")
        print_cpu("metakv", results["cpu_ms_per_write"])
        print("flush as the event loop sees it (handed to the flush thread -> answer handled), mean ms: " + ", ".join(
            f"{name} {figures['mean_ms']}" for name, figures in results["flush_seen_by_loop"].items()))
        if not args.no_trace:
            for node in cluster.nodes.values():
                node.signal(signal.SIGUSR1)
            traces: dict[int, list[tuple[float, str, int]]] = {}
            deadline = time.monotonic() + 10
            for node in cluster.nodes.values():
                path = root / f"trace-{node.node_id}.json"
                while not path.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                traces[node.node_id] = sorted((at, name, size) for at, name, size in json.loads(path.read_text()))
            results["codec_counts_per_write"] = codec_counts(marks, leader.node_id, traces)
            print("codec work per write (calls; " + ", ".join(f"{name}: {what}" for name, what in CODEC_COUNTS.items()) + "):")
            for node_name, counts in results["codec_counts_per_write"].items():
                print(f"  {node_name:>10}: " + "  ".join(f"{name} {value}" for name, value in counts.items()))
            rows = follow_writes(marks, leader.node_id, traces)
            results["writes_followed"] = len(rows)
            results["hops"] = hop_table(rows)
            print(f"hops of the commit path ({len(rows)} of {len(marks)} writes followed), ms:")
            for hop in results["hops"]:
                mark = "  (leader's own flush, in parallel)" if hop.get("leader_own_flush") else ""
                print(f"  {hop['from']:>24} -> {hop['to']:<24} p50 {hop['ms_p50']:7.3f}  mean {hop['ms_mean']:7.3f}{mark}")
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
    if args.etcd:
        etcd = results["etcd"] = measure_etcd(args.writes)
        results["p50_ratio_to_etcd"] = round(results["latency_ms_p50"] / etcd["latency_ms_p50"], 2)
        print(f"etcd {etcd['version']}, the same client: p50 {etcd['latency_ms_p50']} ms  p90 {etcd['latency_ms_p90']} ms  "
              f"mean {etcd['latency_ms_mean']} ms; metakv p50 ÷ etcd p50 = {results['p50_ratio_to_etcd']}")
        print_cpu("etcd", etcd["cpu_ms_per_write"])
        print("etcd WAL fdatasync, mean ms: " + ", ".join(
            f"{name} {figures['mean_ms']}" for name, figures in etcd["wal_fdatasync"].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-traced":
        sys.exit(serve_traced(sys.argv[2:]))
    sys.exit(main())
