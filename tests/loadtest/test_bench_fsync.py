"""bench_fsync: one command gives every layout x sync x arrival pattern its figures, and
refuses a count it cannot measure. Figures are never checked, only that they are there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.bench_fsync import LAYOUTS, PATTERNS, SYNCS, main


def test_every_layout_sync_and_pattern_is_measured(tmp_path: Path) -> None:
    out = tmp_path / "fsync.json"
    assert main(["--writes", "3", "--dir", str(tmp_path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["patterns"]) == set(PATTERNS)
    for results in report["patterns"].values():
        assert set(results) == {f"{layout} + {sync}" for layout in LAYOUTS for sync in SYNCS}
        for figures in results.values():
            assert figures["p50_ms"] > 0 and figures["p99_ms"] >= figures["p50_ms"]
            assert "bytes_written_per_write" in figures
    assert list(tmp_path.iterdir()) == [out]  # the measured files are gone


def test_a_count_of_zero_writes_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--writes", "0", "--json", str(tmp_path / "fsync.json")])
    assert exit_info.value.code == 2
    assert "--writes and --write-bytes must be positive" in capsys.readouterr().err
