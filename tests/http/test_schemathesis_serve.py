"""The schemathesis run against a real one-node ``metakv serve`` (the runtime, raft core,
segment log and state machine behind the same routes) finds nothing either."""

from __future__ import annotations

from pathlib import Path

from tests.cluster import Cluster
from tests.http.schemathesis_run import run_schemathesis

# A real node clamps waits at 60 s (min_version) and 300 s (watch): the fuzzer would hit those
# maxima on most requests, so this run pins them to 0. The in-process run fuzzes them fully.
PINNED_WAITS = {"query.wait_ms": 0, "query.timeout_ms": 0}
# Resigning makes the only voter step down for an election's length, during which writes are
# (correctly) 503: that route is exercised by the cluster tests, not fuzzed here.
NOT_FUZZED = ("/v1/admin/resign",)


def test_schemathesis_against_one_real_node(tmp_path: Path) -> None:
    with Cluster(tmp_path / "cluster", voters=1) as cluster:
        leader = cluster.wait_for_leader()
        result = run_schemathesis(leader.url, tmp_path, max_examples=5, phases="fuzzing",
                                  fixed_parameters=PINNED_WAITS, exclude_paths=NOT_FUZZED)
        log_tail = leader.log_tail()
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-12000:] + "\n--- node log ---\n" + log_tail
    assert "selected / " in report and "Tested: 0" not in report
