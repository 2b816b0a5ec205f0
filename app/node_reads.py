"""The read side of ``KVService`` over a node's SQLite state machine.

Why a module of its own: the runtime (and its in-process test twin) answer reads straight
from the applied state, and the storage errors of those reads must reach front ends as the
service's typed errors. Both inherit these methods instead of each translating on its own.
"""

from __future__ import annotations

from app.service import (
    ChangePage,
    HistoryCompactedError,
    KeyRead,
    ListPage,
    VersionWaitTimeoutError,
)
from storage.state_machine import StateMachine, VersionCompactedError, VersionNotAppliedError


def _service_error(exc: VersionCompactedError | VersionNotAppliedError) -> HistoryCompactedError | VersionWaitTimeoutError:
    if isinstance(exc, VersionCompactedError):
        return HistoryCompactedError(exc.requested_version, exc.oldest_version)
    # A version above the applied one: wait_readable waits for it first, so this answers as
    # its timeout would.
    return VersionWaitTimeoutError(exc.applied_version)


class NodeReads:
    """get, changes and list of ``KVService``, answered from ``self.state``."""

    state: StateMachine

    def get(self, key: str, at_version: int | None = None) -> KeyRead:
        try:
            version, entry = self.state.get(key, at_version=at_version)
        except (VersionCompactedError, VersionNotAppliedError) as exc:
            raise _service_error(exc) from None
        return KeyRead(version, entry)

    def changes(self, prefix: str, since: int, limit: int) -> ChangePage:
        try:
            version, events = self.state.changes(prefix, since, limit)
        except (VersionCompactedError, VersionNotAppliedError) as exc:
            raise _service_error(exc) from None
        return ChangePage(version, events)

    def list(self, prefix: str, *, after: str | None = None, limit: int = 100,
             at_version: int | None = None) -> ListPage:
        try:
            version, entries, next_key = self.state.list(prefix, after=after, limit=limit, at_version=at_version)
        except (VersionCompactedError, VersionNotAppliedError) as exc:
            raise _service_error(exc) from None
        return ListPage(version, entries, next_key)
