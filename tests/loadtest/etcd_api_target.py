"""The load tests through metakv's etcd API: a `metakv-etcd` run, a fresh metakv cluster
driven through its etcd v3 JSON gateway by the etcd adapter. ~12-20 s, so `make test-etcd`
runs it; `make test` runs test_report_targets.py (such runs beside the others in a report)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from loadtest.runner import RunSpec, run


def test_cas_contention_through_metakvs_etcd_gateway(tmp_path: Path) -> None:
    spec = RunSpec(scenario="cas_contention", target="metakv-etcd", users=4, duration_s=2.0, key_count=50)
    folder = run(spec, tmp_path / "runs" / "gateway")
    meta = json.loads((folder / "run.json").read_text())
    checks = json.loads((folder / "checks.json").read_text())
    stats = {entry["name"]: entry for entry in json.loads((folder / "locust.json").read_text())}
    assert (meta["target"], meta["store"]) == ("metakv-etcd", "etcd")
    assert all(re.fullmatch(r"http://127\.0\.0\.1:\d+", url) for url in meta["endpoints"])
    assert checks["ok"] and checks["cas"]["ok"], checks["problems"]
    assert stats["cas: won"]["num_requests"] > 0
    assert {name: entry["num_failures"] for name, entry in stats.items() if entry["num_failures"]} == {}
    assert (folder / "metrics" / "after-1.prom").read_text().startswith("#")  # the nodes' own /metrics
    for endpoint in meta["endpoints"]:  # the runner stopped the cluster it started
        with pytest.raises(OSError):
            urllib.request.urlopen(endpoint + "/version", timeout=2)

