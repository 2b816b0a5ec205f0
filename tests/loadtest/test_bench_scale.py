"""The scale benchmark keeps working: one small stage of it, end to end, yields every figure
for both stores, the ratios, the PNG, and leaves no server running. Figures are never
checked, only that they were measured."""

from __future__ import annotations

import collections
import json
import random
import tempfile
from pathlib import Path

import pytest

from loadtest import bench_scale
from loadtest.scale_load import BLOCK, REPUT_GAP, churn_plan
from loadtest.scale_report import METRICS, METRICS_ONE_SIDED


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line mentions ``text`` (the run's data directory)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def test_a_small_stage_reports_every_figure_for_both_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(runs))  # the run's data directory lands here
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"

    assert bench_scale.main(["--stages", "2000", "--quick", "--out", str(out), "--png", str(png)]) == 0

    assert _processes_naming(str(runs)) == []  # every server stopped
    results = json.loads(out.read_text())
    assert "--auto-compaction-mode" in results["etcd"]["flags"] and results["etcd"]["retention"]
    assert results["metakv"]["retention"]["statement"]
    [stage] = results["stages"]
    assert stage["live_keys"] == 2000 and stage["keys_present"] is True
    summary = stage["summary"]
    missing = [f"{system} {name}" for name in METRICS for system in ("metakv", "etcd")
               if not isinstance(summary[system][name], (int, float))]
    missing += [f"{system} {name}" for name, (system, _) in METRICS_ONE_SIDED.items()
                if not isinstance(summary[system][name], (int, float))]
    assert missing == []
    assert all(stage["metakv_over_etcd"][name]["ratio"] is not None for name in METRICS)
    for system in ("metakv", "etcd"):
        assert stage[system]["growth"]["requests"] == 2000 and stage[system]["growth"]["failed"] == 0
        assert stage[system]["churn_64_clients"]["errors"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_churn_plan_mixes_puts_gets_and_deletes_and_puts_back_what_it_deletes() -> None:
    plan = churn_plan(20_000, random.Random(3), table_max=10_000)
    kinds = collections.Counter(op for op, _ in plan.ops)
    assert len(plan.ops) == 10_000
    assert (kinds["put"], kinds["get"], kinds["delete"]) == (5_000, 3_000, 2_000)
    deleted_at = {index: position for position, (op, index) in enumerate(plan.ops) if op == "delete"}
    assert set(deleted_at) == plan.deleted  # each deleted key is deleted once per cycle
    put_back = [(position, index) for position, (op, index) in enumerate(plan.ops)
                if op == "put" and index in plan.deleted]
    assert len(put_back) == len(plan.deleted)  # the other puts update keys churn never deletes
    for position, index in put_back:  # about REPUT_GAP requests after its delete (cyclically)
        assert (position - deleted_at[index]) % len(plan.ops) in range(REPUT_GAP - len(BLOCK), REPUT_GAP + len(BLOCK))
    assert not [index for op, index in plan.ops if op == "get" and index in plan.deleted]  # every get finds its key
    assert max(plan.deleted) < 20_000 and len(plan.deleted) == 2_000


def test_stages_must_rise() -> None:
    assert bench_scale.parse_stages("10000,100_000") == [10_000, 100_000]
    for text in ("100000,10000", "10", ""):
        with pytest.raises(Exception, match="stages must rise"):
            bench_scale.parse_stages(text)
