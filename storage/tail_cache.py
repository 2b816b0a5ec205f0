"""The decoded batches of a log's unapplied tail, kept in memory (``TailCache``).

A batch the node appended in this process (the leader's proposals, a follower's fetched
records) is read twice more soon after: to answer the fetches that replicate it (leader)
and to apply it once committed. Reading it back from the segment file cost a pread, a copy,
a CRC and a msgpack decode each time; this cache hands back the very ``Batch`` objects that
were appended instead, as etcd's Ready hands committed entries to apply from memory.

Rules (SegmentLog keeps them under its lock):

- The cache holds a suffix of the log: consecutive batches, the last one ending at the log's
  end offset. A read from an offset at or above its first batch is answered from it, byte
  accounting included (each entry keeps its encoded size), exactly as the disk would answer;
  any other read goes to disk.
- Bounded in encoded bytes: appending past ``max_bytes`` drops the oldest batches, so a
  lagging apply falls back to disk reads and memory stays bounded.
- Whatever changes the log below its end drops what it changed: a truncation drops the
  batches at and above the cut (and everything when a batch is cut in two), a snapshot
  reset drops all, a new start or a cleaned prefix drops the batches below it.
- ``drop_below`` forgets what the caller applied; a reopened log starts empty (a restart
  reads from disk).
"""

from __future__ import annotations

import bisect
import collections
import itertools

from raft.types import Batch

DEFAULT_TAIL_CACHE_BYTES = 4 * 1024 * 1024


def _entry_next_offset(entry: tuple[Batch, int]) -> int:
    return entry[0].next_offset


class TailCache:
    """Not thread-safe: its owner (SegmentLog) calls it under its own lock."""

    def __init__(self, max_bytes: int = DEFAULT_TAIL_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.deque[tuple[Batch, int]] = collections.deque()  # (batch, encoded bytes)
        self._bytes = 0

    @property
    def size_bytes(self) -> int:
        """Encoded bytes of the batches held (what the bound counts)."""
        return self._bytes

    def first_offset(self) -> int | None:
        """Base offset of the oldest batch held, or None when empty."""
        return self._entries[0][0].base_offset if self._entries else None

    def appended(self, batch: Batch, encoded_bytes: int, previous_end: int) -> None:
        """``batch`` (``encoded_bytes`` on disk) was appended to a log that ended at
        ``previous_end``; oldest batches go once the bound is passed."""
        if self._entries and self._entries[-1][0].next_offset != previous_end:
            self.clear()  # not a suffix any more (cannot happen through SegmentLog; cheap to keep true)
        self._entries.append((batch, encoded_bytes))
        self._bytes += encoded_bytes
        while self._bytes > self.max_bytes:
            self._bytes -= self._entries.popleft()[1]

    def read(self, offset: int, max_bytes: int) -> list[Batch] | None:
        """SegmentLog.read's answer from memory, or None when the cache does not hold every
        batch at or above ``offset`` (the caller reads the disk)."""
        entries = self._entries
        if not entries or offset < entries[0][0].base_offset:
            return None
        first = bisect.bisect_right(entries, offset, key=_entry_next_offset)
        result: list[Batch] = []
        total_bytes = 0
        for batch, encoded_bytes in itertools.islice(entries, first, None):
            if result and total_bytes + encoded_bytes > max_bytes:
                break
            result.append(batch)
            total_bytes += encoded_bytes
        return result

    def truncated(self, offset: int) -> None:
        """The log drops every record at ``offset`` and above."""
        entries = self._entries
        while entries and entries[-1][0].next_offset > offset:
            self._bytes -= entries.pop()[1]
        if entries and entries[-1][0].next_offset != offset:
            self.clear()  # a batch cut in two (or a cut in a gap): its kept part is on disk only

    def drop_below(self, offset: int) -> None:
        """Forget the batches that lie wholly below ``offset``."""
        entries = self._entries
        while entries and entries[0][0].next_offset <= offset:
            self._bytes -= entries.popleft()[1]

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
