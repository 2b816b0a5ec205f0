"""`python -m loadtest bench` (`make bench`): the standard metakv vs etcd comparison.

Every scenario once per target at the default churn, the churn scenario at three churn
levels, and a write-heavy run with a leader SIGKILL in the middle; targets alternate run by
run so both see the same background load on a shared machine. The steady-state runs share
one 3-node cluster per target (started once; each run writes under its own key prefix), which
keeps the bench to a few minutes; the failover runs get fresh clusters, since they kill a node.
A run that fails is recorded in bench.json and the rest continue; the
report covers whatever ran, and the command exits non-zero if anything failed.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from loadtest.clusters import ClusterError, LocalCluster, start_cluster
from loadtest.report import write_report
from loadtest.runner import RunSpec, run
from loadtest.scenario_names import SCENARIOS

CHURN_LEVELS = (0.1, 0.5, 0.9)
FAILOVER_SCENARIO = "write_heavy"
FAILOVER_DURATION_FACTOR = 1.5  # the failover run is longer, the kill lands at 40% of it


def bench_plan(targets: list[str], duration_s: float, users: int) -> list[RunSpec]:
    plan: list[RunSpec] = []
    for scenario in SCENARIOS:
        churns = CHURN_LEVELS if scenario == "churn" else (0.5,)
        for churn in churns:
            for target in targets:
                plan.append(RunSpec(scenario=scenario, target=target, users=users, duration_s=duration_s,
                                    churn=churn))
    failover_duration_s = float(round(duration_s * FAILOVER_DURATION_FACTOR))
    for target in targets:
        plan.append(RunSpec(scenario=FAILOVER_SCENARIO, target=target, users=users,
                            duration_s=failover_duration_s, failover_after_s=round(failover_duration_s * 0.4, 1)))
    return plan


def run_bench(targets: list[str], duration_s: float, users: int, out: Path | None = None) -> list[Path]:
    root = out or Path("results") / f"bench-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"
    runs_dir = root / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"targets": targets, "duration": duration_s, "users": users, "runs": []}
    plan = bench_plan(targets, duration_s, users)
    clusters: dict[str, LocalCluster | None] = {}
    try:
        for index, spec in enumerate(plan, start=1):
            name = f"{index:02d}-{spec.scenario}-{spec.target}-c{spec.churn:g}" + (
                "-failover" if spec.failover_after_s else "")
            print(f"[{index}/{len(plan)}] {name}", file=sys.stderr, flush=True)
            try:
                shared = None
                if spec.failover_after_s is None:
                    if spec.target not in clusters:
                        clusters[spec.target] = None  # a failed start is not retried
                        clusters[spec.target] = start_cluster(spec.target)
                    shared = clusters[spec.target]
                    if shared is None:
                        raise ClusterError(f"the shared {spec.target} cluster did not start")
                else:
                    _stop_all(clusters)  # failover runs start their own clusters, on a quiet machine
                folder = run(spec, runs_dir / name, shared_cluster=shared)
                record["runs"].append({"folder": str(folder), "ok": True})
            except Exception as error:  # noqa: BLE001 - one failed run must not lose the others
                record["runs"].append({"folder": str(runs_dir / name), "ok": False, "error": str(error)[-2000:],
                                       "traceback": traceback.format_exc()[-4000:]})
                print(f"    failed: {str(error)[-300:]}", file=sys.stderr, flush=True)
    finally:
        _stop_all(clusters)
    (root / "bench.json").write_text(json.dumps(record, indent=2) + "\n")
    done = [Path(row["folder"]) for row in record["runs"] if row["ok"]]
    paths = write_report(done, root / "report") if done else []
    failed = [row for row in record["runs"] if not row["ok"]]
    if failed:
        raise BenchError(f"{len(failed)} of {len(plan)} runs failed; see {root / 'bench.json'}", paths)
    return paths


def _stop_all(clusters: dict[str, LocalCluster | None]) -> None:
    for kind, cluster in list(clusters.items()):
        if cluster is not None:
            cluster.stop()
            clusters[kind] = None


class BenchError(RuntimeError):
    """Some runs failed; ``paths`` is the report of the runs that did not."""

    def __init__(self, message: str, paths: list[Path]) -> None:
        super().__init__(message)
        self.paths = paths
