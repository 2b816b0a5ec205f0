"""The application records metakv writes into the log: one ``Command`` per record.

Every write is a command of compares plus success and failure operations (a plain PUT is a
command with no compares and one put). Conditions are evaluated by the state machine at
apply time, deterministically, so every replica reaches the same outcome. Encoding:

    [COMMAND_VERSION, [[key, compare_kind, target], ...], [op, ...], [op, ...]]
    op = [op_kind, key, value (bytes), content_type (str)]
    op = [op_kind, key, value, content_type, create_version]   (cleaned PUT, see below)
    op = [op_kind, key, value, content_type, create_version, lease(, key_version)]

Trailing op fields are written only up to the last one that is not its default (0), so
records without them keep the 4- or 5-element form; the decoder accepts 4 to 7 elements.
``lease`` (a PUT's lease id, see docs/leases.md) attaches the key to that lease; a DELETE
whose content_type is a LEASE_DELETE_REASONS member was written by a lease's revoke or
expiry and the reason shows in watch events.

The cleaner (storage/cleaner.py) rewrites a key's newest record into an unconditional PUT
that carries the key's ``create_version``, so that a replica replaying the cleaned log
reaches exactly the rows of a replica that applied the original records.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgpack

COMMAND_VERSION = 1
DEFAULT_CONTENT_TYPE = "application/octet-stream"
# Leases live under this key prefix, which clients cannot write or read (keys hold no NUL):
# one key per lease, its value the TTL, its create_version the version that granted it.
LEASE_KEY_PREFIX = "\x00lease/"
LEASE_EXPIRED = "lease-expired"
LEASE_REVOKED = "lease-revoked"
LEASE_DELETE_REASONS = frozenset((LEASE_EXPIRED, LEASE_REVOKED))
MAX_OP_FIELDS = 7  # [kind, key, value, content_type, create_version, lease, key_version]


def lease_key(lease_id: int) -> str:
    """The internal key that holds lease ``lease_id`` (zero-padded: keys sort by id)."""
    return f"{LEASE_KEY_PREFIX}{lease_id:020d}"


def is_internal_key(key: str) -> bool:
    """Keys clients never see: they start with NUL (leases)."""
    return key.startswith("\x00")


class CommandDecodeError(ValueError):
    """A log record that is not a command of a version this code understands."""


class CompareKind(enum.IntEnum):
    MOD_VERSION = 1  # the key's mod_version equals target (int); a missing key has mod_version 0
    EXISTS = 2  # the key exists == target (bool)
    VALUE = 3  # the key exists and its value equals target (bytes)


class OpKind(enum.IntEnum):
    PUT = 1
    DELETE = 2
    GET = 3  # reads inside a txn; results come back in the apply result


@dataclass(frozen=True, slots=True)
class Compare:
    key: str
    kind: CompareKind
    target: int | bool | bytes


@dataclass(frozen=True, slots=True)
class Op:
    kind: OpKind
    key: str
    value: bytes = b""
    content_type: str = DEFAULT_CONTENT_TYPE
    create_version: int = 0  # set only by the cleaner: the key's create_version to restore
    lease: int = 0  # a PUT's lease id (0: none; the put detaches the key from any lease)


@dataclass(frozen=True, slots=True)
class Command:
    compare: tuple[Compare, ...]
    success: tuple[Op, ...]
    failure: tuple[Op, ...] = ()


def put(key: str, value: bytes, content_type: str = DEFAULT_CONTENT_TYPE, compare: tuple[Compare, ...] = ()) -> Command:
    return Command(compare, (Op(OpKind.PUT, key, value, content_type),))


def delete(key: str, compare: tuple[Compare, ...] = ()) -> Command:
    return Command(compare, (Op(OpKind.DELETE, key),))


def encode_command(command: Command) -> bytes:
    return msgpack.packb(
        [
            COMMAND_VERSION,
            [[c.key, int(c.kind), c.target] for c in command.compare],
            [_encode_op(o) for o in command.success],
            [_encode_op(o) for o in command.failure],
        ],
        use_bin_type=True,
    )


def _encode_op(op: Op) -> list[object]:
    encoded: list[object] = [int(op.kind), op.key, op.value, op.content_type]
    if op.create_version or op.lease:
        encoded.append(op.create_version)
    if op.lease:
        encoded.append(op.lease)
    return encoded


_TARGET_TYPES = {CompareKind.MOD_VERSION: int, CompareKind.EXISTS: bool, CompareKind.VALUE: bytes}
_OP_KINDS = {int(kind): kind for kind in OpKind}

# Raw (validated) command parts: what decode_command_parts returns. Readers that only need
# the fields (the pipeline decodes millions of records) skip building the dataclasses.
RawCompare = list  # [key: str, kind: int (a CompareKind value), target]
RawOp = list  # [kind: int (an OpKind value), key: str, value: bytes, content_type: str(, create_version, lease, key_version: int)]


def _check_compare(item: object) -> None:
    if type(item) is not list or len(item) != 3 or type(item[0]) is not str:
        raise CommandDecodeError("malformed compare")
    try:
        kind = CompareKind(item[1])
    except ValueError as exc:
        raise CommandDecodeError(f"unknown compare kind {item[1]!r}") from exc
    if type(item[2]) is not _TARGET_TYPES[kind]:
        raise CommandDecodeError(f"compare target of wrong type for {kind.name}")


def _check_op(item: object) -> None:
    if (type(item) is not list or not 4 <= len(item) <= MAX_OP_FIELDS or type(item[1]) is not str
            or type(item[2]) is not bytes or type(item[3]) is not str):
        raise CommandDecodeError("malformed op")
    for number in item[4:]:
        if type(number) is not int or number < 0:
            raise CommandDecodeError("malformed op create_version, lease or key_version")
    create_version = item[4] if len(item) > 4 else 0
    lease = item[5] if len(item) > 5 else 0
    kind = _OP_KINDS.get(item[0]) if type(item[0]) is int else None
    if kind is None:
        try:
            kind = OpKind(item[0])
        except ValueError as exc:
            raise CommandDecodeError(f"unknown op kind {item[0]!r}") from exc
    if (create_version or lease) and kind != OpKind.PUT:
        raise CommandDecodeError("create_version or lease on an op that is not a put")


def decode_command_parts(record: bytes) -> tuple[list[RawCompare], list[RawOp], list[RawOp]]:
    """The command's compares, success ops and failure ops as the plain lists msgpack gave,
    after exactly the checks decode_command makes (same errors). Why: building a Command of
    frozen dataclasses costs more than decoding the bytes, and bulk readers need only fields."""
    try:
        value = msgpack.unpackb(record, raw=False)
    except Exception as exc:
        raise CommandDecodeError(f"not msgpack: {exc}") from exc
    if type(value) is not list or len(value) != 4 or type(value[0]) is not int:
        raise CommandDecodeError("not a command")
    if value[0] != COMMAND_VERSION:
        raise CommandDecodeError(f"unknown command version {value[0]}")
    compares, success, failure = value[1], value[2], value[3]
    if type(compares) is not list or type(success) is not list or type(failure) is not list:
        raise CommandDecodeError("malformed command")
    for item in compares:
        _check_compare(item)
    for item in success:
        _check_op(item)
    for item in failure:
        _check_op(item)
    return compares, success, failure


def _compare(item: RawCompare) -> Compare:
    return Compare(item[0], CompareKind(item[1]), item[2])


def _op(item: RawOp) -> Op:
    return Op(OpKind(item[0]), item[1], item[2], item[3], item[4] if len(item) > 4 else 0,
              item[5] if len(item) > 5 else 0)


def decode_command(record: bytes) -> Command:
    compares, success, failure = decode_command_parts(record)
    return Command(tuple(_compare(c) for c in compares), tuple(_op(o) for o in success),
                   tuple(_op(o) for o in failure))
