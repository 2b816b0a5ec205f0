"""The voter set (KIP-853): who votes and counts, as written into the log.

A ``VoterSet`` is a plain value. The set in force at a log end is the latest voters record
below that end (``VoterHistory``); a node whose log holds none runs on its static
configuration (kraft.version 0, directory ids ""), which allows no changes. Records are
control records (raft/types.py); a voters record names every voter of the new set.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from raft.types import (
    CONTROL_KRAFT_VERSION,
    CONTROL_VOTERS,
    Batch,
    decode_control_record,
    encode_control_record,
)

KRAFT_VERSION = 1  # the version a voters record requires; 0: static voters only
BOOTSTRAP_RECORDS = 2  # a formatted log's first batch: kraft.version, then the voters record
_DIRECTORY_ID = re.compile(r"^[0-9a-f]{32}$")


class VoterChangeError(Exception):
    """add_voter / remove_voter refused; ``code`` is one of the contract's codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def is_directory_id(value: str) -> bool:
    """32 lowercase hex characters (uuid4().hex)."""
    return bool(_DIRECTORY_ID.match(value))


@dataclass(frozen=True, slots=True)
class Voter:
    """One voter: its id, the directory id of its data directory, raft endpoint, HTTP URL."""

    replica_id: int
    directory_id: str
    endpoint: str
    http_url: str = ""


@dataclass(frozen=True, slots=True)
class VoterSet:
    """Voters sorted by replica id, one per id. A directory id "" (static configuration)
    matches any directory."""

    voters: tuple[Voter, ...]
    ids: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.voters, key=lambda v: v.replica_id))
        if len({v.replica_id for v in ordered}) != len(ordered):
            raise ValueError("a voter set names each replica id once")
        object.__setattr__(self, "voters", ordered)
        object.__setattr__(self, "ids", frozenset(v.replica_id for v in ordered))

    @classmethod
    def static(cls, ids: frozenset[int] | set[int]) -> VoterSet:
        """The set of a static configuration (``--voters``): no directory ids."""
        return cls(tuple(Voter(replica_id, "", "") for replica_id in ids))

    @property
    def majority(self) -> int:
        return len(self.voters) // 2 + 1

    def get(self, replica_id: int) -> Voter | None:
        for voter in self.voters:
            if voter.replica_id == replica_id:
                return voter
        return None

    def contains(self, replica_id: int, directory_id: str) -> bool:
        voter = self.get(replica_id)
        return voter is not None and voter.directory_id in ("", directory_id)

    def directory_of(self, replica_id: int) -> str:
        voter = self.get(replica_id)
        return voter.directory_id if voter is not None else ""

    def with_voter(self, voter: Voter) -> VoterSet:
        return VoterSet(tuple(v for v in self.voters if v.replica_id != voter.replica_id) + (voter,))

    def without(self, replica_id: int) -> VoterSet:
        return VoterSet(tuple(v for v in self.voters if v.replica_id != replica_id))

    def encode(self) -> bytes:
        """The voters control record."""
        return encode_control_record(
            CONTROL_VOTERS, kraft_version=KRAFT_VERSION,
            voters=[[v.replica_id, v.directory_id, v.endpoint, v.http_url] for v in self.voters])

    @classmethod
    def decode(cls, record: bytes) -> VoterSet:
        """A voters control record; ValueError when it is not a well-formed one."""
        value = decode_control_record(record)
        voters = value.get("voters")
        if value.get("type") != CONTROL_VOTERS or type(voters) is not list or not voters:
            raise ValueError("not a voters record")
        decoded = []
        for item in voters:
            if (type(item) is not list or len(item) != 4 or type(item[0]) is not int or item[0] < 0
                    or not all(type(text) is str for text in item[1:]) or not is_directory_id(item[1])):
                raise ValueError(f"bad voter in a voters record: {item!r}")
            decoded.append(Voter(item[0], item[1], item[2], item[3]))
        return cls(tuple(decoded))


def kraft_version_record() -> bytes:
    return encode_control_record(CONTROL_KRAFT_VERSION, kraft_version=KRAFT_VERSION)


def bootstrap_batch(voters: VoterSet) -> Batch:
    """What formatting a log writes at offset 0 (epoch 0, timestamp 0: every replica formatted
    with the same initial voters holds the same batch): the kraft.version and the first set."""
    return Batch(0, 0, 0, True, (kraft_version_record(), voters.encode()))


def voters_records(batch: Batch) -> list[tuple[int, VoterSet]]:
    """(offset, set) of each voters record in a batch (none in a data batch)."""
    if not batch.control:
        return []
    found = []
    for index, record in enumerate(batch.records):
        try:
            found.append((batch.base_offset + index, VoterSet.decode(record)))
        except Exception:  # noqa: BLE001 - msgpack raises several types; other control records
            continue
    return found


class VoterHistory:
    """Voters records by offset. The set in force at log end ``end`` is the latest one below
    ``end``; ``static`` when there is none."""

    def __init__(self, static: VoterSet) -> None:
        self.static = static
        self._offsets: list[int] = []
        self._sets: list[VoterSet] = []

    @property
    def dynamic(self) -> bool:
        """kraft.version 1: the log (or a snapshot) holds a voters record."""
        return bool(self._offsets)

    def entries(self) -> list[tuple[int, VoterSet]]:
        return list(zip(self._offsets, self._sets, strict=True))

    def add(self, offset: int, voters: VoterSet) -> None:
        """Record a voters record (replacing one at the same offset)."""
        index = bisect.bisect_left(self._offsets, offset)
        if index < len(self._offsets) and self._offsets[index] == offset:
            self._sets[index] = voters
        else:
            self._offsets.insert(index, offset)
            self._sets.insert(index, voters)

    def truncate(self, offset: int) -> None:
        """The log was cut to ``offset``: records at or above it are gone."""
        index = bisect.bisect_left(self._offsets, offset)
        del self._offsets[index:], self._sets[index:]

    def entry_at(self, end: int) -> tuple[int, VoterSet] | None:
        """(offset, set) of the latest voters record below ``end``, or None."""
        index = bisect.bisect_left(self._offsets, end)
        if index == 0:
            return None
        return self._offsets[index - 1], self._sets[index - 1]

    def at(self, end: int) -> VoterSet:
        entry = self.entry_at(end)
        return self.static if entry is None else entry[1]

    def latest_offset(self) -> int:
        return self._offsets[-1] if self._offsets else -1
