"""The SQLite state machine: committed log batches in, rows readable at one version out.

docs/state-machine.md has the full contract. StateMachine is what the rest of the project
imports; its parts live in one module per concern:

- storage/state_database.py: the database (connections, schema, versions, locks, the key
  index, checkpoints, close), the base the other parts extend;
- storage/state_writes.py: apply, clear and prune_history;
- storage/state_reads.py: get, list, entries_at and changes;
- storage/state_leases.py: the leases and the keys attached to one;
- storage/state_snapshots.py: create_snapshot and load_snapshot;
- storage/key_index.py: every key's head in memory, in key order;
- storage/state_heads_sweep.py: which heads apply writes behind it into key_heads;
- storage/evaluator.py: records decoded and evaluated without a database (shared with the
  cleaner and the replay pipeline);
- storage/state_types.py: the result types and errors.

The parts share one object's state (its connections, locks, versions and index) rather
than passing it along: apply and the reads are tuned per call (docs/state-machine.md, "How
apply is kept fast"), and one object keeps them free of an extra hop.
"""

from __future__ import annotations

from storage.evaluator import decode_compact, evaluate_commands
from storage.state_database import (
    CHECKPOINT_EVERY_RECORDS,
    HEADS_FLUSH_RECORDS,
    SQLITE_CACHE_KIB,
    WAL_BACKSTOP_PAGES,
)
from storage.state_heads_sweep import HEADS_SWEEP_KEYS_PER_RECORD
from storage.state_leases import LeaseState, StateLeases
from storage.state_snapshots import StateSnapshots
from storage.state_types import (
    ApplyResult,
    Entry,
    Event,
    OpResult,
    SnapshotRejectedError,
    StateDatabaseError,
    VersionCompactedError,
    VersionNotAppliedError,
)
from storage.state_writes import PutResults, StateWrites

# The names app/, loadtest/ and pipeline/ import from here.
__all__ = [
    "CHECKPOINT_EVERY_RECORDS",
    "HEADS_FLUSH_RECORDS",
    "HEADS_SWEEP_KEYS_PER_RECORD",
    "SQLITE_CACHE_KIB",
    "WAL_BACKSTOP_PAGES",
    "ApplyResult",
    "Entry",
    "Event",
    "LeaseState",
    "OpResult",
    "PutResults",
    "SnapshotRejectedError",
    "StateDatabaseError",
    "StateMachine",
    "VersionCompactedError",
    "VersionNotAppliedError",
    "decode_compact",
    "evaluate_commands",
]


class StateMachine(StateWrites, StateLeases, StateSnapshots):
    """Applies committed batches to ``db_path`` and answers versioned reads from it.

    StateMachine(db_path, *, history_retention_versions=None, background_checkpoint=True,
    heads_flush_records=HEADS_FLUSH_RECORDS): see StateDatabase for the arguments.
    """
