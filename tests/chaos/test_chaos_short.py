"""A short chaos suite for ``make test``: fixed seeds, each with one family of faults, about
2.5 minutes in all. ``make chaos SEED=... DURATION=...`` runs the long version.

Each run starts real metakv processes with every raft link behind a fault proxy, runs the
workload under the seed's faults, heals everything, and asserts what a user relies on:
the cluster recovers, every node ends with the same data, no acknowledged write is lost,
and the recorded history is linearizable per key (plus the read and watch guarantees).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.harness import run_chaos

SHORT_RUNS = [
    # (seed, seconds of faults, nemeses)
    (101, 15.0, ("partition_halves", "isolate_leader", "bridge", "one_way_cut", "delay_links", "stall_link",
                 "reset_connections", "mute_leader")),
    (202, 15.0, ("kill_restart", "kill_leader", "pause_leader", "graceful_restart", "crash_all",
                 "slow_fsync", "failing_fsync")),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("seed", "duration_s", "nemeses"), SHORT_RUNS, ids=[f"seed{s}" for s, _, _ in SHORT_RUNS])
def test_history_under_faults_is_linearizable(tmp_path: Path, seed: int, duration_s: float,
                                              nemeses: tuple[str, ...]) -> None:
    result = run_chaos(seed, duration_s, tmp_path / f"chaos-{seed}", keys=3, processes=5, nemeses=nemeses,
                       log=lambda line: None)
    text = result.report_path.read_text()
    assert result.faults, "the schedule applied no fault"
    assert result.op_counts.get("final_read:ok", 0) == 3 * 3, text  # every node listed every key
    acknowledged = sum(count for label, count in result.op_counts.items()
                       if label.endswith(":ok") and label.split(":")[0] in ("put", "cas", "create", "delete", "txn"))
    assert acknowledged > 20, f"too little work got through to judge anything:\n{text}"
    assert not result.workload_errors, text
    assert result.report.ok, text
