"""The HTTP benchmark's two generators (wrk closed loop, asyncio open loop) against both
stores: they count what the servers answered, errors included, and the writes they report
are really stored. Figures are never checked, only that they are counted."""

from __future__ import annotations

import base64
import time

import httpx

from loadtest.bench_http import (
    ETCD,
    METAKV,
    PHASES,
    Store,
    closed_loop,
    fixed_rate,
    interleaved_rounds,
    median_ratios,
)
from loadtest.clusters import LocalCluster
from loadtest.stores import b64


def _leader_url(cluster: LocalCluster) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        leader = cluster.leader()
        if leader is not None:
            return leader.url
        time.sleep(0.1)
    raise AssertionError("no leader within 30 s")


def test_wrk_writes_are_counted_and_stored_on_metakv(metakv_cluster: LocalCluster) -> None:
    url = _leader_url(metakv_cluster)
    result = closed_loop([url], 4, 1.0, "write", METAKV)
    assert result["errors"] == 0 and result["error_kinds"] == {}
    assert result["requests"] > 0 and result["requests_total"] > result["requests"]  # warm-up counted apart
    assert result["latency_ms_p50"] > 0
    # wrk process 0 writes bench/w0/k<n>, 256-byte values.
    response = httpx.get(f"{url}/v1/kv", params={"prefix": "bench/w0/", "limit": 1000, "consistency": "leader"},
                         follow_redirects=True)
    assert response.status_code == 200
    items = response.json()["items"]
    assert len(items) >= min(result["requests"], 1000) // 2
    assert all(len(base64.b64decode(item["value"])) == 256 for item in items)


def test_wrk_counts_error_statuses(metakv_cluster: LocalCluster) -> None:
    # Nothing in the test session writes bench/read/: every read is a 404.
    result = closed_loop(metakv_cluster.endpoints[:1], 2, 1.0, "read", METAKV)
    missing = result["error_kinds"].get("status>=400", 0)
    assert missing > 0 and result["errors"] >= missing


def test_wrk_writes_are_stored_on_etcd(etcd_cluster: LocalCluster) -> None:
    url = _leader_url(etcd_cluster)
    result = closed_loop([url], 2, 1.0, "write", ETCD)
    assert result["errors"] == 0 and result["requests"] > 0
    response = httpx.post(f"{url}/v3/kv/range", json={"key": b64("bench/w0/"), "range_end": b64("bench/w00"),
                                                      "count_only": True})
    assert response.status_code == 200 and int(response.json().get("count", 0)) >= min(result["requests"], 1000) // 2


def test_open_loop_sends_exactly_rate_times_duration(metakv_cluster: LocalCluster, etcd_cluster: LocalCluster) -> None:
    for cluster, requests in ((metakv_cluster, METAKV), (etcd_cluster, ETCD)):
        result = fixed_rate(_leader_url(cluster), 40, 1.0, connections=8, requests=requests)
        assert result["errors"] == 0, result["error_kinds"]
        assert result["requests"] == 40
        assert 0 < result["latency_ms_p50"] <= result["latency_ms_p99"]


def _figures(per_s: float, p50: float, p99: float) -> dict:
    return {"per_s": per_s, "latency_ms_p50": p50, "latency_ms_p99": p99}


def test_interleaved_rounds_alternate_the_stores_phase_by_phase() -> None:
    """Every phase runs against both stores back to back, the first store swapping every
    round, and each store's figures land under the phase's name."""
    calls: list[tuple[str, str]] = []
    stores = {"metakv": Store(None, "m", [], METAKV), "etcd": Store(None, "e", [], ETCD)}

    def run(store: Store, phase: str, _duration_s: float) -> dict:
        calls.append((store.leader_url, phase))
        return _figures(len(calls), 1.0, 2.0)

    rounds = interleaved_rounds(stores, 2, 0.0, run)
    assert calls[:2] == [("m", "writes_1"), ("e", "writes_1")]
    assert calls[10:12] == [("e", "writes_1"), ("m", "writes_1")]
    assert [phase for _url, phase in calls[0:10:2]] == list(PHASES)
    assert len(calls) == 2 * 2 * len(PHASES)
    assert rounds[0]["metakv"]["writes"]["64"]["per_s"] == 5
    assert rounds[1]["etcd"]["fixed_rate_500_writes_per_s"]["per_s"] == 19


def test_median_ratios_hold_each_round_against_the_issue_targets() -> None:
    def store(write_64_per_s: float, p50_1: float, p99_500: float) -> dict:
        return {"writes": {"1": _figures(100, p50_1, 10), "16": _figures(100, 5, 10), "64": _figures(write_64_per_s, 5, 10)},
                "local_reads_64_clients": _figures(100, 1, 2),
                "fixed_rate_500_writes_per_s": _figures(500, 3, p99_500)}

    rounds = [{"metakv": store(1500, 5.0, 30), "etcd": store(3000, 2.0, 10)},   # 0.5, 2.5, 3.0
              {"metakv": store(2000, 3.0, 20), "etcd": store(2500, 2.0, 10)},   # 0.8, 1.5, 2.0
              {"metakv": store(1000, 4.0, 25), "etcd": store(2500, 2.0, 10)}]   # 0.4, 2.0, 2.5
    ratios = median_ratios(rounds)
    assert ratios["writes_64_clients_per_s"] == {
        "median": 0.5, "rounds": [0.5, 0.8, 0.4], "target": ">= 0.5", "rounds_meeting_target": 2}
    assert ratios["writes_1_clients_p50"]["median"] == 2.0
    assert ratios["writes_1_clients_p50"]["rounds_meeting_target"] == 2
    assert ratios["fixed_rate_500_p99"]["target"] == "<= 2.632"
    assert ratios["fixed_rate_500_p99"]["rounds_meeting_target"] == 2
    assert "target" not in ratios["local_reads_64_clients_per_s"]
