"""What the leader fills in for a voter request and which refusal comes first
(app/runtime_voters.py, resolve_voter): pure, no node."""

from __future__ import annotations

import pytest

from app.runtime_voters import resolve_voter
from app.service import NewVoter, VoterChangeRefusedError
from raft.messages import ReplicaState
from raft.voters import Voter, VoterSet

LEADER = Voter(1, "a" * 32, "127.0.0.1:9001", "http://n1")
DYNAMIC = VoterSet((LEADER,))
OBSERVER = ReplicaState(2, "http://n2", 10, 5, 5, "b" * 32)


def refusal(request: NewVoter, voters: VoterSet = DYNAMIC, known: dict[int, str] | None = None) -> str:
    with pytest.raises(VoterChangeRefusedError) as refused:
        resolve_voter(request, voters, (OBSERVER,), known or {})
    return refused.value.code


def test_missing_fields_come_from_the_fetches_and_the_known_endpoints() -> None:
    assert resolve_voter(NewVoter(2), DYNAMIC, (OBSERVER,), {2: "127.0.0.1:9002"}) == Voter(
        2, "b" * 32, "127.0.0.1:9002", "http://n2")
    given = NewVoter(2, "c" * 32, "[::1]:9012", "http://other")
    assert resolve_voter(given, DYNAMIC, (OBSERVER,), {}) == Voter(2, "c" * 32, "[::1]:9012", "http://other")


def test_each_refusal_names_its_gate() -> None:
    assert refusal(NewVoter(2, raft_endpoint="127.0.0.1:9002"), VoterSet.static({1})) == "kraft-version-0"
    assert refusal(NewVoter(1)) == "already-voter"
    assert refusal(NewVoter(3, raft_endpoint="127.0.0.1:9003")) == "not-caught-up"  # never fetched
    assert refusal(NewVoter(2)) == "raft-endpoint-unknown"
    assert refusal(NewVoter(2, raft_endpoint="127.0.0.1:0")) == "bad-voter"
    assert refusal(NewVoter(2, directory_id="B" * 32, raft_endpoint="127.0.0.1:9002")) == "bad-voter"
