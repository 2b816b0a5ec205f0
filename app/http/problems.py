"""RFC 9457 problem documents: the one shape of every error answer, and the mapping of the
service's exceptions to them (docs/api.md "HTTP: common rules").

Every path that answers an error renders it here: the FastAPI routes through the exception
handlers ``install_problem_handlers`` registers, the key routes' fast path through
``problem_answer``, and the edge, auth and uvicorn's parser errors through ``problem_body``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Message, Scope, Send

from app.http.routing import downgrades_scheme
from app.service import (
    HistoryCompactedError,
    IndeterminateError,
    LeaseExistsError,
    LeaseNotFoundError,
    LeaseTtlError,
    NotLeaderError,
    NotReadyError,
    QuotaExceededError,
    ServiceError,
    SnapshotStorageError,
    VersionWaitTimeoutError,
    VoterChangeIndeterminateError,
    VoterChangeRefusedError,
    WriteRejectedError,
    WriteTooLargeError,
)

PROBLEM_MEDIA_TYPE = "application/problem+json"
PROBLEM_TYPE_PREFIX = "urn:metakv:problem:"
RETRY_AFTER_SECONDS = 1


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


def problem_body(status: int, slug: str, title: str, detail: str, extras: dict[str, Any] | None = None) -> bytes:
    """The JSON bytes of a problem document (members that are None are left out)."""
    document = {"type": PROBLEM_TYPE_PREFIX + slug, "title": title, "status": status, "detail": detail}
    document.update({name: value for name, value in (extras or {}).items() if value is not None})
    return json.dumps(document, separators=(",", ":")).encode()


def internal_error_body() -> bytes:
    """The 500 answer to an exception nobody expected; the error itself goes to the log only."""
    return problem_body(500, "internal-error", "Internal server error",
                        "the server failed to answer; the error is in its log")


def problem_start(status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()) -> Message:
    """The ASGI start message of the problem document ``body``."""
    return {"type": "http.response.start", "status": status, "headers": [
        (b"content-type", PROBLEM_MEDIA_TYPE.encode()), (b"content-length", str(len(body)).encode()), *headers]}


@dataclass(slots=True)
class Answer:
    """A response as its two ASGI messages carry it: what the key routes send directly, and
    what every problem document is rendered to (FastAPI's routes wrap it in a Response)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    async def send(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def problem_answer(problem: ProblemError, head: bool) -> Answer:
    """The problem document of ``problem``; a HEAD answer keeps the document's length only."""
    body = problem_body(problem.status, problem.slug, problem.title, problem.detail, problem.extras)
    headers = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in problem.headers.items()]
    headers.append((b"content-length", str(len(body)).encode()))
    headers.append((b"content-type", PROBLEM_MEDIA_TYPE.encode()))
    return Answer(problem.status, headers, b"" if head else body)


def _problem_response(request: Request, problem: ProblemError) -> Response:
    answer = problem_answer(problem, request.method == "HEAD")
    response = Response(answer.body, status_code=answer.status)
    response.raw_headers = answer.headers
    return response


def _not_leader_problem(exc: NotLeaderError, scope: Scope) -> ProblemError:
    """307 to the same path and query on the leader, or 503 when no leader is known."""
    leader = exc.leader_id if exc.leader_id >= 0 else None
    if not exc.leader_url:
        return ProblemError(503, "no-leader", "No leader", "no leader is known right now; retry",
                            headers={"Retry-After": str(RETRY_AFTER_SECONDS)}, leader=leader)
    if downgrades_scheme(scope, exc.leader_url):
        return ProblemError(503, "no-leader", "No leader", "the leader advertises a plain http URL; an https "
                            "request is not redirected there", headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                            leader=leader)
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


def history_compacted_body(oldest_version: int) -> tuple[str, dict[str, int]]:
    """The detail and extras of a 410: the SSE stream sends the same document as an event."""
    return (f"versions below {oldest_version} are no longer retained; re-list, then watch from the list's version",
            {"oldest_version": oldest_version})


def as_problem(exc: Exception, scope: Scope) -> ProblemError | None:
    """The problem document a route's exception answers with (docs/api.md); None for an
    exception nobody expected, which the edge turns into a logged 500. The one place the
    service's errors (app/service.py) meet HTTP statuses."""
    retry = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    if isinstance(exc, ProblemError):
        return exc
    if isinstance(exc, NotLeaderError):
        return _not_leader_problem(exc, scope)
    if isinstance(exc, SnapshotStorageError):
        if exc.disk_full:
            return ProblemError(507, "insufficient-storage", "Insufficient storage", str(exc))
        return ProblemError(503, "snapshot-io-error", "Snapshot I/O error", str(exc), headers=retry)
    if isinstance(exc, QuotaExceededError):
        return ProblemError(507, "quota-exceeded", "Storage quota exceeded", f"the write did not happen: {exc}")
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
    if isinstance(exc, LeaseNotFoundError):
        return ProblemError(404, "lease-not-found", "Lease not found", str(exc), lease=exc.lease_id)
    if isinstance(exc, LeaseExistsError):
        return ProblemError(409, "lease-exists", "Lease exists", str(exc))
    if isinstance(exc, LeaseTtlError):
        return ProblemError(400, "invalid-ttl", "Invalid TTL", str(exc))
    if isinstance(exc, HistoryCompactedError):
        detail, extras = history_compacted_body(exc.oldest_version)
        return ProblemError(410, "version-compacted", "Version compacted", detail, **extras)
    if isinstance(exc, VoterChangeRefusedError):
        status = _VOTER_CHANGE_STATUSES.get(exc.code, 409)
        return ProblemError(status, exc.code, "Voter change refused", f"nothing changed: {exc}",
                            headers=retry if status == 503 else None)
    if isinstance(exc, VoterChangeIndeterminateError):
        return ProblemError(504, "voter-change-indeterminate", "Voter change outcome unknown", str(exc),
                            indeterminate=True)
    return None


# A refused voter change's code -> status; the others (change-pending, already-voter,
# kraft-version-0, not-caught-up, last-voter) are 409: the cluster's state forbids it now.
_VOTER_CHANGE_STATUSES = {"unknown-voter": 404, "leader-not-ready": 503, "bad-voter": 400,
                          "raft-endpoint-unknown": 422}


def validation_errors(exc: ValidationError | RequestValidationError) -> list[dict[str, str]]:
    """Location and message of each error; never the offending input, which may be huge or binary."""
    return [{"location": ".".join(str(part) for part in error.get("loc", ())), "message": str(error.get("msg", ""))}
            for error in exc.errors()]


def describe(error: dict[str, str]) -> str:
    return f"{error['location']}: {error['message']}" if error["location"] else error["message"]


def invalid_parameters(errors: list[dict[str, str]]) -> ProblemError:
    detail = "; ".join(describe(e) for e in errors) or "invalid request"
    return ProblemError(400, "invalid-parameter", "Invalid parameter", detail, errors=errors)


def install_problem_handlers(app: FastAPI) -> None:
    """Answer every error of the FastAPI routes with a problem document: the service's
    errors, the routes' own, parameter validation (400, not FastAPI's 422), Starlette's 404
    and 405 (with every method the path serves), and the 500 of an unexpected exception
    (Starlette answers it, then re-raises it to the edge, which logs it)."""

    async def on_route_error(request: Request, exc: Exception) -> Response:
        problem = as_problem(exc, request.scope)
        if problem is None:
            raise exc
        return _problem_response(request, problem)

    async def on_validation(request: Request, exc: Exception) -> Response:
        errors = validation_errors(exc) if isinstance(exc, RequestValidationError) else []
        return _problem_response(request, invalid_parameters(errors))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        if not isinstance(exc, StarletteHTTPException):
            raise exc
        slug = {404: "not-found", 405: "method-not-allowed"}.get(exc.status_code, "http-error")
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(app, request.scope))
        return _problem_response(request, ProblemError(exc.status_code, slug, slug.replace("-", " ").capitalize(),
                                                       str(exc.detail), headers=headers))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        return Response(internal_error_body(), status_code=500, media_type=PROBLEM_MEDIA_TYPE)

    for error_class in (ProblemError, ServiceError):
        app.add_exception_handler(error_class, on_route_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


def _allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method any route serves at this path (Starlette names only the first route's)."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


_STATUS_DESCRIPTIONS = {
    307: "not the leader: Location is the same request on the leader's advertised URL",
    400: "invalid key or parameter",
    404: "no such key, or (lease-not-found) no such lease",
    409: "the lease id is taken",
    410: "the requested version is below the oldest retained version (oldest_version)",
    412: "the If-Match / If-None-Match condition failed (current_version)",
    413: "key or value (or body) too large",
    422: "the body is not JSON of the documented schema",
    429: "too many open watches on this node or for this token; retry after Retry-After",
    503: "no leader known, write rejected, or this node is not ready; retry after Retry-After",
    504: "indeterminate write outcome, or min_version not reached within wait_ms",
    507: "the leader's storage is past --quota-bytes (or its disk is full): the write did not happen",
}


def problem_content() -> dict[str, Any]:
    return {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries of problem statuses, so /openapi.json lists every status."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"description": _STATUS_DESCRIPTIONS[status], "content": problem_content()}
        if status == 307:
            entry["headers"] = {"Location": {"schema": {"type": "string"}, "description": "the leader's URL for this request"}}
        if status in (429, 503):
            entry["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
        responses[status] = entry
    return responses
