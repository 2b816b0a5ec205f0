"""metakv's HTTP face: FastAPI routes that translate shared/API.md to ``KVService`` calls.

Routes are thin on purpose: they parse and bound the request, call the service (which owns
every protocol decision: leadership, readiness, commit), and map results and exceptions to
statuses. Everything a fuzzer can reach is declared in the OpenAPI document, including every
problem status, so that ``/openapi.json`` is a complete description of the behaviour.

Cross-cutting rules live in one ASGI layer (``_EdgeMiddleware``): the node headers on every
response, requests-by-route-and-status counters and the latency histogram, and the last-resort
500 problem document for an exception nobody expected (logged, never echoed to the client).
"""

from __future__ import annotations

import base64
import inspect
import json
import logging
import math
import re
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_type_hints
from urllib.parse import parse_qsl, unquote_to_bytes

import orjson
from fastapi import APIRouter, FastAPI, Header, Path, Query, Request, params
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    TypeAdapter,
    ValidationError,
)
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.auth import install_auth
from app.service import (
    Consistency,
    IndeterminateError,
    KVService,
    NotLeaderError,
    NotReadyError,
    SnapshotStorageError,
    VersionWaitTimeoutError,
    WriteRejectedError,
    WriteTooLargeError,
)
from raft.types import check
from storage.commands import (
    DEFAULT_CONTENT_TYPE,
    Command,
    Compare,
    CompareKind,
    Op,
    OpKind,
    delete,
    put,
)
from storage.state_machine import VersionCompactedError, VersionNotAppliedError

log = logging.getLogger("metakv.http")

KEY_MAX_BYTES = 1024
MAX_VERSION = 2**63 - 1  # versions are SQLite INTEGERs
VERSION_TEXT_PATTERN = re.compile(r"[0-9]{1,19}")
CONTENT_TYPE_MAX_BYTES = 256
DEFAULT_MAX_VALUE_BYTES = 1024 * 1024
DEFAULT_MAX_TXN_BODY_BYTES = 8 * 1024 * 1024  # JSON (and base64) overhead over a few values
TXN_MAX_OPS = 128  # per branch, and compares per txn
LIST_LIMIT_DEFAULT = 100
LIST_LIMIT_MAX = 1000
WATCH_EVENTS_MAX = 1000  # events per long-poll answer or per SSE read
DEFAULT_WAIT_MS = 5000
DEFAULT_WATCH_TIMEOUT_MS = 30_000
RETRY_AFTER_SECONDS = 1
EDGE_LABEL_CACHE_MAX = 1024  # labelled metric children an edge layer keeps at hand
WAIT_EARLY_RETURN_S = 0.005  # a change wait ending this long before its deadline was cut short
PROBLEM_MEDIA_TYPE = "application/problem+json"
KEY_PATH_PREFIX = "/v1/kv/"  # every path under it is a key route (_KeyRoutes)
KEY_PATH_PREFIX_BYTES = KEY_PATH_PREFIX.encode()
KEY_ROUTE_TEMPLATE = "/v1/kv/{key:path}"  # the route label of the key routes in metrics
PROBLEM_TYPE_PREFIX = "urn:metakv:problem:"
LATENCY_BUCKETS_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Content types whose values the list and watch routes render as JSON strings.
_TEXTUAL_TYPES = frozenset({
    "application/json", "application/xml", "application/javascript", "application/yaml",
    "application/x-yaml", "application/toml", "application/x-www-form-urlencoded",
    "application/x-ndjson",
})


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Bounds of the HTTP layer. Waits above the maxima are clamped, not refused, the way
    long-poll APIs (Consul's ``wait``) behave, so a client asking too much still gets an answer."""

    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    max_txn_body_bytes: int = DEFAULT_MAX_TXN_BODY_BYTES
    max_wait_ms: int = 60_000  # min_version waits
    max_watch_timeout_ms: int = 300_000  # watch long-polls and SSE stream lifetime
    sse_keepalive_ms: int = 15_000  # comment lines that keep idle proxies from closing streams
    watch_events_max: int = WATCH_EVENTS_MAX  # events per long-poll answer or per SSE read

    def __post_init__(self) -> None:
        for name in ("max_value_bytes", "max_txn_body_bytes", "max_wait_ms", "max_watch_timeout_ms"):
            check(getattr(self, name) >= 0, f"HttpSettings.{name} must be >= 0")
        # A zero keepalive would make an idle SSE stream a busy loop.
        check(self.sse_keepalive_ms > 0, "HttpSettings.sse_keepalive_ms must be > 0")
        check(0 < self.watch_events_max <= WATCH_EVENTS_MAX, f"HttpSettings.watch_events_max must be in 1..{WATCH_EVENTS_MAX}")


# --------------------------------------------------------------------------------------------
# Problem documents


class Problem(BaseModel):
    """RFC 9457 problem document; extra members are present only where they apply."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    leader: int | None = Field(None, description="leader's node id (307 redirects)")
    leader_url: str | None = Field(None, description="leader's advertised HTTP URL")
    current_version: int | None = Field(None, description="412: the key's mod_version; 504: this node's applied version")
    oldest_version: int | None = Field(None, description="410: the oldest version still readable")
    indeterminate: bool | None = Field(None, description="504: the write may or may not have happened")
    errors: list[dict[str, str]] | None = Field(None, description="400: what was wrong with which parameter")


class ProblemError(Exception):
    """Raised by routes for a 4xx/5xx they decide themselves (bad key, size, failed condition)."""

    def __init__(self, status: int, slug: str, title: str, detail: str,
                 headers: dict[str, str] | None = None, **extras: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.slug = slug
        self.title = title
        self.detail = detail
        self.headers = headers or {}
        self.extras = extras


def _problem_body(status: int, slug: str, title: str, detail: str, extras: dict[str, Any]) -> bytes:
    document = {"type": PROBLEM_TYPE_PREFIX + slug, "title": title, "status": status, "detail": detail}
    document.update({name: value for name, value in extras.items() if value is not None})
    return json.dumps(document, separators=(",", ":")).encode()


@dataclass(slots=True)
class _Answer:
    """A response as its two ASGI messages carry it: what the key routes send directly, and
    what every problem document is rendered to (FastAPI's routes wrap it in a Response)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    async def send(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def _problem_answer(problem: ProblemError, head: bool) -> _Answer:
    """The problem document of ``problem``; a HEAD answer keeps the document's length only."""
    body = _problem_body(problem.status, problem.slug, problem.title, problem.detail, problem.extras)
    headers = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in problem.headers.items()]
    headers.append((b"content-length", str(len(body)).encode()))
    headers.append((b"content-type", PROBLEM_MEDIA_TYPE.encode()))
    return _Answer(problem.status, headers, b"" if head else body)


def _problem_response(request: Request, problem: ProblemError) -> Response:
    answer = _problem_answer(problem, request.method == "HEAD")
    response = Response(answer.body, status_code=answer.status)
    response.raw_headers = answer.headers
    return response


def _not_leader_problem(exc: NotLeaderError, scope: Scope) -> ProblemError:
    """307 to the same path and query on the leader, or 503 when no leader is known."""
    leader = exc.leader_id if exc.leader_id >= 0 else None
    if not exc.leader_url:
        return ProblemError(503, "no-leader", "No leader", "no leader is known right now; retry",
                            headers={"Retry-After": str(RETRY_AFTER_SECONDS)}, leader=leader)
    # Raw bytes of path and query, latin-1 both ways, so the Location repeats them exactly.
    # (httpx's ASGI transport puts the query into raw_path too: cut it there.)
    raw_path: bytes = (scope.get("raw_path") or scope["path"].encode()).split(b"?", 1)[0]
    location = exc.leader_url.rstrip("/") + raw_path.decode("latin-1")
    query: bytes = scope.get("query_string", b"")
    if query:
        location += "?" + query.decode("latin-1")
    return ProblemError(307, "not-leader", "Not the leader",
                        f"this node is not the leader; send the request to {exc.leader_url}",
                        headers={"Location": location}, leader=leader, leader_url=exc.leader_url)


def _as_problem(exc: Exception, scope: Scope) -> ProblemError | None:
    """The problem document a route's exception answers with (shared/API.md); None for an
    exception nobody expected, which the edge turns into a logged 500."""
    retry = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    if isinstance(exc, ProblemError):
        return exc
    if isinstance(exc, NotLeaderError):
        return _not_leader_problem(exc, scope)
    if isinstance(exc, SnapshotStorageError):
        if exc.disk_full:
            return ProblemError(507, "insufficient-storage", "Insufficient storage", str(exc))
        return ProblemError(503, "snapshot-io-error", "Snapshot I/O error", str(exc), headers=retry)
    if isinstance(exc, WriteTooLargeError):
        return ProblemError(413, "write-too-large", "Write too large", str(exc))
    if isinstance(exc, WriteRejectedError):
        return ProblemError(503, "write-rejected", "Write rejected", f"the write did not happen: {exc}", headers=retry)
    if isinstance(exc, IndeterminateError):
        return ProblemError(504, "indeterminate", "Outcome unknown",
                            f"the write may or may not have happened: {exc}", indeterminate=True)
    if isinstance(exc, NotReadyError):
        return ProblemError(503, "not-ready", "Not ready", f"this node cannot serve consistent reads yet: {exc}",
                            headers=retry)
    if isinstance(exc, VersionWaitTimeoutError):
        return ProblemError(504, "version-not-reached", "Version not reached",
                            f"this node is still at version {exc.current_version}",
                            current_version=exc.current_version)
    if isinstance(exc, VersionCompactedError):
        oldest = int(getattr(exc, "oldest_version", 0))
        return ProblemError(410, "version-compacted", "Version compacted",
                            f"versions below {oldest} are no longer retained; re-list, then watch from the list's version",
                            oldest_version=oldest)
    if isinstance(exc, VersionNotAppliedError):
        # wait_readable should have waited for the version; answer as its timeout would.
        current = int(getattr(exc, "applied_version", 0))
        return ProblemError(504, "version-not-reached", "Version not reached",
                            f"this node is still at version {current}", current_version=current)
    return None


def _problem_content() -> dict[str, Any]:
    return {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}


_STATUS_DESCRIPTIONS = {
    307: "not the leader: Location is the same request on the leader's advertised URL",
    400: "invalid key or parameter",
    404: "no such key",
    410: "the requested version is below the oldest retained version (oldest_version)",
    412: "the If-Match / If-None-Match condition failed (current_version)",
    413: "key or value (or body) too large",
    422: "the body is not JSON of the documented schema",
    503: "no leader known, write rejected, or this node is not ready; retry after Retry-After",
    504: "indeterminate write outcome, or min_version not reached within wait_ms",
}


def _problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries of problem statuses, so /openapi.json lists every status."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"description": _STATUS_DESCRIPTIONS[status], "content": _problem_content()}
        if status == 307:
            entry["headers"] = {"Location": {"schema": {"type": "string"}, "description": "the leader's URL for this request"}}
        if status == 503:
            entry["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
        responses[status] = entry
    return responses


# --------------------------------------------------------------------------------------------
# Request and response models


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
# If-Match (RFC 9110 §13.1.1): * or a list of entity tags, quotes optional on a strong one
# (leniently). Weak tags never match (strong comparison); a write's condition is one compare
# on the key's mod_version, so a list may name at most one strong tag. _parse_if_match
# enforces exactly this grammar, with a detail saying what is wrong.
_ETAG_NUMBER = "[0-9]{1,18}"
_WEAK_ETAG = f'W/"{_ETAG_NUMBER}"'
_OWS = "[ \t]*"
IF_MATCH_PATTERN = (rf'^{_OWS}(\*|({_WEAK_ETAG}{_OWS},{_OWS})*({_WEAK_ETAG}|"{_ETAG_NUMBER}"|{_ETAG_NUMBER})'
                    rf'({_OWS},{_OWS}{_WEAK_ETAG})*){_OWS}$')
_STRONG_ETAG_RE = re.compile(f'"({_ETAG_NUMBER})"|({_ETAG_NUMBER})')
_WEAK_ETAG_RE = re.compile(f'W/"{_ETAG_NUMBER}"')
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
# An RFC 9110 media type (type/subtype; name=value or name="quoted"): it is sent back as the
# Content-Type of GET, so it must be one a client can parse.
CONTENT_TYPE_PATTERN = (rf'^{_TOKEN}/{_TOKEN}([ \t]*;[ \t]*{_TOKEN}=({_TOKEN}|"[\x20\x21\x23-\x5b\x5d-\x7e]*"))*$')
_CONTENT_TYPE_RE = re.compile(CONTENT_TYPE_PATTERN)

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


def _utf8_bytes(value: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("value is not valid UTF-8") from exc


def _check_utf8(value: str) -> str:
    _utf8_bytes(value)
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


class PutBase64Op(_Strict):
    """Put a binary value, sent as base64."""

    op: Literal["put"]
    key: Key
    value: Base64Text
    encoding: Literal["base64"]
    content_type: ContentType = DEFAULT_CONTENT_TYPE


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


class ReplicaState(BaseModel):
    model_config = ConfigDict(extra="allow")

    node_id: int | None = None
    endpoint: str | None = Field(None, description="the replica's advertised HTTP URL")
    log_end_offset: int | None = None
    lag: int | None = Field(None, description="high watermark minus the replica's log end offset")
    last_fetch_timestamp_ms: int | None = Field(None, description="wall clock, ms since the epoch")
    last_caught_up_timestamp_ms: int | None = Field(None, description="wall clock, ms since the epoch")


class QuorumResponse(BaseModel):
    """The leader's view of every voter and observer (KVService.quorum)."""

    model_config = ConfigDict(extra="allow")

    epoch: int | None = None
    leader_id: int | None = None
    high_watermark: int | None = None
    voters: list[ReplicaState] | None = None
    observers: list[ReplicaState] | None = None


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


# --------------------------------------------------------------------------------------------
# Rendering of state-machine values


def _is_textual(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type.startswith("text/") or media_type in _TEXTUAL_TYPES or media_type.endswith(("+json", "+xml"))


def _render_value(value: bytes, content_type: str) -> dict[str, Any]:
    """A value as JSON members: a string for textual content types, else base64."""
    if _is_textual(content_type):
        try:
            return {"value": value.decode("utf-8")}
        except UnicodeDecodeError:
            pass
    return {"value": base64.b64encode(value).decode("ascii"), "encoding": "base64"}


def _render_entry(entry: Any, keys_only: bool = False) -> dict[str, Any]:
    item: dict[str, Any] = {"key": entry.key, "content_type": entry.content_type,
                            "mod_version": entry.mod_version, "create_version": entry.create_version}
    if not keys_only:
        item.update(_render_value(entry.value, entry.content_type))
    return item


def _event_type(event: Any) -> str:
    kind = event.type
    name = getattr(kind, "name", None) or getattr(kind, "value", None) or kind
    return str(name).lower()


def _render_event(event: Any) -> dict[str, Any]:
    kind = _event_type(event)
    rendered: dict[str, Any] = {"type": kind, "key": event.key, "mod_version": event.mod_version}
    if kind == "put" and event.value is not None:
        content_type = event.content_type or DEFAULT_CONTENT_TYPE
        rendered["content_type"] = content_type
        rendered.update(_render_value(event.value, content_type))
    return rendered


def _op_kind_name(kind: Any) -> str:
    return {OpKind.PUT: "put", OpKind.DELETE: "delete", OpKind.GET: "get"}[OpKind(kind)]


def _render_op_result(result: Any) -> dict[str, Any]:
    kind = _op_kind_name(result.kind)
    rendered: dict[str, Any] = {"op": kind, "key": result.key}
    if kind == "put":
        rendered["created"] = bool(result.created)
    elif kind == "delete":
        rendered["deleted"] = bool(result.deleted)
    else:
        rendered["found"] = result.entry is not None
        if result.entry is not None:
            rendered.update(_render_entry(result.entry))
    return rendered


# --------------------------------------------------------------------------------------------
# Request parsing helpers


def _key_from_scope(scope: Scope) -> str:
    """The key as the client sent it: from the raw path, so that percent-encoded bytes that
    are not UTF-8 are refused rather than silently replaced with U+FFFD."""
    raw_path: bytes | None = scope.get("raw_path")
    if raw_path and raw_path.startswith(KEY_PATH_PREFIX_BYTES):
        raw_key = unquote_to_bytes(raw_path[len(KEY_PATH_PREFIX_BYTES):].split(b"?", 1)[0])
    else:
        raw_key = scope["path"][len(KEY_PATH_PREFIX):].encode("utf-8", "surrogatepass")
    if not raw_key:
        raise ProblemError(400, "invalid-key", "Invalid key", "the key must not be empty")
    if len(raw_key) > KEY_MAX_BYTES:
        raise ProblemError(413, "key-too-large", "Key too large",
                           f"the key is {len(raw_key)} bytes; at most {KEY_MAX_BYTES} are allowed")
    if b"\x00" in raw_key:
        raise ProblemError(400, "invalid-key", "Invalid key", "the key must not contain NUL")
    try:
        return raw_key.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProblemError(400, "invalid-key", "Invalid key", "the key is not valid UTF-8") from exc


async def _read_body_bounded(request: Request, limit_bytes: int, what: str, slug: str) -> bytes:
    """Read the body, refusing it (413) from Content-Length before reading and while reading,
    so a client cannot make this node buffer more than ``limit_bytes``."""
    declared = _header(request.scope, b"content-length")
    if declared is not None:
        try:
            declared_bytes = int(declared)
        except ValueError as exc:
            raise ProblemError(400, "invalid-content-length", "Invalid Content-Length",
                               "Content-Length is not an integer") from exc
        if declared_bytes > limit_bytes:
            raise ProblemError(413, slug, slug.replace("-", " ").capitalize(),
                               f"{what} is {declared_bytes} bytes; at most {limit_bytes} are allowed")
    chunks: list[bytes] = []
    received_bytes = 0
    async for chunk in request.stream():
        received_bytes += len(chunk)
        if received_bytes > limit_bytes:
            raise ProblemError(413, slug, slug.replace("-", " ").capitalize(),
                               f"{what} exceeds {limit_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_if_match(value: str, key: str) -> tuple[Compare, ...]:
    """``If-Match: "<mod_version>"`` is compare-and-set; ``If-Match: *`` requires existence.

    Strong comparison (RFC 9110 §13.1.1): a weak tag ``W/"5"`` never matches, whatever the
    key's version, so a list of weak tags only is a condition that cannot hold. It is still
    proposed (as two contradicting compares) rather than answered here, so that it fails at
    apply time like any other condition: on the leader, with the key's current_version.
    A list of several strong tags would need an OR of compares, which a command cannot
    express (storage/commands.py: all compares must hold): 400, saying so."""
    elements = [element.strip(" \t") for element in value.split(",")]
    if "*" in elements:
        if len(elements) > 1:
            raise ProblemError(400, "invalid-precondition", "Invalid If-Match",
                               "If-Match: * cannot be combined with entity tags")
        return (Compare(key, CompareKind.EXISTS, True),)
    strong: list[int] = []
    for element in elements:
        if _WEAK_ETAG_RE.fullmatch(element):
            continue  # never matches
        match = _STRONG_ETAG_RE.fullmatch(element)
        if match is None:
            raise ProblemError(400, "invalid-precondition", "Invalid If-Match",
                               'If-Match must be * or "<mod_version>" (a quoted integer; a list may add weak W/"<n>" '
                               f"tags, which never match): {element[:40]!r} is not an entity tag")
        strong.append(int(match.group(1) or match.group(2)))
    if len(strong) > 1:
        raise ProblemError(400, "invalid-precondition", "Invalid If-Match",
                           "If-Match lists of several entity tags are not supported: a write's condition is one "
                           'compare of the key\'s mod_version; send one "<mod_version>"')
    if not strong:
        return (Compare(key, CompareKind.EXISTS, True), Compare(key, CompareKind.EXISTS, False))
    return (Compare(key, CompareKind.MOD_VERSION, strong[0]),)


def _parse_if_none_match(value: str, key: str) -> Compare:
    if value.strip() != "*":
        raise ProblemError(400, "invalid-precondition", "Invalid If-None-Match",
                           "only If-None-Match: * (create only) is supported on writes")
    return Compare(key, CompareKind.EXISTS, False)


def _write_compares(key: str, if_match: str | None, if_none_match: str | None) -> tuple[Compare, ...]:
    """Both headers may be sent; both must hold (RFC 9110 evaluates If-Match, then If-None-Match)."""
    compares = []
    if if_match is not None:
        compares.extend(_parse_if_match(if_match, key))
    if if_none_match is not None:
        compares.append(_parse_if_none_match(if_none_match, key))
    return tuple(compares)


def _check_condition(result: Any, key: str) -> None:
    if not result.succeeded:
        current = dict(result.failed_compares).get(key, 0)
        raise ProblemError(412, "precondition-failed", "Precondition failed",
                           f"the condition on {key!r} did not hold (its mod_version is {current})",
                           current_version=current)


def _txn_value(item: PutOp | PutBase64Op | CompareValue | CompareValueBase64) -> bytes:
    if item.encoding == "base64":
        return base64.b64decode(item.value, validate=True)
    return _utf8_bytes(item.value)


def _txn_command(body: TxnRequest, max_value_bytes: int) -> Command:
    def op(item: PutOp | PutBase64Op | DeleteOp | GetOp) -> Op:
        if isinstance(item, PutOp | PutBase64Op):
            value = _txn_value(item)
            if len(value) > max_value_bytes:
                raise ProblemError(413, "value-too-large", "Value too large",
                                   f"the value for {item.key!r} is {len(value)} bytes; at most {max_value_bytes} are allowed")
            return Op(OpKind.PUT, item.key, value, item.content_type)
        return Op(OpKind.DELETE if isinstance(item, DeleteOp) else OpKind.GET, item.key)

    def compare(item: TxnCompare) -> Compare:
        if isinstance(item, CompareModVersion):
            return Compare(item.key, CompareKind.MOD_VERSION, item.mod_version)
        if isinstance(item, CompareExists):
            return Compare(item.key, CompareKind.EXISTS, item.exists)
        return Compare(item.key, CompareKind.VALUE, _txn_value(item))

    return Command(tuple(compare(c) for c in body.compare), tuple(op(o) for o in body.success),
                   tuple(op(o) for o in body.failure))


def _describe(error: dict[str, str]) -> str:
    return f"{error['location']}: {error['message']}" if error["location"] else error["message"]


def _validation_errors(exc: ValidationError | RequestValidationError) -> list[dict[str, str]]:
    """Location and message of each error; never the offending input, which may be huge or binary."""
    return [{"location": ".".join(str(part) for part in error.get("loc", ())), "message": str(error.get("msg", ""))}
            for error in exc.errors()]


# --------------------------------------------------------------------------------------------
# Metrics and the edge middleware


@dataclass(frozen=True, slots=True)
class _HttpMetrics:
    requests: Counter
    latency: Histogram


_METRICS_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, _HttpMetrics] = weakref.WeakKeyDictionary()


def _http_metrics(registry: CollectorRegistry) -> _HttpMetrics:
    """One set of collectors per registry: a second app on the same service (tests, reloads)
    reuses them instead of failing on a duplicate registration."""
    metrics = _METRICS_BY_REGISTRY.get(registry)
    if metrics is None:
        metrics = _HttpMetrics(
            Counter("metakv_http_requests", "HTTP requests by route template, method and status",
                    ("route", "method", "status"), registry=registry),
            Histogram("metakv_http_request_duration_seconds", "HTTP request latency until the response ends",
                      ("route", "method"), buckets=LATENCY_BUCKETS_SECONDS, registry=registry),
        )
        _METRICS_BY_REGISTRY[registry] = metrics
    return metrics


class _EdgeMiddleware:
    """Node headers on every response, no body on a HEAD answer, request metrics, and the
    last-resort 500."""

    def __init__(self, app: ASGIApp, service: KVService, metrics: _HttpMetrics,
                 route_label: Callable[[Scope], str]) -> None:
        self.app = app
        self.service = service
        self.metrics = metrics
        self.route_label = route_label
        # Labelled children, looked up once per label set instead of per request (labels()
        # takes a lock and validates); bounded, since the method label comes from clients.
        self._counters: dict[tuple[str, str, int], Any] = {}
        self._histograms: dict[tuple[str, str], Any] = {}

    def _node_headers(self) -> list[tuple[bytes, bytes]]:
        try:
            return self.service.headers().as_raw()
        except Exception:
            log.exception("service.headers() failed; answering without node headers")
            return []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_s = time.perf_counter()
        status_code = 500
        response_started = False
        head = scope["method"] == "HEAD"

        async def send_with_headers(message: Message) -> None:
            nonlocal status_code, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status_code = message["status"]
                # Routes never set these headers themselves, so they are appended, not merged.
                message = {**message, "headers": [*message.get("headers", ()), *self._node_headers()]}
            elif head and message.get("body"):
                # HEAD: GET's status and headers (Content-Length included), never a body.
                message = {**message, "body": b""}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception:
            log.exception("unexpected error serving %s %s", scope.get("method"), scope.get("path"))
            if not response_started:
                body = _problem_body(500, "internal-error", "Internal server error",
                                     "the server failed to answer; the error is in its log", {})
                await send_with_headers({"type": "http.response.start", "status": 500,
                                         "headers": [(b"content-type", PROBLEM_MEDIA_TYPE.encode()),
                                                     (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
        finally:
            self._record(self.route_label(scope), str(scope.get("method", "")), status_code,
                         time.perf_counter() - started_s)

    def _record(self, route: str, method: str, status_code: int, elapsed_s: float) -> None:
        counter = self._counters.get((route, method, status_code))
        if counter is None:
            counter = self.metrics.requests.labels(route, method, str(status_code))
            if len(self._counters) < EDGE_LABEL_CACHE_MAX:
                self._counters[(route, method, status_code)] = counter
        counter.inc()
        histogram = self._histograms.get((route, method))
        if histogram is None:
            histogram = self.metrics.latency.labels(route, method)
            if len(self._histograms) < EDGE_LABEL_CACHE_MAX:
                self._histograms[(route, method)] = histogram
        histogram.observe(elapsed_s)


# --------------------------------------------------------------------------------------------
# The application


def _clamp_ms(value: int, maximum: int) -> int:
    return max(0, min(value, maximum))


ConsistencyQuery = Annotated[Literal["local", "leader", "linearizable"], Query(
    description="local: this node's applied state; leader: served by the leader (others 307); "
                "linearizable: the leader confirms leadership with a quorum round first")]
MinVersionQuery = Annotated[int | None, Query(ge=0, le=MAX_VERSION, description="wait until this node has applied this version")]
WaitMsQuery = Annotated[int, Query(ge=0, description="how long min_version may wait (clamped to the server's maximum)")]
AtVersionQuery = Annotated[int | None, Query(ge=0, le=MAX_VERSION, description="read as of this version (410 below the oldest retained one)")]
# The key's rules are documented here and enforced by the route (400, or 413 when too long).
KeyPath = Annotated[str, Path(description="the key: UTF-8, 1-1024 bytes, no NUL; may contain /",
                              json_schema_extra={"minLength": 1, "maxLength": KEY_MAX_BYTES, "pattern": NO_NUL_PATTERN})]
IfMatchHeader = Annotated[str | None, Header(
    alias="If-Match", json_schema_extra={"pattern": IF_MATCH_PATTERN},  # enforced by _parse_if_match
    description='"<mod_version>" (quotes optional): only if the key is at this version (compare-and-set); *: only if it '
                'exists. Weak tags (W/"<n>") never match (strong comparison); a list may hold one strong tag at most')]
IfNoneMatchHeader = Annotated[Literal["*"] | None, Header(
    alias="If-None-Match", description="*: only if the key does not exist")]

_COMMON_HEADERS = {
    "X-Metadata-Version": "this node's applied metadata version when it answered",
    "X-Node-Id": "the answering node's id",
    "X-Raft-Leader": "the leader's node id, empty when unknown",
    "X-Raft-Epoch": "the node's current epoch",
    "X-Last-Contact-Ms": "milliseconds since this node last heard the leader (0 on the leader)",
}


def _invalid_parameters(errors: list[dict[str, str]]) -> ProblemError:
    detail = "; ".join(_describe(e) for e in errors) or "invalid request"
    return ProblemError(400, "invalid-parameter", "Invalid parameter", detail, errors=errors)


async def _wait_readable(service: KVService, settings: HttpSettings, consistency: Consistency,
                         min_version: int | None, wait_ms: int, at_version: int | None) -> None:
    """Wait until this node may answer a read (at_version implies waiting for that version)."""
    if at_version is not None:
        min_version = max(min_version or 0, at_version)
    await service.wait_readable(consistency, min_version, _clamp_ms(wait_ms, settings.max_wait_ms))


def _header(scope: Scope, name: bytes) -> str | None:
    """The first value of a (lower-case) request header, as Starlette's Headers.get reads it."""
    for header_name, value in scope["headers"]:
        if header_name == name:
            return str(value.decode("latin-1"))
    return None


@dataclass(frozen=True, slots=True)
class _Parameter:
    """A query parameter or header of a key route, validated by the same annotated type
    FastAPI documents it with, so values, defaults and error messages are FastAPI's."""

    argument: str  # the endpoint's argument name
    location: Literal["query", "header"]
    wire_name: str  # query name, or header name as documented
    lookup: str | bytes  # query name, or lower-case header name
    adapter: TypeAdapter[Any]
    default: Any


def _parameters_of(endpoint: Callable[..., Any]) -> tuple[_Parameter, ...]:
    """The Query and Header arguments of an endpoint, from its signature."""
    hints = get_type_hints(endpoint, include_extras=True)
    parameters = []
    for name, parameter in inspect.signature(endpoint).parameters.items():
        info = next((m for m in getattr(hints.get(name), "__metadata__", ()) if isinstance(m, params.Query | params.Header)), None)
        if info is None:
            continue
        if isinstance(info, params.Header):
            wire_name = info.alias or name
            parameters.append(_Parameter(name, "header", wire_name, wire_name.lower().encode("latin-1"),
                                         TypeAdapter(hints[name]), parameter.default))
        else:
            parameters.append(_Parameter(name, "query", name, name, TypeAdapter(hints[name]), parameter.default))
    return tuple(parameters)


def _parse_parameters(parameters: tuple[_Parameter, ...], scope: Scope) -> dict[str, Any]:
    """Arguments from the query string and headers; every invalid one is listed in one 400,
    queries before headers, as FastAPI reports them. Absent: the default, unvalidated."""
    query_string: bytes = scope.get("query_string", b"")
    # As Starlette's QueryParams: latin-1, blank values kept, the last of repeated names wins.
    query = dict(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)) if query_string else {}
    arguments: dict[str, Any] = {}
    errors: list[dict[str, str]] = []
    for parameter in parameters:
        if parameter.location == "query":
            raw = query.get(str(parameter.lookup))
        else:
            raw = _header(scope, bytes(parameter.lookup))  # type: ignore[arg-type]
        if raw is None:
            arguments[parameter.argument] = parameter.default
            continue
        try:
            arguments[parameter.argument] = parameter.adapter.validate_python(raw)
        except ValidationError as exc:
            errors.extend({"location": ".".join([parameter.location, parameter.wire_name, *map(str, error["loc"])]),
                           "message": str(error.get("msg", ""))} for error in exc.errors())
    if errors:
        raise _invalid_parameters(errors)
    return arguments


def _json_answer(document: dict[str, Any]) -> _Answer:
    body = orjson.dumps(document)  # compact, UTF-8 unescaped: the bytes FastAPI's JSONResponse wrote
    return _Answer(200, [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")], body)


class _KeyRoutes:
    """GET, HEAD, PUT and DELETE /v1/kv/{key}: the hot routes, as one small ASGI app.

    Why not FastAPI routes: its per-request machinery (middleware stack, routing, dependency
    solving and validation of every parameter) cost more CPU than everything else a write
    does on the leader (docs/http.md). This app parses exactly what shared/API.md defines and
    calls the same endpoint methods FastAPI documents in /openapi.json (create_app registers
    them on a documentation-only router), with the same annotated types validating each
    parameter, and maps exceptions through the same _as_problem."""

    def __init__(self, service: KVService, settings: HttpSettings) -> None:
        self.service = service
        self.settings = settings
        self.state = service.state
        read, write = _parameters_of(self.get_key), _parameters_of(self.put_key)
        self.routes: dict[str, tuple[Callable[..., Awaitable[_Answer]], tuple[_Parameter, ...]]] = {
            "GET": (self.get_key, read), "HEAD": (self.get_key, read),
            "PUT": (self.put_key, write), "DELETE": (self.delete_key, _parameters_of(self.delete_key)),
        }
        self.allow = ", ".join(sorted(self.routes))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        try:
            route = self.routes.get(method)
            if route is None:
                raise ProblemError(405, "method-not-allowed", "Method not allowed", "Method Not Allowed",
                                   headers={"Allow": self.allow})
            endpoint, parameters = route
            arguments = _parse_parameters(parameters, scope)
            answer = await endpoint(Request(scope, receive), _key_from_scope(scope), **arguments)
        except Exception as exc:
            problem = _as_problem(exc, scope)
            if problem is None:
                raise  # the edge logs it and answers 500
            answer = _problem_answer(problem, method == "HEAD")
        await answer.send(send)

    async def get_key(self, request: Request, key: KeyPath, consistency: ConsistencyQuery = "local",
                      min_version: MinVersionQuery = None, wait_ms: WaitMsQuery = DEFAULT_WAIT_MS,
                      at_version: AtVersionQuery = None) -> _Answer:
        # GET, and HEAD: the same headers, no body. (No docstring: FastAPI would publish it.)
        await _wait_readable(self.service, self.settings, consistency, min_version, wait_ms, at_version)
        _version, entry = self.state.get(key, at_version=at_version)
        if entry is None:
            raise ProblemError(404, "key-not-found", "Key not found", f"no key {key!r}")
        content_type = entry.content_type if _CONTENT_TYPE_RE.fullmatch(entry.content_type) else DEFAULT_CONTENT_TYPE
        headers = [(b"content-type", content_type.encode("latin-1")), (b"etag", f'"{entry.mod_version}"'.encode()),
                   (b"x-create-version", str(entry.create_version).encode()),
                   (b"content-length", str(len(entry.value)).encode())]
        return _Answer(200, headers, b"" if request.method == "HEAD" else entry.value)

    async def put_key(self, request: Request, key: KeyPath,
                      if_match: IfMatchHeader = None, if_none_match: IfNoneMatchHeader = None) -> _Answer:
        content_type = _header(request.scope, b"content-type") or DEFAULT_CONTENT_TYPE
        if len(content_type) > CONTENT_TYPE_MAX_BYTES or not _CONTENT_TYPE_RE.fullmatch(content_type):
            raise ProblemError(400, "invalid-content-type", "Invalid Content-Type",
                               f"Content-Type must be a media type (type/subtype; name=value) of at most {CONTENT_TYPE_MAX_BYTES} characters")
        compares = _write_compares(key, if_match, if_none_match)
        value = await _read_body_bounded(request, self.settings.max_value_bytes, "the value", "value-too-large")
        result = await self.service.propose(put(key, value, content_type, compares))
        _check_condition(result, key)
        return _json_answer({"key": key, "version": result.version, "created": bool(result.ops[0].created)})

    async def delete_key(self, request: Request, key: KeyPath,
                         if_match: IfMatchHeader = None, if_none_match: IfNoneMatchHeader = None) -> _Answer:
        compares = _write_compares(key, if_match, if_none_match)
        result = await self.service.propose(delete(key, compares))
        _check_condition(result, key)
        return _json_answer({"key": key, "version": result.version, "deleted": bool(result.ops[0].deleted)})


def _settings_from(service: KVService) -> HttpSettings:
    """HttpSettings fields the service carries as attributes of the same name (the runtime's
    configured max_value_bytes, say) override the defaults."""
    overrides = {name: int(getattr(service, name)) for name in HttpSettings.__dataclass_fields__
                 if isinstance(getattr(service, name, None), int)}
    return HttpSettings(**overrides)


class MetakvApp(FastAPI):
    """FastAPI, except that every path under /v1/kv/ goes straight to the key routes (behind
    their own edge layer) instead of through FastAPI's middleware stack and router. It stays
    one ASGI app, so a middleware wrapping it (auth) sees every request."""

    key_routes: ASGIApp | None = None

    def add_middleware(self, middleware_class: Any, *args: Any, **kwargs: Any) -> None:
        """Refused once the key routes are installed: FastAPI middleware would never see
        /v1/kv/ requests (auth would silently not apply to them). Wrap the app instead:
        ``app = SomeMiddleware(create_app(service))``."""
        if self.key_routes is not None:
            raise RuntimeError("MetakvApp serves /v1/kv/ ahead of FastAPI's middleware stack: "
                               "wrap the ASGI app create_app returns instead of add_middleware")
        super().add_middleware(middleware_class, *args, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key_routes is not None and scope["type"] == "http" and scope["path"].startswith(KEY_PATH_PREFIX):
            await self.key_routes(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(service: KVService, settings: HttpSettings | None = None) -> MetakvApp:
    """The FastAPI application serving ``service`` per shared/API.md. Without ``settings``,
    bounds come from the service's attributes of the same names, else the defaults."""
    settings = settings or _settings_from(service)
    registry = getattr(service, "metrics", None)
    if not isinstance(registry, CollectorRegistry):
        registry = CollectorRegistry()
    # No slash redirects: Starlette would answer /v1/status/ with a bare 307 to /v1/status on
    # this very node (no body, no problem document), which a client reads as "not the leader".
    app = MetakvApp(title="metakv", version="1", description="Replicated key-value metadata store (shared/API.md).",
                    redirect_slashes=False)
    state = service.state

    # ---- exception mapping (the key routes map through the same _as_problem) ---------------

    async def on_route_error(request: Request, exc: Exception) -> Response:
        problem = _as_problem(exc, request.scope)
        if problem is None:
            raise exc
        return _problem_response(request, problem)

    async def on_validation(request: Request, exc: Exception) -> Response:
        errors = _validation_errors(exc) if isinstance(exc, RequestValidationError) else []
        return _problem_response(request, _invalid_parameters(errors))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        if not isinstance(exc, StarletteHTTPException):
            raise exc
        slug = {404: "not-found", 405: "method-not-allowed"}.get(exc.status_code, "http-error")
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(request.scope))
        return _problem_response(request, ProblemError(exc.status_code, slug, slug.replace("-", " ").capitalize(),
                                                       str(exc.detail), headers=headers))

    def _allowed_methods(scope: Scope) -> list[str]:
        """Every method any route serves at this path (Starlette names only the first route's)."""
        methods: set[str] = set()
        for route in app.router.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:
                methods |= set(getattr(route, "methods", None) or ())
        return sorted(methods)

    for error_class in (ProblemError, NotLeaderError, WriteRejectedError, IndeterminateError, NotReadyError,
                        SnapshotStorageError,
                        VersionWaitTimeoutError, VersionCompactedError, VersionNotAppliedError):
        app.add_exception_handler(error_class, on_route_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http_error)

    # ---- keys: served by _KeyRoutes ahead of FastAPI, documented through FastAPI -----------

    key_routes = _KeyRoutes(service, settings)
    # Never served: it only feeds /openapi.json, from the signatures of the very methods
    # _KeyRoutes calls, so the document and the parsing cannot drift apart.
    key_documentation = APIRouter()
    read_statuses = _problems(307, 400, 404, 410, 413, 503, 504)
    write_statuses = _problems(307, 400, 412, 413, 503, 504)
    value_response = {200: {
        "description": "the value as raw bytes with its stored Content-Type",
        "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}},
        "headers": {"ETag": {"schema": {"type": "string"}, "description": '"<mod_version>"'},
                    "X-Create-Version": {"schema": {"type": "integer"}}},
    }}
    key_documentation.add_api_route(
        KEY_ROUTE_TEMPLATE, key_routes.get_key, methods=["GET"], name="get_key", tags=["keys"],
        summary="Read a key", response_class=Response, response_model=None,
        responses={**value_response, **read_statuses})
    key_documentation.add_api_route(
        KEY_ROUTE_TEMPLATE, key_routes.get_key, methods=["HEAD"], name="head_key", tags=["keys"],
        summary="The headers of GET", response_class=Response, response_model=None,
        responses={200: {"description": "the headers of GET, no body", "headers": value_response[200]["headers"]},
                   **read_statuses})
    key_documentation.add_api_route(
        KEY_ROUTE_TEMPLATE, key_routes.put_key, methods=["PUT"], name="put_key", tags=["keys"],
        summary="Set a key to the request body", response_model=WriteResult, responses=write_statuses,
        openapi_extra={"requestBody": {"required": False, "description": "the value; its Content-Type is stored",
                                       "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                                                   "text/plain": {"schema": {"type": "string"}}}}})
    key_documentation.add_api_route(
        KEY_ROUTE_TEMPLATE, key_routes.delete_key, methods=["DELETE"], name="delete_key", tags=["keys"],
        summary="Delete a key (writes a tombstone)", response_model=DeleteResult, responses=write_statuses)

    async def _wait(consistency: Consistency, min_version: int | None, wait_ms: int, at_version: int | None) -> None:
        await _wait_readable(service, settings, consistency, min_version, wait_ms, at_version)

    def get_and_head(path: str, *, summary: str, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A GET route and its HEAD twin (same endpoint and options, so the same status and
        headers; _EdgeMiddleware drops the body): load balancers and probes send HEAD. Two
        routes, not methods=["GET", "HEAD"], so /openapi.json gets two operation ids."""
        def register(endpoint: Callable[..., Any]) -> Callable[..., Any]:
            app.add_api_route(path, endpoint, methods=["GET"], summary=summary, **options)
            app.add_api_route(path, endpoint, methods=["HEAD"], name=f"head_{endpoint.__name__}",
                              summary=f"{summary}: the headers of GET, no body", **options)
            return endpoint
        return register

    @get_and_head("/v1/kv", tags=["keys"], summary="List entries at one version", response_model=ListResponse,
                  responses=_problems(307, 400, 410, 503, 504))
    async def list_keys(
        prefix: Annotated[str, Query(description="only keys starting with this")] = "",
        limit: Annotated[int, Query(ge=1, le=LIST_LIMIT_MAX)] = LIST_LIMIT_DEFAULT,
        after: Annotated[str | None, Query(description="start after this key (the previous page's next)")] = None,
        keys_only: Annotated[bool, Query(description="leave values out")] = False,
        consistency: ConsistencyQuery = "local", min_version: MinVersionQuery = None,
        wait_ms: WaitMsQuery = DEFAULT_WAIT_MS, at_version: AtVersionQuery = None,
    ) -> Response:
        await _wait(consistency, min_version, wait_ms, at_version)
        version, entries, next_key = state.list(prefix, after=after, limit=limit, at_version=at_version)
        body = {"version": version, "items": [_render_entry(e, keys_only) for e in entries], "next": next_key}
        return JSONResponse(body)

    # ---- txn --------------------------------------------------------------------------------

    @app.post("/v1/txn", tags=["keys"], summary="Atomic compare-and-apply over several keys",
              response_model=TxnResponse, responses=_problems(307, 400, 413, 422, 503, 504),
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": {"$ref": "#/components/schemas/TxnRequest"}}}}})
    async def txn(request: Request) -> Response:
        raw = await _read_body_bounded(request, settings.max_txn_body_bytes, "the txn body", "body-too-large")
        try:
            body = TxnRequest.model_validate_json(raw)
        except ValidationError as exc:
            errors = _validation_errors(exc)
            too_large = [error for error, raw_error in zip(errors, exc.errors(), strict=True)
                         if raw_error["type"] == KEY_TOO_LARGE_ERROR]
            if too_large:  # as the key routes answer for the same key
                raise ProblemError(413, "key-too-large", "Key too large", _describe(too_large[0]),
                                   errors=too_large) from exc
            detail = "; ".join(_describe(e) for e in errors[:10]) or "invalid txn body"
            raise ProblemError(422, "invalid-body", "Invalid txn body", detail, errors=errors) from exc
        result = await service.propose(_txn_command(body, settings.max_value_bytes))
        return JSONResponse({
            "succeeded": bool(result.succeeded), "version": result.version,
            "results": [_render_op_result(op) for op in result.ops],
            "failed_compares": [{"key": key, "current_version": current} for key, current in result.failed_compares],
        })

    # ---- watch ------------------------------------------------------------------------------

    async def _changes_after(prefix: str, since: int, deadline_s: float) -> tuple[int, list[Any], bool]:
        """Events under ``prefix`` newer than ``since``, waiting for one until the deadline.
        The flag says the service stopped waiting well before the deadline without a new
        version (the node is closing): callers answer instead of asking again in a busy loop.

        A read that finds nothing under the prefix moves ``since`` up to the version it read
        at: nothing under the prefix changed up to there, so the next read asks only for what
        is newer. Otherwise a watch of a quiet prefix kept asking from its first version, and
        was answered 410 as soon as the history horizon passed it while other keys changed."""
        while True:
            version, events = state.changes(prefix, since, settings.watch_events_max)
            remaining_ms = math.ceil((deadline_s - time.monotonic()) * 1000)
            if events or remaining_ms <= 0:
                return version, list(events), False
            since = max(version, since)
            if await service.wait_for_change(since, remaining_ms) <= since:
                stopped_early = deadline_s - time.monotonic() > WAIT_EARLY_RETURN_S
                return version, [], stopped_early

    async def _sse(prefix: str, since: int, timeout_ms: int) -> AsyncIterator[bytes]:
        """Events as Server-Sent Events; the id of the last event of each read is a version
        to resume from (Last-Event-ID or since=) without gaps, even when one version holds
        several events."""
        stream_end_s = time.monotonic() + timeout_ms / 1000
        keepalive_s = settings.sse_keepalive_ms / 1000
        yield b"retry: 1000\n\n"
        resume_id = since  # the Last-Event-ID the client holds
        while time.monotonic() < stream_end_s:
            deadline_s = min(stream_end_s, time.monotonic() + keepalive_s)
            try:
                version, events, stopped_early = await _changes_after(prefix, since, deadline_s)
            except VersionCompactedError as exc:
                # The horizon passed ``since`` mid-stream: the status is sent already, so the
                # 410 problem document travels as an event and the stream ends.
                oldest = int(exc.oldest_version)
                problem = _problem_body(410, "version-compacted", "Version compacted",
                                        f"versions below {oldest} are no longer retained; re-list, then watch from the list's version",
                                        {"oldest_version": oldest})
                yield b"event: error\ndata: " + problem + b"\n\n"
                return
            if stopped_early:
                return  # the node stopped waiting (shutting down): end the stream, clients reconnect
            if not events:
                since = max(since, version)  # nothing under the prefix up to there
                block = b""
                if since > resume_id:
                    # An id without data moves the client's Last-Event-ID without an event
                    # (WHATWG SSE), so a reconnect resumes from here: from its old id a quiet
                    # prefix's watch would meet 410 once the horizon passed that id.
                    resume_id = since
                    block += f"id: {since}\n".encode()
                if time.monotonic() < stream_end_s:
                    block += b": keepalive\n"
                if block:
                    yield block + b"\n"
                continue
            parts = []
            for index, event in enumerate(events):
                rendered = _render_event(event)
                last = index == len(events) - 1
                if last or events[index + 1].mod_version != event.mod_version:
                    event_id = version if last else event.mod_version
                    parts.append(f"id: {event_id}\n".encode())
                parts.append(f"event: {rendered['type']}\ndata: ".encode())
                parts.append(json.dumps(rendered, separators=(",", ":")).encode() + b"\n\n")
            yield b"".join(parts)
            since = resume_id = version

    @app.get("/v1/watch", tags=["keys"], summary="Changes after a version (long-poll, or SSE)",
             response_model=WatchResponse, responses={
                 200: {"description": "events (JSON), or a text/event-stream when asked for",
                       "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                 **_problems(400, 410, 503)})
    async def watch(
        request: Request,
        prefix: Annotated[str, Query(description="only keys starting with this")] = "",
        since: Annotated[int, Query(ge=0, le=MAX_VERSION, description="answer changes newer than this version")] = 0,
        timeout_ms: Annotated[int, Query(ge=0, description="long-poll wait, or SSE stream lifetime (clamped)")] = DEFAULT_WATCH_TIMEOUT_MS,
        last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", description="SSE resume: overrides since")] = None,
    ) -> Response:
        timeout_ms = _clamp_ms(timeout_ms, settings.max_watch_timeout_ms)
        await service.wait_readable("local", None, 0)
        wants_sse = "text/event-stream" in request.headers.get("accept", "")
        if wants_sse and last_event_id is not None:
            # ASCII digits only (str.isdigit admits "²", which int() refuses), and within
            # the range ``since`` accepts.
            resume = last_event_id.strip()
            if not VERSION_TEXT_PATTERN.fullmatch(resume) or int(resume) > MAX_VERSION:
                raise ProblemError(400, "invalid-parameter", "Invalid Last-Event-ID",
                                   f"Last-Event-ID must be a version between 0 and {MAX_VERSION}")
            since = int(resume)
        # Checked before answering so a stale since is a 410 status, not an error mid-stream.
        version, events = state.changes(prefix, since, settings.watch_events_max)
        if wants_sse:
            return StreamingResponse(_sse(prefix, since, timeout_ms), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if not events:
            version, events, _ = await _changes_after(prefix, since, time.monotonic() + timeout_ms / 1000)
        return JSONResponse({"version": version, "events": [_render_event(e) for e in events]})

    # ---- cluster ----------------------------------------------------------------------------

    @get_and_head("/v1/status", tags=["cluster"], summary="This node's state", response_model=StatusResponse,
                  response_model_exclude_unset=True)
    async def status() -> dict[str, Any]:
        return service.status()

    @get_and_head("/v1/quorum", tags=["cluster"], summary="The leader's view of the quorum",
                  response_model=QuorumResponse, response_model_exclude_unset=True, responses=_problems(307, 503))
    async def quorum() -> dict[str, Any]:
        return service.quorum()

    @get_and_head("/healthz", tags=["cluster"], summary="200 while the process serves", response_model=HealthResponse)
    async def healthz() -> HealthResponse:
        return HealthResponse(status="ok")

    @get_and_head("/readyz", tags=["cluster"], summary="200 when this node can serve consistent reads",
                  response_model=ReadyResponse, responses=_problems(503))
    async def readyz() -> ReadyResponse:
        if not service.is_ready():
            raise ProblemError(503, "not-ready", "Not ready", "this node cannot serve consistent reads yet",
                               headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        return ReadyResponse(ready=True)

    @get_and_head("/metrics", tags=["cluster"], summary="Prometheus metrics", response_class=Response,
                  responses={200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(generate_latest(registry), headers={"content-type": CONTENT_TYPE_LATEST})

    admin_statuses = _problems(307, 503)

    snapshot_statuses = _problems(503)
    snapshot_statuses[503]["description"] = (
        "nothing applied yet, this replica is catching up, the node is shutting down, or the "
        "snapshot failed on an I/O error (detail); retry after Retry-After")
    snapshot_statuses[507] = {"description": "the disk holding the snapshots is full (detail names the error); "
                              "nothing was published; free space and retry", "content": _problem_content()}

    @app.post("/v1/admin/snapshot", tags=["admin"], summary="Take a snapshot now",
              response_model=AdminResponse, response_model_exclude_unset=True, responses=snapshot_statuses)
    async def admin_snapshot() -> dict[str, Any]:
        return await service.take_snapshot()

    @app.post("/v1/admin/resign", tags=["admin"], summary="The leader steps down gracefully",
              response_model=AdminResponse, response_model_exclude_unset=True, responses=admin_statuses)
    async def admin_resign() -> dict[str, Any]:
        return await service.resign()

    compact: Callable[[], Awaitable[dict[str, Any]]] | None = getattr(service, "compact", None)
    if callable(compact):
        run_compact = compact

        @app.post("/v1/admin/compact", tags=["admin"], summary="Run the cleaner now (leader)",
                  response_model=AdminResponse, response_model_exclude_unset=True, responses=admin_statuses)
        async def admin_compact() -> dict[str, Any]:
            return await run_compact()

    # ---- OpenAPI and the edge ---------------------------------------------------------------

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _complete_openapi(app, key_documentation.routes)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    def route_label(scope: Scope) -> str:
        matched = scope.get("route")  # set by the router on the shared scope when a route served it
        if matched is not None and hasattr(matched, "path"):
            return str(matched.path)
        for route in app.router.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:
                return str(getattr(route, "path", "unmatched"))
        return "unmatched"

    # Auth sits inside the edge layer on both paths, so 401/403 carry the node headers and
    # count in the request metrics; it is off (an identity wrapper) without a token file.
    with_auth = install_auth(app, getattr(service, "auth_tokens", None), settings.max_txn_body_bytes,
                             served_ahead=key_documentation.routes)
    edge_metrics = _http_metrics(registry)
    app.add_middleware(_EdgeMiddleware, service=service, metrics=edge_metrics, route_label=route_label)
    app.key_routes = _EdgeMiddleware(with_auth(key_routes), service, edge_metrics, lambda _scope: KEY_ROUTE_TEMPLATE)
    return app


def _hoist(model: type[BaseModel], components: dict[str, Any]) -> None:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema


def _drop_null_branch(parameter: dict[str, Any]) -> None:
    """An optional parameter is absent, never the string "null": document only its real type."""
    branches = parameter.get("schema", {}).get("anyOf")
    if not branches:
        return
    real = [branch for branch in branches if branch.get("type") != "null"]
    if len(real) == 1 and len(real) < len(branches):
        schema = {key: value for key, value in parameter["schema"].items() if key != "anyOf"}
        parameter["schema"] = {**real[0], **schema}


def _complete_openapi(app: FastAPI, key_routes: list[BaseRoute]) -> dict[str, Any]:
    """FastAPI's document plus what it cannot infer: the Problem and TxnRequest schemas
    referenced by hand, the node headers on every response, and without the default 422
    validation responses (parameter errors are 400 problem documents here), and without the
    null branch of optional parameters."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=[*key_routes, *app.routes])
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _hoist(Problem, components)
    _hoist(TxnRequest, components)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    node_headers = {name: {"description": text, "schema": {"type": "string"}} for name, text in _COMMON_HEADERS.items()}
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            for parameter in operation.get("parameters", []):
                _drop_null_branch(parameter)
            responses: dict[str, Any] = operation.get("responses", {})
            default_422 = responses.get("422", {}).get("content", {}).get("application/json", {})
            if default_422.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
                del responses["422"]
            for status, response in responses.items():
                if operation is path_item.get("head") and status == "200":
                    response.pop("content", None)  # HEAD: the headers of GET, no body
                response.setdefault("headers", {}).update(node_headers)
    return schema
