"""Reading requests the same way everywhere: the key from the raw path (the key routes and
auth must always mean the same key), request headers, bounded bodies, and the wait a read
asks for."""

from __future__ import annotations

from urllib.parse import unquote_to_bytes

from fastapi import Request
from starlette.types import Scope

from app.http.problems import ProblemError
from app.http.settings import KEY_MAX_BYTES, HttpSettings, clamp_ms
from app.service import Consistency, KVService

KEY_PATH_PREFIX = "/v1/kv/"  # every path under it is a key route (app/http/key_fast_path.py)
KEY_PATH_PREFIX_BYTES = KEY_PATH_PREFIX.encode()
KEY_ROUTE_TEMPLATE = "/v1/kv/{key:path}"  # the key routes' path template, and their route label in metrics


def key_of_path(path: str, raw_path: bytes | None) -> str:
    """The key of a path under /v1/kv/ as the client sent it: from the raw path, so that
    percent-encoded bytes that are not UTF-8 are refused rather than silently replaced with
    U+FFFD. Raises ProblemError (400, or 413 when too long) for an invalid key."""
    if raw_path and raw_path.startswith(KEY_PATH_PREFIX_BYTES):
        raw_key = unquote_to_bytes(raw_path[len(KEY_PATH_PREFIX_BYTES):].split(b"?", 1)[0])
    else:
        raw_key = path[len(KEY_PATH_PREFIX):].encode("utf-8", "surrogatepass")
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


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a (lower-case) request header, as Starlette's Headers.get reads it."""
    for header_name, value in scope["headers"]:
        if header_name == name:
            return str(value.decode("latin-1"))
    return None


async def read_body_bounded(request: Request, limit_bytes: int, what: str, slug: str) -> bytes:
    """Read the body, refusing it (413) from Content-Length before reading and while reading,
    so a client cannot make this node buffer more than ``limit_bytes``."""
    declared = header(request.scope, b"content-length")
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


async def wait_readable(service: KVService, settings: HttpSettings, consistency: Consistency,
                        min_version: int | None, wait_ms: int, at_version: int | None) -> None:
    """Wait until this node may answer a read (at_version implies waiting for that version)."""
    if at_version is not None:
        min_version = max(min_version or 0, at_version)
    await service.wait_readable(consistency, min_version, clamp_ms(wait_ms, settings.max_wait_ms))
