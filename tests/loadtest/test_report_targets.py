"""The report with three targets (metakv's HTTP API, metakv's etcd gateway, etcd): a column
per target and each ratio to etcd, from run folders written here with known figures (the
arithmetic, not a measurement; tests/loadtest/etcd_api_target.py makes a real run)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.report import load_run, write_report

SPAN_S = 10.0
# target -> (requests in SPAN_S, every response time in ms)
FIGURES = {"metakv": (300, 5), "metakv-etcd": (100, 40), "etcd": (200, 20)}


def write_run(folder: Path, target: str, store: str, requests: int, response_ms: int) -> None:
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({
        "scenario": "write_heavy", "target": target, "store": store, "users": 8, "rate": 0.0, "churn": 0.5,
        "duration": SPAN_S, "started": f"2026-11-26T21:00:0{len(target) % 10}+00:00", "host": "test",
        "cluster_shared": True, "failover": None}))
    (folder / "locust.json").write_text(json.dumps([{
        "name": "put", "num_requests": requests, "num_failures": 0, "response_times": {str(response_ms): requests},
        "start_time": 1000.0, "last_request_timestamp": 1000.0 + SPAN_S}]))


def test_each_target_gets_its_column_and_its_ratio_to_etcd(tmp_path: Path) -> None:
    for target, (requests, response_ms) in FIGURES.items():
        write_run(tmp_path / "runs" / target, target, "etcd" if target != "metakv" else "metakv", requests,
                  response_ms)
    write_report([tmp_path / "runs"], tmp_path / "report")
    lines = (tmp_path / "report" / "report.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| scenario |")).strip("| ").split(" | ")
    row = dict(zip(header, next(line for line in lines if line.startswith("| write_heavy |")).strip("| ").split(" | "),
                   strict=True))
    assert {name: row[f"{name} ops/s"] for name in FIGURES} == {"metakv": "30", "metakv-etcd": "10", "etcd": "20"}
    assert (row["metakv ÷ etcd ops/s"], row["metakv-etcd ÷ etcd ops/s"]) == ("1.50×", "0.50×")
    assert (row["metakv ÷ etcd p99"], row["metakv-etcd ÷ etcd p99"]) == ("0.25×", "2.00×")
    assert row["failed requests (metakv/metakv-etcd/etcd)"] == "0/0/0"


def test_a_url_target_is_named_by_the_api_it_spoke(tmp_path: Path) -> None:
    write_run(tmp_path / "url", "http://127.0.0.1:12379", "etcd", 10, 1)
    assert load_run(tmp_path / "url").target == "etcd"
