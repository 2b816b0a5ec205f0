"""The HTTP API as requests to build and answers to read, with no I/O: the sync and the
async client send the same ``Request`` objects and parse answers with the same functions."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar
from urllib.parse import quote, urlencode

from metakv.errors import InvalidRequest, ServerError
from metakv.results import (
    DeleteResult,
    Event,
    KeyValue,
    ListResult,
    PutResult,
    TxnResult,
    event_of,
    key_value_of,
)

TEXT_CONTENT_TYPE = "text/plain; charset=utf-8"  # what a str value is stored as
OK = frozenset({200})
Params = ParamSpec("Params")
Parsed = TypeVar("Parsed")


def parses_answer(parse: Callable[Params, Parsed]) -> Callable[Params, Parsed]:
    """``parse`` with a body that is not what the API promises (a member missing, of another
    type: another server behind the URL) raising ``ServerError``, not KeyError or TypeError."""
    @functools.wraps(parse)
    def checked(*args: Params.args, **kwargs: Params.kwargs) -> Parsed:
        try:
            return parse(*args, **kwargs)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ServerError("Malformed answer", f"{parse.__name__}: {type(exc).__name__} {exc}") from None
    return checked


@dataclass(frozen=True, slots=True)
class Request:
    """One API call. ``target_leader``: only the leader can answer (writes, leader reads),
    others redirect. ``writes``: it changes data, so an unknown outcome matters.
    ``safe_to_resend``: sending it again after an unknown outcome can never apply it twice
    (reads, and writes whose condition a first apply would make fail)."""

    method: str
    path: str  # path and query, percent-encoded
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes | None = None
    target_leader: bool = False
    writes: bool = False
    safe_to_resend: bool = True
    ok_statuses: frozenset[int] = OK
    timeout_s: float | None = None  # None: the client's own timeout
    long_poll: bool = False  # the server may hold it open for long (a watch): see Call's deadline
    deadline_s: float | None = None  # None: the retry policy's (a keep-alive gives up sooner)


@dataclass(frozen=True, slots=True)
class Answer:
    """A response as the parsers need it."""

    status: int
    headers: Mapping[str, str]
    content: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.content)
        except ValueError:
            raise ServerError("Malformed answer", f"HTTP {self.status} body is not JSON: {self.content[:80]!r}") from None

    def metadata_version(self) -> int | None:
        return header_int(self.headers, "x-metadata-version")


def header_int(headers: Mapping[str, str], name: str) -> int | None:
    text = headers.get(name, "").strip().strip('"')
    return int(text) if text.isdigit() else None


def utf8(what: str, text: str) -> bytes:
    """``text`` as UTF-8; a str that has none (a lone surrogate) is ``InvalidRequest``."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"Invalid {what}", f"{text!r} is not valid UTF-8 ({exc.reason})") from None


def key_path(key: str) -> str:
    """``/v1/kv/<key>`` with everything but unreserved characters and ``/`` percent-encoded,
    and the dots of a ``.`` or ``..`` segment too: URL normalization would resolve them
    (``a/../b`` would write ``b``)."""
    segments = utf8("key", key).split(b"/")
    return "/v1/kv/" + "/".join("%2E" * len(segment) if segment in (b".", b"..") else quote(segment, safe="")
                                for segment in segments)


def with_query(path: str, params: Mapping[str, object | None]) -> str:
    present = {name: str(value).lower() if isinstance(value, bool) else utf8(name, str(value))
               for name, value in params.items() if value is not None}
    return f"{path}?{urlencode(present, quote_via=quote, safe='/')}" if present else path


def value_bytes(value: bytes | str, content_type: str | None) -> tuple[bytes, str | None]:
    """A value to send: a str is UTF-8 text unless a content type says otherwise."""
    if isinstance(value, str):
        return utf8("value", value), content_type or TEXT_CONTENT_TYPE
    return bytes(value), content_type


# ---------------------------------------------------------------------------- reads


def read_params(consistency: str, min_version: int | None, wait_ms: int | None,
                at_version: int | None = None) -> dict[str, object | None]:
    return {"consistency": None if consistency == "local" else consistency, "min_version": min_version or None,
            "wait_ms": wait_ms if min_version or at_version is not None else None, "at_version": at_version}


def get_request(key: str, params: Mapping[str, object | None]) -> Request:
    return Request("GET", with_query(key_path(key), params), target_leader=params.get("consistency") is not None,
                   ok_statuses=frozenset({200, 404}))


@parses_answer
def parse_get(key: str, answer: Answer) -> KeyValue | None:
    if answer.status == 404:
        return None
    headers = answer.headers
    mod_version = header_int(headers, "etag")
    create_version = header_int(headers, "x-create-version")
    if mod_version is None or create_version is None:
        raise ServerError("Malformed answer", f"GET {key!r} answered without ETag or X-Create-Version")
    return KeyValue(key, answer.content, headers.get("content-type", ""), mod_version, create_version,
                    header_int(headers, "x-lease") or 0)


def list_request(prefix: str, limit: int, after: str | None, keys_only: bool,
                 params: Mapping[str, object | None]) -> Request:
    query = {"prefix": prefix, "limit": limit, "after": after, "keys_only": keys_only or None, **params}
    return Request("GET", with_query("/v1/kv", query), target_leader=params.get("consistency") is not None)


@parses_answer
def parse_list(answer: Answer) -> ListResult:
    body = answer.json()
    return ListResult(int(body["version"]), [key_value_of(item) if "value" in item else _key_only(item)
                                             for item in body["items"]], body.get("next"))


def _key_only(item: dict[str, Any]) -> KeyValue:
    return key_value_of({**item, "value": ""})


# ---------------------------------------------------------------------------- writes


def applies_at_most_once(if_version: int | None) -> bool:
    """Whether a write with this condition can be re-sent after an unknown outcome: a first
    apply moves the key's mod_version past ``if_version`` for good. Not so for "missing"
    (0, or ``create``): a delete in between makes it hold again and a re-send apply twice."""
    return if_version is not None and if_version > 0


def put_request(key: str, value: bytes | str, content_type: str | None, if_version: int | None,
                create_only: bool, lease_id: int | None = None) -> Request:
    body, media_type = value_bytes(value, content_type)
    if media_type is not None and not (media_type.isascii() and media_type.isprintable()):
        raise InvalidRequest("Invalid Content-Type", f"{media_type!r}: a media type is printable ASCII")
    headers = {"Content-Type": media_type} if media_type else {}
    if if_version is not None:
        headers["If-Match"] = f'"{if_version}"'
    if create_only:
        headers["If-None-Match"] = "*"
    return Request("PUT", with_query(key_path(key), {"lease": lease_id}), headers, body, target_leader=True,
                   writes=True, safe_to_resend=applies_at_most_once(if_version))


@parses_answer
def parse_put(answer: Answer) -> PutResult:
    body = answer.json()
    return PutResult(str(body["key"]), int(body["version"]), bool(body.get("created", False)))


def delete_request(key: str, if_version: int | None) -> Request:
    headers = {"If-Match": f'"{if_version}"'} if if_version is not None else {}
    return Request("DELETE", key_path(key), headers, target_leader=True, writes=True,
                   safe_to_resend=applies_at_most_once(if_version))


@parses_answer
def parse_delete(answer: Answer) -> DeleteResult:
    body = answer.json()
    return DeleteResult(str(body["key"]), int(body["version"]), bool(body.get("deleted", True)))


def txn_request(body: dict[str, Any]) -> Request:
    # Never re-sent after an unknown outcome: its failure branch may write too.
    return Request("POST", "/v1/txn", {"Content-Type": "application/json"}, json.dumps(body).encode(),
                   target_leader=True, writes=True, safe_to_resend=False)


@parses_answer
def parse_txn(answer: Answer) -> TxnResult:
    body = answer.json()
    results = []
    for result in body.get("results", []):
        if result.get("op") == "get" and result.get("found"):
            result = {**result, "kv": key_value_of(result)}
        results.append(result)
    return TxnResult(bool(body["succeeded"]), int(body["version"]), results, list(body.get("failed_compares", [])))


@parses_answer
def parse_status(answer: Answer) -> dict[str, Any]:
    body = answer.json()
    if not isinstance(body, dict):
        raise TypeError(f"a status is a JSON object, not {type(body).__name__}")
    return body


# ---------------------------------------------------------------------------- watch


WATCH_ANSWER_MARGIN_S = 10.0  # a long-poll answers after timeout_ms; allow this much on top


@dataclass(slots=True)
class WatchCursor:
    """Where a watch stands: the next long-poll asks for changes after ``since``, so a
    reconnect (to any node) neither repeats nor skips an event."""

    prefix: str
    since: int
    poll_timeout_ms: int

    def request(self) -> Request:
        query = {"prefix": self.prefix, "since": self.since, "timeout_ms": self.poll_timeout_ms}
        return Request("GET", with_query("/v1/watch", query),
                       timeout_s=self.poll_timeout_ms / 1000 + WATCH_ANSWER_MARGIN_S, long_poll=True)

    @parses_answer
    def accept(self, answer: Answer) -> list[Event]:
        body = answer.json()
        events = [event_of(item) for item in body["events"] if int(item["mod_version"]) > self.since]
        self.since = max(self.since, int(body["version"]))  # a lagging node may answer a lower one
        return events
