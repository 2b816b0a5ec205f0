"""The storage quota (``--quota-bytes``, docs/security.md): past it the leader refuses writes
that add data (507), so a cluster filling its disks turns read-only instead of every node
stopping on ENOSPC at once (etcd's NOSPACE alarm, simplified: each leader decides on its own
size, nothing is replicated). Deletes, and txns of deletes and gets only, still pass.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from app.service import QuotaExceededError
from storage.commands import Command, OpKind

QUOTA_REFRESH_S = 0.1  # used bytes are measured at most this often (a stat per file), not per write
STATE_DB_FILES = ("state.db", "state.db-wal")


def state_db_bytes(data_dir: Path) -> int:
    """Bytes of state.db and its WAL (a missing file counts 0)."""
    total = 0
    for name in STATE_DB_FILES:
        try:
            total += os.stat(data_dir / name).st_size
        except FileNotFoundError:
            pass
    return total


def adds_nothing(command: Command) -> bool:
    """Whether every op of either branch is a delete or a get: such a write never adds data."""
    return all(op.kind != OpKind.PUT for op in (*command.success, *command.failure))


class StorageQuota:
    """``check(command)`` raises QuotaExceededError for a write that adds data while the
    measured bytes are past the quota; a quota of 0 checks nothing."""

    def __init__(self, quota_bytes: int, measure: Callable[[], int], registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.quota_bytes = quota_bytes
        self._measure = measure
        self._clock = clock
        self._used_bytes = 0
        self._measured_at_s = float("-inf")
        Gauge("metakv_quota_bytes", "The storage quota (--quota-bytes; 0 = none)",
              registry=registry).set(quota_bytes)
        Gauge("metakv_quota_used_bytes", "Bytes of state.db and log counted against the quota",
              registry=registry).set_function(lambda: float(self.used_bytes()))
        Gauge("metakv_quota_exceeded", "1 while writes that add data are refused with 507",
              registry=registry).set_function(lambda: float(self.exceeded()))

    def used_bytes(self) -> int:
        now_s = self._clock()
        if now_s - self._measured_at_s >= QUOTA_REFRESH_S:
            self._used_bytes = self._measure()
            self._measured_at_s = now_s
        return self._used_bytes

    def exceeded(self) -> bool:
        return self.quota_bytes > 0 and self.used_bytes() > self.quota_bytes

    def check(self, command: Command) -> None:
        if self.exceeded() and not adds_nothing(command):
            raise QuotaExceededError(
                f"this leader holds {self._used_bytes} bytes of state.db and log, past --quota-bytes="
                f"{self.quota_bytes}; deletes still work, and their space is reused once the log is cleaned")
