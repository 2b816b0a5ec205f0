"""Which heads apply writes into ``key_heads`` behind it: a sweep over the keys in key order.

Why a sweep: ``key_heads`` is a B-tree by key, and the keys one call changes are spread
over all its pages. Writing every changed head soon after its change (the heads of the
oldest 1,000 versions per call, as schema 3 first did) wrote about one page per record at
a million keys, ~8 µs, where at 10,000 keys a page held many of them: apply cost per
record grew 1.8x from 10 k to 1 M keys. The sweep walks the keys in order instead, a slice
per apply call of HEADS_SWEEP_KEYS_PER_RECORD keys per record of the call, and writes the
heads in that slice that changed since the sweep last passed them. Each page is written at
most once per pass however many of its keys changed, so a record costs about
HEADS_SWEEP_KEYS_PER_RECORD / (keys per page) page writes and one row write at any store
size; the price is that ``key_heads`` trails by up to one pass (keys /
HEADS_SWEEP_KEYS_PER_RECORD records), which an open reads back from history.

``heads_version`` (in ``meta``): every change ``key_heads`` lacks is above it. A pass that
begins at version s (the applied version before its first call) leaves each key's row as
the key was at some version >= s when the pass reaches it, and a key it does not reach was
created above s; so when the pass ends, s becomes ``heads_version``. A prune deletes the
rows of the keys it forgets (storage/state_writes.py), so no row outlives its key.

Pure bookkeeping over the key index: the writer (storage/state_writes.py) runs the rows a
step names and commits the step after its transaction commits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from storage.key_index import Head, HeadIndex

# Keys the sweep passes per record applied. Each costs a look-up in ``dirty`` (in a large
# store a cache miss, ~0.3-0.5 µs on a loaded machine), and a page of key_heads holds ~50-110
# keys, so 2 keys per record cost ~1 µs and ~0.03 page writes per record at a million keys;
# a pass takes keys / 2 records (500,000 at a million keys: the most history an open after
# a kill reads back, ~1 s).
HEADS_SWEEP_KEYS_PER_RECORD = 2
# Keys one call passes at least: a call's fixed cost (~50 µs) dwarfs these few look-ups, and
# a store this small is swept whole by every call (key_heads exact after each call with
# heads_flush_records=1).
HEADS_SWEEP_MIN_KEYS = 16


@dataclass(frozen=True, slots=True)
class SweepStep:
    """One call's share of the sweep: the rows to upsert (key order), the last key passed
    (None: the pass ended), the pass's start version, and the new heads_version (None:
    unchanged)."""

    rows: list[tuple[str, int, int]]
    after: str | None
    pass_start: int | None
    heads_version: int | None


class HeadsSweep:
    """The keys whose ``key_heads`` row is not their head, with that head (``dirty``; kept
    here rather than looked up again in the index: in a large store each lookup is a cache
    miss), and where the current pass of the sweep is."""

    def __init__(self) -> None:
        self.dirty: dict[str, Head] = {}
        self._after: str | None = None  # the last key the pass reached (None: at the start)
        self._pass_start: int | None = None  # applied version before the pass's first call

    def reset(self, dirty: dict[str, Head]) -> None:
        """After a (re)load of the index: ``dirty`` are the keys whose row is behind."""
        self.dirty = dirty
        self._after = None
        self._pass_start = None

    def step(self, index: HeadIndex, new_heads: dict[str, Head], records: int,
             applied_before: int, end_version: int) -> SweepStep:
        """The rows a call that changes ``new_heads`` (not yet in ``index``) and moves the
        version from ``applied_before`` to ``end_version`` writes: the changed heads among
        the next ``HEADS_SWEEP_KEYS_PER_RECORD * records`` keys of the index, and those of
        the call's new keys that fall in the same range (at least HEADS_SWEEP_MIN_KEYS)."""
        count = max(HEADS_SWEEP_MIN_KEYS, HEADS_SWEEP_KEYS_PER_RECORD * records)
        low = self._after
        keys = index.keys_after(low, count)
        ended = len(keys) < count
        high = None if ended else keys[-1]
        dirty = self.dirty
        written = {key: head for key in keys if (head := dirty.get(key)) is not None}
        for key, head in new_heads.items():
            if (low is None or key > low) and (high is None or key <= high):
                written[key] = head
        rows = [(key, written[key][1], written[key][2]) for key in sorted(written)]
        if not ended:
            pass_start = applied_before if self._pass_start is None else self._pass_start
            return SweepStep(rows, high, pass_start, None)
        # A pass begun in this very call reached every key as of this call's end.
        heads_version = end_version if low is None else self._pass_start
        return SweepStep(rows, None, None, heads_version)

    def commit(self, step: SweepStep | None, new_heads: dict[str, Head]) -> None:
        """Record a committed call: its changed keys are dirty unless its step wrote them."""
        dirty = self.dirty
        dirty.update(new_heads)
        if step is not None:
            for key, _version, _seq in step.rows:
                del dirty[key]
            self._after = step.after
            self._pass_start = step.pass_start

    def forget(self, keys: Iterable[str]) -> None:
        """Keys a prune dropped with their rows."""
        dirty = self.dirty
        for key in keys:
            dirty.pop(key, None)

    def drain(self) -> list[tuple[str, int, int]]:
        """Every dirty key's row, in key order (at close), and start clean."""
        dirty = self.dirty
        rows = [(key, dirty[key][1], dirty[key][2]) for key in sorted(dirty)]
        self.reset({})
        return rows
