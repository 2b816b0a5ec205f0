"""Caps on concurrent watches (long-polls and SSE streams), per node and per token: every
open watch holds a hub queue and wakes on changes under its prefix, so past a cap a new one
is answered 429 ``too-many-watchers`` with Retry-After (docs/security.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge
from starlette.types import Scope

from app.http.auth import token_name
from app.http.collectors import PerRegistry
from app.http.problems import RETRY_AFTER_SECONDS, ProblemError


@dataclass(frozen=True, slots=True)
class WatcherMetrics:
    active: Gauge
    refused: Counter


watcher_metrics = PerRegistry(lambda registry: WatcherMetrics(
    Gauge("metakv_http_watchers", "open watch long-polls and SSE streams", registry=registry),
    Counter("metakv_http_watchers_refused", "watches answered 429 too-many-watchers, by the cap met",
            ("cap",), registry=registry)))


class WatcherSlots:
    """Counts open watches; ``take`` answers a release function or raises the 429."""

    def __init__(self, max_watchers: int, max_per_token: int, metrics: WatcherMetrics) -> None:
        self.max_watchers = max_watchers
        self.max_per_token = max_per_token
        self.metrics = metrics
        self.active = 0
        self.by_token: dict[str, int] = {}  # only tokens with open watches: bounded by max_watchers

    def take(self, scope: Scope) -> Callable[[], None]:
        name = token_name(scope)  # None with auth off: only the node cap applies
        if self.active >= self.max_watchers:
            self._refuse("node", f"this node serves its maximum of {self.max_watchers} watches")
        if name is not None and self.by_token.get(name, 0) >= self.max_per_token:
            self._refuse("token", f"token {name!r} holds its maximum of {self.max_per_token} watches on this node")
        self.active += 1
        self.metrics.active.inc()
        if name is not None:
            self.by_token[name] = self.by_token.get(name, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.active -= 1
            self.metrics.active.dec()
            if name is not None:
                left = self.by_token[name] - 1
                if left:
                    self.by_token[name] = left
                else:
                    del self.by_token[name]
        return release

    def _refuse(self, cap: str, detail: str) -> None:
        self.metrics.refused.labels(cap).inc()
        raise ProblemError(429, "too-many-watchers", "Too many watchers",
                           f"{detail}; retry later, or close a watch first",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
