"""The HTTP benchmark's two generators (wrk closed loop, asyncio open loop) against both
stores: they count what the servers answered, errors included, and the writes they report
are really stored. Figures are never checked, only that they are counted."""

from __future__ import annotations

import base64
import time

import httpx

from loadtest.bench_http import ETCD, METAKV, closed_loop, fixed_rate
from loadtest.clusters import LocalCluster
from loadtest.stores import _b64


def _leader_url(cluster: LocalCluster) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        leader = cluster.leader()
        if leader is not None:
            return leader.http_url
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
    response = httpx.post(f"{url}/v3/kv/range", json={"key": _b64("bench/w0/"), "range_end": _b64("bench/w00"),
                                                      "count_only": True})
    assert response.status_code == 200 and int(response.json().get("count", 0)) >= min(result["requests"], 1000) // 2


def test_open_loop_sends_exactly_rate_times_duration(metakv_cluster: LocalCluster, etcd_cluster: LocalCluster) -> None:
    for cluster, requests in ((metakv_cluster, METAKV), (etcd_cluster, ETCD)):
        result = fixed_rate(_leader_url(cluster), 40, 1.0, connections=8, requests=requests)
        assert result["errors"] == 0, result["error_kinds"]
        assert result["requests"] == 40
        assert 0 < result["latency_ms_p50"] <= result["latency_ms_p99"]
