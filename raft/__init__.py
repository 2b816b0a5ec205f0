"""metakv's consensus core: KRaft's pull-based Raft as a pure state machine.

This docstring is the driving contract; the runtime (app/runtime.py ``_drive``) and the
simulator (tests/sim/cluster.py ``_after_input``) follow it, and other texts point here.

Construction: ``RaftNode(config, log, persisted, rng, snapshots, now_ms)`` (raft/node.py).
The caller hands in the log (a ``RaftLog``, raft/log.py), the quorum state read back from
disk (``None`` on first start), the node's own ``random.Random``, a ``SnapshotStore``
(raft/snapshots.py) and the time. The core never reads a clock, opens a socket or file,
or calls the global ``random``; it appends to and truncates the log itself.

Inputs, each with ``now_ms`` (integer milliseconds of one monotonic clock): ``handle``
(a message), ``tick`` (call it no later than ``next_deadline_ms()``; early is harmless),
``propose``, ``read_index``, ``on_flushed``, ``resign``, ``begin_shutdown`` and
``on_snapshot_installed``. The core collects the outputs of any number of inputs into one
``Ready``; ``take_ready()`` hands it over (coalescing inputs is what makes group commit).

Perform every ``Ready`` in this order:

1. ``quorum_state``: if set, write it durably (fsync) before any message of this Ready is
   sent: a vote or epoch another node may act on must survive a crash.
2. ``messages``: send them; losing some is fine (the core retries).
3. ``flush``: if set, start one ``log.flush()`` unless one is running (then one more once
   it ends), and call ``on_flushed`` when it returns. The core asks once and not again
   until ``on_flushed``. An offset counts as durable only once ``log.flushed_offset()``
   covers it: the leader counts its own offset toward the high watermark, and a follower
   acknowledges (by fetching from) an offset, only then.
4. ``snapshot_to_install``: if set, a downloaded snapshot is complete and the core has
   already reset the log to start at its ``end_offset``. Load it into the state machine
   before applying any batch of this Ready (its end offset becomes the applied offset),
   then call ``on_snapshot_installed``.
5. ``high_watermark``: apply the committed batches below it, in order, read with
   ``log.read``; control batches change no state but advance the applied offset.
6. ``reads_done`` (token, offset): a linearizable read may answer once the applied offset
   reaches ``offset``; ``reads_failed``: that read lost its leader.
7. ``role_changed``: look at ``role``, ``epoch`` and ``leader_id``; after a leader steps
   down, its proposals not applied in step 5 are indeterminate.

A leader that needs a snapshot for a fetcher raises ``snapshot_wanted_offset``; the caller
takes one once it applied that far, records it with the log, and sets the field back to 0.
"""
