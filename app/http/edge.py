"""The edge of the HTTP layer: one ASGI middleware, outermost, that every request passes
whichever router serves it. It appends the node headers to every response, drops the body
of a HEAD answer, counts requests by route template and status with their latency, writes
the audit line of every admin action (app/http/audit.py), and answers the last-resort 500
problem document for an exception nobody expected (logged, never echoed to the client)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.audit import ADMIN_PATH_PREFIX, AuditLog
from app.http.auth import token_name
from app.http.collectors import PerRegistry
from app.http.log_text import loggable
from app.http.parsing import KEY_PATH_PREFIX, KEY_ROUTE_TEMPLATE
from app.http.problems import internal_error_body, problem_start
from app.service import KVService, NodeHeaders

log = logging.getLogger("metakv.http")

EDGE_LABEL_CACHE_MAX = 1024  # labelled metric children an edge layer keeps at hand
LATENCY_BUCKETS_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# What each node header says, for /openapi.json.
NODE_HEADER_DESCRIPTIONS = {
    "X-Metadata-Version": "this node's applied metadata version when it answered",
    "X-Node-Id": "the answering node's id",
    "X-Raft-Leader": "the leader's node id, empty when unknown",
    "X-Raft-Epoch": "the node's current epoch",
    "X-Last-Contact-Ms": "milliseconds since this node last heard the leader (0 on the leader)",
}


def node_header_fields(headers: NodeHeaders) -> list[tuple[bytes, bytes]]:
    """The node headers as ASGI response headers (lower-case names)."""
    return [
        (b"x-metadata-version", str(headers.metadata_version).encode()),
        (b"x-node-id", str(headers.node_id).encode()),
        (b"x-raft-leader", b"" if headers.leader_id < 0 else str(headers.leader_id).encode()),
        (b"x-raft-epoch", str(headers.epoch).encode()),
        (b"x-last-contact-ms", str(headers.last_contact_ms).encode()),
    ]


@dataclass(frozen=True, slots=True)
class HttpMetrics:
    requests: Counter
    latency: Histogram


def _build_http_metrics(registry: CollectorRegistry) -> HttpMetrics:
    return HttpMetrics(
        Counter("metakv_http_requests", "HTTP requests by route template, method and status",
                ("route", "method", "status"), registry=registry),
        Histogram("metakv_http_request_duration_seconds", "HTTP request latency until the response ends",
                  ("route", "method"), buckets=LATENCY_BUCKETS_SECONDS, registry=registry),
    )


http_metrics = PerRegistry(_build_http_metrics)  # http_metrics(registry): the request metrics


class EdgeMiddleware:
    """Node headers on every response, no body on a HEAD answer, request metrics, and the
    last-resort 500."""

    def __init__(self, app: ASGIApp, service: KVService, routes: Sequence[BaseRoute],
                 audit: AuditLog | None = None) -> None:
        self.app = app
        self.service = service
        self.audit = audit if audit is not None else AuditLog()
        self.metrics = http_metrics(service.metrics)
        self.routes = routes  # the routes FastAPI serves, to label requests no route matched
        # Labelled children, looked up once per label set instead of per request (labels()
        # takes a lock and validates); bounded, since the method label comes from clients.
        self._counters: dict[tuple[str, str, int], Any] = {}
        self._histograms: dict[tuple[str, str], Any] = {}

    def _node_headers(self) -> list[tuple[bytes, bytes]]:
        try:
            return node_header_fields(self.service.headers())
        except Exception:
            log.exception("service.headers() failed; answering without node headers")
            return []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_s = time.perf_counter()
        status_code = 500
        response_started = False
        head = scope["method"] == "HEAD"

        async def send_with_headers(message: Message) -> None:
            nonlocal status_code, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status_code = message["status"]
                # Routes never set these headers themselves, so they are appended, not merged.
                message = {**message, "headers": [*message.get("headers", ()), *self._node_headers()]}
            elif head and message.get("body"):
                # HEAD: GET's status and headers (Content-Length included), never a body.
                message = {**message, "body": b""}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception:
            log.exception("unexpected error serving %s %s", loggable(scope.get("method")), loggable(scope.get("path")))
            if not response_started:
                body = internal_error_body()
                await send_with_headers(problem_start(500, body))
                await send({"type": "http.response.body", "body": body})
        finally:
            self._record(self._route_label(scope), str(scope.get("method", "")), status_code,
                         time.perf_counter() - started_s)
            if scope["path"].startswith(ADMIN_PATH_PREFIX):
                self.audit.admin(scope, status_code, token_name(scope))

    def _record(self, route: str, method: str, status_code: int, elapsed_s: float) -> None:
        counter = self._counters.get((route, method, status_code))
        if counter is None:
            counter = self.metrics.requests.labels(route, method, str(status_code))
            if len(self._counters) < EDGE_LABEL_CACHE_MAX:
                self._counters[(route, method, status_code)] = counter
        counter.inc()
        histogram = self._histograms.get((route, method))
        if histogram is None:
            histogram = self.metrics.latency.labels(route, method)
            if len(self._histograms) < EDGE_LABEL_CACHE_MAX:
                self._histograms[(route, method)] = histogram
        histogram.observe(elapsed_s)


    def _route_label(self, scope: Scope) -> str:
        """The template of the route that served the request: every path under /v1/kv/ is
        the key routes', others the one the router matched, else "unmatched"."""
        if scope["path"].startswith(KEY_PATH_PREFIX):
            return KEY_ROUTE_TEMPLATE
        matched = scope.get("route")  # set by the router on the shared scope when a route served it
        if matched is not None and hasattr(matched, "path"):
            return str(matched.path)
        for route in self.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:
                return str(getattr(route, "path", "unmatched"))
        return "unmatched"
