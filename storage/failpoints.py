"""Failpoints: named places in the storage write path where a test can inject a fault.

Chosen by the environment variable ``METAKV_FAILPOINTS`` so that a test can arm them in a
child process it then observes from outside (crash tests), e.g.::

    METAKV_FAILPOINTS="segment.before_fsync=crash,segment.after_write=error@3,segment.fsync=sleep(50)"

Each entry is ``name=action[@n]``. Actions:

- ``crash``      ``os._exit(FAILPOINT_CRASH_EXIT_CODE)``: no cleanup, no flush, like a SIGKILL.
- ``error``      raise ``OSError(EIO)`` as a failing disk would.
- ``enospc``     raise ``OSError(ENOSPC)``: the disk is full.
- ``emfile``     raise ``OSError(EMFILE)``: the process has no file descriptor left.
- ``sleep(ms)``  pause for ``ms`` milliseconds (widens race windows; never used for timing).

``@n`` fires on the n-th time the point is reached and on every time after it (default 1).
Points used by the segment log: ``segment.before_write``, ``segment.after_write``,
``segment.before_fsync``, ``segment.after_fsync``, ``segment.before_create`` (a roll is about
to create the next segment), ``segment.after_roll`` (the new segment exists, the sealed
segment's index is not written yet), ``segment.before_swap_marker``,
``segment.before_swap``, ``segment.after_swap`` (replace_prefix); by the quorum-state file:
``quorum_state.before_rename``, ``quorum_state.after_rename``.

Unarmed points cost one dict lookup; production code never sets the variable.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from dataclasses import dataclass

ENVIRONMENT_VARIABLE = "METAKV_FAILPOINTS"
FAILPOINT_CRASH_EXIT_CODE = 86
_ENTRY = re.compile(r"^\s*([a-z_.]+)\s*=\s*(crash|error|enospc|emfile|sleep\((\d+)\))\s*(?:@(\d+))?\s*$")


class FailpointSpecError(ValueError):
    """The failpoint specification does not parse; names the bad entry."""


@dataclass(slots=True)
class _Failpoint:
    action: str
    sleep_ms: int
    fire_from_hit: int
    hits: int = 0


class Failpoints:
    """A set of armed failpoints; ``hit(name)`` runs the action armed for ``name``, if any."""

    def __init__(self, spec: str = "") -> None:
        self._points: dict[str, _Failpoint] = {}
        self._lock = threading.Lock()
        for entry in filter(None, (part.strip() for part in spec.split(","))):
            match = _ENTRY.match(entry)
            if match is None:
                raise FailpointSpecError(
                    f"bad failpoint entry {entry!r} in {ENVIRONMENT_VARIABLE}: "
                    "expected name=crash|error|enospc|emfile|sleep(ms)[@n]"
                )
            name, action, sleep_ms, fire_from = match.groups()
            kind = "sleep" if action.startswith("sleep") else action
            self._points[name] = _Failpoint(kind, int(sleep_ms or 0), int(fire_from or 1))

    @classmethod
    def from_env(cls) -> Failpoints:
        return cls(os.environ.get(ENVIRONMENT_VARIABLE, ""))

    def armed(self) -> bool:
        return bool(self._points)

    def disarm(self, name: str) -> None:
        """Stop firing ``name`` (a shortage that ends, in a test that watches the recovery)."""
        with self._lock:
            self._points.pop(name, None)

    def hit(self, name: str) -> None:
        """Run the action armed for ``name`` once its hit count is reached; else do nothing."""
        point = self._points.get(name)
        if point is None:
            return
        with self._lock:
            point.hits += 1
            firing = point.hits >= point.fire_from_hit
        if not firing:
            return
        if point.action == "crash":
            os._exit(FAILPOINT_CRASH_EXIT_CODE)
        if point.action == "error":
            raise OSError(errno.EIO, f"failpoint {name}: injected I/O error")
        if point.action == "enospc":
            raise OSError(errno.ENOSPC, f"failpoint {name}: injected disk full")
        if point.action == "emfile":
            raise OSError(errno.EMFILE, f"failpoint {name}: injected: no file descriptor left")
        time.sleep(point.sleep_ms / 1000)


NO_FAILPOINTS = Failpoints()
