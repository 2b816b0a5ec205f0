"""The compaction simulator's key-value model: states with an incremental digest, and the
committed history they are checked against (tests/sim/compaction.py).

Why a module of its own: checking every exposed state against the committed history after
every event used to freeze and sort the whole state each time (most of a seed's cost). A
state now carries a digest (a sum of per-entry hashes) that each applied record updates for
the keys it names, so comparing a replica's state with the history's at one version costs
one integer comparison; the full states are only built to explain a mismatch. Records are
decoded once per process (every replica applies the same bytes), with apply's own evaluator
(storage.evaluator).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping

from storage.commands import CommandDecodeError
from storage.evaluator import CompactCommand, command_keys, decode_compact, evaluate_compact
from storage.state_types import Entry

MASK = (1 << 64) - 1
DECODED_MAX = 200_000  # records kept decoded; a seed has far fewer, so this only bounds memory

Rows = dict[str, tuple[bytes, str, int, int]]  # key -> (value, content type, mod, create version)

_decoded: dict[bytes, tuple[CompactCommand | str, tuple[str, ...]]] = {}


def decode(record: bytes) -> tuple[CompactCommand | str, tuple[str, ...]]:
    """The record as the evaluator runs it (or its decode error: a no-op), and the keys it
    names, decoded once per process."""
    cached = _decoded.get(record)
    if cached is None:
        try:
            command: CompactCommand | str = decode_compact(record)
        except CommandDecodeError as exc:
            cached = (f"record does not decode: {exc}", ())
        else:
            cached = (command, tuple(dict.fromkeys(command_keys(command))))
        if len(_decoded) >= DECODED_MAX:
            _decoded.clear()
        _decoded[record] = cached
    return cached


def entry_hash(entry: Entry | None) -> int:
    if entry is None:
        return 0
    return hash((entry.key, entry.value, entry.content_type, entry.mod_version, entry.create_version)) & MASK


def digest_of(entries: Mapping[str, Entry | None]) -> int:
    return sum(entry_hash(entry) for entry in entries.values()) & MASK


class ModelState:
    """One state machine's key -> entry map (sparse: a key not in it is absent; None: absent
    too, named by a record) and its digest, kept equal to ``digest_of(entries)``."""

    __slots__ = ("entries", "digest")

    def __init__(self, entries: dict[str, Entry | None] | None = None, digest: int | None = None) -> None:
        self.entries: dict[str, Entry | None] = entries if entries is not None else {}
        self.digest = digest_of(self.entries) if digest is None else digest

    def apply(self, offset: int, record: bytes) -> None:
        """Apply one data record at ``offset`` (its version is offset + 1)."""
        command, keys = decode(record)
        entries = self.entries
        before = [entries.setdefault(key, None) for key in keys]  # the evaluator reads every key named
        evaluate_compact([(offset, command)], entries)
        digest = self.digest
        for key, old in zip(keys, before, strict=True):
            new = entries[key]
            if new is not old:
                digest += entry_hash(new) - entry_hash(old)
        self.digest = digest & MASK

    def copy(self) -> ModelState:
        return ModelState(dict(self.entries), self.digest)

    def rows(self) -> Rows:
        return {key: (e.value, e.content_type, e.mod_version, e.create_version)
                for key, e in self.entries.items() if e is not None}


def rows_difference(found: Rows, expected: Rows) -> str:
    """What a state holds that the expected one does not: the keys deleted ones brought back,
    and the keys whose entries differ."""
    back = sorted(set(found) - set(expected))
    differ = sorted(key for key in set(found) | set(expected) if key not in back and found.get(key) != expected.get(key))
    return ((f"; deleted keys reappeared: {back}" if back else "")
            + (f"; keys with other entries: {differ}" if differ else ""))


class CommittedHistory:
    """The committed log as the oracle sees it (offset -> (epoch, control, record), every
    replica's committed records, tests/sim/cluster.py) and what it produces: the state's
    digest at every version, each key's changes (so the state at any version can be read
    back), and where each epoch starts."""

    def __init__(self) -> None:
        self.state = ModelState()
        self.digests: list[int] = [0]  # version -> digest of the state at that version
        self._changes: dict[str, tuple[list[int], list[Entry | None]]] = {}  # key -> (versions, entries)
        self.epoch_starts: list[tuple[int, int]] = []  # (first offset, epoch), in offset order

    @property
    def version(self) -> int:
        return len(self.digests) - 1

    def advance(self, committed: Mapping[int, tuple[int, bool, bytes]]) -> None:
        """Take in every record committed contiguously past the current version."""
        state, digests, changes, epochs = self.state, self.digests, self._changes, self.epoch_starts
        offset = len(digests) - 1
        while offset in committed:
            epoch, control, record = committed[offset]
            if not epochs or epoch != epochs[-1][1]:
                epochs.append((offset, epoch))
            if not control:
                _command, keys = decode(record)
                before = [state.entries.get(key) for key in keys]
                state.apply(offset, record)
                for key, old in zip(keys, before, strict=True):
                    new = state.entries[key]
                    if new is not old:
                        versions, entries = changes.setdefault(key, ([], []))
                        versions.append(offset + 1)
                        entries.append(new)
            digests.append(state.digest)
            offset += 1

    def entries_at(self, keys: Iterable[str], version: int) -> dict[str, Entry | None]:
        """Each key's entry at ``version`` (at most ``self.version``)."""
        result: dict[str, Entry | None] = {}
        for key in keys:
            versions, entries = self._changes.get(key, ((), ()))
            index = bisect.bisect_right(versions, version)  # type: ignore[arg-type]
            result[key] = entries[index - 1] if index else None
        return result

    def rows_at(self, version: int) -> Rows:
        entries = self.entries_at(self._changes, version)
        return {key: (e.value, e.content_type, e.mod_version, e.create_version)
                for key, e in entries.items() if e is not None}

    def state_at(self, version: int) -> ModelState:
        return ModelState({key: e for key, e in self.entries_at(self._changes, version).items() if e is not None})

    def epoch_at(self, offset: int) -> int:
        """The epoch of committed offset ``offset``."""
        index = bisect.bisect_right(self.epoch_starts, (offset, 1 << 62)) - 1
        return self.epoch_starts[index][1]

