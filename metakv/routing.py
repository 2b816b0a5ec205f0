"""Where each attempt of a call goes, and whether and when to try again.

``Endpoints`` tracks the cluster: the URLs the client was given, the node id behind each
(``X-Node-Id``), and the leader, learned from a 307's ``Location`` and from every answer's
``X-Raft-Leader``. ``Call`` decides, for one request, what each answer or transport failure
means: done, redirect, retry elsewhere after a backoff with jitter (at least ``Retry-After``),
or an exception. It does no I/O, so the sync and async clients drive the same decisions.

The one rule that matters: a write is re-sent only when it surely did not happen (refused
connection, 503, 307) or when sending it again cannot apply it twice (``safe_to_resend``: a
write conditional on a version >= 1). Any other write whose outcome is unknown raises ``Indeterminate``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from metakv.errors import (
    ClientClosed,
    Conflict,
    Indeterminate,
    InvalidRequest,
    MetakvError,
    Unavailable,
    error_from_answer,
)
from metakv.protocol import Answer, Request, header_int

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS_PER_ATTEMPT = 4  # a follower redirects once; more means the cluster disagrees
# Failures that prove the request never reached a server (nothing can have happened).
NOT_SENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# Failures of the request itself, found before it left: sending it again cannot help.
UNSENDABLE_ERRORS = (httpx.InvalidURL, httpx.UnsupportedProtocol, httpx.LocalProtocolError)
CLIENT_ERRORS = (httpx.HTTPError, httpx.InvalidURL)  # everything httpx raises for a request


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``deadline_s``: how long one call keeps failing over before it raises; backoff
    between attempts grows from ``backoff_base_s`` to ``backoff_max_s`` with full jitter,
    never below the ``Retry-After`` a 503 asks for (capped at ``retry_after_max_s``)."""

    deadline_s: float = 15.0
    backoff_base_s: float = 0.05
    backoff_max_s: float = 1.0
    retry_after_max_s: float = 5.0


def closed_error() -> ClientClosed:
    """What a call on a closed client raises (httpx raises a bare RuntimeError)."""
    return ClientClosed("Client closed", "the client was closed; nothing more is sent through it")


def origin(url: str) -> str:
    """``scheme://host:port`` of a URL."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def parse_endpoints(text: str | Sequence[str]) -> list[str]:
    """A comma-separated list (or a sequence) of node URLs, each checked to be an origin."""
    items = text.split(",") if isinstance(text, str) else list(text)
    urls = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        parts = urlsplit(item)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest("Invalid endpoint", f"{item!r} is not an http:// or https:// URL")
        try:
            parts.port  # noqa: B018  (raises on a port that is not a number)
        except ValueError:
            raise InvalidRequest("Invalid endpoint", f"{item!r} has an invalid port") from None
        if parts.path.strip("/") or parts.query or parts.fragment or "@" in parts.netloc:
            # Requests go to /v1/... at the origin: a prefix would be dropped silently.
            raise InvalidRequest("Invalid endpoint", f"{item!r}: a node URL is scheme://host:port, "
                                 "without user, path, query or fragment")
        urls.append(origin(item))
    if not urls:
        raise InvalidRequest("Invalid endpoint", "no endpoint given")
    return urls


class Endpoints:
    """The cluster as the client knows it; shared by every call of one client."""

    def __init__(self, urls: Sequence[str], credentials: Mapping[str, str] | None = None) -> None:
        self.urls = list(urls)
        # The Authorization header goes only to the URLs the caller listed: a redirect or
        # a leader elsewhere is asked without it (docs/security.md, the client and the token).
        self._credentials = dict(credentials or {})
        self._trusted = frozenset(origin(url) for url in self.urls)
        self._preferred = 0  # index of the endpoint reads go to (sticky until it fails)
        self._leader_url: str | None = None
        self._url_of_node: dict[int, str] = {}
        self._lock = threading.Lock()

    @property
    def leader_url(self) -> str | None:
        return self._leader_url

    def credentials_for(self, url: str) -> dict[str, str]:
        """The token's header for ``url`` when its origin is one the caller listed, else none."""
        return self._credentials if origin(url) in self._trusted else {}

    def for_read(self) -> str:
        return self.urls[self._preferred]

    def for_write(self) -> str:
        return self._leader_url or self.urls[self._preferred]

    def learn(self, base_url: str, headers: Mapping[str, str]) -> None:
        """Note which node answered and whom it names leader."""
        node_id = header_int(headers, "x-node-id")
        leader_id = header_int(headers, "x-raft-leader")
        with self._lock:
            if node_id is not None:
                self._url_of_node[node_id] = base_url
            if leader_id is not None and leader_id in self._url_of_node:
                self._leader_url = self._url_of_node[leader_id]

    def redirected_to(self, location: str) -> None:
        with self._lock:
            self._leader_url = origin(location)

    def failed(self, base_url: str, leader_gone: bool = True) -> None:
        """``base_url`` did not serve: move reads on to the next endpoint, and forget it as
        leader (``leader_gone``)."""
        with self._lock:
            if leader_gone and self._leader_url == base_url:
                self._leader_url = None
            if self.urls[self._preferred] == base_url:
                self._preferred = (self._preferred + 1) % len(self.urls)


class Call:
    """One request's attempts. The driver loops: send to ``url``; feed the answer to
    ``answered`` (None: done, ``answer`` holds it) or the exception to ``failed``; both
    return the seconds to sleep before the next attempt, or raise."""

    def __init__(self, request: Request, endpoints: Endpoints, policy: RetryPolicy,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.request = request
        self.endpoints = endpoints
        self.policy = policy
        self._clock = clock
        self._rng = rng or random.Random()
        self._deadline = clock() + (policy.deadline_s if request.deadline_s is None else request.deadline_s)
        self._failures = 0
        self._not_reached = 0  # 504 version-not-reached answers: one try per endpoint
        self._redirects = 0
        self._maybe_applied = False  # an earlier attempt of this write may have happened
        self._last_error = ""
        self.url = self._base() + request.path
        self.answer: Answer | None = None

    def send_options(self) -> dict[str, Any]:
        """The httpx ``request`` arguments of the next attempt."""
        request = self.request
        timeout = request.timeout_s if request.timeout_s is not None else httpx.USE_CLIENT_DEFAULT
        headers = {**request.headers, **self.endpoints.credentials_for(self.url)}
        return {"method": request.method, "url": self.url, "headers": headers, "content": request.content,
                "timeout": timeout}

    def outcome(self, result: httpx.Response | Exception) -> float | None:
        """Feed one attempt's response (read) or httpx exception: seconds to wait before the
        next attempt, or None when the call is done (``answer``)."""
        if isinstance(result, Exception):
            return self.failed(result)
        return self.answered(Answer(result.status_code, result.headers, result.content))

    def _base(self) -> str:
        return self.endpoints.for_write() if self.request.target_leader else self.endpoints.for_read()

    def answered(self, answer: Answer) -> float | None:
        base = origin(self.url)
        self.endpoints.learn(base, answer.headers)
        status = answer.status
        if status in self.request.ok_statuses:
            self.answer = answer
            return None
        location = answer.headers.get("location")
        if status in REDIRECT_STATUSES and location:
            self._redirects += 1
            if self._redirects > MAX_REDIRECTS_PER_ATTEMPT:
                return self._retry(base, f"redirected more than {MAX_REDIRECTS_PER_ATTEMPT} times", 0.0)
            target = str(httpx.URL(self.url).join(location))  # a relative Location too (a proxy's)
            if self.url.startswith("https:") and not target.startswith("https:"):
                return self._retry(base, f"refused a redirect from https to {origin(target)}", 0.0)
            self.url = target
            self.endpoints.redirected_to(self.url)
            return 0.0
        error = error_from_answer(status, answer.content)
        if isinstance(error, Conflict) and self._maybe_applied:
            raise Indeterminate(
                "Outcome unknown", f"an earlier attempt may have applied this write (its retry found the "
                f"condition failed: the key is at version {error.current_version})", status=status,
                problem=error.problem) from error
        if status == 503:
            retry_after = min(float(header_int(answer.headers, "retry-after") or 0), self.policy.retry_after_max_s)
            return self._retry(base, str(error), retry_after, error, leader_gone=error.slug == "no-leader")
        if isinstance(error, Indeterminate) and self.request.safe_to_resend:
            self._maybe_applied = True
            return self._retry(base, str(error), 0.0, error, leader_gone=False)
        if status == 504 and not isinstance(error, Indeterminate):  # min_version not reached: another node may have
            self._not_reached += 1
            if self._not_reached < len(self.endpoints.urls):  # each node already waited wait_ms: once each
                return self._retry(base, str(error), 0.0, error)
        raise error

    def failed(self, exc: Exception) -> float:
        base = origin(self.url)
        if isinstance(exc, httpx.LocalProtocolError):  # e.g. a header value holding a line break
            raise InvalidRequest("Invalid request", f"it cannot be sent: {exc}") from None
        if isinstance(exc, UNSENDABLE_ERRORS):
            raise InvalidRequest("Invalid endpoint", f"{self.url}: {exc}") from None
        if not isinstance(exc, httpx.TransportError):
            raise MetakvError("Client error", f"{type(exc).__name__}: {exc}") from None
        reason = f"{base}: {type(exc).__name__} {exc}".rstrip()
        if self.request.writes and not isinstance(exc, NOT_SENT_ERRORS):
            if not self.request.safe_to_resend:
                raise Indeterminate("Outcome unknown", f"the connection failed after the write was sent "
                                    f"({reason}): it may or may not have happened") from None
            self._maybe_applied = True
        return self._retry(base, reason, 0.0)

    def _retry(self, base: str, reason: str, at_least_s: float, error: MetakvError | None = None,
               leader_gone: bool = True) -> float:
        """Back off, then try again at the next endpoint (or the leader), within the deadline."""
        if self._failures == 0 and self.request.long_poll:
            # A long-poll waits longer than the deadline by design: retrying starts now.
            self._deadline = self._clock() + self.policy.deadline_s
        self._failures += 1
        self._last_error = reason
        self.endpoints.failed(base, leader_gone)
        backoff_cap = min(self.policy.backoff_max_s, self.policy.backoff_base_s * 2 ** min(self._failures, 16))
        delay = max(at_least_s, self._rng.uniform(0, backoff_cap))
        if self._clock() + delay > self._deadline:
            if error is not None and not isinstance(error, Unavailable):
                raise error
            if self._maybe_applied:
                raise Indeterminate("Outcome unknown", f"gave up after {self._failures} attempts; an earlier one "
                                    f"may have applied this write (last: {reason})")
            raise Unavailable(error.title if error else "Cluster unavailable",
                              f"gave up after {self._failures} attempts in {self.policy.deadline_s:g} s; "
                              f"last: {reason}", status=error.status if error else 0,
                              problem=error.problem if error else None)
        self._redirects = 0
        self.url = self._base() + self.request.path
        return delay
