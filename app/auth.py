"""Bearer tokens: the token file and the rules it grants. Nothing here knows about HTTP.

Why it looks like this. Operators coming from Consul ACLs or etcd roles expect tokens with
rules on key prefixes, the most specific prefix winning, and a separate right for cluster
operations; they also expect the server never to hold the secrets themselves. So the token
file (TOML, docs/http.md "Auth") lists tokens by name with the SHA-256 of the secret and a
table of rules, ``prefix = "deny" | "read" | "write" | "admin"`` (each level implies the
ones before it; ``admin`` only on the prefix ``""``, and it is what the admin routes need).

Enforcing it on requests (which right a route needs, what a txn body touches, the log of
refused requests) is app/http/auth.py's. Off by default: with no token file nothing is
installed, and nothing changes.

Operations: SIGHUP makes ``metakv serve`` read its token file again (``AuthTokens.reload``),
so tokens are added and revoked without a restart; a file that no longer validates is
refused with a log line and the tokens loaded before stay in force. Requests still open
then (watch streams, long-polls) are rechecked against the new file (``on_reload``).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.toml_files import TomlFileError, read_toml

TOKENS_MAX = 10_000  # tokens per file; each request compares against all of them
RULES_PER_TOKEN_MAX = 1_000
TOKEN_NAME_MAX_CHARS = 128
PREFIX_MAX_BYTES = 1024  # a prefix longer than the longest key could never match a key
SHA256_HEX_CHARS = 64

log = logging.getLogger("metakv.auth")


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
        # Told after every reload that took effect (open requests recheck their token);
        # weak, so an app built and dropped (tests build many) leaves nothing behind.
        self._listeners: list[weakref.WeakMethod[Callable[[], None]]] = []

    def on_reload(self, listener: Callable[[], None]) -> None:
        """Call the bound method ``listener`` after every reload that took effect."""
        self._listeners = [ref for ref in self._listeners if ref() is not None]
        self._listeners.append(weakref.WeakMethod(listener))

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
        for ref in self._listeners:
            listener = ref()
            if listener is not None:
                listener()
        return True


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
