"""The key routes: GET, HEAD, PUT and DELETE /v1/kv/{key}, and the list GET /v1/kv.

The single-key endpoints are methods of ``KeyEndpoints``: the fast path
(app/http/key_fast_path.py) calls them, and ``key_documentation_router`` registers the very
same methods on a router that is never served, only documented in /openapi.json, so the
document and the parsing cannot drift apart. The list is an ordinary FastAPI route.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import Response

from app.http.conditions import IF_MATCH_PATTERN, check_condition, write_compares
from app.http.models import (
    CONTENT_TYPE_RE,
    MAX_LEASE_ID,
    NO_NUL_PATTERN,
    DeleteResult,
    ListResponse,
    WriteResult,
)
from app.http.parsing import KEY_ROUTE_TEMPLATE, header, read_body_bounded, wait_readable
from app.http.problems import Answer, ProblemError, problem_responses
from app.http.render import render_entry
from app.http.routing import add_get_and_head
from app.http.settings import (
    CONTENT_TYPE_MAX_BYTES,
    DEFAULT_WAIT_MS,
    KEY_MAX_BYTES,
    LIST_LIMIT_DEFAULT,
    LIST_LIMIT_MAX,
    MAX_VERSION,
    HttpSettings,
)
from app.service import DEFAULT_CONTENT_TYPE, KVService

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
    alias="If-Match", json_schema_extra={"pattern": IF_MATCH_PATTERN},  # enforced by conditions.parse_if_match
    description='"<mod_version>" (quotes optional): only if the key is at this version (compare-and-set); *: only if it '
                'exists. Weak tags (W/"<n>") never match (strong comparison); a list may hold one strong tag at most')]
LeaseQuery = Annotated[int, Query(ge=0, le=MAX_LEASE_ID, description=(
    "attach the key to this lease: it is deleted when the lease ends (0: none; a put without it "
    "detaches the key). 404 lease-not-found when the lease does not exist as the write applies"))]
IfNoneMatchHeader = Annotated[Literal["*"] | None, Header(
    alias="If-None-Match", description="*: only if the key does not exist")]


def _json_answer(document: dict[str, Any]) -> Answer:
    body = orjson.dumps(document)  # compact, UTF-8 unescaped: the bytes FastAPI's JSONResponse wrote
    return Answer(200, [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")], body)


class KeyEndpoints:
    """The single-key endpoints. Each returns the whole answer; errors are raised and mapped
    by app/http/problems.py. (No docstrings on the endpoints: FastAPI would publish them.)"""

    def __init__(self, service: KVService, settings: HttpSettings) -> None:
        self.service = service
        self.settings = settings

    async def get_key(self, request: Request, key: KeyPath, consistency: ConsistencyQuery = "local",
                      min_version: MinVersionQuery = None, wait_ms: WaitMsQuery = DEFAULT_WAIT_MS,
                      at_version: AtVersionQuery = None) -> Answer:
        # GET, and HEAD: the same headers, no body.
        await wait_readable(self.service, self.settings, consistency, min_version, wait_ms, at_version)
        entry = self.service.get(key, at_version=at_version).entry
        if entry is None:
            raise ProblemError(404, "key-not-found", "Key not found", f"no key {key!r}")
        content_type = entry.content_type if CONTENT_TYPE_RE.fullmatch(entry.content_type) else DEFAULT_CONTENT_TYPE
        headers = [(b"content-type", content_type.encode("latin-1")), (b"etag", f'"{entry.mod_version}"'.encode()),
                   (b"x-create-version", str(entry.create_version).encode()),
                   (b"content-length", str(len(entry.value)).encode())]
        if entry.lease:
            headers.append((b"x-lease", str(entry.lease).encode()))
        return Answer(200, headers, b"" if request.method == "HEAD" else entry.value)

    async def put_key(self, request: Request, key: KeyPath, lease: LeaseQuery = 0,
                      if_match: IfMatchHeader = None, if_none_match: IfNoneMatchHeader = None) -> Answer:
        content_type = header(request.scope, b"content-type") or DEFAULT_CONTENT_TYPE
        if len(content_type) > CONTENT_TYPE_MAX_BYTES or not CONTENT_TYPE_RE.fullmatch(content_type):
            raise ProblemError(400, "invalid-content-type", "Invalid Content-Type",
                               f"Content-Type must be a media type (type/subtype; name=value) of at most {CONTENT_TYPE_MAX_BYTES} characters")
        compares = write_compares(key, if_match, if_none_match)
        value = await read_body_bounded(request, self.settings.max_value_bytes, "the value", "value-too-large")
        result = await self.service.put(key, value, content_type, compares, lease)
        check_condition(result, key)
        return _json_answer({"key": key, "version": result.version, "created": bool(result.ops[0].created)})

    async def delete_key(self, request: Request, key: KeyPath,
                         if_match: IfMatchHeader = None, if_none_match: IfNoneMatchHeader = None) -> Answer:
        compares = write_compares(key, if_match, if_none_match)
        result = await self.service.delete(key, compares)
        check_condition(result, key)
        return _json_answer({"key": key, "version": result.version, "deleted": bool(result.ops[0].deleted)})


def key_documentation_router(endpoints: KeyEndpoints) -> APIRouter:
    """The key routes as FastAPI would serve them: never served, only documented."""
    router = APIRouter(tags=["keys"])
    read_statuses = problem_responses(307, 400, 404, 410, 413, 503, 504)
    write_statuses = problem_responses(307, 400, 412, 413, 503, 504)
    put_statuses = problem_responses(307, 400, 404, 412, 413, 503, 504, 507)
    value_response = {200: {
        "description": "the value as raw bytes with its stored Content-Type",
        "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}},
        "headers": {"ETag": {"schema": {"type": "string"}, "description": '"<mod_version>"'},
                    "X-Create-Version": {"schema": {"type": "integer"}},
                    "X-Lease": {"schema": {"type": "integer"}, "description": "the key's lease, when attached"}},
    }}
    router.add_api_route(
        KEY_ROUTE_TEMPLATE, endpoints.get_key, methods=["GET"], name="get_key",
        summary="Read a key", response_class=Response, response_model=None,
        responses={**value_response, **read_statuses})
    router.add_api_route(
        KEY_ROUTE_TEMPLATE, endpoints.get_key, methods=["HEAD"], name="head_key",
        summary="The headers of GET", response_class=Response, response_model=None,
        responses={200: {"description": "the headers of GET, no body", "headers": value_response[200]["headers"]},
                   **read_statuses})
    router.add_api_route(
        KEY_ROUTE_TEMPLATE, endpoints.put_key, methods=["PUT"], name="put_key",
        summary="Set a key to the request body", response_model=WriteResult, responses=put_statuses,
        openapi_extra={"requestBody": {"required": False, "description": "the value; its Content-Type is stored",
                                       "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                                                   "text/plain": {"schema": {"type": "string"}}}}})
    router.add_api_route(
        KEY_ROUTE_TEMPLATE, endpoints.delete_key, methods=["DELETE"], name="delete_key",
        summary="Delete a key (writes a tombstone)", response_model=DeleteResult, responses=write_statuses)
    return router


def list_router(service: KVService, settings: HttpSettings) -> APIRouter:
    """GET (and HEAD) /v1/kv: entries under a prefix, all at one version."""
    router = APIRouter(tags=["keys"])

    async def list_keys(
        prefix: Annotated[str, Query(description="only keys starting with this")] = "",
        limit: Annotated[int, Query(ge=1, le=LIST_LIMIT_MAX)] = LIST_LIMIT_DEFAULT,
        after: Annotated[str | None, Query(description="start after this key (the previous page's next)")] = None,
        keys_only: Annotated[bool, Query(description="leave values out")] = False,
        consistency: ConsistencyQuery = "local", min_version: MinVersionQuery = None,
        wait_ms: WaitMsQuery = DEFAULT_WAIT_MS, at_version: AtVersionQuery = None,
    ) -> Response:
        await wait_readable(service, settings, consistency, min_version, wait_ms, at_version)
        page = service.list(prefix, after=after, limit=limit, at_version=at_version)
        body = {"version": page.version, "items": [render_entry(e, keys_only) for e in page.entries],
                "next": page.next_key}
        # orjson: the bytes JSONResponse's json.dumps wrote, at a tenth of its CPU (a page of
        # 100 entries took ~20 % of the leader's time per list request, py-spy --gil).
        return Response(orjson.dumps(body), media_type="application/json")

    add_get_and_head(router, "/v1/kv", list_keys, summary="List entries at one version", response_model=ListResponse,
                     responses=problem_responses(307, 400, 410, 503, 504))
    return router
