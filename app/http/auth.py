"""Bearer-token auth enforced on HTTP requests: one ASGI middleware in the one middleware
stack (inside the edge, so 401/403 answers carry the node headers and count in the request
metrics), and its description in /openapi.json. The token file and its rules are app/auth.py.

The check is a middleware, not a FastAPI dependency, for two reasons: it must run before
anything the routes do (a follower's 307 redirect included, so a client learns nothing
without a valid token), and it must cover the key routes' fast path, which FastAPI's
dependencies never see. It maps method and path to the right needed, exactly as the router
and the routes read them (``scope["path"]`` for routing, the raw path for the key, Starlette's
query parsing, last value wins), and for a txn reads the body once, bounded, checks every
key it touches, then replays the same bytes to the app.

Over HTTPS with client certificates (app/http/client_certs.py), a request without an
Authorization header whose certificate names a token (CN or SAN equal to its name) is that
token's request, as etcd's --client-cert-auth maps a certificate to a user.

Every 401 and 403 is logged at WARNING (method, path, client address, why), at most
``DENIED_LOG_PER_S`` lines a second so a client hammering with a bad token cannot flood the
log; the lines held back are counted in the next one.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.datastructures import QueryParams
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.auth import Access, AuthTokens, Token
from app.http.client_certs import client_cert_names
from app.http.log_text import loggable
from app.http.parsing import KEY_PATH_PREFIX, key_of_path
from app.http.problems import ProblemError, problem_body, problem_content, problem_start

SECURITY_SCHEME = "bearerAuth"
REALM = "metakv"
AUTHORIZATION_MAX_BYTES = 8192  # a longer Authorization header is refused without hashing it
DENIED_LOG_PER_S = 10  # denied-request log lines per second at most; the rest are counted

_ADMIN_PREFIX = "/v1/admin/"
_READ_METHODS = frozenset({"GET", "HEAD"})
_WRITE_METHODS = frozenset({"PUT", "DELETE"})
# Cluster views: topology, offsets and URLs, never keys or values. Any valid token may
# read them (`metakv status` and every client's leader discovery need them).
_AUTHENTICATED_ONLY_PATHS = frozenset({"/v1/status", "/v1/quorum"})
TOKEN_NAME_SCOPE_KEY = "metakv.token_name"  # set once authenticated; per-token caps read it
# Probes and scrapers, and the API's own description: open, like etcd's /health and /metrics.
_OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})

log = logging.getLogger("metakv.auth")


class Need(enum.Enum):
    OPEN = "open"  # no token at all
    AUTHENTICATED = "authenticated"  # any valid token
    KEY = "key"  # an access level on one key
    PREFIX = "prefix"  # an access level on every key under a prefix
    TXN = "txn"  # per key of the body
    SOME_WRITE = "some-write"  # write access to at least one key (the lease calls)
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Requirement:
    need: Need
    access: Access = Access.DENY
    target: str = ""


_OPEN = Requirement(Need.OPEN)
_AUTHENTICATED = Requirement(Need.AUTHENTICATED)


def requirement_for(method: str, path: str, raw_path: bytes | None, query_string: bytes,
                    open_paths: frozenset[str]) -> Requirement:
    """Which right ``method path`` needs. ``path`` is what the router matches on; the key
    is read by the function the key routes read it with, so both always mean the same key."""
    if path in open_paths:
        return _OPEN
    if path.startswith(KEY_PATH_PREFIX):
        try:
            key = key_of_path(path, raw_path)
        except ProblemError:  # empty, NUL, too long or not UTF-8: the route refuses it, reading nothing
            return _AUTHENTICATED
        if method in _READ_METHODS:
            return Requirement(Need.KEY, Access.READ, key)
        if method in _WRITE_METHODS:
            return Requirement(Need.KEY, Access.WRITE, key)
        return _AUTHENTICATED  # 405
    if path in ("/v1/kv", "/v1/watch"):
        if method in _READ_METHODS:
            return Requirement(Need.PREFIX, Access.READ, QueryParams(query_string).get("prefix", ""))
        return _AUTHENTICATED
    if path == "/v1/txn":
        return Requirement(Need.TXN) if method == "POST" else _AUTHENTICATED
    if path == "/v1/leases" or path.startswith("/v1/leases/"):
        return Requirement(Need.SOME_WRITE, Access.WRITE)
    if path.startswith(_ADMIN_PREFIX):
        return Requirement(Need.ADMIN, Access.ADMIN, "")
    return _AUTHENTICATED  # /v1/status, /v1/quorum, and paths no route serves (404)


class DeniedLog:
    """WARNING lines for refused requests, at most ``per_s`` a second (the rest counted)."""

    def __init__(self, per_s: int = DENIED_LOG_PER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._per_s = per_s
        self._clock = clock
        self._window_start_s = -1.0
        self._logged = 0
        self._held_back = 0

    def denied(self, scope: Scope, status: int, detail: str) -> None:
        now_s = self._clock()
        if now_s - self._window_start_s >= 1.0:
            self._window_start_s = now_s
            self._logged = 0
        if self._logged >= self._per_s:
            self._held_back += 1
            return
        self._logged += 1
        held_back, self._held_back = self._held_back, 0
        client = scope.get("client")
        address = f"{client[0]}:{client[1]}" if client else "unknown"
        log.warning("auth: %d %s %s from %s: %s%s", status, loggable(scope.get("method", "?")),
                    loggable(scope.get("path", "?")), address, loggable(detail),
                    f" ({held_back} more denied requests not logged)" if held_back else "")


def token_name(scope: Scope) -> str | None:
    """The name of the token that authenticated the request (None with auth off)."""
    return scope.get(TOKEN_NAME_SCOPE_KEY)


def token_of_certificate(tokens: AuthTokens, cert_names: tuple[str, ...]) -> Token | None:
    """The token named like the certificate's first name that names one (CN, then SANs)."""
    if not cert_names:
        return None
    by_name = {token.name: token for token in tokens.policy.tokens}
    return next((by_name[name] for name in cert_names if name in by_name), None)


class AuthMiddleware:
    """Answers 401 without a valid bearer token and 403 when the token lacks the right the
    request needs; everything else reaches the app unchanged (a txn's body replayed)."""

    def __init__(self, app: ASGIApp, tokens: AuthTokens, max_txn_body_bytes: int,
                 open_paths: frozenset[str] = _OPEN_PATHS, denied_log: DeniedLog | None = None) -> None:
        self.app = app
        self.tokens = tokens
        self.max_txn_body_bytes = max_txn_body_bytes
        self.open_paths = open_paths
        self.denied_log = denied_log if denied_log is not None else DeniedLog()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = str(scope.get("method", "GET"))
        requirement = requirement_for(method, str(scope.get("path", "")), scope.get("raw_path"),
                                      scope.get("query_string", b""), self.open_paths)
        if requirement.need == Need.OPEN:
            await self.app(scope, receive, send)
            return
        token, problem = self._authenticate(scope)
        if token is None:
            self.denied_log.denied(scope, 401, problem)
            await self._answer(send, method, 401, "unauthorized", "Unauthorized", problem,
                               [(b"www-authenticate", self._challenge(problem).encode())])
            return
        scope[TOKEN_NAME_SCOPE_KEY] = token.name
        if requirement.need == Need.TXN:
            await self._txn(scope, receive, send, token)
            return
        denied = self._denied(token, requirement)
        if denied:
            self.denied_log.denied(scope, 403, denied)
            await self._answer(send, method, 403, "forbidden", "Forbidden", denied)
            return
        await self.app(scope, receive, send)

    def _authenticate(self, scope: Scope) -> tuple[Token | None, str]:
        values = [value for name, value in scope.get("headers", ()) if name.lower() == b"authorization"]
        if not values:
            # No bearer token: a verified client certificate naming a token stands for it
            # (etcd's --client-cert-auth). A header, when sent, always wins.
            cert_names = client_cert_names(scope)
            token = token_of_certificate(self.tokens, cert_names)
            if token is not None:
                return token, ""
            if cert_names:
                return None, (f"the client certificate ({', '.join(cert_names[:3])}) names no token of this node: "
                              "send Authorization: Bearer <token>")
            return None, "this node requires a token: send Authorization: Bearer <token>"
        if len(values) > 1:
            return None, "send exactly one Authorization header"
        value = values[0]
        scheme, _, secret = value.strip().partition(b" ")
        secret = secret.strip()
        if scheme.lower() != b"bearer" or not secret:
            return None, "the Authorization header must be: Bearer <token>"
        if len(value) > AUTHORIZATION_MAX_BYTES:
            return None, "the token is not valid"
        token = self.tokens.policy.authenticate(secret)
        if token is None:
            return None, "the token is not valid"
        return token, ""

    @staticmethod
    def _challenge(problem: str) -> str:
        """RFC 6750: the bare challenge when no credentials came, invalid_token when they did."""
        if problem.startswith(("this node requires", "the client certificate")):
            return f'Bearer realm="{REALM}"'
        return f'Bearer realm="{REALM}", error="invalid_token"'

    @staticmethod
    def _denied(token: Token, requirement: Requirement) -> str:
        """Why ``token`` may not do this, or "" when it may."""
        if requirement.need == Need.KEY:
            if token.access_to_key(requirement.target) < requirement.access:
                return (f"token {token.name!r} lacks {requirement.access.name.lower()} access "
                        f"to the key {requirement.target!r}")
        elif requirement.need == Need.PREFIX:
            if token.access_to_prefix(requirement.target) < requirement.access:
                return (f"token {token.name!r} lacks {requirement.access.name.lower()} access "
                        f"to every key under the prefix {requirement.target!r}")
        elif requirement.need == Need.SOME_WRITE:
            if not any(access >= Access.WRITE for _prefix, access in token.rules):
                return f"token {token.name!r} lacks write access to any key (the lease calls need it)"
        elif requirement.need == Need.ADMIN:
            # The rule on "" itself: narrower rules limit keys, not cluster operations.
            if token.access_to_key("") < Access.ADMIN:
                return f"token {token.name!r} lacks admin access (a rule \"\" = \"admin\")"
        return ""

    async def _txn(self, scope: Scope, receive: Receive, send: Send, token: Token) -> None:
        """Check every key of the txn body, then replay the body to the app. A token with
        write on every key skips reading it."""
        method = str(scope.get("method"))
        if token.access_to_prefix("") >= Access.WRITE:
            await self.app(scope, receive, send)
            return
        body, complete = await self._read_body(receive)
        if not complete:
            if body is None:
                return  # the client went away mid-body
            await self._answer(send, method, 413, "body-too-large", "Body too large",
                               f"the txn body exceeds {self.max_txn_body_bytes} bytes")
            return
        try:
            needed = txn_keys(body)
        except TxnBodyError as exc:
            await self._answer(send, method, 422, "invalid-body", "Invalid txn body", str(exc))
            return
        for key, access in needed:
            denied = self._denied(token, Requirement(Need.KEY, access, key))
            if denied:
                self.denied_log.denied(scope, 403, f"txn: {denied}")
                await self._answer(send, method, 403, "forbidden", "Forbidden", f"txn: {denied}")
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, if it comes

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, bool]:
        """The whole body, or (partial, False) once it passes the bound, or (None, False)
        when the client disconnected."""
        chunks: list[bytes] = []
        received_bytes = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, False
            chunk = message.get("body", b"")
            received_bytes += len(chunk)
            if received_bytes > self.max_txn_body_bytes:
                return b"", False
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True

    @staticmethod
    async def _answer(send: Send, method: str, status: int, slug: str, title: str, detail: str,
                      headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        body = problem_body(status, slug, title, detail)
        await send(problem_start(status, body, headers))
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})


# --------------------------------------------------------------------------------------------
# The keys a txn body touches


class TxnBodyError(ValueError):
    """The txn body is not JSON of the documented shape (the route would answer 422 too)."""


def txn_keys(body: bytes) -> list[tuple[str, Access]]:
    """Every key a txn body touches with the access it needs: write for put and delete ops,
    read for get ops and compares, whichever branch runs. JSON objects keep the last of
    duplicate members, as the route's parser does."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise TxnBodyError("the txn body is not JSON") from exc
    if not isinstance(document, dict):
        raise TxnBodyError("the txn body must be a JSON object")
    needed: list[tuple[str, Access]] = []
    for item in _items(document, "compare"):
        needed.append((_string(item, "key"), Access.READ))
    for branch in ("success", "failure"):
        for item in _items(document, branch):
            op = _string(item, "op")
            needed.append((_string(item, "key"), Access.READ if op == "get" else Access.WRITE))
    return needed


def _items(document: dict[str, Any], member: str) -> Iterable[dict[str, Any]]:
    items = document.get(member, [])
    if not isinstance(items, list):
        raise TxnBodyError(f"{member} must be a list")
    for item in items:
        if not isinstance(item, dict):
            raise TxnBodyError(f"every item of {member} must be an object")
        yield item


def _string(item: dict[str, Any], member: str) -> str:
    value = item.get(member)
    if not isinstance(value, str):
        raise TxnBodyError(f"{member} must be a string")
    return value


# --------------------------------------------------------------------------------------------
# Documenting it in /openapi.json


def auth_open_paths(app: FastAPI) -> frozenset[str]:
    """The paths open without a token: the probes, the metrics and the API's own description."""
    return _OPEN_PATHS | frozenset(
        path for path in (app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url) if path)


def document_auth(routes: Iterable[BaseRoute], open_paths: frozenset[str]) -> None:
    """Add the security requirement and the 401 (and 403) answers the middleware gives to
    every route (the key routes' documentation included)."""
    for route in routes:
        if isinstance(route, APIRoute):
            _document_route(route, open_paths)


def add_security_scheme(schema: dict[str, Any]) -> None:
    """Declare the bearer scheme, required by default, in an OpenAPI document."""
    components = schema.setdefault("components", {})
    components.setdefault("securitySchemes", {})[SECURITY_SCHEME] = {
        "type": "http", "scheme": "bearer",
        "description": "a token of the node's token file (docs/http.md, Auth); "
                       "the file stores only its SHA-256",
    }
    schema.setdefault("security", [{SECURITY_SCHEME: []}])


def _document_route(route: APIRoute, open_paths: frozenset[str]) -> None:
    if route.path in open_paths:
        route.openapi_extra = {**(route.openapi_extra or {}), "security": []}
        return
    route.openapi_extra = {**(route.openapi_extra or {}), "security": [{SECURITY_SCHEME: []}]}
    route.responses = dict(route.responses)  # routes may share one responses dict
    route.responses[401] = {
        "description": "no valid bearer token (missing, malformed or unknown)",
        "content": problem_content(),
        "headers": {"WWW-Authenticate": {"schema": {"type": "string"}, "description": 'Bearer realm="metakv"'}},
    }
    if route.path not in _AUTHENTICATED_ONLY_PATHS:
        route.responses[403] = {"description": "the token lacks the right on this key, prefix or route",
                                "content": problem_content()}
