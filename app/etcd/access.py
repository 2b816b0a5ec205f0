"""etcd's auth on the etcd port, mapped onto metakv's token file (app/auth.py): the same
tokens and the same per-prefix rules the HTTP API enforces (app/http/auth.py).

The mapping. etcd's user is a token's ``name`` and its password the token's secret, so
``Auth.Authenticate(name, password)`` succeeds when the secret's SHA-256 is that token's; the
etcd token it answers is the secret itself, so every member accepts it, a token removed from
the file stops working at once (SIGHUP), and a client may also send a metakv token directly.
A call carries it in the metadata ``token`` (etcd's clients) or ``authorization`` (etcd's
gateway passes the ``Authorization`` header on; ``Bearer`` is accepted). Without one, a
verified client certificate naming a token stands for it, as on the HTTP API.

The rules: a key needs read (Range, a Txn's compares and range ops, Watch) or write (Put,
DeleteRange, a Txn's put and delete ops, either branch); a range needs the right on every key
under its common prefix (``Token.access_to_prefix``, so a deeper ``deny`` is never bypassed);
Compact needs admin; the lease calls write access to some key, as /v1/leases; Status,
MemberList and Alarm any valid token. Refusals are etcd's errors, and each gets its line in
the audit log (app/http/audit.py) naming the call, the client and the token.

Writes a follower forwards to the leader over the HTTP API carry the caller's secret
(``forwarding``), so the leader checks the same rules again; a follower's linearizable read
asks the leader for its version by listing a prefix the caller may read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from app.auth import Access, AuthTokens, Token
from app.etcd.errors import (
    AUTH_FAILED,
    AUTH_NOT_ENABLED,
    INVALID_TOKEN,
    PERMISSION_DENIED,
    USER_EMPTY,
    EtcdError,
)
from app.etcd.forwarding import Forwarding, set_forwarding
from app.etcd.front import Caller
from app.etcd.mapping import EtcdMapping, KeyRange, text_key
from app.etcd.protos import rpc_pb2
from app.http.audit import AuditLog
from app.http.auth import AUTHORIZATION_MAX_BYTES, token_of_certificate

TOKEN_METADATA = ("token", "authorization")




@dataclass(frozen=True, slots=True)
class Needed:
    """A right on the key ``target``, on every key under the prefix ``target`` (``prefix``),
    or on some key at least (``any_key``)."""

    access: Access
    target: str = ""
    prefix: bool = False
    any_key: bool = False


ADMIN = (Needed(Access.ADMIN),)
SOME_WRITE = (Needed(Access.WRITE, any_key=True),)  # the lease calls, as /v1/leases
AUTHENTICATED: tuple[Needed, ...] = ()


def on_range(access: Access, key: bytes, range_end: bytes) -> Needed:
    keys = KeyRange.of(key, range_end)
    if keys.single:
        return Needed(access, text_key(keys.start))
    return Needed(access, keys.list_prefix(), prefix=True)


def _op_needs(op: rpc_pb2.RequestOp) -> Iterator[Needed]:
    kind = op.WhichOneof("request")
    if kind == "request_range":
        yield on_range(Access.READ, op.request_range.key, op.request_range.range_end)
    elif kind == "request_put":
        yield on_range(Access.WRITE, op.request_put.key, b"")
    elif kind == "request_delete_range":
        yield on_range(Access.WRITE, op.request_delete_range.key, op.request_delete_range.range_end)
    elif kind == "request_txn":
        yield from txn_needs(op.request_txn)


def txn_needs(txn: rpc_pb2.TxnRequest) -> Iterator[Needed]:
    """Read on every compare, and every op of both branches (nested txns included)."""
    for compare in txn.compare:
        yield on_range(Access.READ, compare.key, compare.range_end)
    for op in (*txn.success, *txn.failure):
        yield from _op_needs(op)


def watch_needs(create: rpc_pb2.WatchCreateRequest) -> tuple[Needed, ...]:
    return (on_range(Access.READ, create.key, create.range_end),)


def lacks(token: Token, needed: Iterable[Needed]) -> str:
    """Why ``token`` may not do this ("" when it may)."""
    for need in needed:
        if need.any_key:
            if not any(access >= Access.WRITE for _prefix, access in token.rules):
                return f"token {token.name!r} lacks write access to any key (the lease calls need it)"
        elif need.access == Access.ADMIN:
            if token.access_to_key("") < Access.ADMIN:  # the rule on "" itself, as the admin routes
                return f"token {token.name!r} lacks admin access (a rule \"\" = \"admin\")"
        elif need.prefix:
            if token.access_to_prefix(need.target) < need.access:
                return (f"token {token.name!r} lacks {need.access.name.lower()} access to every key under "
                        f"the prefix {need.target!r}")
        elif token.access_to_key(need.target) < need.access:
            return f"token {token.name!r} lacks {need.access.name.lower()} access to the key {need.target!r}"
    return ""


def _readable_prefix(token: Token, needed: Sequence[Needed]) -> str:
    """A prefix ``token`` may list (a follower's barrier lists it on the leader): the call's
    own keys first, else one of the token's rules."""
    candidates = [need.target for need in needed if not need.any_key and need.access != Access.ADMIN]
    candidates += [prefix for prefix, access in token.rules if access >= Access.READ]
    return next((prefix for prefix in candidates if token.access_to_prefix(prefix) >= Access.READ), "")


def _secret_of(values: Sequence[str]) -> str | None:
    if not values:
        return None
    value = values[0].strip()
    scheme, _, rest = value.partition(" ")
    return rest.strip() if scheme.lower() == "bearer" and rest.strip() else value


class EtcdAuth:
    """The checks of one node's etcd port, on the node's token file (reloaded by SIGHUP)."""

    def __init__(self, tokens: AuthTokens, audit: AuditLog | None = None) -> None:
        self.tokens = tokens
        self.audit = audit if audit is not None else AuditLog()

    def authenticate(self, name: str, password: str, caller: Caller, call: str, method: str = "GRPC") -> str:
        """Auth.Authenticate: the etcd token (the secret) when ``name`` names its token."""
        token = self.tokens.policy.authenticate(password.encode()) if password else None
        if token is None or token.name != name:
            self._refused(method, call, caller, 401, f"authentication failed for the user {name!r}", None)
            raise EtcdError(*AUTH_FAILED)
        return password

    def check(self, call: str, caller: Caller, secrets: Sequence[str], needed: Iterable[Needed],
              method: str = "GRPC") -> Token:
        """The token of a call (``secrets``: its token metadata values, or the gateway's
        Authorization header) if it may do what it needs; else etcd's error, written to the
        audit log as ``method call`` (the gateway's: POST and its path)."""
        secret = _secret_of(secrets)
        if secret is None:
            token = token_of_certificate(self.tokens, caller.cert_names)
            if token is None:
                self._refused(method, call, caller, 401, "no token: send etcd's token metadata (etcdctl --user)", None)
                raise EtcdError(*USER_EMPTY)
        else:
            found = None if len(secret) > AUTHORIZATION_MAX_BYTES else self.tokens.policy.authenticate(secret.encode())
            if found is None:
                self._refused(method, call, caller, 401, "the token is not valid", None)
                raise EtcdError(*INVALID_TOKEN)
            token = found
        needed = tuple(needed)
        denied = lacks(token, needed)
        if denied:
            self._refused(method, call, caller, 403, denied, token.name)
            raise EtcdError(*PERMISSION_DENIED)
        set_forwarding(Forwarding(secret, _readable_prefix(token, needed)))
        return token

    def _refused(self, method: str, call: str, caller: Caller, status: int, detail: str,
                 token_name: str | None) -> None:
        self.audit.denied({"method": method, "path": call, "client": caller.address}, status, detail, token_name)


def authenticate_response(mapping: EtcdMapping, auth: EtcdAuth | None, request: rpc_pb2.AuthenticateRequest,
                          caller: Caller, call: str, method: str = "GRPC") -> rpc_pb2.AuthenticateResponse:
    """Auth.Authenticate on either front end; without a token file etcd's "not enabled"."""
    if auth is None:
        raise EtcdError(*AUTH_NOT_ENABLED)
    token = auth.authenticate(request.name, request.password, caller, call, method)
    return rpc_pb2.AuthenticateResponse(header=mapping.header(), token=token)


def metadata_tokens(metadata: Iterable[tuple[str, str | bytes]]) -> list[str]:
    """The values of the token metadata of a gRPC call, ``token`` before ``authorization``."""
    found = {name: value for name, value in metadata if name in TOKEN_METADATA}
    return [value if isinstance(value, str) else value.decode("latin-1")
            for name in TOKEN_METADATA if (value := found.get(name)) is not None]
