"""The read side of ``KVService`` over a node's SQLite state machine.

Why a module of its own: the runtime (and its in-process test twin) answer reads straight
from the applied state, and the storage errors of those reads must reach front ends as the
service's typed errors. Both inherit these methods instead of each translating on its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from app.service import (
    ChangePage,
    ChangeWatch,
    HistoryCompactedError,
    KeyRead,
    ListPage,
    VersionWaitTimeoutError,
    is_internal_key,
)
from app.watch_hub import WatchHub
from storage.state_machine import StateMachine, VersionCompactedError, VersionNotAppliedError

# Above every internal key (NUL, then anything) and below every client key (no NUL).
INTERNAL_KEYS_END = "\x00\U0010ffff"


@contextlib.contextmanager
def _service_errors() -> Iterator[None]:
    """Storage's version errors as the service's typed errors."""
    try:
        yield
    except VersionCompactedError as exc:
        raise HistoryCompactedError(exc.requested_version, exc.oldest_version) from None
    except VersionNotAppliedError as exc:
        # A version above the applied one: wait_readable waits for it first, so this
        # answers as its timeout would.
        raise VersionWaitTimeoutError(exc.applied_version) from None


class NodeReads:
    """get, changes, list and watch of ``KVService``, answered from ``self.state`` (watches
    through ``self.watch_hub``, which the apply path feeds)."""

    state: StateMachine
    watch_hub: WatchHub

    def get(self, key: str, at_version: int | None = None) -> KeyRead:
        with _service_errors():
            version, entry = self.state.get(key, at_version=at_version)
        return KeyRead(version, entry)

    def changes(self, prefix: str, since: int, limit: int) -> ChangePage:
        while True:
            with _service_errors():
                version, events = self.state.changes(prefix, since, limit)
            if prefix:  # only the empty prefix reaches the internal keys (they start with NUL)
                return ChangePage(version, events)
            visible = [event for event in events if not is_internal_key(event.key)]
            if visible or not events:
                return ChangePage(version, visible)
            since = version  # a page of internal changes only: an empty page would end a catch-up early

    def list(self, prefix: str, *, after: str | None = None, limit: int = 100,
             at_version: int | None = None) -> ListPage:
        if is_internal_key(prefix):
            prefix = INTERNAL_KEYS_END  # no client key starts with NUL: an empty page
        elif not prefix and (after is None or after < INTERNAL_KEYS_END):
            after = INTERNAL_KEYS_END  # the internal keys sort first: skip them
        with _service_errors():
            version, entries, next_key = self.state.list(prefix, after=after, limit=limit, at_version=at_version)
        return ListPage(version, entries, next_key)

    def watch(self, prefix: str, since: int, limit: int) -> ChangeWatch:
        return self.watch_hub.open(prefix, since, limit)
