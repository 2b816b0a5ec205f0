"""StateMachine.sync: the version the cleaner may compact below (docs/compaction.md rule 9)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from raft.types import Batch
from storage.commands import Command, Op, OpKind, encode_command
from storage.state_machine import StateMachine

# Another process that opens the database, reads and closes it (the sqlite3 shell, a backup).
_OTHER_READER = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
                 "c.execute('SELECT applied_version FROM meta').fetchone(); c.close()")


def _batch(offset: int) -> Batch:
    return Batch(offset, 1, 0, False, (encode_command(Command((), (Op(OpKind.PUT, f"k{offset}", b"v"),))),))


def test_sync_returns_the_applied_version_and_keeps_sqlites_locks(tmp_path: Path) -> None:
    """sync() must not open the main file: closing that descriptor would drop the POSIX
    locks SQLite holds on it, and the next process to open and close the database would
    take itself for the last connection and delete the live WAL (a review found this)."""
    path = tmp_path / "state.db"
    wal = tmp_path / "state.db-wal"
    with StateMachine(str(path)) as state:
        state.apply([_batch(0)])
        assert state.sync() == 1
        subprocess.run([sys.executable, "-c", _OTHER_READER, str(path)], check=True, timeout=60)
        assert wal.exists(), "another process deleted the live WAL after sync()"
        state.apply([_batch(1)])
        assert state.sync() == 2


def test_sync_without_a_wal_file_reports_only_what_it_saw_made_durable(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with StateMachine(str(path)) as state:
        assert state.sync() == 0
        state.apply([_batch(0)])
        assert state.sync() == 1
        os.unlink(tmp_path / "state.db-wal")  # someone removed it: new commits go nowhere durable
        state.apply([_batch(1)])
        assert state.sync() == 1
        state.clear()  # back to version 0, of which nothing was seen made durable
        assert state.sync() == 0
