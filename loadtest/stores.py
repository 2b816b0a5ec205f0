"""One client interface over two stores, so every scenario drives metakv and etcd alike.

A scenario calls ``Store.put/get/delete/create/cas/list_prefix/put_many``; the adapter turns
that into metakv's HTTP API (docs/api.md) or etcd's v3 JSON gateway (base64 keys and
values, ``/v3/kv/*``). Both adapters follow the same client rules, which are what a careful
production client does and what makes the comparison fair:

- every request has an operation name (``name=``), so Locust groups statistics by operation;
- reads go to this user's "home" endpoint, spreading reads over every node of the cluster;
- metakv writes follow 307 redirects to the leader and remember it (a smart client), etcd
  writes go to the home member, which forwards to its leader internally;
- a connection error marks the request failed and moves this user to the next endpoint,
  like etcd's clientv3 endpoint balancer.

This module and the locustfile import only Locust and the standard library, so the Locust
containers of docker-compose.yml run them from a mounted ./loadtest folder.

Requests travel through an ``HttpTransport``: inside Locust it is the user's FastHttpSession
(so statistics are recorded), outside Locust (preloading, end-of-run checks) it is urllib.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote, urlencode, urlsplit


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range_end for every key starting with ``prefix`` (clientv3.GetPrefixRangeEnd).
    Not imported from app/etcd: the Locust image of the compose profile holds only loadtest/."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b"\0"


REDIRECTS_MAX = 3  # a write is re-sent at most this many times after 307
TXN_OPS_MAX = 100  # preload batch size; etcd's default --max-txn-ops is 128
TXN_BYTES_MAX = 1024 * 1024  # preload batch bytes; etcd's default --max-request-bytes is 1.5 MiB
CONTENT_TYPE_OCTETS = "application/octet-stream"


class OperationFailed(Exception):
    """The request failed (and, inside Locust, was already recorded as a failed request).
    The locustfile turns it into Locust's RescheduleTask, which ends the task iteration
    quietly; this module does not import Locust, whose import monkey-patches the process."""


@dataclass(frozen=True, slots=True)
class Reply:
    """A response; header names are lower-case."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True, slots=True)
class Entry:
    key: str
    value: bytes
    mod_version: int


@dataclass(frozen=True, slots=True)
class CasOutcome:
    """``won``: the compare held and the value was written at ``version``. Otherwise the
    race was lost and ``version`` is the key's current mod version."""

    won: bool
    version: int


@dataclass(frozen=True, slots=True)
class Deleted:
    """``existed``: the key was there and the delete produced ``version`` (and an event);
    otherwise nothing changed and ``version`` is just the store's current version."""

    version: int
    existed: bool


@dataclass(slots=True)
class WatchEvent:
    kind: str  # "put" | "delete"
    key: str
    mod_version: int
    value: bytes | None


@dataclass(slots=True)
class WatchBatch:
    """Events after some version; ``covered_version`` is the version through which the
    store promises the batch is complete (metakv's long-poll ``version``), or 0 when the
    protocol makes no such promise (etcd's stream)."""

    covered_version: int
    events: list[WatchEvent] = field(default_factory=list)


class HttpTransport(Protocol):
    def call(
        self,
        method: str,
        url: str,
        *,
        name: str,
        ok: dict[int, str | None],
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """Send one request. ``ok`` maps each acceptable status to the statistics name it is
        recorded under (None: keep ``name``); any other status, or no answer, is recorded as
        a failure and raises OperationFailed."""


class LocustHttp:
    """Transport over a Locust FastHttpSession: every request lands in Locust's statistics."""

    def __init__(self, session: Any) -> None:
        self.session = session
        # Redirects are followed by the adapter (to count them and cache the leader), never
        # silently by the HTTP client.
        session.client.redirect_response_codes = frozenset()

    def call(
        self,
        method: str,
        url: str,
        *,
        name: str,
        ok: dict[int, str | None],
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        with self.session.request(
            method, url, name=name, data=body, headers=headers or {}, catch_response=True
        ) as response:
            status = response.status_code or 0
            if status in ok:
                renamed = ok[status]
                if renamed is not None:
                    response.request_meta["name"] = renamed
                response.success()
                headers = {str(key).lower(): str(value) for key, value in (response.headers or {}).items()}
                return Reply(status, headers, response.content or b"")
            response.failure(_describe_failure(status, response.content, response.error))
        raise OperationFailed(f"{method} {url}: {status}")


class PlainHttp:
    """Transport over urllib for work that must not count as load (preload, final checks).
    Cooperative under gevent because Locust monkey-patches the socket module."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s

    def call(
        self,
        method: str,
        url: str,
        *,
        name: str,
        ok: dict[int, str | None],
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            with opener.open(request, timeout=self.timeout_s) as response:
                reply = Reply(response.status, _lower_keys(response.headers.items()), response.read())
        except urllib.error.HTTPError as error:
            reply = Reply(error.code, _lower_keys(error.headers.items()), error.read())
        except OSError as error:
            raise OperationFailed(f"{name}: {method} {url}: {error}") from error
        if reply.status not in ok:
            raise OperationFailed(f"{name}: {_describe_failure(reply.status, reply.body, None)}")
        return reply


def _lower_keys(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {str(key).lower(): str(value) for key, value in items}


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _describe_failure(status: int, body: bytes | None, error: Any) -> str:
    if status == 0:
        return f"no response: {type(error).__name__}: {error}"
    detail = ""
    if body:
        try:
            problem = json.loads(body)
            if isinstance(problem, dict):
                detail = str(problem.get("title") or problem.get("message") or problem.get("error") or "")
                if problem.get("indeterminate"):
                    detail += " (indeterminate)"
        except ValueError:
            detail = body[:80].decode("utf-8", "replace")
    return f"HTTP {status} {detail}".strip()


class Store:
    """What a scenario may do to a key-value metadata store. Versions are the store's own:
    metakv's metadata version, etcd's revision; both grow with every write."""

    kind = "abstract"

    def __init__(self, http: HttpTransport, endpoints: list[str], home_index: int = 0) -> None:
        if not endpoints:
            raise ValueError("a store needs at least one endpoint")
        self.http = http
        self.endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self.home_index = home_index % len(self.endpoints)

    @property
    def home(self) -> str:
        return self.endpoints[self.home_index]

    def _call(self, method: str, base: str, path: str, **kwargs: Any) -> Reply:
        try:
            return self.http.call(method, base + path, **kwargs)
        except OperationFailed:
            self._after_failure(base)
            raise

    def _after_failure(self, base: str) -> None:
        """Move to the next endpoint when the failing one was ours: a node may be down."""
        if base == self.home:
            self.home_index = (self.home_index + 1) % len(self.endpoints)

    # The operations every adapter provides.
    def put(self, key: str, value: bytes, *, name: str = "put") -> int:
        raise OperationFailed(f"{self.kind} cannot put")

    def create(self, key: str, value: bytes, *, name: str = "create") -> int | None:
        """Create ``key`` only if absent: the new version, or None when it already existed."""
        raise OperationFailed(f"{self.kind} cannot create")

    def get(self, key: str, *, name: str = "get", min_version: int = 0) -> Entry | None:
        raise OperationFailed(f"{self.kind} cannot get")

    def delete(self, key: str, *, name: str = "delete") -> Deleted:
        raise OperationFailed(f"{self.kind} cannot delete")

    def cas(self, key: str, expected_version: int, value: bytes, *, name: str = "cas") -> CasOutcome:
        raise OperationFailed(f"{self.kind} cannot cas")

    def list_prefix(self, prefix: str, *, limit: int, name: str = "list prefix", min_version: int = 0) -> list[Entry]:
        raise OperationFailed(f"{self.kind} cannot list")

    def put_many(self, items: Iterable[tuple[str, bytes]], *, name: str = "preload") -> int:
        """Write many ASCII values in a few transactions (preloading); the last version."""
        raise OperationFailed(f"{self.kind} cannot put_many")


class MetakvStore(Store):
    """metakv over its HTTP API. Reads are ``consistency=local`` on the home node with
    ``min_version`` when the scenario reads its own writes; writes go to the leader."""

    kind = "metakv"

    def __init__(self, http: HttpTransport, endpoints: list[str], home_index: int = 0) -> None:
        super().__init__(http, endpoints, home_index)
        self.leader: str | None = None  # learnt from 307 Location headers

    def _write(self, method: str, path: str, *, name: str, ok: dict[int, str | None], **kwargs: Any) -> Reply:
        base = self.leader or self.home
        following = dict(ok)
        following[307] = f"{name} (307 to leader)"
        for attempt in range(REDIRECTS_MAX + 1):
            # A 307 on the last allowed attempt is recorded as a failure (redirect loop).
            accept = following if attempt < REDIRECTS_MAX else ok
            try:
                reply = self.http.call(method, base + path, name=name, ok=accept, **kwargs)
            except OperationFailed:
                self.leader = None
                self._after_failure(base)
                raise
            if reply.status != 307:
                return reply
            location = reply.headers.get("location", "")
            parts = urlsplit(location)
            if not (parts.scheme and parts.netloc):
                raise RuntimeError(f"307 without an absolute Location: {location!r}")  # a server bug: surfaces as a Locust exception
            base = f"{parts.scheme}://{parts.netloc}"
            self.leader = base
        raise OperationFailed(f"{name}: more than {REDIRECTS_MAX} redirects")  # unreachable: recorded above

    @staticmethod
    def _key_path(key: str) -> str:
        return "/v1/kv/" + quote(key, safe="/")

    def put(self, key: str, value: bytes, *, name: str = "put") -> int:
        reply = self._write(
            "PUT", self._key_path(key), name=name, ok={200: None}, body=value,
            headers={"Content-Type": CONTENT_TYPE_OCTETS},
        )
        return int(reply.json()["version"])

    def create(self, key: str, value: bytes, *, name: str = "create") -> int | None:
        reply = self._write(
            "PUT", self._key_path(key), name=name, ok={200: None, 412: f"{name}: exists"}, body=value,
            headers={"Content-Type": CONTENT_TYPE_OCTETS, "If-None-Match": "*"},
        )
        return int(reply.json()["version"]) if reply.status == 200 else None

    def delete(self, key: str, *, name: str = "delete") -> Deleted:
        reply = self._write("DELETE", self._key_path(key), name=name, ok={200: None})
        document = reply.json()
        return Deleted(int(document["version"]), bool(document.get("deleted", True)))

    def cas(self, key: str, expected_version: int, value: bytes, *, name: str = "cas") -> CasOutcome:
        reply = self._write(
            "PUT", self._key_path(key), name=name,
            ok={200: f"{name}: won", 412: f"{name}: lost race"}, body=value,
            headers={"Content-Type": CONTENT_TYPE_OCTETS, "If-Match": f'"{expected_version}"'},
        )
        document = reply.json()
        if reply.status == 200:
            return CasOutcome(True, int(document["version"]))
        return CasOutcome(False, int(document.get("current_version") or 0))

    def get(self, key: str, *, name: str = "get", min_version: int = 0) -> Entry | None:
        query = f"?min_version={min_version}" if min_version > 0 else ""
        reply = self._call("GET", self.home, self._key_path(key) + query, name=name, ok={200: None, 404: None})
        if reply.status == 404:
            return None
        etag = reply.headers.get("etag", "").strip('"')
        return Entry(key, reply.body, int(etag))

    def list_prefix(self, prefix: str, *, limit: int, name: str = "list prefix", min_version: int = 0) -> list[Entry]:
        params: dict[str, Any] = {"prefix": prefix, "limit": limit}
        if min_version > 0:
            params["min_version"] = min_version
        reply = self._call("GET", self.home, "/v1/kv?" + urlencode(params), name=name, ok={200: None})
        return [
            Entry(item["key"], _item_value(item), int(item["mod_version"]))
            for item in reply.json()["items"]
        ]

    def put_many(self, items: Iterable[tuple[str, bytes]], *, name: str = "preload") -> int:
        version = 0
        for chunk in _chunks(list(items)):
            operations = [
                {"op": "put", "key": key, "value": value.decode("ascii"), "content_type": CONTENT_TYPE_OCTETS}
                for key, value in chunk
            ]
            body = json.dumps({"compare": [], "success": operations, "failure": []}).encode()
            reply = self._write("POST", "/v1/txn", name=name, ok={200: None}, body=body,
                                headers={"Content-Type": "application/json"})
            version = int(reply.json()["version"])
        return version

    def watch(self, prefix: str, since_version: int, timeout_ms: int, *, name: str = "watch poll") -> WatchBatch:
        """One long poll: returns as soon as a change after ``since_version`` exists."""
        query = urlencode({"prefix": prefix, "since": since_version, "timeout_ms": timeout_ms})
        reply = self._call("GET", self.home, "/v1/watch?" + query, name=name, ok={200: None})
        document = reply.json()
        events = [
            WatchEvent(
                event["type"], event["key"], int(event["mod_version"]),
                _item_value(event) if "value" in event and event["value"] is not None else None,
            )
            for event in document["events"]
        ]
        return WatchBatch(int(document["version"]), events)


class EtcdStore(Store):
    """etcd 3.4 over its v3 JSON gateway. Reads are etcd's default (linearizable), which is
    how an etcd client reads its own writes from any member."""

    kind = "etcd"

    def _post(self, path: str, document: dict[str, Any], *, name: str) -> dict[str, Any]:
        body = json.dumps(document).encode()
        reply = self._call("POST", self.home, path, name=name, ok={200: None}, body=body,
                           headers={"Content-Type": "application/json"})
        return reply.json()

    def put(self, key: str, value: bytes, *, name: str = "put") -> int:
        answer = self._post("/v3/kv/put", {"key": b64(key), "value": b64(value)}, name=name)
        return int(answer["header"]["revision"])

    def create(self, key: str, value: bytes, *, name: str = "create") -> int | None:
        document = {
            "compare": [{"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": b64(key), "value": b64(value)}}],
            "failure": [],
        }
        answer = self._call_renamed(
            "/v3/kv/txn", json.dumps(document).encode(), name=name, lost_name=f"{name}: exists"
        )
        return int(answer["header"]["revision"]) if answer.get("succeeded") else None

    def delete(self, key: str, *, name: str = "delete") -> Deleted:
        answer = self._post("/v3/kv/deleterange", {"key": b64(key)}, name=name)
        return Deleted(int(answer["header"]["revision"]), int(answer.get("deleted", 0)) > 0)

    def cas(self, key: str, expected_version: int, value: bytes, *, name: str = "cas") -> CasOutcome:
        document = {
            "compare": [{"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(expected_version)}],
            "success": [{"request_put": {"key": b64(key), "value": b64(value)}}],
            "failure": [{"request_range": {"key": b64(key), "keys_only": True}}],
        }
        answer = self._call_renamed(
            "/v3/kv/txn", json.dumps(document).encode(), name=f"{name}: won", lost_name=f"{name}: lost race"
        )
        if answer.get("succeeded"):
            return CasOutcome(True, int(answer["header"]["revision"]))
        kvs = answer["responses"][0]["response_range"].get("kvs") or []
        return CasOutcome(False, int(kvs[0]["mod_revision"]) if kvs else 0)

    def _call_renamed(
        self, path: str, body: bytes, *, name: str, lost_name: str
    ) -> dict[str, Any]:
        """A txn whose statistics name depends on whether its compare held. The gateway
        answers 200 either way, so the name is decided from the body before recording."""
        http = self.http
        if isinstance(http, LocustHttp):
            base = self.home
            with http.session.request(
                "POST", base + path, name=name, data=body,
                headers={"Content-Type": "application/json"}, catch_response=True,
            ) as response:
                status = response.status_code or 0
                if status == 200:
                    answer = json.loads(response.content)
                    if not answer.get("succeeded"):
                        response.request_meta["name"] = lost_name
                    response.success()
                else:
                    response.failure(_describe_failure(status, response.content, response.error))
                    answer = None
            if answer is None:
                self._after_failure(base)
                raise OperationFailed(f"{name}: {status}")
        else:
            answer = self._call("POST", self.home, path, name=name, ok={200: None}, body=body,
                                headers={"Content-Type": "application/json"}).json()
        return answer

    def get(self, key: str, *, name: str = "get", min_version: int = 0) -> Entry | None:
        answer = self._post("/v3/kv/range", {"key": b64(key)}, name=name)
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        return Entry(key, _unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"]))

    def list_prefix(self, prefix: str, *, limit: int, name: str = "list prefix", min_version: int = 0) -> list[Entry]:
        answer = self._post(
            "/v3/kv/range",
            {"key": b64(prefix), "range_end": b64(prefix_end(prefix.encode())), "limit": str(limit)},
            name=name,
        )
        return [
            Entry(_unb64(kv["key"]).decode(), _unb64(kv.get("value", "")), int(kv["mod_revision"]))
            for kv in answer.get("kvs") or []
        ]

    def put_many(self, items: Iterable[tuple[str, bytes]], *, name: str = "preload") -> int:
        revision = 0
        for chunk in _chunks(list(items)):
            document = {
                "compare": [],
                "success": [{"request_put": {"key": b64(key), "value": b64(value)}} for key, value in chunk],
                "failure": [],
            }
            answer = self._post("/v3/kv/txn", document, name=name)
            revision = int(answer["header"]["revision"])
        return revision

    def watch_request(self, prefix: str, since_version: int) -> bytes:
        """The body that opens a gateway watch stream for changes after ``since_version``."""
        return json.dumps({
            "create_request": {
                "key": b64(prefix),
                "range_end": b64(prefix_end(prefix.encode())),
                "start_revision": str(since_version + 1),
            }
        }).encode()


def parse_etcd_watch_message(line: bytes) -> WatchBatch | None:
    """One newline-delimited message of the gateway's watch stream; None for messages that
    carry no events (the "created" acknowledgement, progress notifications)."""
    document = json.loads(line)
    result = document.get("result") or {}
    if "error" in document:
        raise OperationFailed(f"watch stream error: {document['error']}")
    events = []
    for event in result.get("events") or []:
        kv = event["kv"]
        kind = "delete" if event.get("type") == "DELETE" else "put"
        value = _unb64(kv["value"]) if kind == "put" and "value" in kv else None
        events.append(WatchEvent(kind, _unb64(kv["key"]).decode(), int(kv["mod_revision"]), value))
    if not events:
        return None
    return WatchBatch(0, events)


def make_store(kind: str, http: HttpTransport, endpoints: list[str], home_index: int = 0) -> Store:
    if kind == "metakv":
        return MetakvStore(http, endpoints, home_index)
    if kind == "etcd":
        return EtcdStore(http, endpoints, home_index)
    raise ValueError(f"unknown store kind {kind!r} (metakv or etcd)")


def wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


def b64(data: str | bytes) -> str:
    """Base64 text of ``data`` (UTF-8 first when it is text): how etcd's JSON gateway takes keys and values."""
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text) if text else b""


def _item_value(item: dict[str, Any]) -> bytes:
    value = item.get("value")
    if value is None:
        return b""
    if item.get("encoding") == "base64":
        return base64.b64decode(value)
    return str(value).encode()


def _chunks(items: list[tuple[str, bytes]]) -> Iterable[list[tuple[str, bytes]]]:
    """Preload batches within both stores' request limits (TXN_OPS_MAX, TXN_BYTES_MAX)."""
    chunk: list[tuple[str, bytes]] = []
    chunk_bytes = 0
    for key, value in items:
        size = len(key) + len(value)
        if chunk and (len(chunk) >= TXN_OPS_MAX or chunk_bytes + size > TXN_BYTES_MAX):
            yield chunk
            chunk, chunk_bytes = [], 0
        chunk.append((key, value))
        chunk_bytes += size
    if chunk:
        yield chunk
