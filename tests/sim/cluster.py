"""A whole metakv quorum inside one process, driven by one seeded priority queue of events.

(Over 800 lines: the network, the faults and the invariants all act on the one event queue.)

Every node is a real ``RaftNode`` over a ``MemoryLog``; the simulated network drops,
delays (a few messages past an election timeout, snapshot chunks slowly), duplicates and
reorders messages and applies partitions; crashes lose whatever was not flushed
(``MemoryLog.reopen``); a paused node handles its inputs late. After every event the cluster checks the safety
invariants (``InvariantViolation`` names the first broken one). With ``directory_ids`` every
replica has a directory id and a replaced disk (``replace_disk``) makes a node a new replica;
the voter-change seeds (tests/sim/membership.py) then supply the majority and check-quorum
rules of the set in force through ``holders_check`` and ``voters_counted``.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from raft.log import MemoryLog, QuorumStateRecord
from raft.messages import (
    EndQuorumEpochRequest,
    Envelope,
    FetchRequest,
    FetchSnapshotRequest,
    FetchSnapshotResponse,
)
from raft.node import (
    NotLeaderError,
    Proposal,
    ProposalRejectedError,
    RaftConfig,
    RaftNode,
    Ready,
    Role,
)
from raft.snapshots import MemorySnapshotStore
from raft.types import Batch
from raft.voters import Voter, VoterSet

MAX_EVENTS_PER_RUN = 2_000_000  # a hard bound so a livelock cannot hang a test
MAX_READS_KEPT = 10_000  # completed reads remembered for tests to look at
# Check-quorum's bound is 1.5 x fetch_timeout_ms; the leader's tick runs at its deadline, so
# a few ms of slack cover only the granularity of events at one simulated time.
CHECK_QUORUM_SLACK_MS = 5


class InvariantViolation(AssertionError):
    """A safety property failed; the message names it and the simulated time."""


@dataclass
class NetworkFaults:
    """What the network does to each message (probabilities in [0, 1])."""

    drop_probability: float = 0.0
    duplicate_probability: float = 0.0
    delay_min_ms: int = 1
    delay_max_ms: int = 5
    flush_min_ms: int = 1
    flush_max_ms: int = 5
    # A few messages are held for 1-3 election timeouts: an old Fetch or vote arrives after
    # the cluster moved on (a new commit, a new epoch).
    long_delay_probability: float = 0.0
    long_delay_min_ms: int = 100
    long_delay_max_ms: int = 300
    # Added to every FetchSnapshotResponse: a slow snapshot transfer, one chunk at a time.
    snapshot_chunk_delay_ms: int = 0
    # A Fetch sent before its sender truncated is delivered again later (see _keep_stale_fetch).
    replay_stale_fetches: bool = False


def sim_config(node_id: int, voters: frozenset[int], directory_id: str = "", **overrides: object) -> RaftConfig:
    """Timeouts scaled down 10x from the defaults so simulated seconds stay cheap."""
    values: dict[str, object] = dict(
        election_timeout_ms=100, fetch_timeout_ms=200, election_backoff_max_ms=100,
        fetch_max_wait_ms=50, request_timeout_ms=200, retry_backoff_ms=10,
        snapshot_chunk_bytes=64,
    )
    values.update(overrides)
    if directory_id:
        values["directory_id"] = directory_id
    return RaftConfig(node_id=node_id, voters=voters, endpoint=f"http://node{node_id}", **values)  # type: ignore[arg-type]


@dataclass
class SimNode:
    node_id: int
    config: RaftConfig
    log: MemoryLog
    snapshots: MemorySnapshotStore
    durable_state: QuorumStateRecord | None = None
    core: RaftNode | None = None  # None while crashed
    incarnation: int = 0
    flush_running: bool = False
    next_tick_ms: int = -1
    highest_epoch_persisted: int = 0
    last_high_watermark: int = 0
    last_end_offset: int = 0
    checked_offset: int = 0  # committed records below this were compared with the oracle
    # A paused process (a GC pause, SIGSTOP, a stalled VM) handles nothing; its inputs wait
    # in ``held``, in arrival order, and all arrive late when it resumes.
    paused: bool = False
    pause_token: int = 0  # which pause a scheduled resume belongs to
    resumed_ms: int = -1  # when the last pause ended: its held inputs all arrive then
    resigned_leader: tuple[int, int] | None = None  # (epoch, leader) of the last EndQuorumEpoch handled
    shutting_down: bool = False  # begin_shutdown ran on this incarnation
    held: list[_Event] = field(default_factory=list)
    directory_id: str = ""  # this replica's, new with each new data directory (replace_disk)


@dataclass(slots=True)
class _Event:
    time_ms: int
    sequence: int
    kind: str
    node_id: int
    incarnation: int
    payload: object = None


@dataclass
class QuorumWatch:
    """One leader's epoch, since when it leads, and when each voter's last Fetch or
    FetchSnapshot of that epoch reached it."""

    epoch: int
    since_ms: int
    members: frozenset[int]  # the voters it counts, and their majority
    majority: int
    heard_ms: dict[int, int] = field(default_factory=dict)


class Cluster:
    """Nodes 1..voters are voters, the next ``observers`` ids are observers."""

    def __init__(
        self, seed: int, voters: int, observers: int = 0, faults: NetworkFaults | None = None,
        config_overrides: dict[str, int] | None = None, trace: Callable[[str], None] | None = None,
        directory_ids: bool = False,
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        # Its own stream: replaying stale fetches shifts no other draw of the seed.
        self.stale_rng = random.Random(seed * 7919 + 1)
        self.last_fetch_sent: dict[int, Envelope] = {}  # node -> its latest FetchRequest
        self.stale_fetches: dict[int, Envelope] = {}  # node -> a Fetch sent before it truncated
        self.faults = faults or NetworkFaults()
        self.now_ms = 0
        self.voter_ids = frozenset(range(1, voters + 1))
        self.majority = voters // 2 + 1
        self.nodes: dict[int, SimNode] = {}
        self.trace = trace
        self._queue: list[tuple[int, int, _Event]] = []  # (time, sequence, event): one total order
        self._sequence = 0
        self.events_processed = 0
        self.blocked: set[tuple[int, int]] = set()  # (src, dst) pairs whose messages are lost
        self.stalled_links: set[tuple[int, int]] = set()  # (src, dst) pairs whose messages wait for heal()
        self.stalled: list[_Event] = []  # what they hold, in the order it was due
        self.slow_links: dict[tuple[int, int], int] = {}  # (src, dst) -> extra delay of what is sent now
        self.leaders_by_epoch: dict[int, int] = {}
        self.committed: dict[int, tuple[int, bool, bytes]] = {}  # offset -> (epoch, control, record)
        self.max_high_watermark = 0
        self.proposals: list[tuple[Proposal, tuple[bytes, ...]]] = []
        self.reads_done: list[tuple[int, int, int]] = []  # (node, token, offset)
        self.reads_hook: Callable[[int, int, int], None] | None = None
        self.stats: collections.Counter[str] = collections.Counter()  # what the run exercised
        self.on_elected: Callable[[SimNode], None] | None = None  # a fault plan's hook
        # Runs after each Ready is performed, before a downloaded snapshot is reported
        # installed: the compaction simulation applies to its state model here.
        self.after_ready: Callable[[SimNode, Ready], None] | None = None
        # Offsets below this were cleaned on some replica: a replica may receive them in
        # cleaned form (the compaction simulation checks them with a state model instead).
        self.compacted_below = 0
        # Voter -> the durable log end it had when its disk was lost (see lose_disk), lowered
        # to the highest high watermark once a leader took an acknowledgement from its new log.
        self.lost_disk_held: dict[int, int] = {}
        self.stable_leader: tuple[int, int] | None = None  # (leader, epoch) of a fault-free window
        self._action_generation = 0  # actions scheduled before cancel_scheduled_actions are dropped
        # Each node's epoch when the window began: a node cut off for good may already be
        # in a later epoch (an election its side began before), which others may learn.
        self.window_epochs: dict[int, int] = {}
        self.window_max_epoch = 0  # the highest of window_epochs, taken once per window
        self.quorum_watch: dict[int, QuorumWatch] = {}  # leader id -> who it heard from (check-quorum)
        # More checks of each performed Ready (tests/sim/election_checks.py), and observers
        # of a lost disk, called after the crash and before the log is wiped.
        self.ready_checks: list[Callable[[SimNode, Ready], None]] = []
        # Called with each message just before its node handles it (a model's view of the wire).
        self.delivery_observers: list[Callable[[SimNode, Envelope], None]] = []
        self.disk_loss_observers: list[Callable[[SimNode], None]] = []
        # Dynamic voters (tests/sim/membership.py): each replica gets a directory id, and
        # these replace the static set's majority and check-quorum rules.
        self.directory_rng = random.Random(seed * 15_485_863 + 3) if directory_ids else None
        self.holders_check: Callable[[int], None] | None = None  # target offset -> check
        self.voters_counted: Callable[[SimNode], tuple[frozenset[int], int]] | None = None
        self.former_voters: set[int] = set()  # nodes a committed voters record named
        self.vanished: dict[tuple[int, str], int] = {}  # (node, directory) replaced -> what it held durably
        directories = {node_id: self.new_directory_id() for node_id in range(1, voters + observers + 1)}
        values: dict[str, object] = dict(config_overrides or {})
        if directory_ids:  # every replica is formatted with the first voters record (KIP-853)
            values["initial_voters"] = VoterSet(tuple(Voter(n, directories[n], f"http://node{n}")
                                                      for n in sorted(self.voter_ids)))
        for node_id, directory_id in directories.items():
            config = sim_config(node_id, self.voter_ids, directory_id, **values)  # type: ignore[arg-type]
            node = SimNode(node_id, config, MemoryLog(), MemorySnapshotStore(), directory_id=directory_id)
            self.nodes[node_id] = node
            self._start(node)

    def new_directory_id(self) -> str:
        """A fresh data directory's id (32 hex digits), or "" without dynamic voters."""
        return f"{self.directory_rng.getrandbits(128):032x}" if self.directory_rng is not None else ""

    # ------------------------------------------------------------------ driving

    def _start(self, node: SimNode) -> None:
        node.incarnation += 1
        node.flush_running = False
        node.next_tick_ms = -1
        node.paused = False
        node.held.clear()
        node.resigned_leader = None  # rule 8 keeps a resignation in memory only
        node.shutting_down = False
        node.core = RaftNode(node.config, node.log, node.durable_state,
                             random.Random(self.rng.getrandbits(64)), node.snapshots, self.now_ms)
        node.last_high_watermark = node.core.high_watermark
        self.after_input(node)

    def _push(self, time_ms: int, kind: str, node: SimNode, payload: object = None) -> None:
        self._sequence += 1
        event = _Event(time_ms, self._sequence, kind, node.node_id, node.incarnation, payload)
        heapq.heappush(self._queue, (time_ms, self._sequence, event))

    def after_input(self, node: SimNode) -> None:
        """Perform the node's Ready as raft/__init__.py orders it, then check invariants.

        Persist, send and flush come first; reads and role changes are only recorded. A
        state model (tests/sim/compaction.py) installs a snapshot, then applies, in
        ``after_ready``; ``on_snapshot_installed`` follows."""
        core = node.core
        if core is None:
            return
        ready = core.take_ready()
        if ready.quorum_state is not None:
            if ready.quorum_state.epoch < node.highest_epoch_persisted:
                raise InvariantViolation(f"t={self.now_ms} node {node.node_id} persisted epoch went back")
            node.durable_state = ready.quorum_state
            node.highest_epoch_persisted = ready.quorum_state.epoch
        fetch_before = self.last_fetch_sent.get(node.node_id)
        for envelope in ready.messages:
            self._transmit(envelope)
        if ready.flush and not node.flush_running:
            node.flush_running = True
            self._push(self.now_ms + self.rng.randint(self.faults.flush_min_ms, self.faults.flush_max_ms),
                       "flush", node)
        if ready.role_changed:
            self.stats[f"became_{core.role.value}"] += 1
            if core.role == Role.LEADER and self.on_elected is not None:
                self.on_elected(node)
        self.stats["reads_failed"] += len(ready.reads_failed)
        if node.log.end_offset() < node.last_end_offset:
            self.stats["truncations"] += 1
            self._keep_stale_fetch(node, fetch_before)
        node.last_end_offset = node.log.end_offset()
        for token, offset in ready.reads_done:
            self.stats["reads_done"] += 1
            if len(self.reads_done) < MAX_READS_KEPT:
                self.reads_done.append((node.node_id, token, offset))
            if self.reads_hook is not None:
                self.reads_hook(node.node_id, token, offset)
        if self.after_ready is not None:
            self.after_ready(node, ready)
        if ready.snapshot_to_install is not None:
            self.stats["snapshot_installs"] += 1
            core.on_snapshot_installed(self.now_ms, ready.snapshot_to_install)
        deadline = core.next_deadline_ms()
        if node.next_tick_ms < 0 or deadline < node.next_tick_ms or node.next_tick_ms <= self.now_ms:
            node.next_tick_ms = max(deadline, self.now_ms)
            self._push(node.next_tick_ms, "tick", node)
        for ready_check in self.ready_checks:
            ready_check(node, ready)
        self.check_invariants(node)

    def _keep_stale_fetch(self, node: SimNode, stale: Envelope | None) -> None:
        """Hold a copy of the Fetch the node sent before it truncated (the one whose answer made
        it truncate): retransmitted over a new connection, it can arrive while the node's
        next Fetch at the same offset, from its truncated and refilled log, is in flight."""
        if (self.faults.replay_stale_fetches and stale is not None
                and stale.message.fetch_offset > node.log.end_offset()  # type: ignore[union-attr]
                and self.stale_rng.random() < 0.5):
            self.stale_fetches[node.node_id] = stale

    def _replay_stale_fetch(self, envelope: Envelope, delay_ms: int) -> None:
        """Deliver a held stale Fetch just after the node's new Fetch at the same offset."""
        stale = self.stale_fetches.get(envelope.src)
        request = envelope.message
        if (stale is None or stale.dst != envelope.dst
                or stale.message.fetch_offset != request.fetch_offset  # type: ignore[union-attr]
                or stale.message.last_fetched_epoch == request.last_fetched_epoch):  # type: ignore[union-attr]
            return
        del self.stale_fetches[envelope.src]
        self.stats["stale_fetch_replays"] += 1
        self._push(self.now_ms + delay_ms + 1, "deliver", self.nodes[envelope.dst], stale)

    def _transmit(self, envelope: Envelope) -> None:
        faults = self.faults
        if isinstance(envelope.message, FetchRequest):
            self.last_fetch_sent[envelope.src] = envelope
        copies = 1
        if self.rng.random() < faults.drop_probability:
            copies = 0
        elif self.rng.random() < faults.duplicate_probability:
            copies = 2
        dst = self.nodes.get(envelope.dst)
        if dst is None:
            return
        for _ in range(copies):
            delay_ms = self._delay_ms(envelope)
            self._push(self.now_ms + delay_ms, "deliver", dst, envelope)
            if self.stale_fetches and isinstance(envelope.message, FetchRequest):
                self._replay_stale_fetch(envelope, delay_ms)

    def _delay_ms(self, envelope: Envelope) -> int:
        """The network delay of one copy; the slow faults draw randomness only when enabled,
        so runs without them stay what they were."""
        faults = self.faults
        delay_ms = self.rng.randint(faults.delay_min_ms, faults.delay_max_ms)
        if faults.long_delay_probability and self.rng.random() < faults.long_delay_probability:
            delay_ms = self.rng.randint(faults.long_delay_min_ms, faults.long_delay_max_ms)
            self.stats["long_delays"] += 1
        if faults.snapshot_chunk_delay_ms and isinstance(envelope.message, FetchSnapshotResponse):
            delay_ms += faults.snapshot_chunk_delay_ms
            self.stats["slow_snapshot_chunks"] += 1
        if self.slow_links:
            delay_ms += self.slow_links.get((envelope.src, envelope.dst), 0)
        return delay_ms

    def step(self) -> bool:
        """Process the next event; False when there is none."""
        if not self._queue:
            return False
        event = heapq.heappop(self._queue)[2]
        self.now_ms = max(self.now_ms, event.time_ms)
        self.events_processed += 1
        node = self.nodes[event.node_id]
        if event.kind == "action":
            generation, action = event.payload  # type: ignore[misc]
            if generation == self._action_generation:
                action()
            return True
        core = node.core
        if core is None:
            return True
        if event.kind == "deliver" and self._blocked(event):
            return True
        if event.kind == "deliver" and self.stalled_links and self._stalled(event):
            return True
        if node.paused:
            self._hold(node, event)
            return True
        if event.kind in ("deliver", "arrived"):
            envelope: Envelope = event.payload  # type: ignore[assignment]
            if self.trace:
                self.trace(f"{self.now_ms:>6} {envelope.src}->{envelope.dst} {describe_message(envelope.message)}")
            self._note_fetch_to_leader(node, envelope)
            if self.lost_disk_held:
                self._note_fetch_from_lost_disk(node, envelope)
            self._note_resignation(node, envelope)
            for observe in self.delivery_observers:
                observe(node, envelope)
            following = (core.role, core.epoch, core.leader_id)
            core.handle(self.now_ms, envelope)
            self._check_resigned_leader_unfollowed(node, following)
        elif event.kind == "tick":
            if event.incarnation != node.incarnation or event.time_ms != node.next_tick_ms:
                return True
            node.next_tick_ms = -1
            core.tick(self.now_ms)
        elif event.kind == "flush":
            if event.incarnation != node.incarnation:
                return True
            node.flush_running = False
            node.log.flush()
            core.on_flushed(self.now_ms)
        self.after_input(node)
        return True

    def run_for(self, duration_ms: int) -> None:
        self.run_until(lambda: False, duration_ms)

    def run_until(self, predicate: Callable[[], bool], timeout_ms: int) -> bool:
        """Run events until ``predicate()`` holds (True) or ``timeout_ms`` pass (False)."""
        end_ms = self.now_ms + timeout_ms
        while not predicate():
            if not self._queue or self._queue[0][0] > end_ms:
                self.now_ms = max(self.now_ms, end_ms)
                return predicate()
            if self.events_processed > MAX_EVENTS_PER_RUN:
                raise InvariantViolation(f"seed {self.seed}: more than {MAX_EVENTS_PER_RUN} events")
            self.step()
        return True

    def at(self, time_ms: int, action: Callable[[], None]) -> None:
        """Schedule ``action`` (a fault, a proposal) at simulated time ``time_ms``."""
        self._push(time_ms, "action", self.nodes[min(self.nodes)], (self._action_generation, action))

    def cancel_scheduled_actions(self) -> None:
        """Drop every action scheduled so far: a phase's late heals and restarts must not
        undo the next phase's faults (a partition "for good" healed by a leftover timer)."""
        self._action_generation += 1

    # ------------------------------------------------------------------ faults

    def crash(self, node_id: int) -> None:
        """Power loss: unflushed log data is gone; the quorum-state file survives."""
        node = self.nodes[node_id]
        if node.core is None:
            return
        node.core = None
        node.log = node.log.reopen()
        node.last_end_offset = node.log.end_offset()
        node.incarnation += 1
        node.paused = False
        node.held.clear()  # a killed process loses what waited in its socket buffers
        self.stats["crashes"] += 1

    def shutdown(self, node_id: int) -> None:
        """Graceful stop: a leader resigns first; everything is flushed."""
        node = self.nodes[node_id]
        if node.core is None:
            return
        self.resume(node_id)  # SIGTERM takes effect once a stopped process runs again
        self.begin_shutdown(node_id)
        node.log.flush()
        node.core = None
        node.incarnation += 1

    def begin_shutdown(self, node_id: int) -> None:
        """The first half of a graceful stop: a leader resigns, and the node keeps running
        (answering votes, following) but never campaigns again, as in the real runtime
        between SIGTERM and exit."""
        node = self.nodes[node_id]
        if node.core is not None:
            node.shutting_down = True
            node.core.begin_shutdown(self.now_ms)
            self.after_input(node)

    def restart(self, node_id: int) -> None:
        node = self.nodes[node_id]
        if node.core is None:
            self._start(node)

    # ------------------------------------------------------------------ fault: a voter's disk lost

    def lose_disk(self, node_id: int) -> None:
        """Power loss that also takes the log and the snapshots (the node stays down until
        ``restart``). The quorum-state file survives: that is what the printed way out of
        a damaged log does (move log/, snapshots/, state.db away, keep quorum-state), and
        a quorum-state restored after a lost disk. A whole data directory lost is out of
        reach without dynamic voters (docs/raft.md, Limits)."""
        node = self.nodes[node_id]
        self.crash(node_id)
        durable_end = node.log.end_offset()  # crash() left only the flushed prefix
        # Any replica: a voter the log added is not in voter_ids but counts all the same.
        self.lost_disk_held[node_id] = max(self.lost_disk_held.get(node_id, 0), durable_end)
        for observe in self.disk_loss_observers:
            observe(node)
        node.log = MemoryLog()
        node.snapshots = MemorySnapshotStore()
        node.last_end_offset = 0
        node.checked_offset = 0
        self.stats["disks_lost"] += 1

    def replace_disk(self, node_id: int) -> None:
        """Power loss, then a new, empty data directory (quorum-state gone too) with a new
        directory id: a new replica under the same node id (down until ``restart``)."""
        node = self.nodes[node_id]
        self.crash(node_id)
        self.vanished[(node_id, node.directory_id)] = node.log.end_offset()  # crash() kept what was flushed
        node.directory_id = self.new_directory_id()
        node.config = dataclasses.replace(node.config, directory_id=node.directory_id)  # type: ignore[call-arg]
        node.log, node.snapshots, node.durable_state = MemoryLog(), MemorySnapshotStore(), None
        node.last_end_offset = node.checked_offset = node.highest_epoch_persisted = 0
        self.stats["disks_replaced"] += 1

    def held_durably(self, node_id: int, offset: int) -> bool:
        """The replica's log durably holds every offset below ``offset`` (a snapshot counts), or
        it still counts for what it held before its disk was lost."""
        log = self.nodes[node_id].log
        return (log.flushed_offset() >= offset or log.start_offset() >= offset
                or self._still_counted_after_disk_loss(node_id, offset))

    def _still_counted_after_disk_loss(self, voter: int, offset: int) -> bool:
        """A leader may still count what a voter acknowledged before its disk was lost,
        until it takes a Fetch from the new log: below the high watermark reached by then the
        voter counts as holding what it held, until it holds that again."""
        held = self.lost_disk_held.get(voter)
        if held is None or held < offset:
            return False
        if self.nodes[voter].log.flushed_offset() >= held:
            del self.lost_disk_held[voter]
            return False
        return True

    def _note_fetch_from_lost_disk(self, node: SimNode, envelope: Envelope) -> None:
        """A leader takes a Fetch from a voter whose disk was lost, at an offset its new log
        holds: from now on the leader counts that voter for its new log only, so it may count
        for what it held before only below what was committed until now."""
        message, core = envelope.message, node.core
        held = self.lost_disk_held.get(envelope.src)
        if (held is not None and isinstance(message, FetchRequest) and core is not None
                and core.role == Role.LEADER and message.epoch == core.epoch
                and message.replica_id == envelope.src
                and node.log.start_offset() <= message.fetch_offset <= self.nodes[envelope.src].log.flushed_offset()):
            self.lost_disk_held[envelope.src] = min(held, self.max_high_watermark)

    def partition(self, side_a: set[int], side_b: set[int], one_way: bool = False) -> None:
        for a in side_a:
            for b in side_b:
                self.blocked.add((a, b))
                if not one_way:
                    self.blocked.add((b, a))

    def stall(self, side_a: set[int], side_b: set[int]) -> None:
        """Like a partition, but the links keep what is sent over them (a stalled TCP
        connection) and deliver it all on ``heal``: stale messages from an old epoch."""
        for a in side_a:
            for b in side_b:
                self.stalled_links.update(((a, b), (b, a)))

    def heal(self) -> None:
        self.blocked.clear()
        self.stalled_links.clear()
        for event in self.stalled:
            self._sequence += 1
            heapq.heappush(self._queue, (self.now_ms, self._sequence, event))
        self.stalled.clear()

    # ------------------------------------------------------------------ faults: process pauses

    def pause(self, node_id: int, duration_ms: int) -> None:
        """Stop a process for ``duration_ms``: it resumes with its stale state, and every
        timer, flush completion and message due meanwhile arrives late, none lost."""
        node = self.nodes[node_id]
        if node.core is None or node.paused:
            return
        node.paused = True
        node.pause_token += 1
        self.stats["pauses"] += 1
        self.at(self.now_ms + duration_ms, lambda token=node.pause_token: self.resume(node_id, token))

    def resume(self, node_id: int, token: int | None = None) -> None:
        """End a pause (``token``: only the pause it was scheduled for); held inputs follow
        in their order."""
        node = self.nodes[node_id]
        if not node.paused or (token is not None and token != node.pause_token):
            return
        node.paused = False
        node.resumed_ms = self.now_ms
        for event in node.held:
            self._sequence += 1
            heapq.heappush(self._queue, (self.now_ms, self._sequence, event))
        node.held.clear()

    def _blocked(self, event: _Event) -> bool:
        envelope: Envelope = event.payload  # type: ignore[assignment]
        return (envelope.src, envelope.dst) in self.blocked

    def _stalled(self, event: _Event) -> bool:
        envelope: Envelope = event.payload  # type: ignore[assignment]
        if (envelope.src, envelope.dst) not in self.stalled_links:
            return False
        self.stalled.append(event)
        return True

    def _hold(self, node: SimNode, event: _Event) -> None:
        """A paused node's input waits; a message that reached it already got past the network."""
        if event.kind == "deliver":
            event.kind = "arrived"
        node.held.append(event)

    # ------------------------------------------------------------------ client side

    def leader(self) -> SimNode | None:
        """The live leader of the highest epoch, if any."""
        best: SimNode | None = None
        for node in self.nodes.values():
            if node.core is not None and node.core.role == Role.LEADER:
                if best is None or node.core.epoch > best.core.epoch:  # type: ignore[union-attr]
                    best = node
        return best

    def leaders(self) -> list[SimNode]:
        """Every live node that believes it leads (a deposed one may not know yet)."""
        return [n for n in self.nodes.values() if n.core is not None and n.core.role == Role.LEADER
                and not n.paused]

    def propose(self, records: tuple[bytes, ...], leader: SimNode | None = None) -> Proposal | None:
        leader = leader or self.leader()
        if leader is None or leader.core is None or leader.paused:
            return None  # a paused process answers no client
        try:
            proposal = leader.core.propose(self.now_ms, list(records))
        except (NotLeaderError, ProposalRejectedError):
            return None
        self.proposals.append((proposal, records))
        self.after_input(leader)
        return proposal

    def is_committed(self, proposal: Proposal) -> bool:
        entry = self.committed.get(proposal.last_offset)
        return entry is not None and entry[0] == proposal.epoch

    # ------------------------------------------------------------------ invariants

    def check_invariants(self, changed: SimNode) -> None:
        now = self.now_ms
        core = changed.core
        if core is None:
            return
        if core.role == Role.LEADER:
            holder = self.leaders_by_epoch.setdefault(core.epoch, changed.node_id)
            if holder != changed.node_id:
                raise InvariantViolation(f"t={now} two leaders in epoch {core.epoch}: {holder} and {changed.node_id}")
        hw = core.high_watermark
        if hw < changed.last_high_watermark:
            raise InvariantViolation(f"t={now} node {changed.node_id} high watermark went back "
                                     f"{changed.last_high_watermark} -> {hw}")
        changed.last_high_watermark = hw
        if hw > changed.log.end_offset():
            raise InvariantViolation(f"t={now} node {changed.node_id} high watermark {hw} past its log end "
                                     f"{changed.log.end_offset()}")
        if hw > changed.checked_offset:
            self._record_committed(changed, hw)
        if hw > self.max_high_watermark:
            self.max_high_watermark = hw
        self._check_majority_holds()
        if self.stable_leader is not None:
            self._check_stable_leader(changed)
        self._check_quorum_resigns(changed)

    def _record_committed(self, node: SimNode, hw: int) -> None:
        """Compare every newly committed record with what other nodes committed there."""
        offset = max(node.checked_offset, node.log.start_offset())
        cleaned_end = max(node.log.cleaned_end(), self.compacted_below)  # compacted: not comparable
        for batch in node.log.read(offset, 1 << 30):
            for index, record in enumerate(batch.records):
                at = batch.base_offset + index
                if at < offset or at >= hw or at < cleaned_end:
                    continue
                entry = (batch.epoch, batch.control, record)
                known = self.committed.setdefault(at, entry)
                if known != entry:
                    raise InvariantViolation(f"t={self.now_ms} node {node.node_id} committed a different record "
                                             f"at offset {at}: epoch {batch.epoch} vs {known[0]}")
            if batch.next_offset >= hw:
                break
        node.checked_offset = hw

    def _check_majority_holds(self) -> None:
        """Every offset below the highest high watermark is durable on a majority of voters."""
        target = self.max_high_watermark
        if target == 0:
            return
        if self.holders_check is not None:
            self.holders_check(target)
            return
        holders = sum(1 for v in self.voter_ids if self.held_durably(v, target))
        if holders < self.majority:
            raise InvariantViolation(f"t={self.now_ms} only {holders} voters durably hold offset "
                                     f"{target - 1} below the high watermark")

    # ------------------------------------------------------------------ invariant: check-quorum

    def _note_fetch_to_leader(self, node: SimNode, envelope: Envelope) -> None:
        """A Fetch or FetchSnapshot of the leader's epoch from a voter reaches the leader."""
        watch = self.quorum_watch.get(node.node_id)
        message = envelope.message
        if (watch is not None and isinstance(message, (FetchRequest, FetchSnapshotRequest))
                and message.epoch == watch.epoch and envelope.src in watch.members
                and message.replica_id == envelope.src):
            watch.heard_ms[envelope.src] = self.now_ms

    def _check_quorum_resigns(self, changed: SimNode) -> None:
        """A leader that heard from no majority of voters (itself included) for 1.5 x
        fetch_timeout_ms has resigned (rule 6, check-quorum): a leader cut off in a minority
        must not keep answering clients. A paused leader is judged once it ran again."""
        core = changed.core
        if core is not None and core.role == Role.LEADER:
            watch = self.quorum_watch.get(changed.node_id)
            if watch is None or watch.epoch != core.epoch:
                members, majority = self._counted_voters(changed)
                self.quorum_watch[changed.node_id] = QuorumWatch(core.epoch, self.now_ms, members, majority)
        for leader_id, watch in list(self.quorum_watch.items()):
            node = self.nodes[leader_id]
            if node.core is None or node.core.role != Role.LEADER or node.core.epoch != watch.epoch:
                del self.quorum_watch[leader_id]
                continue
            if self.voters_counted is not None:
                self._follow_voter_set(node, watch)
            if node.paused or node.resumed_ms == self.now_ms or len(watch.members) < 2:
                continue
            # The majority-th latest sign of life; the leader itself counts as heard now.
            heard = sorted(watch.heard_ms.values(), reverse=True)
            quorum_ms = heard[watch.majority - 2] if len(heard) >= watch.majority - 1 else -1
            silent_ms = self.now_ms - max(watch.since_ms, quorum_ms)
            bound_ms = node.config.fetch_timeout_ms * 3 // 2 + CHECK_QUORUM_SLACK_MS
            if silent_ms > bound_ms:
                raise InvariantViolation(f"t={self.now_ms} check-quorum: leader {leader_id} of epoch {watch.epoch} "
                                         f"heard from no majority for {silent_ms} ms and still leads "
                                         f"(bound {bound_ms} ms)")

    def _counted_voters(self, leader: SimNode) -> tuple[frozenset[int], int]:
        """The voters a leader counts and their majority: the static set, else its set in force."""
        if self.voters_counted is not None:
            return self.voters_counted(leader)
        return self.voter_ids, self.majority

    def _follow_voter_set(self, leader: SimNode, watch: QuorumWatch) -> None:
        """A change of the leader's set in force restarts the period: a voter just added
        has had no time to fetch as a voter."""
        members, majority = self._counted_voters(leader)
        if (members, majority) != (watch.members, watch.majority):
            watch.members, watch.majority, watch.since_ms = members, majority, self.now_ms
            watch.heard_ms = {voter: ms for voter, ms in watch.heard_ms.items() if voter in members}

    # ------------------------------------------------------------------ invariant: rule 8

    def _note_resignation(self, node: SimNode, envelope: Envelope) -> None:
        """A valid EndQuorumEpoch of the node's epoch or a later one reaches it."""
        message = envelope.message
        if (isinstance(message, EndQuorumEpochRequest) and message.leader_id == envelope.src
                and envelope.src in self.voter_ids and node.core is not None and message.epoch >= node.core.epoch):
            node.resigned_leader = (message.epoch, envelope.src)

    def _check_resigned_leader_unfollowed(self, node: SimNode, before: tuple[Role, int, int]) -> None:
        """Rule 8: once told that a leader resigned, no message makes a node follow it in that
        epoch (a peer that missed the resignation still names it; following it only waits
        out a fetch timeout and slows the failover). A Prospective's own timer falling back
        to the leader it lost is rule 3's, not word from a peer."""
        core = node.core
        if (node.resigned_leader is None or core is None or core.role != Role.FOLLOWER
                or (core.epoch, core.leader_id) != node.resigned_leader
                or before == (Role.FOLLOWER, core.epoch, core.leader_id)):
            return
        raise InvariantViolation(f"t={self.now_ms} rule 8: node {node.node_id} follows leader {core.leader_id} "
                                 f"of epoch {core.epoch} again after it said it resigned")

    # ------------------------------------------------------------------ invariants: fault-free windows

    def expect_stable_leader(self, leader_id: int) -> None:
        """Until ``end_stable_window``, nothing fails: the leader must keep leading, no node
        may start an election and no epoch past every node's may appear (checked after every
        event)."""
        core = self.nodes[leader_id].core
        assert core is not None and core.role == Role.LEADER
        self.stable_leader = (leader_id, core.epoch)
        self.window_epochs = {node.node_id: node.core.epoch for node in self.nodes.values()
                              if node.core is not None}
        self.window_max_epoch = max(self.window_epochs.values(), default=core.epoch)

    def end_stable_window(self) -> None:
        self.stable_leader = None

    def _check_stable_leader(self, changed: SimNode) -> None:
        assert self.stable_leader is not None and changed.core is not None
        leader_id, epoch = self.stable_leader
        core = changed.core
        own_epoch = self.window_epochs.get(changed.node_id, epoch)
        if core.epoch > epoch and (core.epoch > self.window_max_epoch
                                   or (core.role == Role.CANDIDATE and core.epoch > own_epoch)):
            raise InvariantViolation(f"t={self.now_ms} fault-free window: node {changed.node_id} raised the epoch "
                                     f"{epoch} -> {core.epoch} under healthy leader {leader_id}")
        if changed.node_id == leader_id and core.role != Role.LEADER:
            raise InvariantViolation(f"t={self.now_ms} fault-free window: healthy leader {leader_id} deposed "
                                     f"(now {core.role.value} in epoch {core.epoch})")

    def check_replicas_agree(self) -> None:
        """Every record below each node's high watermark matches the committed record."""
        for node in self.nodes.values():
            hw = node.core.high_watermark if node.core is not None else 0
            node.checked_offset = min(node.checked_offset, node.log.start_offset())
            saved = node.checked_offset
            node.checked_offset = node.log.start_offset()
            self._record_committed(node, hw)
            node.checked_offset = max(saved, hw)


def batches_text(batches: list[Batch]) -> str:
    """A short, stable rendering of log batches for golden files."""
    parts = []
    for batch in batches:
        kind = "control" if batch.control else "data"
        parts.append(f"[{batch.base_offset}..{batch.last_offset} e{batch.epoch} {kind}]")
    return " ".join(parts)


_SHOWN_FIELDS: dict[str, tuple[str, ...]] = {
    "VoteRequest": ("epoch", "last_offset_epoch", "last_offset", "pre_vote"),
    "VoteResponse": ("error", "epoch", "leader_id", "vote_granted", "pre_vote"),
    "BeginQuorumEpochRequest": ("epoch", "leader_id"),
    "BeginQuorumEpochResponse": ("error", "epoch", "leader_id"),
    "EndQuorumEpochRequest": ("epoch", "leader_id", "preferred_successors"),
    "EndQuorumEpochResponse": ("error", "epoch", "leader_id"),
    "FetchRequest": ("epoch", "fetch_offset", "last_fetched_epoch", "high_watermark"),
    "FetchResponse": ("error", "epoch", "leader_id", "fetch_offset", "high_watermark", "records",
                      "diverging_epoch", "diverging_end_offset", "snapshot_id"),
    "FetchSnapshotRequest": ("epoch", "snapshot_id", "position"),
    "FetchSnapshotResponse": ("error", "epoch", "snapshot_id", "size", "position"),
}


def describe_message(message: object) -> str:
    """One stable line per message, with only the fields that explain the protocol."""
    name = type(message).__name__
    parts = []
    for field_name in _SHOWN_FIELDS.get(name, ()):
        value = getattr(message, field_name)
        if field_name == "records":
            value = batches_text(list(value)) or "-"
        elif field_name == "error":
            if not value:
                continue
            value = value.name
        elif field_name in ("diverging_epoch", "diverging_end_offset") and value == -1:
            continue
        elif field_name == "snapshot_id":
            if value is None:
                continue
            value = f"{value.end_offset}/e{value.epoch}"
        parts.append(f"{field_name}={value}")
    return f"{name}({', '.join(parts)})"
