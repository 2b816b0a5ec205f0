"""What a user of the store would notice, checked while the load runs.

A load test that only times requests can report excellent latency for a store that loses
writes. These ledgers record what each simulated client did and compare it with what the
store showed back:

- ``WatchVerifier``: every acknowledged write under a watcher's prefix must arrive as a
  watch event, events must arrive in strictly increasing version order, and when metakv
  says a long-poll answer is complete through version V, no acknowledged write at or below
  V may be missing from it.
- ``CasLedger``: compare-and-set counters; the final value must equal the number of won
  races, give or take the attempts whose outcome the client never learnt.
- ``Checks.read_own_write``: a read with ``min_version`` after the reader's own write must
  show that write (or a later one by the same, only, writer of the key).

Everything here runs inside one Locust process, in greenlets that switch only on I/O, so the
ledgers need no locks.
"""

from __future__ import annotations

import json
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.stores import WatchBatch

PROBLEMS_KEPT_MAX = 50  # first problems kept verbatim in the checks file
UNACKED_EVENTS_MAX = 10_000  # events whose write has not been acknowledged (yet), per watcher

# fire(name, response_time_ms, error_or_None): records a measurement or a failed check in
# Locust's statistics (bound to environment.events.request by the locustfile).
Recorder = Callable[[str, float, str | None], None]


@dataclass
class Checks:
    """The counters written to the run's checks.json."""

    read_own_writes_checked: int = 0
    read_own_writes_violated: int = 0
    list_checked: int = 0
    list_short: int = 0
    large_values_checked: int = 0
    large_values_wrong_size: int = 0
    failed: int = 0  # every failed check, of any kind
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        self.failed += 1
        if len(self.problems) < PROBLEMS_KEPT_MAX:
            self.problems.append(text)


class WatchVerifier:
    """One watcher's expectations: the versions of its own user's acknowledged writes."""

    def __init__(self, name: str, record: Recorder) -> None:
        self.name = name
        self.record = record
        self.pending: deque[tuple[int, float]] = deque()  # (version, sent_at_s), increasing
        self.unacked: dict[int, float] = {}  # event version -> received_at_s
        self.last_event_version = 0
        self.last_acked_version = 0
        self.acked = 0
        self.delivered = 0
        self.missed = 0
        self.out_of_order = 0
        self.problems: list[str] = []

    def on_ack(self, version: int, sent_at_s: float) -> None:
        """The writer's write at ``version`` was acknowledged."""
        self.acked += 1
        if version <= self.last_acked_version:
            self._problem(f"write acknowledged at version {version} after {self.last_acked_version}")
        self.last_acked_version = max(self.last_acked_version, version)
        received_at_s = self.unacked.pop(version, None)
        if received_at_s is not None:  # the event beat the acknowledgement
            self._delivered(received_at_s - sent_at_s)
        elif version <= self.last_event_version:
            # Events arrive in order, so a write older than the newest event that has not
            # been seen by now never will be.
            self._missed(version, "an event with a higher version already arrived")
        else:
            self.pending.append((version, sent_at_s))

    def on_batch(self, batch: WatchBatch) -> None:
        now_s = time.time()
        for event in batch.events:
            if event.mod_version <= self.last_event_version:
                self.out_of_order += 1
                self._problem(
                    f"event for {event.key} at version {event.mod_version} arrived after version "
                    f"{self.last_event_version}"
                )
                continue
            self.last_event_version = event.mod_version
            while self.pending and self.pending[0][0] < event.mod_version:
                version, _ = self.pending.popleft()
                self._missed(version, f"event {event.mod_version} arrived first")
            if self.pending and self.pending[0][0] == event.mod_version:
                _, sent_at_s = self.pending.popleft()
                self._delivered(now_s - sent_at_s)
            else:
                if len(self.unacked) >= UNACKED_EVENTS_MAX:
                    self.unacked.pop(next(iter(self.unacked)))
                self.unacked[event.mod_version] = now_s
        while self.pending and 0 < batch.covered_version and self.pending[0][0] <= batch.covered_version:
            version, _ = self.pending.popleft()
            self._missed(version, f"answer complete through {batch.covered_version} left it out")

    def caught_up(self) -> bool:
        return not self.pending

    def finish(self) -> None:
        """End of run: whatever is still pending was never delivered."""
        while self.pending:
            version, _ = self.pending.popleft()
            self._missed(version, "never delivered")

    def summary(self) -> dict[str, Any]:
        return {
            "watcher": self.name,
            "acked_writes": self.acked,
            "delivered": self.delivered,
            "missed": self.missed,
            "out_of_order": self.out_of_order,
            "problems": self.problems,
        }

    def _delivered(self, lag_s: float) -> None:
        self.delivered += 1
        self.record("watch delivery", max(0.0, lag_s * 1000.0), None)

    def _missed(self, version: int, why: str) -> None:
        self.missed += 1
        self._problem(f"write at version {version} missing from the watch: {why}")

    def _problem(self, text: str) -> None:
        if len(self.problems) < PROBLEMS_KEPT_MAX:
            self.problems.append(f"{self.name}: {text}")
        self.record("check: watch order", 0.0, text)


@dataclass
class CasLedger:
    """Won races and undecided attempts per counter key."""

    wins: Counter[str] = field(default_factory=Counter)
    undecided: Counter[str] = field(default_factory=Counter)
    lost: int = 0

    def verdict(self, final_values: dict[str, int]) -> dict[str, Any]:
        keys = sorted(set(final_values) | set(self.wins))
        rows = []
        ok = True
        for key in keys:
            value = final_values.get(key, 0)
            wins = self.wins[key]
            undecided = self.undecided[key]
            holds = wins <= value <= wins + undecided
            ok = ok and holds
            rows.append({"key": key, "final_value": value, "wins": wins, "undecided": undecided, "holds": holds})
        return {"ok": ok, "lost_races": self.lost, "counters": rows}


@dataclass
class RunLedger:
    """Everything one Locust process checks in one run."""

    checks: Checks = field(default_factory=Checks)
    watchers: list[WatchVerifier] = field(default_factory=list)
    cas: CasLedger = field(default_factory=CasLedger)
    cas_final: dict[str, Any] | None = None
    newest_version: int = 0  # newest version any user's write produced (final reads wait for it)

    def reset(self) -> None:
        """A new test starts in the same process (the web UI): forget the last one."""
        self.checks = Checks()
        self.watchers.clear()
        self.cas = CasLedger()
        self.cas_final = None
        self.newest_version = 0

    def as_document(self) -> dict[str, Any]:
        watch = [watcher.summary() for watcher in self.watchers]
        document: dict[str, Any] = {
            "read_own_writes": {
                "checked": self.checks.read_own_writes_checked,
                "violated": self.checks.read_own_writes_violated,
            },
            "list_prefix": {"checked": self.checks.list_checked, "short": self.checks.list_short},
            "large_values": {
                "checked": self.checks.large_values_checked,
                "wrong_size": self.checks.large_values_wrong_size,
            },
            "watch": {
                "watchers": len(watch),
                "acked_writes": sum(row["acked_writes"] for row in watch),
                "delivered": sum(row["delivered"] for row in watch),
                "missed": sum(row["missed"] for row in watch),
                "out_of_order": sum(row["out_of_order"] for row in watch),
                "per_watcher": watch,
            },
            "cas": self.cas_final,
            "failed_checks": self.checks.failed,
            "problems": self.checks.problems,
        }
        document["ok"] = (
            self.checks.failed == 0
            and self.checks.read_own_writes_violated == 0
            and self.checks.list_short == 0
            and self.checks.large_values_wrong_size == 0
            and document["watch"]["missed"] == 0
            and document["watch"]["out_of_order"] == 0
            and (self.cas_final is None or bool(self.cas_final["ok"]))
        )
        return document

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_document(), indent=2) + "\n")
