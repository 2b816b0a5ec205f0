"""Persist the quorum state, then send: the Ready order, kept through a descriptor shortage.

A vote or an epoch change must be durable before any message that follows from it leaves
(raft/__init__.py). Writing the quorum-state file needs file descriptors; when none are
left (EMFILE, ENFILE: idle connections can take them all) nothing was written and nothing
is lost, so the record and every message after it wait, and the write is tried again,
instead of the node stopping as it must on a failed fsync.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from raft.log import QuorumStateRecord
from raft.messages import Envelope
from storage.descriptors import out_of_descriptors

# Messages held while the record waits; older ones are dropped past this (raft tolerates
# lost messages: fetches and votes are sent again).
MAX_HELD_MESSAGES = 10_000


class QuorumStateOutbox:
    """``perform`` a Ready's quorum state and messages in order; ``pending`` while a write
    found no descriptor (call ``perform(None, ())`` later to try again)."""

    def __init__(self, write: Callable[[QuorumStateRecord], None], send: Callable[[Envelope], None]) -> None:
        self._write, self._send = write, send
        self._unwritten: QuorumStateRecord | None = None
        self._held: collections.deque[Envelope] = collections.deque(maxlen=MAX_HELD_MESSAGES)

    @property
    def pending(self) -> bool:
        return self._unwritten is not None

    def perform(self, record: QuorumStateRecord | None, messages: Iterable[Envelope]) -> bool:
        """Write ``record`` (the newest supersedes one still waiting), then send what waited
        and ``messages``. False if the write found no descriptor: all of it waits. Any
        other error propagates (a quorum-state file that cannot be written is fatal)."""
        if record is not None:
            self._unwritten = record
        if self._unwritten is not None:
            self._held.extend(messages)
            try:
                self._write(self._unwritten)
            except OSError as exc:
                if not out_of_descriptors(exc):
                    raise
                return False
            self._unwritten = None
            messages, held = tuple(self._held), self._held
            held.clear()
        for envelope in messages:
            self._send(envelope)
        return True
