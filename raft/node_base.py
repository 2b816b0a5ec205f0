"""What RaftNode's role handlers share: the node's fields, its outputs and its queries.

raft/leader.py and raft/follower.py hold the handlers that belong to one role; RaftNode
(raft/node.py) combines them and is the one owner of transitions and persistence. The
transitions a handler may ask for are declared here and implemented only there.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from raft.log import RaftLog
from raft.messages import NO_LEADER, Envelope, Message
from raft.roles import FollowerState, LeaderState, Role, RoleState
from raft.snapshots import SnapshotStore

if TYPE_CHECKING:
    from raft.node import RaftConfig, Ready


class NodeBase:
    """Fields and helpers of one node; set up by ``RaftNode.__init__``."""

    config: RaftConfig
    _id: int
    _voters: frozenset[int]
    _majority: int
    _log: RaftLog
    _rng: random.Random
    _snapshots: SnapshotStore
    _ready: Ready
    _flush_requested: bool
    _last_fetched_ms: int  # last successful Fetch answer (start time before any)
    _shutting_down: bool
    _state: RoleState
    high_watermark: int
    dirty_offset: int
    tombstone_horizon: int
    dirty_offset_known: bool
    snapshot_wanted_offset: int
    _leader_high_watermark: tuple[int, int]  # (epoch, high watermark) of the last accepted answer
    peer_endpoints: dict[int, str]

    # ------------------------------------------------------------------ queries

    @property
    def node_id(self) -> int:
        return self._id

    @property
    def is_voter(self) -> bool:
        return self._id in self._voters

    @property
    def role(self) -> Role:
        return self._state.role

    @property
    def epoch(self) -> int:
        return self._state.epoch

    @property
    def leader_id(self) -> int:
        state = self._state
        if isinstance(state, LeaderState):
            return self._id
        if isinstance(state, FollowerState):
            return state.leader_id
        return NO_LEADER

    @property
    def leader_endpoint(self) -> str:
        state = self._state
        if isinstance(state, LeaderState):
            return self.config.endpoint
        if isinstance(state, FollowerState):
            return state.leader_endpoint
        return ""

    # ------------------------------------------------------------------ outputs

    def _send(self, dst: int, message: Message) -> None:
        self._ready.messages.append(Envelope(self._id, dst, message))

    def _request_flush(self) -> None:
        if not self._flush_requested:
            self._flush_requested = True
            self._ready.flush = True

    def _fetch_request_timeout_ms(self) -> int:
        """When to give up on an unanswered Fetch and send it again: well inside the fetch
        timeout, so one lost message does not start an election."""
        config = self.config
        return min(config.request_timeout_ms, config.fetch_max_wait_ms + config.fetch_timeout_ms // 4)

    def _check_quorum_ms(self) -> int:
        return self.config.fetch_timeout_ms * 3 // 2

    def _observe_response_epoch(self, now_ms: int, src: int, epoch: int, leader_id: int) -> bool:
        """Rule 1 for a response; False when it is dropped (not from a voter, or a bad or
        older epoch)."""
        if src not in self._voters or epoch < 0:
            return False
        return self._observe_epoch(now_ms, epoch, leader_id, src=src)

    # ------------------------------------------------------------------ transitions
    # Implemented only by RaftNode (raft/node.py); declared for the type checker, so a
    # handler here can name them without this class defining a body of its own.

    if TYPE_CHECKING:

        def _observe_epoch(
            self, now_ms: int, epoch: int, leader_id: int, leader_endpoint: str = "", src: int = NO_LEADER
        ) -> bool: ...

        def _become_unattached(self, now_ms: int, epoch: int, voted_id: int = -1,
                               delay_ms: int | None = None) -> None: ...

        def _become_prospective(self, now_ms: int) -> None: ...

        def _become_resigned(self, now_ms: int, leader: LeaderState) -> None: ...
