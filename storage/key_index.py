"""The in-memory key index: every key's head (its newest history row), and the keys in order.

Like etcd's key index over its store of revisions: the state machine reads and updates
heads here and writes ``key_heads`` on disk behind apply (docs/state-machine.md, Schema).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from sortedcontainers import SortedList


def prefix_upper_bound(prefix: str) -> str | None:
    """The smallest string above every string starting with ``prefix`` (None: no bound).

    SQLite compares TEXT by UTF-8 bytes, which orders like code points, so bumping the last
    code point gives an index-friendly range ``prefix <= key < bound``.
    """
    chars = list(prefix)
    while chars:
        last = ord(chars.pop())
        if last == 0x10FFFF:
            continue
        bumped = 0xE000 if last + 1 == 0xD800 else last + 1
        return "".join(chars) + chr(bumped)
    return None


# A key's head: (create_version, head_version, head_seq, key_version), naming the key's
# newest history row; create_version and key_version are 0 when that change is a delete
# (the key is absent; the row stays a head until it falls below the horizon, since a later
# put links to it). For a put head the entry's mod_version is head_version.
Head = tuple[int, int, int, int]

# The index holds each head packed into one int. A dict holding only ints and strings is
# never tracked by the garbage collector; one holding tuples is re-tracked into the
# youngest generation by every insert of a new tuple, and the next young collection then
# walks all of it (21 ms at 1 M keys, measured): a stall in apply and on the event loop.
_SEQ_BITS = 32
_VERSION_BITS = 64
_SEQ_MASK = (1 << _SEQ_BITS) - 1
_VERSION_MASK = (1 << _VERSION_BITS) - 1
_CREATE_SHIFT = _SEQ_BITS + _VERSION_BITS
_KEY_VERSION_SHIFT = _CREATE_SHIFT + _VERSION_BITS


def pack_head(head: Head) -> int:
    create_version, version, seq, key_version = head
    return ((key_version << _KEY_VERSION_SHIFT) | (create_version << _CREATE_SHIFT)
            | (version << _SEQ_BITS) | seq)


def unpack_head(packed: int) -> Head:
    return ((packed >> _CREATE_SHIFT) & _VERSION_MASK, (packed >> _SEQ_BITS) & _VERSION_MASK,
            packed & _SEQ_MASK, packed >> _KEY_VERSION_SHIFT)


class HeadIndex:
    """Every key's head and the keys in order.

    The writer changes it only after a commit, under the state machine's publish lock; a
    reader takes heads under that lock. It holds every key that has a head (no bound: like
    etcd's key index, the keys of a metadata store fit in memory; the values stay in
    SQLite). The heads are a plain dict (packed, see pack_head) and the order a separate
    SortedList that changes only when a key is created or forgotten: most calls only
    update heads, at dict speed.
    """

    def __init__(self) -> None:
        self._heads: dict[str, int] = {}
        self.keys: SortedList = SortedList()

    def __len__(self) -> int:
        return len(self._heads)

    def __contains__(self, key: object) -> bool:
        return key in self._heads

    def get(self, key: str) -> Head | None:
        packed = self._heads.get(key)
        return None if packed is None else unpack_head(packed)

    def as_dict(self) -> dict[str, Head]:
        """Every head, unpacked (a copy: for checks and tests, not for request paths)."""
        return {key: unpack_head(packed) for key, packed in self._heads.items()}

    def clear(self) -> None:
        self._heads = {}
        self.keys = SortedList()

    def load(self, heads: dict[str, Head]) -> None:
        self._heads = {key: pack_head(head) for key, head in heads.items()}
        self.keys = SortedList(self._heads)

    def update(self, new_heads: dict[str, Head]) -> None:
        """Record a committed call's new heads."""
        heads = self._heads
        created = [key for key in new_heads if key not in heads]
        for key, head in new_heads.items():
            heads[key] = pack_head(head)
        if created:
            self.keys.update(created)

    def forget_deletes(self, deletes: list[tuple[str, int, int]]) -> None:
        """Drop the keys whose head is one of ``deletes`` (key, version, seq): the delete
        rows a prune removed with their key_heads rows. The prune reads them anyway, so
        this costs what was pruned, not a walk over every key."""
        heads = self._heads
        for key, version, seq in deletes:
            if heads.get(key) == pack_head((0, version, seq, 0)):
                del heads[key]
                self.keys.remove(key)

    def keys_after(self, after: str | None, count: int) -> list[str]:
        """Up to ``count`` keys above ``after`` (from the first key when None), in key order."""
        # By key, not by position: a position needs SortedList's positional index, which
        # it rebuilds after every split of a sublist.
        keys = self.keys.irange() if after is None else self.keys.irange(after, inclusive=(False, False))
        return list(itertools.islice(keys, count))

    def range(self, prefix: str, after: str | None) -> Iterator[tuple[str, Head]]:
        """(key, head) for the keys starting with ``prefix`` and above ``after``, in key
        order (code point order, which is SQLite's order of UTF-8 TEXT)."""
        heads = self._heads
        upper = prefix_upper_bound(prefix) if prefix else None
        if after is not None and after >= prefix:
            keys = self.keys.irange(after, upper, inclusive=(False, False))
        else:
            keys = self.keys.irange(prefix, upper, inclusive=(True, False))
        for key in keys:
            yield key, unpack_head(heads[key])

