"""loadtest: result folders with known Locust percentiles aggregate to known figures; runs with a
leader failover form groups of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from tests.pipeline.helpers import run_cli

HEADER = ("Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,Min Response Time,"
          "Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,99.9%,"
          "99.99%,100%")
HISTORY_HEADER = ("Timestamp,User Count,Type,Name,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,99.9%,"
                  "99.99%,100%,Total Request Count,Total Failure Count")


def _stats_row(kind: str, name: str, requests: int, failures: int, average: float, percentiles: list[int]) -> str:
    return ",".join([kind, name, str(requests), str(failures), str(percentiles[0]), str(average), "1",
                     str(percentiles[-1]), "10", "5.0", "0.0", *map(str, percentiles)])


def _run(folder: Path, target: str, rows: list[str], churn: float = 0.5, failover: dict | None = None) -> None:
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"scenario": "churn", "target": target, "churn": churn,
                                                 "failover": failover}))
    (folder / "locust_stats.csv").write_text("\n".join([HEADER, *rows]) + "\n")
    (folder / "locust_stats_history.csv").write_text(HISTORY_HEADER + "\n")


SPREAD = [10, 12, 14, 15, 20, 30, 40, 50, 60, 70, 80]


def test_percentiles_per_operation_and_target(spark, tmp_path: Path, capsys) -> None:
    results = tmp_path / "results"
    _run(results / "run-a", "metakv", [_stats_row("PUT", "/v1/kv/[key]", 100, 2, 25.0, SPREAD),
                                       _stats_row("GET", "/v1/kv/[key]", 50, 0, 5.0, [5] * 11)])
    _run(results / "run-b", "metakv", [_stats_row("PUT", "/v1/kv/[key]", 100, 0, 100.0, [100] * 11)])
    _run(results / "run-c", "etcd", [_stats_row("PUT", "/v2/keys/[key]", 40, 1, 25.0, SPREAD)])
    # A run that killed the leader (as loadtest/runner.py records it) is not merged with the others.
    _run(results / "run-d-failover", "metakv", [_stats_row("PUT", "/v1/kv/[key]", 10, 3, 900.0, [900] * 11)],
         failover={"killed_at": 1.0, "node": 1, "endpoint": "http://127.0.0.1:1", "after_s": 5.0})
    output = tmp_path / "out"
    code, out, _ = run_cli(capsys, "loadtest", "--input", str(results), "--output", str(output))
    assert code == 0
    frame = pd.read_parquet(output / "percentiles.parquet")
    failover = frame[frame.failover].set_index(["target", "operation"]).loc[("metakv", "PUT /v1/kv/[key]")]
    assert (failover.runs, failover.requests, failover.failures, failover.p50_ms) == (1, 10, 3, 900.0)
    table = frame[~frame.failover].set_index(["target", "operation"])
    put = table.loc[("metakv", "PUT /v1/kv/[key]")]
    # 200 requests: 100 from run a (its own spread) and 100 all at 100 ms; 100 of them
    # (half) are at or below run a's max of 80 ms, so p50 = 80, everything above = 100.
    assert (put.runs, put.requests, put.failures) == (2, 200, 2)
    assert (put.p50_ms, put.p90_ms, put.p99_ms, put.max_ms) == (80.0, 100.0, 100.0, 100.0)
    assert put.avg_ms == 62.5
    # One run: exactly its own percentiles.
    etcd = table.loc[("etcd", "PUT /v2/keys/[key]")]
    assert (etcd.p50_ms, etcd.p90_ms, etcd.p95_ms, etcd.p99_ms, etcd.p999_ms, etcd.max_ms) == (10, 20, 30, 50, 60, 80)
    assert table.loc[("metakv", "GET /v1/kv/[key]")].p99_ms == 5
    markdown = (output / "percentiles.md").read_text()
    assert "| metakv | churn | 0.5 | no | PUT /v1/kv/[key] | 2 | 200 | 2 | 62.5 | 80 | 100 | 100 | 100 | 100 | 100 |" in markdown
    assert "| metakv | churn | 0.5 | yes | PUT /v1/kv/[key] | 1 | 10 | 3 | 900.0 | 900 |" in markdown
    assert len(pd.read_parquet(output / "runs.parquet")) == 5
