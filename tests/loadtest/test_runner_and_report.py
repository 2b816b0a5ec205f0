"""The runner's own cluster (started, failed over, stopped) and the report built from it."""

from __future__ import annotations

import json
import math
import re
import urllib.request
from pathlib import Path

import pytest

from loadtest.clusters import LocalCluster
from loadtest.report import write_report
from loadtest.runner import RunSpec, run
from loadtest.stores import PlainHttp, make_store

STORE_KINDS = ["metakv", "etcd"]


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_fresh_cluster_with_leader_failover_then_report(kind: str, tmp_path: Path) -> None:
    # 15 s of load after the kill: etcd answers a write caught by the leader's death only
    # after its 7 s request timeout (5 s + 2 election timeouts), and in one CI run every user
    # was caught, leaving too little of the old 9 s to see a successful write.
    spec = RunSpec(scenario="write_heavy", target=kind, users=4, duration_s=18.0, failover_after_s=3.0,
                   key_count=100)
    folder = run(spec, tmp_path / "failover")
    meta = json.loads((folder / "run.json").read_text())
    failover = meta["failover"]
    assert failover["node"] in (1, 2, 3) and failover["killed_at"] > meta["load_started_at"]
    assert meta["cluster"]["killed"] == [failover["node"]]
    for endpoint in meta["endpoints"]:  # the runner stopped every node it started
        with pytest.raises(OSError):
            urllib.request.urlopen(endpoint + "/metrics", timeout=2)

    stats = {entry["name"]: entry for entry in json.loads((folder / "locust.json").read_text())}
    puts_after_kill = [
        line for line in (folder / "samples.csv").read_text().splitlines()[1:]
        if line.split(",")[2] == "put" and line.endswith(",1") and float(line.split(",")[0]) > failover["killed_at"] + 0.5
    ]
    assert puts_after_kill, "no successful write after the leader was killed"
    assert stats["put"]["num_requests"] > 0

    out = tmp_path / "report"
    paths = write_report([folder], out)
    markdown = (out / "report.md").read_text()
    html_text = (out / "report.html").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert [path.name for path in paths] == ["report.md", "report.html", "summary.json"]

    # The figures are the run's: recompute throughput from locust.json independently.
    span = max(e["last_request_timestamp"] for e in stats.values() if e["name"] in ("put", "get")) - min(
        e["start_time"] for e in stats.values() if e["name"] in ("put", "get"))
    expected_put_rate = stats["put"]["num_requests"] / span
    assert math.isclose(summary[0]["operations"]["put"]["throughput_per_s"], expected_put_rate, rel_tol=1e-6)
    assert summary[0]["failover"] is True

    assert "Leader failover" in markdown
    outage = re.search(r"\| write_heavy \| " + kind + r" \| ([0-9.]+) \| ([0-9.]+) \|", markdown)
    assert outage is not None, markdown
    assert float(outage.group(2)) > 0
    pngs = sorted(out.glob("*.png"))
    assert pngs and all(png.stat().st_size > 1000 for png in pngs)
    for png in pngs:
        assert f"]({png.name})" in markdown
    assert html_text.count("data:image/png;base64,") == len(pngs)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_adapter_counts_a_stale_compare_and_set_as_a_lost_race(kind: str, request: pytest.FixtureRequest) -> None:
    cluster: LocalCluster = request.getfixturevalue(f"{kind}_cluster")
    store = make_store(kind, PlainHttp(), cluster.endpoints, home_index=1)
    first = store.put("adapter/cas", b"1")
    second = store.put("adapter/cas", b"2")
    assert store.cas("adapter/cas", first, b"3").won is False
    lost = store.cas("adapter/cas", first, b"3")
    assert (lost.won, lost.version) == (False, second)
    won = store.cas("adapter/cas", second, b"3")
    assert won.won and won.version > second
    # A local read may lag the leader: read our own write with min_version, as users do.
    assert store.get("adapter/cas", min_version=won.version).value == b"3"
    assert store.create("adapter/cas", b"x") is None
    created = store.create("adapter/new", b"x")
    assert created is not None and store.get("adapter/new", min_version=created).mod_version == created
    deleted = store.delete("adapter/new")
    assert deleted.existed and deleted.version > created
    assert store.delete("adapter/new").existed is False
    written = store.put_many([(f"adapter/list/{index:03d}", b"v") for index in range(150)])
    listed = store.list_prefix("adapter/list/", limit=500, min_version=written)
    assert [entry.key for entry in listed] == [f"adapter/list/{index:03d}" for index in range(150)]
