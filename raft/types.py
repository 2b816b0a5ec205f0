"""Plain values shared by the core, storage and the transport: batches, snapshot ids, errors."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgpack


class ProtocolInvariantError(Exception):
    """An internal invariant was broken; unlike ``assert`` this survives ``python -O``."""


def check(condition: bool, message: str) -> None:
    """Check an invariant; raise ``ProtocolInvariantError`` when it does not hold."""
    if not condition:
        raise ProtocolInvariantError(message)


class ErrorCode(enum.IntEnum):
    """Error codes with KRaft's meanings (Kafka protocol error names)."""

    NONE = 0
    FENCED_LEADER_EPOCH = 1  # the request's epoch is below the receiver's
    UNKNOWN_LEADER_EPOCH = 2  # the request's epoch is above the receiver's
    NOT_LEADER_OR_FOLLOWER = 3  # the receiver is not the leader it was taken for
    INVALID_REQUEST = 4  # malformed or out-of-range fields
    SNAPSHOT_NOT_FOUND = 5  # the named snapshot does not exist (any more)
    POSITION_OUT_OF_RANGE = 6  # a snapshot position past its end
    INCONSISTENT_VOTER_SET = 7  # the sender is not a voter of this quorum
    INCONSISTENT_CLUSTER_ID = 8  # the sender belongs to another cluster


# Batch.size_bytes() accounting, shared by the leader's max_batch_bytes check and the
# runtime's: the codec's batch header (storage/batch_codec.py HEADER_BYTES) and the largest
# msgpack length prefix of one record (bin 32). tests/raft/test_batch_overhead.py checks both.
BATCH_OVERHEAD_BYTES = 34
RECORD_OVERHEAD_BYTES = 5


@dataclass(frozen=True, slots=True)
class SnapshotId:
    """A snapshot covers offsets below ``end_offset``; ``epoch`` is the epoch of offset end_offset - 1."""

    end_offset: int
    epoch: int


@dataclass(frozen=True, slots=True)
class Batch:
    """One log batch: ``records`` occupy offsets base_offset .. base_offset + len(records) - 1.

    Records are opaque bytes to the core, except in control batches (``control=True``),
    whose records are encoded by ``encode_control_record``.
    """

    base_offset: int
    epoch: int
    timestamp_ms: int
    control: bool
    records: tuple[bytes, ...]

    @property
    def next_offset(self) -> int:
        """The offset just past this batch's last record."""
        return self.base_offset + len(self.records)

    @property
    def last_offset(self) -> int:
        return self.base_offset + len(self.records) - 1

    def size_bytes(self) -> int:
        """Approximate encoded size, used for max_batch_bytes accounting."""
        return BATCH_OVERHEAD_BYTES + sum(len(record) + RECORD_OVERHEAD_BYTES for record in self.records)


# Control records: what the core itself writes into the log.
CONTROL_LEADER_CHANGE = "leader_change"
CONTROL_VOTERS = "voters"  # the voter set from this offset on (raft/voters.py, KIP-853)
CONTROL_KRAFT_VERSION = "kraft_version"  # 1: the log holds voters records


def encode_control_record(kind: str, **fields: object) -> bytes:
    """Encode a control record (e.g. leader_change with leader_id and voters)."""
    return msgpack.packb({"type": kind, **fields}, use_bin_type=True)


def decode_control_record(record: bytes) -> dict[str, object]:
    value = msgpack.unpackb(record, raw=False)
    if not isinstance(value, dict) or "type" not in value:
        raise ValueError("not a control record")
    return value
