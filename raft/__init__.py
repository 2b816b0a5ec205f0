"""metakv's consensus core: KRaft's pull-based Raft as a pure state machine.

The caller's contract (the runtime in app/ and the simulator in tests/sim follow it):

1. Drive the core only through its methods, passing the current time in integer
   milliseconds; the core never reads a clock, opens a socket or file, or calls the
   global ``random`` (each node gets its own ``random.Random``).
2. After every call, take the core's ``Ready`` and perform it in this order:
   persist ``quorum_state`` (fsync) before sending any ``messages``; start a log
   flush when ``flush`` is set and report completion with ``on_flushed``; apply
   committed batches only up to ``high_watermark``.
3. The core appends to and truncates the log itself through the narrow
   ``RaftLog`` protocol (raft/log.py); an offset counts as durable only once the log
   reports it flushed.

See docs/raft-core-api.md for the full driving contract.
"""
