"""make test's share of mutation testing (the whole catalogue runs in ``make mutants``).

The catalogue must stay applicable while the code under it changes: every entry's old text
occurs exactly once and the mutated file compiles. The QUICK subset runs against the
simulators with a few seeds, and each of its mutants must be caught.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.mutants.catalogue import MUTANTS, QUICK, Mutant
from tests.mutants.run import ROOT, mutated_source, run_mutants

QUICK_SIM_SEEDS = 100
QUICK_COMPACTION_SEEDS = 10


@pytest.mark.parametrize("mutant", MUTANTS, ids=[mutant.name for mutant in MUTANTS])
def test_mutant_applies_once_and_compiles(mutant: Mutant) -> None:
    mutated_source((ROOT / mutant.path).read_text(), mutant)


def test_catalogue_covers_every_rule() -> None:
    names = [mutant.name for mutant in MUTANTS]
    assert len(names) == len(set(names)), "mutant names must be unique"
    assert len(MUTANTS) >= 30
    assert QUICK <= set(names), f"QUICK names unknown mutants: {sorted(QUICK - set(names))}"
    assert all(mutant.rule and mutant.old != mutant.new for mutant in MUTANTS)
    for number in range(1, 12):  # raft/roles.py's numbered rules
        assert any(re.match(rf"rules? {number}\b", mutant.rule) for mutant in MUTANTS), f"no mutant breaks rule {number}"
    for topic in ("check_quorum", "read_index", "copy", "rebootstrap", "cleaner", "hw", "truncate"):
        assert any(topic in name for name in names), f"no {topic} mutant"


def test_quick_mutants_are_caught() -> None:
    quick = [mutant for mutant in MUTANTS if mutant.name in QUICK]
    assert quick, "the QUICK subset is empty"
    baseline, outcomes = run_mutants(quick, QUICK_SIM_SEEDS, QUICK_COMPACTION_SEEDS,
                                     jobs=min(2, os.cpu_count() or 1), timeout_s=120, report=False)
    assert all(outcome.verdict == "survived" for outcome in baseline), \
        f"the unmutated tree fails: {[outcome.detail for outcome in baseline]}"
    missed = [f"{o.mutant.name}: {o.verdict} {o.detail}" for o in outcomes if not o.caught]  # type: ignore[union-attr]
    assert not missed, "mutants the simulators no longer catch:\n" + "\n".join(missed)
