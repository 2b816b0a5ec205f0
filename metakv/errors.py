"""The client's exceptions: one per problem document a caller must tell apart.

Every failure leaving ``metakv.Client`` or ``metakv.AsyncClient`` is a ``MetakvError``
carrying the problem document's ``title``, ``status``, ``detail`` and whole body
(``problem``); transport failures (no document) get a title of their own. No ``httpx``
exception escapes the client.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

PROBLEM_TYPE_PREFIX = "urn:metakv:problem:"


class MetakvError(Exception):
    """Base of every client error. ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, title: str, detail: str = "", *, status: int = 0,
                 problem: dict[str, Any] | None = None) -> None:
        super().__init__(f"{title}: {detail}" if detail else title)
        self.title = title
        self.detail = detail
        self.status = status
        self.problem = problem or {}

    @property
    def slug(self) -> str:
        """The problem type without its prefix (``precondition-failed``), or ``""``."""
        return str(self.problem.get("type", "")).removeprefix(PROBLEM_TYPE_PREFIX)


class InvalidRequest(MetakvError):
    """The cluster refused the request as malformed or too large (400, 404, 405, 413, 422):
    retrying it unchanged cannot succeed."""


class LeaseNotFound(InvalidRequest):
    """404 ``lease-not-found``: the cluster does not know the lease (never granted, revoked
    or expired); a put with it wrote nothing."""


class LeaseLost(MetakvError):
    """A ``Lease`` this client held has ended (the cluster reported it gone, or no keep-alive
    was acknowledged for a whole TTL): nothing may be done under it any more."""

    def __init__(self, title: str, detail: str = "", *, lease_id: int, status: int = 0,
                 problem: dict[str, Any] | None = None) -> None:
        super().__init__(title, detail, status=status, problem=problem)
        self.lease_id = lease_id


class Unauthorized(MetakvError):
    """401: no token, or a token the cluster does not know."""


class Forbidden(MetakvError):
    """403: the token lacks the right on that key or prefix."""


class Conflict(MetakvError):
    """412: a write's condition did not hold; ``current_version`` is the key's mod_version
    (0: the key does not exist)."""

    def __init__(self, title: str, detail: str = "", *, current_version: int, status: int = 412,
                 problem: dict[str, Any] | None = None) -> None:
        super().__init__(title, detail, status=status, problem=problem)
        self.current_version = current_version


class Compacted(MetakvError):
    """410: the version asked for (a watch's ``since``, an ``at_version``) is below the oldest
    retained one, ``oldest_version``: re-list, then watch from the list's version."""

    def __init__(self, title: str, detail: str = "", *, oldest_version: int, status: int = 410,
                 problem: dict[str, Any] | None = None) -> None:
        super().__init__(title, detail, status=status, problem=problem)
        self.oldest_version = oldest_version


class Indeterminate(MetakvError):
    """A write whose outcome is unknown: it may or may not have happened (a 504 from the
    cluster, or the connection failed after the request was sent). The client never
    re-sends such a write on its own unless its condition makes a second apply impossible;
    the caller decides (read the key, compare, write again)."""


class VersionNotReached(MetakvError):
    """504: no node reached the ``min_version`` (read-your-writes) within the wait; it holds
    ``current_version``."""

    def __init__(self, title: str, detail: str = "", *, current_version: int, status: int = 504,
                 problem: dict[str, Any] | None = None) -> None:
        super().__init__(title, detail, status=status, problem=problem)
        self.current_version = current_version


class Unavailable(MetakvError):
    """The request surely did not happen and retrying until the client's deadline did not
    help: no endpoint answered, no leader was elected, the nodes were not ready (503)."""


class ClientClosed(MetakvError):
    """The client was closed (``close()``, or the end of its ``with`` block), perhaps by
    another thread while this call or watch was running; nothing more was sent."""


class ServerError(MetakvError):
    """Any other answer (a 500, a 507 full disk, a body that is not what the API promises)."""


def problem_of(content: bytes) -> dict[str, Any]:
    """The problem document in a response body, or ``{}`` when it holds none."""
    try:
        document = json.loads(content)
    except ValueError:
        return {}
    return document if isinstance(document, dict) else {}


def error_from_answer(status: int, content: bytes) -> MetakvError:
    """The exception an error status with this body stands for."""
    problem = problem_of(content)
    title = str(problem.get("title") or f"HTTP {status}")
    detail = str(problem.get("detail") or "")
    if status == 412:
        return Conflict(title, detail, current_version=_int(problem.get("current_version")), problem=problem)
    if status == 410:
        return Compacted(title, detail, oldest_version=_int(problem.get("oldest_version")), problem=problem)
    if status == 504 and problem.get("indeterminate"):
        return Indeterminate(title, detail, status=status, problem=problem)
    if status == 504 and "current_version" in problem:
        return VersionNotReached(title, detail, current_version=_int(problem.get("current_version")),
                                 problem=problem)
    kinds: dict[int, type[MetakvError]] = {401: Unauthorized, 403: Forbidden, 503: Unavailable}
    if status in kinds:
        return kinds[status](title, detail, status=status, problem=problem)
    if status == 404 and str(problem.get("type", "")).endswith(":lease-not-found"):
        return LeaseNotFound(title, detail, status=status, problem=problem)
    if 400 <= status < 500:
        return InvalidRequest(title, detail, status=status, problem=problem)
    return ServerError(title, detail, status=status, problem=problem)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


@contextlib.contextmanager
def raised_unless_failing(exc_type: type[BaseException] | None) -> Iterator[None]:
    """For an ``__exit__`` that cleans up through the cluster (revoke, release): its own
    ``MetakvError`` is raised only when the block did not fail already, whose error is the
    one to see (the lease frees whatever the cleanup could not)."""
    try:
        yield
    except MetakvError:
        if exc_type is None:
            raise
