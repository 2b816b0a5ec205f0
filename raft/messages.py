"""Raft RPC messages as frozen dataclasses, and their msgpack codec.

Messages are one-way to the core: a response is just another message, routed back to
the sender's address by the runtime (the transport pairs them with correlation ids).
``decode_message`` accepts any bytes and either returns a well-typed message or raises
``MessageDecodeError``; range checks (negative offsets, epochs from the future) are the
core's job, which answers them with ``ErrorCode.INVALID_REQUEST`` or drops them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgpack

from raft.types import Batch, ErrorCode, SnapshotId

NO_LEADER = -1  # leader_id when no leader is known
ANONYMOUS_REPLICA = -1  # replica_id of an observer without an id
NO_EPOCH = -1  # diverging_epoch when the fetch offset is consistent


class MessageDecodeError(ValueError):
    """Bytes that are not a well-formed message."""


@dataclass(frozen=True, slots=True)
class VoteRequest:
    epoch: int  # the candidate's epoch; for a pre-vote, the epoch it would campaign in
    candidate_id: int
    last_offset_epoch: int  # epoch of the candidate's last log entry
    last_offset: int  # the candidate's log end offset
    pre_vote: bool
    candidate_directory_id: str = ""  # KIP-853: (id, directory id) must be a voter
    voter_directory_id: str = ""  # the receiver as the candidate knows it ("" any)


@dataclass(frozen=True, slots=True)
class VoteResponse:
    error: ErrorCode
    epoch: int  # the responder's epoch
    leader_id: int
    vote_granted: bool
    pre_vote: bool


@dataclass(frozen=True, slots=True)
class BeginQuorumEpochRequest:
    epoch: int
    leader_id: int
    leader_endpoint: str  # the leader's advertised HTTP URL
    voter_directory_id: str = ""  # the receiver as the leader knows it ("" any)


@dataclass(frozen=True, slots=True)
class BeginQuorumEpochResponse:
    error: ErrorCode
    epoch: int
    leader_id: int


@dataclass(frozen=True, slots=True)
class EndQuorumEpochRequest:
    epoch: int
    leader_id: int
    preferred_successors: tuple[int, ...]  # voters ordered by replicated offset, best first


@dataclass(frozen=True, slots=True)
class EndQuorumEpochResponse:
    error: ErrorCode
    epoch: int
    leader_id: int


@dataclass(frozen=True, slots=True)
class FetchRequest:
    epoch: int
    replica_id: int  # ANONYMOUS_REPLICA for an observer without an id
    fetch_offset: int
    last_fetched_epoch: int
    high_watermark: int  # the fetcher's own high watermark
    max_wait_ms: int
    replica_endpoint: str  # the fetcher's advertised HTTP URL ("" when none)
    read_nonce: int = 0  # the latest read_nonce this leader sent the fetcher (0: none)
    # The fetcher's log cleaned_end: above its log end when it holds part of a copy of a
    # leader's cleaned prefix (relative to that end); a leader cleaned less sends a snapshot.
    cleaned_end: int = 0
    replica_directory_id: str = ""  # KIP-853: only (id, directory id) of a voter counts


@dataclass(frozen=True, slots=True)
class FetchResponse:
    error: ErrorCode
    epoch: int
    leader_id: int
    leader_endpoint: str
    fetch_offset: int  # echoes the request, so the fetcher can discard stale responses
    high_watermark: int
    log_start_offset: int
    dirty_offset: int
    tombstone_horizon: int
    records: tuple[Batch, ...]
    diverging_epoch: int  # NO_EPOCH unless the fetcher must truncate
    diverging_end_offset: int  # end offset of diverging_epoch in the leader's log
    snapshot_id: SnapshotId | None  # set when the fetcher must download this snapshot
    read_nonce: int = 0  # leader's read barrier: a Fetch echoing it left the fetcher after
    # the leader sent it, which is what confirms leadership for read_index
    # The leader's log is compacted below this (its cleaned_end): records there lack
    # superseded ops even where no offset is missing, so a fetcher copies them as such.
    cleaned_end: int = 0
    # The leader's setting; a fetcher with another one refuses the answer (it must be
    # equal on every node: docs/compaction.md rule 3).
    tombstone_retention_records: int = 0
    # Echoes the request's last_fetched_epoch: a delayed request at the same offset but from
    # before a truncation gets an answer (e.g. a divergence) that the fetcher's log no longer fits.
    fetch_epoch: int = NO_EPOCH
    # With snapshot_id: the latest voters record below the snapshot's end (offset, record),
    # so the fetcher knows the set in force there once its log starts at that end.
    snapshot_voters_offset: int = -1
    snapshot_voters: bytes = b""


@dataclass(frozen=True, slots=True)
class FetchSnapshotRequest:
    epoch: int
    replica_id: int
    snapshot_id: SnapshotId
    position: int
    max_bytes: int
    replica_directory_id: str = ""


@dataclass(frozen=True, slots=True)
class FetchSnapshotResponse:
    error: ErrorCode
    epoch: int
    leader_id: int
    snapshot_id: SnapshotId
    size: int  # total size of the snapshot in bytes
    position: int
    chunk: bytes


@dataclass(frozen=True, slots=True)
class DescribeQuorumRequest:
    pass


@dataclass(frozen=True, slots=True)
class ReplicaState:
    replica_id: int
    endpoint: str
    log_end_offset: int
    last_fetch_timestamp_ms: int
    last_caught_up_timestamp_ms: int
    directory_id: str = ""  # KIP-853: as the replica's latest Fetch named it


@dataclass(frozen=True, slots=True)
class DescribeQuorumResponse:
    error: ErrorCode
    epoch: int
    leader_id: int
    high_watermark: int
    voters: tuple[ReplicaState, ...]
    observers: tuple[ReplicaState, ...]


Message = (
    VoteRequest
    | VoteResponse
    | BeginQuorumEpochRequest
    | BeginQuorumEpochResponse
    | EndQuorumEpochRequest
    | EndQuorumEpochResponse
    | FetchRequest
    | FetchResponse
    | FetchSnapshotRequest
    | FetchSnapshotResponse
    | DescribeQuorumRequest
    | DescribeQuorumResponse
)


@dataclass(frozen=True, slots=True)
class Envelope:
    """A message in flight: ``src`` and ``dst`` are node ids (transport addresses)."""

    src: int
    dst: int
    message: Message


# ---------------------------------------------------------------------------
# Codec: [type_id, field, field, ...] as msgpack, every field type-checked on decode.

_TYPE_IDS: dict[type, int] = {
    VoteRequest: 1,
    VoteResponse: 2,
    BeginQuorumEpochRequest: 3,
    BeginQuorumEpochResponse: 4,
    EndQuorumEpochRequest: 5,
    EndQuorumEpochResponse: 6,
    FetchRequest: 7,
    FetchResponse: 8,
    FetchSnapshotRequest: 9,
    FetchSnapshotResponse: 10,
    DescribeQuorumRequest: 11,
    DescribeQuorumResponse: 12,
}
_TYPES_BY_ID = {type_id: cls for cls, type_id in _TYPE_IDS.items()}

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


_PLAIN_WIRE_TYPES = frozenset((int, str, bool, bytes, type(None)))


def _to_wire(value: Any) -> Any:
    if type(value) in _PLAIN_WIRE_TYPES:  # most fields: no conversion (checked first, it is per field)
        return value
    if isinstance(value, Batch):
        return [value.base_offset, value.epoch, value.timestamp_ms, value.control, list(value.records)]
    if isinstance(value, SnapshotId):
        return [value.end_offset, value.epoch]
    if isinstance(value, ReplicaState):
        return [_to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, tuple):
        return [_to_wire(item) for item in value]
    if isinstance(value, ErrorCode):
        return int(value)
    return value


def encode_message(message: Message) -> bytes:
    cls = type(message)
    fields = [_to_wire(getattr(message, name)) for name in _FIELD_NAMES[cls]]
    return msgpack.packb([_TYPE_IDS[cls], *fields], use_bin_type=True)


def _int(value: Any, name: str) -> int:
    if type(value) is not int or not INT64_MIN <= value <= INT64_MAX:
        raise MessageDecodeError(f"{name}: expected a 64-bit integer")
    return value


def _bool(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise MessageDecodeError(f"{name}: expected a boolean")
    return value


def _str(value: Any, name: str) -> str:
    if type(value) is not str:
        raise MessageDecodeError(f"{name}: expected a string")
    return value


def _bytes(value: Any, name: str) -> bytes:
    if type(value) is not bytes:
        raise MessageDecodeError(f"{name}: expected bytes")
    return value


def _list(value: Any, name: str, length: int | None = None) -> list[Any]:
    if type(value) is not list or (length is not None and len(value) != length):
        raise MessageDecodeError(f"{name}: expected a list" + (f" of {length}" if length else ""))
    return value


def _error(value: Any, name: str) -> ErrorCode:
    try:
        return ErrorCode(_int(value, name))
    except ValueError as exc:
        raise MessageDecodeError(f"{name}: unknown error code {value}") from exc


def _snapshot_id(value: Any, name: str) -> SnapshotId:
    end_offset, epoch = _list(value, name, 2)
    return SnapshotId(_int(end_offset, name), _int(epoch, name))


def _optional_snapshot_id(value: Any, name: str) -> SnapshotId | None:
    return None if value is None else _snapshot_id(value, name)


def _batch(value: Any, name: str) -> Batch:
    base_offset, epoch, timestamp_ms, control, records = _list(value, name, 5)
    return Batch(
        _int(base_offset, name),
        _int(epoch, name),
        _int(timestamp_ms, name),
        _bool(control, name),
        tuple(_bytes(record, name) for record in _list(records, name)),
    )


def _replica_state(value: Any, name: str) -> ReplicaState:
    replica_id, endpoint, end_offset, last_fetch, last_caught_up, directory_id = _list(value, name, 6)
    return ReplicaState(
        _int(replica_id, name), _str(endpoint, name), _int(end_offset, name),
        _int(last_fetch, name), _int(last_caught_up, name), _str(directory_id, name),
    )


def _tuple_of(item_decoder: Any) -> Any:
    def decode(value: Any, name: str) -> tuple[Any, ...]:
        return tuple(item_decoder(item, name) for item in _list(value, name))
    return decode


_DECODERS: dict[str, Any] = {
    "int": _int,
    "bool": _bool,
    "str": _str,
    "bytes": _bytes,
    "ErrorCode": _error,
    "SnapshotId": _snapshot_id,
    "SnapshotId | None": _optional_snapshot_id,
    "tuple[int, ...]": _tuple_of(_int),
    "tuple[Batch, ...]": _tuple_of(_batch),
    "tuple[ReplicaState, ...]": _tuple_of(_replica_state),
}

# Per message class, computed once (encoding and decoding run for every raft message):
# field names in wire order, and (name, decoder, name used in errors) per field.
_FIELD_NAMES: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _TYPE_IDS
}
_FIELD_DECODERS: dict[type, list[tuple[str, Any, str]]] = {
    cls: [(f.name, _DECODERS[f.type], f"{cls.__name__}.{f.name}") for f in dataclasses.fields(cls)]
    for cls in _TYPE_IDS
}


def decode_message(data: bytes) -> Message:
    """Decode bytes from the wire; any malformation raises ``MessageDecodeError``."""
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise MessageDecodeError(f"not msgpack: {exc}") from exc
    if type(value) is not list or not value:
        raise MessageDecodeError("expected a non-empty list")
    cls = _TYPES_BY_ID.get(value[0]) if type(value[0]) is int else None
    if cls is None:
        raise MessageDecodeError(f"unknown message type {value[0]!r}")
    decoders = _FIELD_DECODERS[cls]
    if len(value) - 1 != len(decoders):
        raise MessageDecodeError(f"{cls.__name__}: expected {len(decoders)} fields")
    kwargs = {name: decode(item, where) for (name, decode, where), item in zip(decoders, value[1:], strict=True)}
    return cls(**kwargs)


MESSAGE_TYPES: tuple[type, ...] = tuple(_TYPE_IDS)
