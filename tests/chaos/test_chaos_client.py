"""The chaos workload through the Python client (tests/chaos/client_workload.py): a short run
with a leader SIGKILL and an isolated leader, checked like the raw-HTTP runs. The client's failover,
retries and read sessions must add no anomaly: the history stays linearizable per key, no
acknowledged write is lost, none is applied twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.harness import run_chaos

CLIENT_RUN = (404, 10.0, ("kill_leader", "isolate_leader"))  # both faults occur with this seed


@pytest.mark.timeout(180)
def test_history_through_the_client_under_faults_is_linearizable(tmp_path: Path) -> None:
    seed, duration_s, nemeses = CLIENT_RUN
    result = run_chaos(seed, duration_s, tmp_path / f"chaos-{seed}", keys=3, processes=4, nemeses=nemeses,
                       log=lambda line: None, client="metakv")
    text = result.report_path.read_text()
    assert result.faults, "the schedule applied no fault"
    acknowledged = sum(count for label, count in result.op_counts.items()
                       if label.endswith(":ok") and label.split(":")[0] in ("put", "cas", "create", "delete", "txn"))
    assert acknowledged > 20, f"too little work got through to judge anything:\n{text}"
    assert not result.workload_errors, text
    assert result.report.ok, text
