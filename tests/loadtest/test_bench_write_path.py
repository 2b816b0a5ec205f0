"""bench_write_path's client and its /metrics readings, against both stores: the writes it
times are stored, and the sync histograms it reads exist and count them (a renamed metric
would otherwise read as zero syncs). Figures are never checked."""

from __future__ import annotations

import base64

import httpx

import loadtest.bench_write_path as bench
from loadtest.clusters import LocalCluster


def _leader(cluster: LocalCluster) -> tuple[str, int]:
    leader = cluster.leader()
    assert leader is not None
    return leader.url, leader.http_port


def test_metakv_writes_are_stored_and_their_flushes_counted(metakv_cluster: LocalCluster) -> None:
    url, port = _leader(metakv_cluster)
    before = bench.histogram_totals(url, bench.FLUSH_HISTOGRAM)
    marks, _ = bench.one_client_writes(port, bench.metakv_put, 5, {})
    assert len(marks) == 5 and all(received > sent for sent, received in marks)
    assert bench.histogram_totals(url, bench.FLUSH_HISTOGRAM)[1] >= before[1] + 1
    assert httpx.get(f"{url}/v1/kv/bench/path/k4").content == b"v" * 256
    assert httpx.get(f"{url}/v1/kv/bench/path/k{bench.WARMUP_WRITES - 1}").status_code == 200


def test_etcd_writes_are_stored_and_its_wal_syncs_counted(etcd_cluster: LocalCluster) -> None:
    url, port = _leader(etcd_cluster)
    before = bench.histogram_totals(url, bench.ETCD_WAL_FSYNC_HISTOGRAM)
    marks, _ = bench.one_client_writes(port, bench.etcd_put, 5, {})
    assert len(marks) == 5
    assert bench.histogram_totals(url, bench.ETCD_WAL_FSYNC_HISTOGRAM)[1] >= before[1] + 5
    key = base64.b64encode(b"bench/path/k4").decode()
    stored = httpx.post(f"{url}/v3/kv/range", json={"key": key}).json()["kvs"][0]["value"]
    assert base64.b64decode(stored) == b"v" * 256
