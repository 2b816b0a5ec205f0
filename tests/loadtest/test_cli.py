"""Bad command lines exit 2 with one line, before starting anything."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "no_such_scenario"],
        ["run", "churn", "--churn", "1.5"],
        ["run", "read_heavy", "--users", "0"],
        ["run", "read_heavy", "--duration", "10", "--failover-after", "20"],
        ["run", "read_heavy", "--target", "http://127.0.0.1:1", "--failover-after", "1"],
        ["bench", "--targets", "consul"],
        ["report"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "loadtest", *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "error" in result.stderr


def test_report_of_a_folder_without_runs_is_a_clear_error(tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "loadtest", "report", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "no results folders" in result.stderr
