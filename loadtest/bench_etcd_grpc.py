"""What the one etcd port costs gRPC: puts and serializable ranges through metakv's etcd port
(gRPC relayed by the sniffing front, app/etcd/front.py) against metakv's gRPC-only port (with
--listen-etcd-gateway, grpc's own listener, no relay) and a real etcd, same run, 64 clients.

    python -m loadtest.bench_etcd_grpc [--duration-s 5] [--rounds 2] [--grpc-port-first]
                                       [--out results/bench_etcd_grpc.json]

Three stores of 3 nodes on loopback: two metakv clusters that differ only in that flag, and
etcd 3.4 (Debian's etcd-server). The load is ``--workers`` generator processes (grpc.aio on
uvloop), 64 calls in flight in all, each call issued as soon as the last one answered: puts
of 256-byte values to the leader, then serializable ranges of one seeded key spread over every
node. Each phase runs against the three stores back to back, ``--rounds`` times, the order
rotating, so the ratios compare figures seconds apart. The generators share the two cores with
the servers, and cost the same whichever store they load.

A benchmark never fails on a figure; it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import uvloop

from app.etcd.protos import rpc_pb2, rpc_pb2_grpc
from loadtest.clusters import start_etcd
from loadtest.local_cluster import Cluster

PHASES = ("puts_64", "serializable_ranges_64")
CLIENTS = 64
VALUE = b"v" * 256
READ_KEYS = 100
CALL_TIMEOUT_S = 10.0


async def _load(kind: str, targets: list[str], clients: int, duration_s: float) -> dict[str, int]:
    """``clients`` closed loops over one channel per target; counts answers and errors."""
    channels = [grpc.aio.insecure_channel(target) for target in targets]
    stubs = [rpc_pb2_grpc.KVStub(channel) for channel in channels]
    done = errors = 0
    deadline = time.monotonic() + duration_s

    async def client(index: int) -> None:
        nonlocal done, errors
        kv = stubs[index % len(stubs)]
        sequence = 0
        while time.monotonic() < deadline:
            sequence += 1
            try:
                if kind == "puts":
                    await kv.Put(rpc_pb2.PutRequest(key=f"bench/grpc/{index}/{sequence % 100}".encode(), value=VALUE),
                                 timeout=CALL_TIMEOUT_S)
                else:
                    await kv.Range(rpc_pb2.RangeRequest(key=f"bench/read/k{sequence % READ_KEYS}".encode(),
                                                        serializable=True), timeout=CALL_TIMEOUT_S)
                done += 1
            except grpc.aio.AioRpcError:
                errors += 1

    await asyncio.gather(*(client(index) for index in range(clients)))
    for channel in channels:
        await channel.close()
    return {"done": done, "errors": errors}


def _worker(argv: list[str]) -> int:
    kind, targets, clients, duration_s = argv[0], argv[1].split(","), int(argv[2]), float(argv[3])
    print(json.dumps(uvloop.run(_load(kind, targets, clients, duration_s))), flush=True)
    return 0


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` used so far (every thread)."""
    total_ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total_ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return total_ticks / os.sysconf("SC_CLK_TCK")


def run_phase(kind: str, targets: list[str], workers: int, duration_s: float, server_pids: list[int]
              ) -> dict[str, float]:
    """``workers`` generator processes sharing ``CLIENTS``: answers per second in all, and
    the servers' CPU per answer (less sensitive than throughput to other jobs' load)."""
    cpu_before_s = _cpu_s(server_pids)
    share = [CLIENTS // workers + (1 if index < CLIENTS % workers else 0) for index in range(workers)]
    processes = [subprocess.Popen([sys.executable, "-m", "loadtest.bench_etcd_grpc", "--worker", kind,
                                   ",".join(targets), str(clients), str(duration_s)], stdout=subprocess.PIPE, text=True)
                 for clients in share]
    answers = [json.loads(process.communicate(timeout=duration_s + 60)[0]) for process in processes]
    done, errors = sum(answer["done"] for answer in answers), sum(answer["errors"] for answer in answers)
    cpu_ms_per_call = (_cpu_s(server_pids) - cpu_before_s) * 1000 / max(done, 1)
    return {"per_s": done / duration_s, "errors": errors, "servers_cpu_ms_per_call": cpu_ms_per_call}


def _seed(target: str) -> None:
    async def seed() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            kv = rpc_pb2_grpc.KVStub(channel)
            for key in range(READ_KEYS):
                await kv.Put(rpc_pb2.PutRequest(key=f"bench/read/k{key}".encode(), value=VALUE), timeout=CALL_TIMEOUT_S)
    uvloop.run(seed())


def _metakv(root: Path, one_port: bool) -> tuple[Cluster, str, list[str]]:
    cluster = Cluster(root, 3, etcd=True)
    if one_port:  # drop the separate gateway: the etcd port then serves both behind the front
        for node in cluster.nodes.values():
            at = node.command.index("--listen-etcd-gateway")
            del node.command[at:at + 2]
    cluster.start()
    leader = cluster.wait_for_leader()
    return cluster, f"127.0.0.1:{leader.etcd_port}", [f"127.0.0.1:{node.etcd_port}" for node in cluster.nodes.values()]


def _etcd_leader(etcd: Any) -> str:
    deadline = time.monotonic() + 30
    while (leader := etcd.leader()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if leader is None:
        raise RuntimeError("etcd elected no leader within 30 s")
    return f"127.0.0.1:{leader.http_port}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="results/bench_etcd_grpc.json")
    parser.add_argument("--grpc-port-first", action="store_true",
                        help="start the gRPC-port cluster before the one-port cluster (the order moves put figures)")
    args = parser.parse_args(argv)
    clusters: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="bench-etcd-grpc-") as tmp:
        try:
            stores: dict[str, tuple[str, list[str]]] = {}
            pids: dict[str, list[int]] = {}
            layouts = (("metakv_one_port", True), ("metakv_grpc_port", False))
            for name, one_port in (reversed(layouts) if args.grpc_port_first else layouts):
                cluster, leader, targets = _metakv(Path(tmp) / name, one_port)
                clusters.append(cluster)
                stores[name] = (leader, targets)
                pids[name] = [node.pid for node in cluster.nodes.values() if node.pid is not None]
            etcd = start_etcd(3, Path(tmp) / "etcd")
            clusters.append(etcd)
            stores["etcd"] = (_etcd_leader(etcd), [f"127.0.0.1:{node.http_port}" for node in etcd.nodes.values()])
            pids["etcd"] = [node.pid for node in etcd.nodes.values() if node.pid is not None]
            for name, (leader, _targets) in stores.items():
                print(f"seeding {name} through {leader}", flush=True)
                _seed(leader)
            time.sleep(1)  # followers apply the seeded keys
            names = list(stores)
            figures: dict[str, dict[str, list[float]]] = {name: {phase: [] for phase in PHASES} for name in names}
            cpu: dict[str, dict[str, list[float]]] = {name: {phase: [] for phase in PHASES} for name in names}
            for round_index in range(args.rounds):
                print(f"round {round_index + 1}/{args.rounds}", flush=True)
                order = names[round_index % len(names):] + names[:round_index % len(names)]
                for phase in PHASES:
                    for name in order:
                        leader, targets = stores[name]
                        kind = "puts" if phase == "puts_64" else "ranges"
                        result = run_phase(kind, [leader] if kind == "puts" else targets, args.workers, args.duration_s,
                                           pids[name])
                        print(f"  [{name}] {phase}: {result['per_s']:.0f}/s, {result['errors']} errors, servers' CPU "
                              f"{result['servers_cpu_ms_per_call']:.3f} ms/call", flush=True)
                        figures[name][phase].append(result["per_s"])
                        cpu[name][phase].append(result["servers_cpu_ms_per_call"])
        finally:
            for cluster in clusters:
                if isinstance(cluster, Cluster):
                    cluster.close()
                else:
                    for member in cluster.nodes.values():
                        member.kill()
    medians = {name: {phase: statistics.median(values) for phase, values in phases.items()}
               for name, phases in figures.items()}
    cpu_medians = {name: {phase: statistics.median(values) for phase, values in phases.items()}
                   for name, phases in cpu.items()}
    ratios = {phase: {"one_port_over_grpc_port": medians["metakv_one_port"][phase] / medians["metakv_grpc_port"][phase],
                      "one_port_over_etcd": medians["metakv_one_port"][phase] / medians["etcd"][phase],
                      "grpc_port_over_etcd": medians["metakv_grpc_port"][phase] / medians["etcd"][phase],
                      "cpu_per_call_one_port_over_grpc_port": cpu_medians["metakv_one_port"][phase]
                      / cpu_medians["metakv_grpc_port"][phase]}
              for phase in PHASES}
    for phase, phase_ratios in ratios.items():
        figures_line = ", ".join(f"{name} {medians[name][phase]:.0f}/s ({cpu_medians[name][phase]:.3f} ms CPU)"
                                 for name in names)
        print(f"{phase} medians: {figures_line}; " + ", ".join(f"{key} {value:.2f}" for key, value in phase_ratios.items()),
              flush=True)
    report = {"per_s": figures, "median_per_s": medians, "servers_cpu_ms_per_call": cpu,
              "median_servers_cpu_ms_per_call": cpu_medians, "ratios": ratios,
              "settings": {"duration_s": args.duration_s, "rounds": args.rounds, "workers": args.workers}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
