"""Election invariants of the raft simulator, checked on every performed Ready.

``ElectionChecks(cluster)`` adds itself to ``Cluster.ready_checks``. Each check states a
promise of raft/roles.py's rules as the simulator can observe it:

- Leader completeness: a new leader holds every record committed in a lower epoch (a
  leader of a stale epoch, elected late, may lack what a later one committed).
- Pre-vote (rule 3, KIP-996): a voter that cannot win never raises the epoch. A Candidate
  holds every record that was committed when the pre-vote grants it may have counted were
  sent: a majority granted, each holding no more than it, and a majority held each of them.
- Rule 11: a node that began a graceful shutdown never becomes Candidate or Leader (it
  would abandon the election or the leadership when it exits).
- Rule 12: a voter whose disk was lost grants no vote or pre-vote until its log again
  durably holds the committed records it held before; and only a voter whose disk was lost
  ever says its log was lost (refusing votes for that alone would cost availability).
"""

from __future__ import annotations

from raft.messages import VoteResponse
from raft.node import Ready, Role
from tests.sim.cluster import Cluster, InvariantViolation, SimNode

# Grants a Candidate may have counted were sent at most this long ago: its round lasts at
# most two election timeouts, a grant may be held up to three (a long delay), and a paused
# node reads its inputs up to three later. Grants sent earlier are not considered.
GRANT_WINDOW_MS = 1_500


class ElectionChecks:
    """The checks above for one cluster; a broken one raises ``InvariantViolation``."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        # Candidate id -> (sent ms, committed end then, its incarnation then) of each
        # pre-vote granted to it.
        self.grants: dict[int, list[tuple[int, int, int]]] = {}
        # Epoch -> the highest high watermark a node held in it (a node learns it from that
        # epoch's leader, or is it): the commits made in that epoch.
        self.committed_in_epoch: dict[int, int] = {}
        self.disk_lost: set[int] = set()  # voters whose disk was lost in this run
        # Voter -> the committed prefix its log held when its disk was lost, until it holds it again.
        self.lost_prefix: dict[int, int] = {}
        cluster.ready_checks.append(self.check)
        cluster.disk_loss_observers.append(self.note_disk_loss)

    def check(self, node: SimNode, ready: Ready) -> None:
        core = node.core
        if core is None:
            return
        if core.high_watermark > self.committed_in_epoch.get(core.epoch, 0):
            self.committed_in_epoch[core.epoch] = core.high_watermark
        for envelope in ready.messages:
            message = envelope.message
            if isinstance(message, VoteResponse) and message.vote_granted:
                if message.pre_vote:
                    self._note_grant(self.cluster.nodes[envelope.dst])
                self._check_lost_voter_grant(node, message)
        if core.log_lost and node.node_id not in self.disk_lost:
            raise InvariantViolation(f"t={self.cluster.now_ms} rule 12: voter {node.node_id} refuses votes for a "
                                     f"lost log, but its disk was never lost")
        if not ready.role_changed or core.role not in (Role.CANDIDATE, Role.LEADER):
            return
        if node.shutting_down:
            raise InvariantViolation(f"t={self.cluster.now_ms} rule 11: node {node.node_id} became "
                                     f"{core.role.value} of epoch {core.epoch} after it began shutting down")
        if core.role == Role.LEADER:
            committed = max((hw for epoch, hw in self.committed_in_epoch.items() if epoch < core.epoch), default=0)
            self._check_holds(node, committed, f"leader of epoch {core.epoch}")
        else:
            self._check_holds(node, self._committed_when_granted(node),
                              f"candidate for epoch {core.epoch} (pre-vote: it cannot win)")

    # ------------------------------------------------------------------ pre-vote grants

    def _note_grant(self, candidate: SimNode) -> None:
        now_ms = self.cluster.now_ms
        grants = [grant for grant in self.grants.get(candidate.node_id, []) if grant[0] >= now_ms - GRANT_WINDOW_MS]
        grants.append((now_ms, self.cluster.max_high_watermark, candidate.incarnation))
        self.grants[candidate.node_id] = grants

    def _committed_when_granted(self, candidate: SimNode) -> int:
        """The committed end when the earliest grant this candidate may have counted was
        sent; 0 if one went to its previous incarnation (granted to a log it may have lost
        in the crash, only the real vote can tell)."""
        now_ms = self.cluster.now_ms
        recent = [grant for grant in self.grants.get(candidate.node_id, []) if grant[0] >= now_ms - GRANT_WINDOW_MS]
        if any(incarnation != candidate.incarnation for _, _, incarnation in recent):
            return 0
        return min((committed for _, committed, _ in recent), default=self.cluster.max_high_watermark)

    def _check_holds(self, node: SimNode, end: int, who: str) -> None:
        """``node``'s log holds every committed record below ``end`` (a snapshot covers its start)."""
        log = node.log
        if end <= log.start_offset():
            return
        if log.end_offset() < end or not self._agrees_at(node, end - 1):
            raise InvariantViolation(f"t={self.cluster.now_ms} node {node.node_id}, {who}, lacks committed offset "
                                     f"{end - 1} (its log ends at {log.end_offset()}, epoch {log.last_epoch()})")

    def _agrees_at(self, node: SimNode, offset: int) -> bool:
        """The record at ``offset`` is the committed one (same epoch: by log matching, the
        whole prefix agrees), or cannot be compared (compacted, or never recorded)."""
        committed = self.cluster.committed.get(offset)
        if committed is None or offset < max(node.log.cleaned_end(), self.cluster.compacted_below):
            return True
        return _epoch_at(node, offset) == committed[0]

    # ------------------------------------------------------------------ rule 12: a lost disk

    def note_disk_loss(self, node: SimNode) -> None:
        """Called after the crash, before the log is wiped: what committed prefix it held.

        Committed here means below a high watermark of a node in an epoch the voter had
        reached: a leader it follows after the restart may be one of those, deposed without
        knowing it, and a later leader's commits never counted this voter's acknowledgements."""
        cluster = self.cluster  # any replica: a voter the log added is in neither voter_ids nor former_voters
        self.disk_lost.add(node.node_id)
        epoch = node.durable_state.epoch if node.durable_state is not None else 0
        committed = max([node.last_high_watermark] + [
            other.core.high_watermark for other in cluster.nodes.values()
            if other.core is not None and other.core.epoch <= epoch])
        held = min(committed, node.log.end_offset())
        while held > node.log.start_offset() and not self._agrees_at(node, held - 1):
            held -= 1
        self.lost_prefix[node.node_id] = max(held, self.lost_prefix.get(node.node_id, 0))

    def _check_lost_voter_grant(self, node: SimNode, response: VoteResponse) -> None:
        prefix = self.lost_prefix.get(node.node_id)
        if prefix is None:
            return
        log = node.log
        if prefix <= log.start_offset() or (log.flushed_offset() >= prefix and self._agrees_at(node, prefix - 1)):
            del self.lost_prefix[node.node_id]  # it holds again what it held
            return
        kind = "pre-vote" if response.pre_vote else "vote"
        raise InvariantViolation(f"t={self.cluster.now_ms} rule 12: voter {node.node_id}, whose disk was lost, granted "
                                 f"a {kind} in epoch {response.epoch} holding {log.flushed_offset()} of the "
                                 f"{prefix} committed offsets it held")


def _epoch_at(node: SimNode, offset: int) -> int:
    """The epoch of the record at ``offset`` in the node's log (-1: not held)."""
    for batch in node.log.read(offset, 1):
        if batch.base_offset <= offset < batch.next_offset:
            return batch.epoch
        break
    return -1
