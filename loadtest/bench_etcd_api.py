"""Put and range throughput through metakv's etcd API against metakv's own HTTP API and a
real etcd, same run, 64 clients; prints figures and ratios, writes JSON.

    python -m loadtest.bench_etcd_api [--duration-s 5] [--rounds 2] [--out results/bench_etcd_api.json]

Three stores on this machine, each 3 nodes on loopback: metakv through its HTTP API,
the same metakv cluster through its etcd v3 JSON gateway (--listen-etcd-gateway; the
calls etcd clients such as etcd3gw make), and etcd 3.4 (Debian's etcd-server) through its
own gateway. The load is bench_http's (wrk, keep-alive connections requesting back to back):
puts of 256-byte values at 64 clients to the leader, and local (serializable) reads of seeded
keys at 64 clients over every node. Each phase runs against the three stores back to back,
``--rounds`` times, the order rotating, so the ratios compare figures seconds apart.

gRPC is not measured here: Debian ships no etcd ``benchmark`` tool, and a Python gRPC
load generator would take the servers' CPU on two cores.

A benchmark never fails on a figure; it reports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from loadtest.bench_http import ETCD, METAKV, Store, etcd_store, run_phase, seed_reads
from loadtest.clusters import start_etcd
from loadtest.local_cluster import Cluster

PHASES = ("writes_64", "local_reads_64_clients")


def _per_s(figures: dict[str, Any]) -> float:
    return float(figures["per_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="results/bench_etcd_api.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-etcd-api-") as tmp:
        metakv = Cluster(Path(tmp) / "metakv", 3, etcd=True).start()
        etcd = None
        try:
            etcd = start_etcd(3, Path(tmp) / "etcd")
            leader = metakv.wait_for_leader()
            nodes = list(metakv.nodes.values())
            stores = {
                "metakv_http": Store(metakv, leader.url, [node.url for node in nodes], METAKV),
                "metakv_etcd_gateway": Store(metakv, f"http://127.0.0.1:{leader.etcd_gateway_port}",
                                             [f"http://127.0.0.1:{node.etcd_gateway_port}" for node in nodes], ETCD),
                "etcd": etcd_store(etcd),
            }
            figures: dict[str, dict[str, list[float]]] = {name: {phase: [] for phase in PHASES} for name in stores}
            names = list(stores)
            for round_index in range(args.rounds):
                print(f"round {round_index + 1}/{args.rounds}", flush=True)
                order = names[round_index % len(names):] + names[:round_index % len(names)]
                for phase in PHASES:
                    for name in order:
                        if phase == "local_reads_64_clients" and round_index == 0:
                            seed_reads(stores[name])
                        print(f"[{name}] ", end="", flush=True)
                        figures[name][phase].append(_per_s(run_phase(stores[name], phase, args.duration_s)))
        finally:
            if etcd is not None:
                for member in etcd.nodes.values():
                    member.kill()
            metakv.close()
    medians = {name: {phase: statistics.median(values) for phase, values in phases.items()}
               for name, phases in figures.items()}
    ratios = {phase: {"etcd_gateway_over_http": medians["metakv_etcd_gateway"][phase] / medians["metakv_http"][phase],
                      "etcd_gateway_over_etcd": medians["metakv_etcd_gateway"][phase] / medians["etcd"][phase],
                      "http_over_etcd": medians["metakv_http"][phase] / medians["etcd"][phase]}
              for phase in PHASES}
    for phase in PHASES:
        print(f"{phase}: " + "  ".join(f"{name} {medians[name][phase]:.0f}/s" for name in names)
              + "  |  " + "  ".join(f"{key} {value:.2f}" for key, value in ratios[phase].items()), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"per_s": figures, "median_per_s": medians, "ratios": ratios,
                               "duration_s": args.duration_s, "rounds": args.rounds}, indent=2) + "\n")
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
