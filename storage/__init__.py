"""What survives a crash: segment log, quorum-state file, snapshots, cleaner, SQLite state machine."""
