"""Role transitions are data (raft/roles.py TRANSITIONS) and RaftNode checks every move."""

from __future__ import annotations

import random

import pytest

from raft.log import MemoryLog, QuorumStateRecord
from raft.node import RaftConfig, RaftNode, Role
from raft.roles import TRANSITIONS, transition_allowed
from raft.snapshots import MemorySnapshotStore
from raft.types import ProtocolInvariantError


def _follower_of_2() -> RaftNode:
    config = RaftConfig(node_id=1, voters=frozenset({1, 2, 3}), endpoint="http://n1")
    return RaftNode(config, MemoryLog(), QuorumStateRecord(4, -1, 2), random.Random(1), MemorySnapshotStore(), 0)


def test_a_transition_outside_the_table_raises() -> None:
    node = _follower_of_2()
    assert node.role == Role.FOLLOWER
    with pytest.raises(ProtocolInvariantError, match="follower -> leader"):
        node._become_leader(10)  # a follower never leads without an election
    assert node.role == Role.FOLLOWER


def test_a_higher_epoch_allows_only_unattached_or_follower() -> None:
    for role in Role:
        assert transition_allowed(role, Role.UNATTACHED, epoch_rises=True)
        assert transition_allowed(role, Role.FOLLOWER, epoch_rises=True)
    assert not transition_allowed(Role.LEADER, Role.FOLLOWER, epoch_rises=False)
    assert not transition_allowed(Role.FOLLOWER, Role.LEADER, epoch_rises=True)


def test_every_transition_names_a_rule_and_a_trigger() -> None:
    for transition in TRANSITIONS:
        assert 1 <= transition.rule <= 13 and transition.trigger
