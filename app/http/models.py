"""The request and response bodies of the HTTP API as pydantic models, so that
/openapi.json describes every body, and the txn body is validated exactly as documented."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
)
from pydantic_core import PydanticCustomError

from app.http.settings import CONTENT_TYPE_MAX_BYTES, KEY_MAX_BYTES, MAX_VERSION, TXN_MAX_OPS
from app.service import DEFAULT_CONTENT_TYPE, MAX_LEASE_ID

KEY_TOO_LARGE_ERROR = "key_too_large"  # the pydantic error type the txn route answers 413 for


def _check_key_text(key: str) -> str:
    """A txn key's rules, in bytes as the key routes count them. Too long is its own error
    type (not a ValueError, which pydantic reports as any other 422) so that the txn route
    answers 413 ``key-too-large`` for it, as the key routes do for the same key."""
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("key is not valid UTF-8") from exc
    if not encoded:
        raise ValueError(f"key must be 1-{KEY_MAX_BYTES} bytes of UTF-8")
    if len(encoded) > KEY_MAX_BYTES:
        raise PydanticCustomError(KEY_TOO_LARGE_ERROR, "the key is {size} bytes; at most {limit} are allowed",
                                  {"size": len(encoded), "limit": KEY_MAX_BYTES})
    if b"\x00" in encoded:
        raise ValueError("key must not contain NUL")
    return key


NO_NUL_PATTERN = r"^[^\x00]*$"
BASE64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
# An RFC 9110 media type (type/subtype; name=value or name="quoted"): it is sent back as the
# Content-Type of GET, so it must be one a client can parse.
CONTENT_TYPE_PATTERN = (rf'^{_TOKEN}/{_TOKEN}([ \t]*;[ \t]*{_TOKEN}=({_TOKEN}|"[\x20\x21\x23-\x5b\x5d-\x7e]*"))*$')
CONTENT_TYPE_RE = re.compile(CONTENT_TYPE_PATTERN)

# maxLength is documented, not validated as characters: _check_key_text counts bytes (413).
Key = Annotated[str, Field(min_length=1, pattern=NO_NUL_PATTERN, json_schema_extra={"maxLength": KEY_MAX_BYTES},
                           description="UTF-8, 1-1024 bytes, no NUL"), AfterValidator(_check_key_text)]
ContentType = Annotated[str, Field(min_length=1, max_length=CONTENT_TYPE_MAX_BYTES, pattern=CONTENT_TYPE_PATTERN)]
Base64Text = Annotated[str, Field(pattern=BASE64_PATTERN, description="standard base64 with padding")]


def _version_number(value: Any) -> Any:
    """JSON integers only (1.0 counts, as JSON Schema says), never booleans or strings."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("must be an integer")
        return int(value)
    return value


VersionNumber = Annotated[int, Field(ge=0, le=MAX_VERSION), BeforeValidator(_version_number)]
JsonInteger = Annotated[int, BeforeValidator(_version_number)]  # any JSON integer (1.0 counts)
LeaseId = Annotated[int, Field(ge=0, le=MAX_LEASE_ID, description="attach the key to this lease (0: none; "
                               "docs/leases.md)"), BeforeValidator(_version_number)]
PositiveLeaseId = Annotated[int, Field(ge=1, le=MAX_LEASE_ID), BeforeValidator(_version_number)]


def utf8_bytes(value: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("value is not valid UTF-8") from exc


def _check_utf8(value: str) -> str:
    utf8_bytes(value)
    return value


Utf8Text = Annotated[str, AfterValidator(_check_utf8)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CompareModVersion(_Strict):
    """True when the key's mod_version equals this (0 = the key does not exist)."""

    key: Key
    mod_version: VersionNumber


class CompareExists(_Strict):
    """True when the key exists (or, with false, does not)."""

    key: Key
    exists: StrictBool


class CompareValue(_Strict):
    """True when the key exists and its value (UTF-8 text) equals this."""

    key: Key
    value: Utf8Text
    encoding: Literal["utf-8"] = "utf-8"


class CompareValueBase64(_Strict):
    """True when the key exists and its value equals these base64-encoded bytes."""

    key: Key
    value: Base64Text
    encoding: Literal["base64"]


class PutOp(_Strict):
    """Put a UTF-8 text value."""

    op: Literal["put"]
    key: Key
    value: Utf8Text = ""
    encoding: Literal["utf-8"] = "utf-8"
    content_type: ContentType = DEFAULT_CONTENT_TYPE
    lease: LeaseId = 0


class PutBase64Op(_Strict):
    """Put a binary value, sent as base64."""

    op: Literal["put"]
    key: Key
    value: Base64Text
    encoding: Literal["base64"]
    content_type: ContentType = DEFAULT_CONTENT_TYPE
    lease: LeaseId = 0


class DeleteOp(_Strict):
    op: Literal["delete"]
    key: Key


class GetOp(_Strict):
    op: Literal["get"]
    key: Key


def _op_tag(value: Any) -> str | None:
    """Which op model a txn op is: by ``op``, and for puts by ``encoding``."""
    if isinstance(value, dict):
        op, encoding = value.get("op"), value.get("encoding")
    else:
        op, encoding = getattr(value, "op", None), getattr(value, "encoding", None)
    if op == "put" and encoding == "base64":
        return "put_base64"
    return op if isinstance(op, str) else None


TxnOp = Annotated[
    Annotated[PutOp, Tag("put")] | Annotated[PutBase64Op, Tag("put_base64")]
    | Annotated[DeleteOp, Tag("delete")] | Annotated[GetOp, Tag("get")],
    Discriminator(_op_tag),
]
TxnCompare = CompareModVersion | CompareExists | CompareValue | CompareValueBase64


class TxnRequest(_Strict):
    """All compares true: the success ops run, else the failure ops; one log record either way."""

    compare: list[TxnCompare] = Field(default_factory=list, max_length=TXN_MAX_OPS)
    success: list[TxnOp] = Field(default_factory=list, max_length=TXN_MAX_OPS)
    failure: list[TxnOp] = Field(default_factory=list, max_length=TXN_MAX_OPS)


class WriteResult(BaseModel):
    key: str
    version: int = Field(description="the metadata version this write produced")
    created: bool


class DeleteResult(BaseModel):
    key: str
    version: int = Field(description="the metadata version this delete produced")
    deleted: bool = Field(description="false when the key did not exist")


class ListItem(BaseModel):
    key: str
    value: str | None = Field(None, description="absent with keys_only=true")
    encoding: Literal["base64"] | None = Field(None, description="present when value is base64 (non-textual content)")
    content_type: str
    mod_version: int
    create_version: int
    key_version: int = Field(description="changes since the key was created (etcd's version): 1 on create")
    lease: int | None = Field(None, description="the lease the key is attached to (absent: none)")


class ListResponse(BaseModel):
    version: int = Field(description="every item is as of this version")
    items: list[ListItem]
    next: str | None = Field(description="pass as after= for the next page; null at the end")


class TxnOpResult(BaseModel):
    op: Literal["put", "delete", "get"]
    key: str
    created: bool | None = Field(None, description="put: the key did not exist before")
    deleted: bool | None = Field(None, description="delete: the key existed")
    found: bool | None = Field(None, description="get: the key exists")
    value: str | None = None
    encoding: Literal["base64"] | None = None
    content_type: str | None = None
    mod_version: int | None = None
    create_version: int | None = None
    key_version: int | None = None
    lease: int | None = None


class FailedCompare(BaseModel):
    key: str
    current_version: int = Field(description="the key's mod_version when the txn applied (0: missing)")


class TxnResponse(BaseModel):
    succeeded: bool
    version: int
    results: list[TxnOpResult]
    failed_compares: list[FailedCompare] = Field(default_factory=list)


class WatchEvent(BaseModel):
    type: Literal["put", "delete"]
    key: str
    mod_version: int
    value: str | None = Field(None, description="put only")
    encoding: Literal["base64"] | None = None
    content_type: str | None = None
    reason: Literal["lease-expired", "lease-revoked"] | None = Field(
        None, description="delete only: the key went with its lease (absent: an ordinary delete)")


class WatchResponse(BaseModel):
    version: int = Field(description="pass as since= to continue without gaps")
    events: list[WatchEvent]


class SnapshotIdModel(BaseModel):
    end_offset: int
    epoch: int


class StatusResponse(BaseModel):
    """The node's own view (KVService.status). Fields are documented, not required: the
    runtime may add or leave out fields without this layer turning its answer into a 500."""

    model_config = ConfigDict(extra="allow")

    node_id: int | None = None
    role: str | None = Field(None, description="unattached, prospective, candidate, leader, follower, resigned")
    voter: bool | None = None
    epoch: int | None = None
    leader_id: int | None = Field(None, description="-1 when unknown")
    leader_url: str | None = None
    log_start_offset: int | None = None
    log_end_offset: int | None = None
    flushed_offset: int | None = None
    high_watermark: int | None = None
    applied_version: int | None = None
    dirty_offset: int | None = None
    tombstone_horizon: int | None = None
    snapshot_id: SnapshotIdModel | None = None
    last_contact_ms: int | None = None
    ready: bool | None = None
    advertise_http: str | None = None
    directory_id: str | None = Field(None, description="this data directory's id (identity.json)")
    raft_endpoint: str | None = Field(None, description="HOST:PORT, as a voters record names this node")
    voter_set: VoterSetResponse | None = Field(None, description="the set in force in this node's log")


class VoterModel(BaseModel):
    node_id: int
    directory_id: str = Field(description='"" in a static (--voters) set')
    raft_endpoint: str
    http_url: str


class PendingVoterChangeModel(BaseModel):
    offset: int = Field(description="the uncommitted voters record's offset")
    action: str = Field(description="add or remove")
    node_id: int


class VoterSetResponse(BaseModel):
    """The set in force (KVService.add_voter / remove_voter, and in /v1/status and /v1/quorum)."""

    kraft_version: int = Field(description="0: a static --voters set (no changes); 1: voters records")
    voters: list[VoterModel]
    pending_change: PendingVoterChangeModel | None = None


class ReplicaState(BaseModel):
    model_config = ConfigDict(extra="allow")

    node_id: int | None = None
    endpoint: str | None = Field(None, description="the replica's advertised HTTP URL")
    log_end_offset: int | None = None
    lag: int | None = Field(None, description="high watermark minus the replica's log end offset")
    last_fetch_timestamp_ms: int | None = Field(None, description="wall clock, ms since the epoch")
    last_caught_up_timestamp_ms: int | None = Field(None, description="wall clock, ms since the epoch")
    directory_id: str | None = Field(None, description="its data directory's id, as its Fetches name it")
    caught_up: bool | None = Field(None, description="observers: the leader would add it as a voter now")


class QuorumResponse(BaseModel):
    """The leader's view of every voter and observer (KVService.quorum)."""

    model_config = ConfigDict(extra="allow")

    epoch: int | None = None
    leader_id: int | None = None
    high_watermark: int | None = None
    voters: list[ReplicaState] | None = None
    observers: list[ReplicaState] | None = None
    voter_set: VoterSetResponse | None = Field(None, description="the set in force and any uncommitted change")


class AdminResponse(BaseModel):
    """What the admin action reports (KVService.take_snapshot / compact / resign)."""

    model_config = ConfigDict(extra="allow")

    snapshot_id: SnapshotIdModel | None = Field(None, description="snapshot: the snapshot taken")
    resigned: bool | None = Field(None, description="resign: the leader stepped down")
    epoch: int | None = Field(None, description="resign: the epoch it led")


class HealthResponse(BaseModel):
    status: Literal["ok"]


class ReadyResponse(BaseModel):
    ready: bool

