"""The load tests through metakv's etcd API: a `metakv-etcd` run (a fresh metakv cluster
driven through its etcd v3 JSON gateway by the etcd adapter), and a report that puts it
beside metakv's HTTP API and etcd with ratios to etcd."""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from pathlib import Path

import pytest

from loadtest.report import write_report
from loadtest.runner import RunSpec, run


def test_cas_through_metakvs_etcd_gateway_then_a_three_target_report(tmp_path: Path) -> None:
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

    # The same figures filed as the other two targets: the report's columns and ratios to
    # etcd (1.00× for identical figures), not a measurement.
    for target in ("metakv", "etcd"):
        copy = shutil.copytree(folder, tmp_path / "runs" / target)
        (copy / "run.json").write_text(json.dumps({**meta, "target": target, "store": target}))
    write_report([tmp_path / "runs"], tmp_path / "report")
    markdown = (tmp_path / "report" / "report.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| scenario | metakv ops/s"))
    assert header.split(" | ")[1:6] == ["metakv ops/s", "metakv-etcd ops/s", "etcd ops/s", "metakv ÷ etcd ops/s",
                                        "metakv-etcd ÷ etcd ops/s"]
    row = next(line for line in markdown.splitlines() if line.startswith("| cas_contention |"))
    assert row.split(" | ")[4:6] == ["1.00×", "1.00×"]
