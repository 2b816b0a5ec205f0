"""Each scenario for a few seconds against a real 3-node cluster, judged as a user would:
no failed request unless the scenario expects it, every check held, and a results folder
with real numbers in it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest.runner import RunSpec, run
from loadtest.scenario_names import SCENARIOS

STORE_KINDS = ["metakv", "etcd"]
SCENARIO_SECONDS = 2.0
USERS = 4


def _load(folder: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    meta = json.loads((folder / "run.json").read_text())
    stats = {entry["name"]: entry for entry in json.loads((folder / "locust.json").read_text())}
    checks = json.loads((folder / "checks.json").read_text())
    return meta, stats, checks


@pytest.fixture(params=STORE_KINDS)
def cluster(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_cluster")


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario_runs_clean(scenario: str, cluster: Any, tmp_path: Path) -> None:
    spec = RunSpec(scenario=scenario, target=",".join(cluster.endpoints), store=cluster.kind, users=USERS,
                   duration_s=SCENARIO_SECONDS, churn=0.5, key_count=200)
    folder = run(spec, tmp_path / scenario)
    meta, stats, checks = _load(folder)

    assert meta["scenario"] == scenario and meta["store"] == cluster.kind and meta["users"] == USERS
    for field in ("target", "rate", "churn", "duration", "started", "host"):
        assert field in meta
    for name in ("locust_stats.csv", "locust_stats_history.csv", "samples.csv", "metrics/before-1.prom",
                 "metrics/after-1.prom"):
        assert (folder / name).stat().st_size > 0, name

    assert meta["locust_exceptions"] == 0, (folder / "locust_exceptions.csv").read_text()
    failed = {name: entry["num_failures"] for name, entry in stats.items() if entry["num_failures"]}
    assert failed == {}, (failed, (folder / "locust_failures.csv").read_text())
    assert checks["ok"], checks["problems"]
    operations = {name for name, entry in stats.items() if entry["num_requests"] > 0}
    assert operations, "no requests were made"
    for name in operations:
        assert stats[name]["total_response_time"] > 0

    if scenario == "churn":
        assert {"create", "update", "delete", "get"} <= operations
        assert checks["read_own_writes"]["checked"] > 0
        assert checks["read_own_writes"]["violated"] == 0
    if scenario == "cas_contention":
        assert "cas: won" in operations and "cas read" in operations
        assert checks["cas"]["ok"]
        total_wins = sum(row["wins"] for row in checks["cas"]["counters"])
        assert total_wins == stats["cas: won"]["num_requests"]
        lost = stats.get("cas: lost race", {}).get("num_requests", 0)
        assert lost == checks["cas"]["lost_races"]
    if scenario == "watchers":
        watch = checks["watch"]
        assert watch["watchers"] == USERS
        assert watch["acked_writes"] > 0
        assert watch["delivered"] == watch["acked_writes"]
        assert watch["missed"] == 0 and watch["out_of_order"] == 0
        assert stats["watch delivery"]["num_requests"] == watch["delivered"]
    if scenario == "large_values":
        assert {"put 64KiB", "get 64KiB"} <= operations
        assert checks["large_values"]["checked"] > 0
        assert stats["get 64KiB"]["total_content_length"] >= 64 * 1024 * stats["get 64KiB"]["num_requests"]
    if scenario == "list_prefix":
        assert checks["list_prefix"]["checked"] > 0 and checks["list_prefix"]["short"] == 0
    if scenario in ("read_heavy", "hot_keys"):
        assert stats["get"]["num_requests"] > stats["put"]["num_requests"]
    if scenario == "write_heavy":
        assert stats["put"]["num_requests"] > stats["get"]["num_requests"]


def test_target_rate_caps_the_request_rate(etcd_cluster: Any, tmp_path: Path) -> None:
    """--rate R paces users (Locust constant_throughput): at most R task iterations per second
    over all users, plus each user's first iteration. A slow machine only makes fewer."""
    users, rate, seconds = 2, 10.0, 3.0
    spec = RunSpec(scenario="read_heavy", target=",".join(etcd_cluster.endpoints), store="etcd", users=users,
                   duration_s=seconds, rate=rate, key_count=50)
    _, stats, checks = _load(run(spec, tmp_path / "paced"))
    iterations = sum(entry["num_requests"] for name, entry in stats.items() if name in ("get", "put"))
    assert 1 <= iterations <= users + rate * seconds
    assert checks["ok"]
