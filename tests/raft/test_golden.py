"""Golden scenario scripts: tests/raft/scenarios/*.script and their *.expected transcripts.

Regenerate after an intended behaviour change with ``UPDATE_GOLDEN=1 pytest tests/raft``,
then read the diff: it is the protocol's behaviour change, message by message.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.raft.golden import run_script

SCENARIOS = sorted((Path(__file__).parent / "scenarios").glob("*.script"))


@pytest.mark.parametrize("script", SCENARIOS, ids=lambda p: p.stem)
def test_golden_scenario(script: Path) -> None:
    expected_path = script.with_suffix(".expected")
    actual = run_script(script.read_text())
    if os.environ.get("UPDATE_GOLDEN") == "1":
        expected_path.write_text(actual)
    assert actual == expected_path.read_text()


def test_there_are_scenarios() -> None:
    assert {p.stem for p in SCENARIOS} >= {"election", "divergence", "prevote", "resign"}
