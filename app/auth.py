"""Bearer-token auth for the HTTP API: a token file, and a pure ASGI middleware enforcing it.

Why it looks like this. Operators coming from Consul ACLs or etcd roles expect tokens with
rules on key prefixes, the most specific prefix winning, and a separate right for cluster
operations; they also expect the server never to hold the secrets themselves. So the token
file (TOML, docs/http.md "Auth") lists tokens by name with the SHA-256 of the secret and a
table of rules, ``prefix = "deny" | "read" | "write" | "admin"`` (each level implies the
ones before it; ``admin`` only on the prefix ``""``, and it is what the admin routes need).

The check is a middleware, not a FastAPI dependency, for two reasons: it must run before
anything the routes do (a follower's 307 redirect included, so a client learns nothing
without a valid token), and it must not touch the routes of app/http.py, whose hot path is
tuned separately. It maps method and path to the right needed, exactly as the router and
the routes read them (``scope["path"]`` for routing, the raw path for the key, Starlette's
query parsing, last value wins), and for a txn reads the body once, bounded, checks every
key it touches, then replays the same bytes to the app.

Off by default: with no token file ``install_auth`` installs nothing, and nothing changes.

Operations: SIGHUP makes ``metakv serve`` read its token file again (``AuthTokens.reload``),
so tokens are added and revoked without a restart; a file that no longer validates is
refused with a log line and the tokens loaded before stay in force. Every 401 and 403 is
logged at WARNING (method, path, client address, why), at most ``DENIED_LOG_PER_S`` lines a
second so a client hammering with a bad token cannot flood the log; the lines held back are
counted in the next one.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.datastructures import QueryParams
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.toml_files import TomlFileError, read_toml

TOKENS_MAX = 10_000  # tokens per file; each request compares against all of them
RULES_PER_TOKEN_MAX = 1_000
TOKEN_NAME_MAX_CHARS = 128
PREFIX_MAX_BYTES = 1024  # a prefix longer than the longest key could never match a key
AUTHORIZATION_MAX_BYTES = 8192  # a longer Authorization header is refused without hashing it
SHA256_HEX_CHARS = 64
PROBLEM_MEDIA_TYPE = "application/problem+json"
PROBLEM_TYPE_PREFIX = "urn:metakv:problem:"
SECURITY_SCHEME = "bearerAuth"
REALM = "metakv"
DENIED_LOG_PER_S = 10  # denied-request log lines per second at most; the rest are counted

log = logging.getLogger("metakv.auth")

_KV_PREFIX = "/v1/kv/"
_KV_PREFIX_BYTES = b"/v1/kv/"
_ADMIN_PREFIX = "/v1/admin/"
_READ_METHODS = frozenset({"GET", "HEAD"})
_WRITE_METHODS = frozenset({"PUT", "DELETE"})
# Cluster views: topology, offsets and URLs, never keys or values. Any valid token may
# read them (`metakv status` and every client's leader discovery need them).
_AUTHENTICATED_ONLY_PATHS = frozenset({"/v1/status", "/v1/quorum"})
# Probes and scrapers, and the API's own description: open, like etcd's /health and /metrics.
_OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class Access(enum.IntEnum):
    """What a rule grants; each level implies the ones below it."""

    DENY = 0
    READ = 1
    WRITE = 2
    ADMIN = 3


class AuthFileError(ValueError):
    """The token file cannot be used; the message is one line naming the file."""


@dataclass(frozen=True, slots=True)
class Token:
    """One token: its name (for logs and 403 details), the SHA-256 hex of its secret, and
    its rules sorted longest prefix first (the most specific rule wins)."""

    name: str
    sha256_hex: str
    rules: tuple[tuple[str, Access], ...]

    def access_to_key(self, key: str) -> Access:
        """The rule of the longest prefix of ``key``; no rule at all denies."""
        for prefix, access in self.rules:
            if key.startswith(prefix):
                return access
        return Access.DENY

    def access_to_prefix(self, prefix: str) -> Access:
        """The access this token has to *every* key starting with ``prefix`` (list, watch):
        the weakest of the rule covering the prefix itself and of every more specific rule
        inside it, so a ``deny`` deeper down is never bypassed by listing its parent."""
        access = self.access_to_key(prefix)
        for rule_prefix, rule_access in self.rules:
            if len(rule_prefix) > len(prefix) and rule_prefix.startswith(prefix):
                access = min(access, rule_access)
        return access


@dataclass(frozen=True, slots=True)
class AuthPolicy:
    """The tokens of one token file."""

    path: str
    tokens: tuple[Token, ...]

    def authenticate(self, secret: bytes) -> Token | None:
        """The token whose hash matches, comparing against every token in constant time
        (no early exit), so timing tells nothing about which stored hash is close."""
        digest = hashlib.sha256(secret).hexdigest()
        found: Token | None = None
        for token in self.tokens:
            if hmac.compare_digest(digest, token.sha256_hex):
                found = token
        return found


class AuthTokens:
    """The policy in force, shared by every place auth is enforced, and replaced as a whole
    (one attribute store) when the token file is read again."""

    def __init__(self, policy: AuthPolicy) -> None:
        self.policy = policy

    def reload(self) -> bool:
        """Read the token file again; on any problem keep the current tokens. Says what
        happened in one log line either way; returns whether the new file took effect."""
        try:
            policy = load_auth_policy(self.policy.path)
        except AuthFileError as exc:
            log.error("auth: token file not reloaded, keeping the %d tokens loaded before: %s",
                      len(self.policy.tokens), exc)
            return False
        before = {token.name for token in self.policy.tokens}
        after = {token.name for token in policy.tokens}
        self.policy = policy
        log.warning("auth: reloaded %s: %d tokens (added %s, removed %s)", policy.path, len(policy.tokens),
                    sorted(after - before) or "none", sorted(before - after) or "none")
        return True


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
        log.warning("auth: %d %s %s from %s: %s%s", status, scope.get("method", "?"), scope.get("path", "?"),
                    address, detail, f" ({held_back} more denied requests not logged)" if held_back else "")


def hash_token(secret: str) -> str:
    """The value of ``sha256`` in the token file for ``secret`` (docs/http.md has a shell
    one-liner that computes the same)."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# The token file


def load_auth_policy(path: str | os.PathLike[str]) -> AuthPolicy:
    """Read and validate a token file; every problem is one AuthFileError line naming it."""
    where = f"auth file {str(path)!r}"
    try:
        data = read_toml(path, where)
    except TomlFileError as exc:
        raise AuthFileError(str(exc)) from None
    unknown = sorted(set(data) - {"tokens"})
    if unknown:
        raise AuthFileError(f"{where}: unknown setting {unknown[0]!r} (expected only [[tokens]])")
    entries = data.get("tokens")
    if not isinstance(entries, list) or not entries:
        raise AuthFileError(f"{where}: no [[tokens]] entries (auth would refuse every request)")
    if len(entries) > TOKENS_MAX:
        raise AuthFileError(f"{where}: {len(entries)} tokens; at most {TOKENS_MAX} are allowed")
    tokens = tuple(_parse_token(where, index, entry) for index, entry in enumerate(entries, 1))
    _check_unique(where, "name", [token.name for token in tokens])
    _check_unique(where, "sha256", [token.sha256_hex for token in tokens])
    return AuthPolicy(str(path), tokens)


def _parse_token(where: str, index: int, entry: Any) -> Token:
    label = f"{where}: token #{index}"
    if not isinstance(entry, dict):
        raise AuthFileError(f"{label} must be a table")
    name = entry.get("name")
    if isinstance(name, str) and name.strip():
        label = f"{where}: token {name!r}"
    unknown = sorted(set(entry) - {"name", "sha256", "rules"})
    if unknown:
        raise AuthFileError(f"{label}: unknown field {unknown[0]!r} (expected name, sha256, rules)")
    if not isinstance(name, str) or not name.strip() or len(name) > TOKEN_NAME_MAX_CHARS:
        raise AuthFileError(f"{label}: name must be a non-empty string of at most {TOKEN_NAME_MAX_CHARS} characters")
    digest = entry.get("sha256")
    if not isinstance(digest, str) or len(digest) != SHA256_HEX_CHARS or any(
            c not in "0123456789abcdefABCDEF" for c in digest):
        raise AuthFileError(f"{label}: sha256 must be the {SHA256_HEX_CHARS} hex characters of the token's SHA-256 "
                            "(store the hash, never the token)")
    rules = entry.get("rules")
    if not isinstance(rules, dict) or not rules:
        raise AuthFileError(f'{label}: rules must be a table of key prefix = "deny" | "read" | "write" | "admin"')
    if len(rules) > RULES_PER_TOKEN_MAX:
        raise AuthFileError(f"{label}: {len(rules)} rules; at most {RULES_PER_TOKEN_MAX} are allowed")
    parsed: list[tuple[str, Access]] = []
    for prefix, value in rules.items():
        if not isinstance(value, str) or value.strip().upper() not in Access.__members__:
            raise AuthFileError(f'{label}: rule {prefix!r} = {value!r}: expected "deny", "read", "write" or "admin"')
        access = Access[value.strip().upper()]
        if access == Access.ADMIN and prefix != "":
            raise AuthFileError(f'{label}: rule {prefix!r} = "admin": admin is granted only on the prefix "" '
                                "(every key), since admin actions touch every key")
        if len(prefix.encode("utf-8", "surrogatepass")) > PREFIX_MAX_BYTES or "\x00" in prefix:
            raise AuthFileError(f"{label}: rule prefix {prefix[:40]!r}... is not a key prefix "
                                f"(at most {PREFIX_MAX_BYTES} bytes, no NUL)")
        parsed.append((prefix, access))
    parsed.sort(key=lambda rule: len(rule[0]), reverse=True)
    return Token(name.strip(), digest.lower(), tuple(parsed))


def _check_unique(where: str, field: str, values: list[str]) -> None:
    seen: set[str] = set()
    for value in values:
        if value in seen:
            shown = value if field == "name" else value[:12] + "..."
            raise AuthFileError(f"{where}: two tokens have the same {field} {shown!r}")
        seen.add(value)


# --------------------------------------------------------------------------------------------
# What a request needs


class Need(enum.Enum):
    OPEN = "open"  # no token at all
    AUTHENTICATED = "authenticated"  # any valid token
    KEY = "key"  # an access level on one key
    PREFIX = "prefix"  # an access level on every key under a prefix
    TXN = "txn"  # per key of the body
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
    is read the way app/http.py reads it, so both sides always mean the same key."""
    if path in open_paths:
        return _OPEN
    if path.startswith(_KV_PREFIX):
        key = _key_of(path, raw_path)
        if key is None:  # empty, NUL, too long or not UTF-8: the route refuses it, reading nothing
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
    if path.startswith(_ADMIN_PREFIX):
        return Requirement(Need.ADMIN, Access.ADMIN, "")
    return _AUTHENTICATED  # /v1/status, /v1/quorum, and paths no route serves (404)


def _key_of(path: str, raw_path: bytes | None) -> str | None:
    """app.http._key_from_request's reading: the raw path when it starts with /v1/kv/,
    else the router's decoded path."""
    if raw_path and raw_path.startswith(_KV_PREFIX_BYTES):
        raw_key = unquote_to_bytes(raw_path[len(_KV_PREFIX_BYTES):].split(b"?", 1)[0])
    else:
        raw_key = path[len(_KV_PREFIX):].encode("utf-8", "surrogatepass")
    if not raw_key or len(raw_key) > PREFIX_MAX_BYTES or b"\x00" in raw_key:
        return None
    try:
        return raw_key.decode("utf-8")
    except UnicodeDecodeError:
        return None


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
# The middleware


def _problem(method: str, status: int, slug: str, title: str, detail: str,
             headers: Iterable[tuple[bytes, bytes]] = ()) -> tuple[Message, Message]:
    """The start and body messages of an RFC 9457 problem document (no body for HEAD)."""
    body = json.dumps({"type": PROBLEM_TYPE_PREFIX + slug, "title": title, "status": status, "detail": detail},
                      separators=(",", ":")).encode()
    start: Message = {"type": "http.response.start", "status": status, "headers": [
        (b"content-type", PROBLEM_MEDIA_TYPE.encode()), (b"content-length", str(len(body)).encode()), *headers]}
    return start, {"type": "http.response.body", "body": b"" if method == "HEAD" else body}


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
        if problem.startswith("this node requires"):
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
        start, body = _problem(method, status, slug, title, detail, headers)
        await send(start)
        await send(body)


# --------------------------------------------------------------------------------------------
# Installing it, and documenting it in /openapi.json


def install_auth(app: FastAPI, tokens: AuthTokens | None, max_txn_body_bytes: int,
                 served_ahead: Iterable[BaseRoute] = ()) -> Callable[[ASGIApp], ASGIApp]:
    """Enforce the policy ``tokens`` holds (now and after each reload) on ``app`` and
    describe it in its OpenAPI document; no tokens (auth disabled, the default) installs
    nothing. Call after every route is defined and
    before the edge middleware, so 401/403 answers still carry the node headers and count
    in the request metrics. Returns the wrapper to put around any ASGI handler that app
    serves ahead of its middleware stack (the key routes), so auth applies to them too;
    ``served_ahead`` are the routes that only document such a handler, to document 401/403
    on them as well."""
    if tokens is None:
        return lambda handler: handler
    open_paths = _OPEN_PATHS | frozenset(
        path for path in (app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url) if path)
    for route in [*served_ahead, *app.routes]:
        if isinstance(route, APIRoute):
            _document_route(route, open_paths)
    original_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        schema = original_openapi()
        components = schema.setdefault("components", {})
        components.setdefault("securitySchemes", {})[SECURITY_SCHEME] = {
            "type": "http", "scheme": "bearer",
            "description": "a token of the node's token file (docs/http.md, Auth); "
                           "the file stores only its SHA-256",
        }
        schema.setdefault("security", [{SECURITY_SCHEME: []}])
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    denied_log = DeniedLog()  # one rate limit for both paths
    app.add_middleware(AuthMiddleware, tokens=tokens, max_txn_body_bytes=max_txn_body_bytes,
                       open_paths=open_paths, denied_log=denied_log)
    return lambda handler: AuthMiddleware(handler, tokens, max_txn_body_bytes, open_paths, denied_log)


_PROBLEM_CONTENT = {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}


def _document_route(route: APIRoute, open_paths: frozenset[str]) -> None:
    """Add the security requirement and the 401 (and 403) answers the middleware gives."""
    if route.path in open_paths:
        route.openapi_extra = {**(route.openapi_extra or {}), "security": []}
        return
    route.openapi_extra = {**(route.openapi_extra or {}), "security": [{SECURITY_SCHEME: []}]}
    route.responses = dict(route.responses)  # routes may share one responses dict
    route.responses[401] = {
        "description": "no valid bearer token (missing, malformed or unknown)",
        "content": _PROBLEM_CONTENT,
        "headers": {"WWW-Authenticate": {"schema": {"type": "string"}, "description": 'Bearer realm="metakv"'}},
    }
    if route.path not in _AUTHENTICATED_ONLY_PATHS:
        route.responses[403] = {"description": "the token lacks the right on this key, prefix or route",
                                "content": _PROBLEM_CONTENT}
