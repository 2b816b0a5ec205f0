"""Scale benchmark: metakv and etcd grown side by side through stages of live keys; at each
stage the per-operation costs of both, measured back to back. Prints a table per stage,
writes JSON and one PNG of cost per operation against store size.

    python -m loadtest.bench_scale [--stages 10000,100000,1000000] [--phase-s 10] [--quick]
                                   [--out results/bench_scale.json] [--png results/bench_scale.png]
                                   [--profile-dir results/scale-profile [--profile-gil]]

One 3-voter metakv cluster and one 3-member etcd 3.4 cluster (Debian's etcd-server, fsync
on, through its v3 JSON gateway, as ``bench_http --etcd`` runs it) run on this machine for
the whole run. etcd runs as an operator would at that size: ``--quota-backend-bytes`` (8 GiB
by default) and ``--auto-compaction-mode revision`` keeping ``--etcd-retention-revisions``
(300,000 by default: metakv's 60 s min_compaction_lag at ~5,000 writes/s; etcd's revision
compactor runs every 5 minutes). Both retentions are printed and written.

Each stage first grows both stores to its size: every new key written once by 64 clients
(256-byte values), in chunks alternating between the stores so the machine's drift falls
on both. Then each phase runs against one store and at once against the other (the first
swapping phase by phase and stage by stage):

- churn, 64 clients: 50 % put / 30 % get / 20 % delete over the whole keyspace, closed loop
  (wrk, as bench_http), to the leader;
- the same churn at a fixed 500 requests/s, open loop: latency counts from each request's
  scheduled start, so a stall is not hidden;
- point reads and prefix lists of 100 keys, one client (metakv local reads, etcd
  serializable ranges), from the leader.

Then, metakv only: a follower's apply figures during the 64-client churn (its /metrics),
a follower's cold restart (SIGKILL, start, until it serves a read at the leader's version),
a cleaning pass, a snapshot's take (POST /v1/admin/snapshot) and install (an observer,
stopped since the first stage and so behind the cleaned log, is sent that snapshot). Both:
RSS per node and bytes on disk. These run after the stage's latency phases (the cleaning
prunes metakv's history).

With ``--profile-dir``, py-spy samples metakv's leader and a follower during each of
metakv's churn and list phases (PROFILED_PHASES): the collapsed stacks are written there,
and where the time went (self time per function, per request) is printed and written.

Ratios are metakv ÷ etcd of figures measured seconds apart in the same stage; a benchmark
never fails on a figure, it reports. ``make bench-scale`` runs the default stages.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.config import NodeConfig
from loadtest import scale_probes as probes
from loadtest.bench_http import (
    FIXED_RATE_WRITES_PER_S,
    METAKV,
    VALUE_BYTES,
    WARMUP_S,
    Store,
    etcd_store,
    start_profile,
    summarise_profile,
)
from loadtest.clusters import LocalCluster, start_etcd
from loadtest.local_cluster import Cluster, Node
from loadtest.scale_load import (
    CLIENTS,
    LIST_LIMIT,
    ChurnPlan,
    churn_closed,
    churn_fixed_rate,
    churn_plan,
    grow,
    key_name,
    point_reads,
    prefix_lists,
    repair,
)
from loadtest.scale_report import METRICS, METRICS_ONE_SIDED, plot, print_stage, ratios, summarise
from loadtest.stores import b64

DEFAULT_STAGES = (10_000, 100_000, 1_000_000)
QUOTA_BACKEND_BYTES = 8 * 1024**3
ETCD_RETENTION_REVISIONS = 300_000
GROWTH_CHUNKS = 10  # growth alternates between the stores this many times per store
GROWTH_CHUNK_MIN = 2_000
STAGE_MIN_KEYS = 1_000
# metakv's settings that decide how much history it keeps (app/config.py; the cluster runs
# with the defaults).
RETENTION_SETTINGS_STATED = ("cleaner_interval_ms", "cleaner_min_dirty_ratio", "min_compaction_lag_ms",
                             "tombstone_retention_records", "snapshot_every_records")
PROFILED_PHASES = ("churn_64_clients", "churn_fixed_rate", "list_prefix_1_client")
PROFILE_TOP_PRINTED = 10


def metakv_retention() -> dict[str, Any]:
    defaults = {field.name: field.default for field in dataclasses.fields(NodeConfig)}
    settings = {name: defaults[name] for name in RETENTION_SETTINGS_STATED}
    settings["statement"] = (
        f"history is kept until the cleaner runs (every {settings['cleaner_interval_ms'] / 1000:g} s, when at least "
        f"{settings['cleaner_min_dirty_ratio']:.0%} of the log is dirty), and at least "
        f"{settings['min_compaction_lag_ms'] / 1000:g} s after apply; tombstones "
        f"{settings['tombstone_retention_records']} records below the cleaned end")
    return settings


def etcd_flags(quota_bytes: int, retention_revisions: int) -> list[str]:
    return ["--quota-backend-bytes", str(quota_bytes), "--auto-compaction-mode", "revision",
            "--auto-compaction-retention", str(retention_revisions)]


@dataclasses.dataclass
class Run:
    """The two stores under test and the metakv nodes the metakv-only probes use."""

    metakv_cluster: Cluster
    etcd_cluster: LocalCluster
    observer: Node
    stores: dict[str, Store] = dataclasses.field(default_factory=dict)
    profile_dir: Path | None = None  # py-spy on metakv's leader and a follower (PROFILED_PHASES)
    profile_gil: bool = False

    def refresh(self) -> None:
        """Find each store's leader again (a metakv leader may change under load)."""
        metakv_leader = self.metakv_cluster.wait_for_leader()
        voters = [node.url for node in self.metakv_cluster.voters]
        self.stores = {"metakv": Store(self.metakv_cluster, metakv_leader.url, voters, METAKV),
                       "etcd": etcd_store(self.etcd_cluster)}

    def metakv_leader(self) -> Node:
        return self.metakv_cluster.wait_for_leader()

    def metakv_follower(self) -> Node:
        leader = self.metakv_leader()
        return next(node for node in self.metakv_cluster.voters if node.node_id != leader.node_id)


def stage_growth(run: Run, first: int, end: int, first_store: str) -> dict[str, Any]:
    """Grow both stores from ``first`` to ``end`` keys in chunks, alternating the stores."""
    chunk = max(GROWTH_CHUNK_MIN, -(-(end - first) // GROWTH_CHUNKS))
    totals = {name: {"requests": 0, "seconds": 0.0, "failed": 0, "error_statuses": {}} for name in run.stores}
    order = [first_store, *(name for name in run.stores if name != first_store)]
    for turn, start in enumerate(range(first, end, chunk)):
        for name in order if turn % 2 == 0 else order[::-1]:
            figures = grow(run.stores[name], start, min(end, start + chunk))
            total = totals[name]
            total["requests"] += figures["requests"]
            total["seconds"] += figures["seconds"]
            total["failed"] += figures["failed"]
            for status, count in figures["error_statuses"].items():
                total["error_statuses"][status] = total["error_statuses"].get(status, 0) + count
    for total in totals.values():
        total["per_s"] = round(total["requests"] / total["seconds"], 1) if total["seconds"] else None
        total["seconds"] = round(total["seconds"], 3)
    return totals


def measure_phases(run: Run, plan: ChurnPlan, live_keys: int, phase_s: float, first_store: str,
                   seed: int) -> dict[str, dict[str, Any]]:
    """Every latency phase against both stores back to back, the first store swapping phase
    by phase; the churn plan's deleted keys are put back before the read phases."""
    figures: dict[str, dict[str, Any]] = {name: {} for name in run.stores}
    follower = run.metakv_follower()

    def churn_64(store: Store) -> dict[str, Any]:
        if store.requests is not METAKV:
            return churn_closed(store, plan, phase_s)
        leader_before = store.leader_url
        before, started = probes.scrape(follower.url), time.monotonic()
        result = with_loop_lag(store, lambda: churn_closed(store, plan, phase_s))
        after, wall_s = probes.scrape(follower.url), time.monotonic() - started
        result["follower_apply"] = {"node_id": follower.node_id, **probes.apply_figures(before, after, wall_s)}
        result["leader_changed"] = run.metakv_leader().url != leader_before
        return result

    def churn_at_fixed_rate(store: Store) -> dict[str, Any]:
        if store.requests is not METAKV:
            return churn_fixed_rate(store, plan, phase_s)
        return with_loop_lag(store, lambda: churn_fixed_rate(store, plan, phase_s))

    phases: list[tuple[str, Callable[[Store], dict[str, Any]]]] = [
        ("churn_64_clients", churn_64),
        ("churn_fixed_rate", churn_at_fixed_rate),
        ("point_read_1_client", lambda store: point_reads(store, live_keys, phase_s, random.Random(seed))),
        ("list_prefix_1_client", lambda store: prefix_lists(store, live_keys, phase_s, random.Random(seed + 1))),
    ]
    order = [first_store, *(name for name in run.stores if name != first_store)]
    for index, (phase, measure) in enumerate(phases):
        if phase == "point_read_1_client":
            for name, store in run.stores.items():
                figures[name]["repair"] = repair(store, plan)
        for name in order if index % 2 == 0 else order[::-1]:
            if name == "metakv" and run.profile_dir is not None and phase in PROFILED_PHASES:
                result = profiled(run, f"{live_keys}-{phase}", phase_s, measure)
            else:
                result = measure(run.stores[name])
            figures[name][phase] = result
            lag = result.get("leader_loop_lag", {}).get("mean_ms")
            print(f"  {name:6s} {phase:22s} {result['per_s']:9.1f}/s  p50 {result['latency_ms_p50']:9.2f} ms  "
                  f"p99 {result['latency_ms_p99']:9.2f} ms  errors {result['errors']}"
                  + (f"  leader loop lag mean {lag:.2f} ms" if lag is not None else ""), flush=True)
    return figures


def with_loop_lag(store: Store, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure()`` and the metakv leader's event loop lag meanwhile (its /metrics)."""
    before = probes.scrape(store.leader_url)
    result = measure()
    result["leader_loop_lag"] = probes.loop_lag_figures(before, probes.scrape(store.leader_url))
    return result


def profiled(run: Run, label: str, phase_s: float, measure: Callable[[Store], dict[str, Any]]) -> dict[str, Any]:
    """``measure(metakv)`` with py-spy on metakv's leader and a follower meanwhile (its warm-up
    included); each one's profile summary lands in the result under "profile"."""
    assert run.profile_dir is not None
    leader = run.metakv_leader()
    follower = run.metakv_follower()
    seconds = phase_s + WARMUP_S
    roles = {"leader": leader, "follower": follower}
    paths = {role: run.profile_dir / f"{label}-{role}-node{node.node_id}.txt" for role, node in roles.items()}
    spies = {role: start_profile(node, seconds, paths[role], run.profile_gil) for role, node in roles.items()}
    result = measure(run.stores["metakv"])
    requests = result.get("requests_total", result.get("requests", 0))
    result["profile"] = {}
    for role, spy in spies.items():
        if spy is None:
            continue
        spy.wait(timeout=seconds + 60)
        if paths[role].exists():
            summary = summarise_profile(paths[role], requests)
            result["profile"][role] = summary
            print(f"  profile {label} {role} (node {roles[role].node_id}): {summary['sampled_ms_per_request']} ms "
                  f"sampled per request; self time per request:", flush=True)
            for entry in summary["top_self"][:PROFILE_TOP_PRINTED]:
                print(f"    {entry['ms_per_request']:8.4f} ms {entry['share'] * 100:5.1f}%  {entry['frame']}", flush=True)
    return result


def spot_check(run: Run, plan: ChurnPlan, live_keys: int, rng: random.Random) -> bool:
    """Both stores hold the stage's last key and a sample of the keys churn deleted and put
    back (a read from the leader)."""
    keys = [key_name(live_keys - 1), *(key_name(index) for index in rng.sample(sorted(plan.deleted), 10))]
    for store in run.stores.values():
        for key in keys:
            if store.requests is METAKV:
                found = probes.get_json(f"{store.leader_url}/v1/kv?prefix={key}&limit=1")
                if not found or not found.get("items"):
                    return False
            else:
                found = probes.post_json(f"{store.leader_url}/v3/kv/range", {"key": b64(key), "count_only": True})
                if not found or int(found.get("count", 0)) != 1:
                    return False
    return True


def resources(run: Run) -> dict[str, Any]:
    metakv_nodes = {str(node.node_id): probes.metakv_node_sizes(node) for node in run.metakv_cluster.voters}
    etcd_nodes = {str(node.node_id): probes.etcd_member_sizes(node) for node in run.etcd_cluster.nodes.values()}
    return {
        "metakv": {"nodes": metakv_nodes,
                   "rss_bytes_max": max((n["rss_bytes"] or 0) for n in metakv_nodes.values()),
                   "disk_bytes_total": sum(n["state_db_bytes"] + n["log_bytes"] + n["snapshots_bytes"]
                                           for n in metakv_nodes.values()),
                   "history": probes.history_retained(run.metakv_leader())},
        "etcd": {"nodes": etcd_nodes,
                 "rss_bytes_max": max((n["rss_bytes"] or 0) for n in etcd_nodes.values()),
                 "disk_bytes_total": sum(n["member_dir_bytes"] for n in etcd_nodes.values())},
    }


def metakv_events(run: Run) -> dict[str, Any]:
    """Restart a follower, clean, take a snapshot, and have the observer install it."""
    probe = key_name(0)
    leader = run.metakv_leader()
    restart = probes.cold_restart(run.metakv_follower(), leader, probe)
    print(f"  metakv cold restart of node {restart['node_id']}: {restart['seconds']:.2f} s", flush=True)
    leader = run.metakv_leader()
    cleaning = probes.compact(leader)
    taken = probes.snapshot_take(leader)
    print(f"  metakv cleaning {cleaning['seconds']:.2f} s, snapshot take {taken['seconds']:.2f} s "
          f"({(taken['snapshot_bytes'] or 0) / 1e6:.1f} MB)", flush=True)
    installed = probes.snapshot_install(run.observer, leader, probe)
    print(f"  metakv snapshot re-bootstrap of the observer {installed['rebootstrap_s']:.2f} s "
          f"(download {installed['download_s']} s, install {installed['install_s']} s)", flush=True)
    return {"cold_restart": restart, "cleaning": cleaning, "snapshot_take": taken, "snapshot_install": installed}


def run_stage(run: Run, index: int, previous: int, live_keys: int, phase_s: float, seed: int) -> dict[str, Any]:
    names = list(run.stores)
    first_store = names[index % len(names)]
    started = time.monotonic()
    print(f"stage {index + 1}: {previous:,} -> {live_keys:,} live keys", flush=True)
    growth = stage_growth(run, previous, live_keys, first_store)
    for name, total in growth.items():
        print(f"  {name:6s} growth {total['requests']:,} keys: {total['per_s']}/s", flush=True)
    grown_s = time.monotonic() - started
    run.refresh()
    rng = random.Random(seed)
    plan = churn_plan(live_keys, rng)
    measured = measure_phases(run, plan, live_keys, phase_s, first_store, seed)
    checked = spot_check(run, plan, live_keys, rng)
    held = resources(run)
    phases_done = time.monotonic()
    events = metakv_events(run)
    run.refresh()
    ended = time.monotonic()
    stage: dict[str, Any] = {
        "live_keys": live_keys, "first_store": first_store, "keys_present": checked,
        "seconds": {"growth": round(grown_s, 1), "phases": round(phases_done - started - grown_s, 1),
                    "metakv_events": round(ended - phases_done, 1), "total": round(ended - started, 1)},
        "load_average_1m_after": round(os.getloadavg()[0], 2),
        "metakv": {"growth": growth["metakv"], **measured["metakv"], "resources": held["metakv"], **events},
        "etcd": {"growth": growth["etcd"], **measured["etcd"], "resources": held["etcd"]},
    }
    stage["summary"] = summarise(stage)
    stage["metakv_over_etcd"] = ratios(stage["summary"])
    return stage


def start(root: Path, etcd_extra: list[str]) -> Run:
    metakv = Cluster(root / "metakv", voters=3, observers=1)
    observer = metakv.observers[0]
    etcd: LocalCluster | None = None
    try:
        for node in metakv.voters:
            node.start()
        etcd = start_etcd(3, root / "etcd", extra_flags=etcd_extra)  # while the metakv nodes start
        leader = metakv.wait_for_leader()
        for node in metakv.voters:
            metakv.wait_ready(node)
        run = Run(metakv, etcd, observer)
        run.refresh()
        metakv.put(key_name(0), b"x" * VALUE_BYTES, node=leader).raise_for_status()
        probes.bootstrap_observer(observer, metakv.wait_for_leader(), key_name(0))
        return run
    except BaseException:
        metakv.close()
        if etcd is not None:
            etcd.stop()
        raise


def parse_stages(text: str) -> list[int]:
    stages = [int(part.replace("_", "")) for part in text.split(",") if part.strip()]
    if not stages or any(b <= a for a, b in zip(stages, stages[1:], strict=False)) or stages[0] < STAGE_MIN_KEYS:
        raise argparse.ArgumentTypeError(f"stages must rise and start at {STAGE_MIN_KEYS} keys or more: {text!r}")
    return stages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_scale", description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=parse_stages, default=list(DEFAULT_STAGES),
                        help="live keys at each stage, rising (default 10000,100000,1000000)")
    parser.add_argument("--phase-s", type=float, default=None, help="measured seconds per phase (default 10)")
    parser.add_argument("--quick", action="store_true", help="1-second phases (a check that it runs)")
    parser.add_argument("--etcd-retention-revisions", type=int, default=ETCD_RETENTION_REVISIONS)
    parser.add_argument("--etcd-quota-bytes", type=int, default=QUOTA_BACKEND_BYTES)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("results/bench_scale.json"))
    parser.add_argument("--png", type=Path, default=Path("results/bench_scale.png"))
    parser.add_argument("--keep-data", action="store_true", help="keep the nodes' data directories")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="run py-spy on metakv's leader and a follower during its churn and list phases")
    parser.add_argument("--profile-gil", action="store_true",
                        help="with --profile-dir: sample only the thread holding the GIL")
    args = parser.parse_args(argv)
    phase_s = args.phase_s if args.phase_s is not None else 1.0 if args.quick else 10.0

    extra = etcd_flags(args.etcd_quota_bytes, args.etcd_retention_revisions)
    results: dict[str, Any] = {
        "command": "python -m loadtest.bench_scale " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
        "value_bytes": VALUE_BYTES, "phase_s": phase_s, "clients": CLIENTS,
        "fixed_rate_per_s": FIXED_RATE_WRITES_PER_S, "list_limit": LIST_LIMIT,
        "metakv": {"retention": metakv_retention()},
        "etcd": {"flags": extra, "retention": (
            f"revision compaction keeping {args.etcd_retention_revisions:,} revisions (etcd's compactor "
            f"runs every 5 minutes); quota {args.etcd_quota_bytes / 1024**3:g} GiB")},
        "metrics": {"both": {name: metric.describe() for name, metric in METRICS.items()},
                    "one_system": {name: {"system": system, **metric.describe()}
                                   for name, (system, metric) in METRICS_ONE_SIDED.items()}},
        "stages": [],
    }
    print(f"metakv: {results['metakv']['retention']['statement']}", flush=True)
    print(f"etcd: {results['etcd']['retention']}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="metakv-scale-"))
    run = None
    try:
        run = start(root, extra)
        run.profile_dir, run.profile_gil = args.profile_dir, args.profile_gil
        results["etcd"]["version"] = run.etcd_cluster.version()
        previous = 0
        for index, live_keys in enumerate(args.stages):
            stage = run_stage(run, index, previous, live_keys, phase_s, args.seed + index)
            results["stages"].append(stage)
            print_stage(stage)
            previous = live_keys
    finally:
        if run is not None:
            run.metakv_cluster.close()
            run.etcd_cluster.stop()
        if not args.keep_data:
            shutil.rmtree(root, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.png)
    print(f"wrote {args.out} and {args.png}", flush=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    sys.exit(main())
