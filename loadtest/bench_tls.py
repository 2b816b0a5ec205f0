"""What TLS costs: write throughput and 1-client write p50, TLS on (HTTPS and peer mutual TLS)
against TLS off, for metakv and for etcd with TLS from the same certificates, in one run.

    python -m loadtest.bench_tls [--duration-s 8] [--clients 16] [--rounds 2] [--out results/bench_tls.json]

Each round starts four fresh 3-node clusters on loopback one after another (metakv plain,
metakv TLS, etcd plain, etcd TLS; the order rotates every round) and drives each with wrk,
against its leader: one client writing back to back (its p50), then ``--clients`` clients
(writes/s). TLS here is server-authenticated HTTPS for clients (wrk does not present a
certificate) and mutually authenticated TLS between nodes. Ratios are medians over rounds of
the per-round ratios. A benchmark never fails on a figure; it reports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loadtest.bench_http import ETCD, METAKV, EtcdRequests, MetakvRequests, closed_loop
from loadtest.clusters import start_etcd
from loadtest.local_cluster import Cluster
from loadtest.tls_clusters import (
    TlsCluster,
    client_context,
    etcd_leader,
    make_cluster_certs,
    start_etcd_tls,
)

NODES = 3
SETUPS = ("metakv", "metakv-tls", "etcd", "etcd-tls")


@contextmanager
def leader_url(setup: str, root: Path, certs: Path) -> Iterator[tuple[str, MetakvRequests | EtcdRequests]]:
    """A fresh cluster of ``setup``, yielding its leader's URL; stopped afterwards."""
    if setup.startswith("metakv"):
        cluster = TlsCluster(root, certs, NODES) if setup == "metakv-tls" else Cluster(root, NODES)
        with cluster:  # starts it
            yield cluster.wait_for_leader().url, METAKV
        return
    etcd = start_etcd_tls(root, certs, NODES) if setup == "etcd-tls" else start_etcd(NODES, root)
    try:
        leader = etcd_leader(etcd, client_context(certs)) if setup == "etcd-tls" else etcd.leader()
        assert leader is not None
        yield leader.url, ETCD
    finally:
        etcd.stop()


def measure(setup: str, root: Path, certs: Path, clients: int, duration_s: float) -> dict[str, Any]:
    with leader_url(setup, root, certs) as (url, requests):
        one = closed_loop([url], 1, duration_s, "write", requests)
        many = closed_loop([url], clients, duration_s, "write", requests)
    return {"p50_ms_1_client": one["latency_ms_p50"], "writes_per_s": many["per_s"],
            "errors": one["errors"] + many["errors"], "one_client": one, "many_clients": many}


def ratio(rounds: list[dict[str, dict[str, Any]]], figure: str, top: str, bottom: str) -> float:
    return round(statistics.median(r[top][figure] / r[bottom][figure] for r in rounds), 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="results/bench_tls.json")
    args = parser.parse_args(argv)
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="metakv-bench-tls-") as tmp:
        certs = make_cluster_certs(Path(tmp) / "certs", NODES)
        for index in range(args.rounds):
            order = SETUPS[index % len(SETUPS):] + SETUPS[:index % len(SETUPS)]
            results: dict[str, dict[str, Any]] = {}
            for setup in order:
                results[setup] = measure(setup, Path(tmp) / f"r{index}-{setup}", certs, args.clients, args.duration_s)
                print(f"round {index + 1} {setup:11s} p50 {results[setup]['p50_ms_1_client']:.2f} ms  "
                      f"{results[setup]['writes_per_s']:.0f} writes/s ({args.clients} clients)  "
                      f"errors {results[setup]['errors']}", flush=True)
            rounds.append(results)

    def figures(figure: str, top: str, bottom: str) -> float:
        return ratio(rounds, figure, top, bottom)

    summary = {
        "metakv TLS / plain, writes/s": figures("writes_per_s", "metakv-tls", "metakv"),
        "metakv TLS / plain, p50": figures("p50_ms_1_client", "metakv-tls", "metakv"),
        "etcd TLS / plain, writes/s": figures("writes_per_s", "etcd-tls", "etcd"),
        "etcd TLS / plain, p50": figures("p50_ms_1_client", "etcd-tls", "etcd"),
        "metakv TLS / etcd TLS, writes/s": figures("writes_per_s", "metakv-tls", "etcd-tls"),
        "metakv TLS / etcd TLS, p50": figures("p50_ms_1_client", "metakv-tls", "etcd-tls"),
    }
    for name, value in summary.items():
        print(f"{name}: {value}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
